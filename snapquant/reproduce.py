"""Every committed results folder, the command that writes it, and a runner that reruns them.

    python scripts/reproduce.py --list                       # folder, device, command of every job
    python scripts/reproduce.py --cpu                        # rerun the CPU jobs (any machine, minutes)
    python scripts/reproduce.py --gpu                        # rerun the GPU jobs (about 10 min on an H200)
    python scripts/reproduce.py --gpu --only results/bench   # only the jobs of one folder
    python scripts/reproduce.py --cpu --dry-run              # print the commands, run nothing
    python scripts/reproduce.py --stale                      # results older than the code that writes them

`JOBS` is the one place that says which command produces which files under `results/`; a test
checks that every committed file there is claimed by exactly one job and that every job's script
exists. Each job also declares the code its results depend on (`code`), so `--stale` can list the
committed results that a later commit may have changed (snapquant/staleness.py). Jobs run one after another from the repository root, with PYTHONPATH set to it (so the
checkout's code runs, not an installed copy). A job whose result is its own console output (a
log, a pytest summary) shows it live and writes its stdout and stderr to the file it names,
atomically once it ends. A failing job is reported and the others still run; the exit status is 1 when any failed.
Jobs marked `manual` (training the embedded model: long, and not bit-reproducible) run only when
`--only` names their folder.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .atomic import atomic_open

ROOT = Path(__file__).resolve().parents[1]
DEVICES = ("cpu", "gpu")

# the side-by-side table against FlashMLA: H = 16, 64 and 128
ANCHOR_SHAPES = "128x16x4096,32x16x16384,8x16x32768,32x64x8192,4x64x8192,128x128x4096,64x128x8192,1x128x32768"
DECODE_SHAPES = ("128x16x4096,32x16x16384,8x16x32768,32x64x8192,4x64x8192,128x128x4096,64x128x8192,"
                 "1x128x32768,mixed64x16,64x32x4096")
DECODE_VARIANTS = ("bf16,snapmla,snapmla_kv_only,snapmla_q_fp8,snapmla_pv_fp8,torch,bf16+rows,bf16+gluon,"
                   "snapmla+pairs,snapmla+gluon,snapmla+gluon+s1,snapmla+gluon+fp8qk*,snapmla+gluon+fp8mma,"
                   "snapmla+gluon+fp8mma+bm64,snapmla+balanced,bf16+balanced")


# What results depend on, by layer (the paths `--stale` watches; see Job.code).
FORMATS = ("snapquant/config.py", "snapquant/presets.py", "snapquant/presets.yaml", "snapquant/constants.py",
           "snapquant/quant")
DECODE = (*FORMATS, "snapquant/reference", "snapquant/attention", "snapquant/cache.py", "snapquant/patching.py",
          "snapquant/models", "snapquant/runtime.py")
KERNELS = (*FORMATS, "snapquant/reference", "snapquant/kernels", "snapquant/runtime.py")
EMBEDDED = ("snapquant/embedded.py", "snapquant/assets/embedded")
BENCH = (*KERNELS, "snapquant/bench", "snapquant/commands/bench.py")
TASKS = ("snapquant/eval/tasks", "snapquant/eval/calibration.py", "snapquant/data/synthetic.py",
         "snapquant/data/corpus.py", "snapquant/analysis/significance.py", "scripts/calibrate_tasks.py")


@dataclass(frozen=True)
class Job:
    folder: str
    """The results folder, relative to the repository root."""
    device: str
    """cpu (any machine) or gpu (the H200 the committed files come from)."""
    argv: tuple[str, ...]
    """The command: a script path (relative to the root) or `-m module`, then its arguments."""
    outputs: tuple[str, ...]
    """Glob patterns (relative to `folder`) of the files this job writes there."""
    what: str
    stdout: str | None = None
    """File (in `folder`) that receives the command's stdout and stderr, or None."""
    manual: bool = False
    """Run only when `--only` names the folder (long or not bit-reproducible)."""
    code: tuple[str, ...] = ()
    """Paths (files or folders, relative to the root) besides the command's own script whose changes can
    change what the job writes: a result older than the last commit touching them is stale (`--stale`)."""

    @property
    def code_paths(self) -> tuple[str, ...]:
        """The job's script (or the module's file) and its declared `code`: what `--stale` compares against."""
        own = [a for a in self.argv if a.endswith((".py", ".sh")) and not a.startswith("-")]
        if self.argv[0] == "-m" and self.argv[1].split(".")[0] == "snapquant":
            own.append(self.argv[1].replace(".", "/") + ".py")
        return tuple(dict.fromkeys([*own, *self.code]))

    @property
    def target(self) -> str:
        """The script path or module the command runs."""
        return self.argv[1] if self.argv[0] == "-m" else self.argv[0]

    def command(self) -> str:
        cmd = "python " + " ".join(shlex.quote(a) for a in self.argv)
        return cmd + (f" > {self.folder}/{self.stdout} 2>&1" if self.stdout else "")

    def target_exists(self, root: Path = ROOT) -> bool:
        """The script (or module) exists, and so does every `.py` file the command names (test files)."""
        scripts = [a for a in self.argv if a.endswith(".py") and not a.startswith("-")]
        if not all((root / a).is_file() for a in scripts):
            return False
        if self.argv[0] != "-m":
            return bool(scripts) and scripts[0] == self.argv[0]
        mod = root.joinpath(*self.argv[1].split("."))
        if mod.with_suffix(".py").is_file() or (mod / "__main__.py").is_file():
            return True
        if self.argv[1].split(".")[0] == "snapquant":
            return False  # the checkout's own modules must be in the checkout
        return importlib.util.find_spec(self.argv[1]) is not None  # a tool such as pytest


def _exp(name: str, *args: str, outputs: tuple[str, ...], what: str) -> Job:
    # experiments write to the git-ignored runs/NAME unless told --out: the job names its results folder
    return Job(f"results/{name}", "cpu", (f"experiments/{name}.py", "--device", "cpu", *args, "--out", f"results/{name}"),
               outputs, what,
               code=("experiments/_common.py", *DECODE, *EMBEDDED, "snapquant/analysis", "snapquant/eval/fidelity.py",
                     "snapquant/kernels"))


JOBS: tuple[Job, ...] = (
    # ------------------------------------------------------------------ CPU
    Job("results/formats", "cpu",
        ("-m", "snapquant.cli", "formats", "--out", "results/formats/formats_synthetic.md"),
        ("formats_synthetic.md",), "every preset's bytes/token and error on a synthetic cache (table)",
        code=(*FORMATS, "snapquant/commands/formats.py")),
    Job("results/formats", "cpu",
        ("-m", "snapquant.cli", "formats", "--out", "results/formats/formats_synthetic.csv"),
        ("formats_synthetic.csv", "formats_synthetic.meta.json"), "the same table as CSV, with its metadata",
        code=(*FORMATS, "snapquant/commands/formats.py")),
    Job("results/tasks", "cpu",
        # about 75 min on 2 CPU cores (the pass key at 1K-4K half of it); the files are rewritten after every
        # task, and `--resume` added to the command finishes a stopped run without rescoring what it kept
        ("scripts/calibrate_tasks.py", "--n", "100", "--compare", "per_tensor_fp8", "--loglikelihood", "decode",
         "--threads", "1", "--output-dir", "results/tasks",
         # sq_passkey's knobs spelled out: its YAML default (20 digits, 32 near-miss keys) is not the bare
         # task's in calibrate_tasks (sq_utils' 5 digits, no distractor, the old default)
         "sq_kv_retrieval_1k", "sq_code_completion", "sq_code_completion_mc",
         "sq_passkey:passkey_digits=20,passkey_distractors=32"),
        ("calibration.md", "calibration.csv", "calibration.json"),
        "the offline tasks at their calibrated difficulty defaults (retrieval, completion, multiple-choice "
        "completion read through the cache, pass key at 1K-4K): bf16 accuracy with its interval, and the "
        "discordance with per-tensor FP8 that sets the experiments' sample sizes",
        code=(*DECODE, *EMBEDDED, *TASKS)),
    Job("results/tasks/knobs", "cpu",
        ("scripts/calibrate_tasks.py", "--n", "50", "--output-dir", "results/tasks/knobs",
         "sq_kv_retrieval_1k:kv_digits=7,kv_distractors=0", "sq_kv_retrieval_1k:kv_distractors=0",
         "sq_kv_retrieval_1k:kv_digits=10",
         "sq_code_completion:completion_prefix=0,completion_copyable=false",
         "sq_code_completion:completion_copyable=false", "sq_code_completion:completion_words=1"),
        ("calibration.md", "calibration.csv", "calibration.json"),
        "the offline tasks' difficulty knobs around their defaults (the old defaults first)",
        code=(*DECODE, *EMBEDDED, *TASKS)),
    Job("results/tasks/mc", "cpu",
        ("scripts/calibrate_tasks.py", "--n", "100", "--compare", "per_tensor_fp8", "--loglikelihood", "decode",
         "--output-dir", "results/tasks/mc", "sq_code_completion_mc"),
        ("calibration.md", "calibration.csv", "calibration.json"),
        "the multiple-choice code completion task at its calibrated default: bf16 accuracy (loglikelihood "
        "argmax) with its interval, and the discordance with per-tensor FP8, the choices read through the "
        "cache one decode step at a time (as served; lm-eval's one forward pass never reads it)",
        code=(*DECODE, *EMBEDDED, *TASKS)),
    Job("results/tasks/mc/knobs", "cpu",
        # unpatched only: lm-eval's forward path equals the decode path to float rounding, in a quarter of the time
        ("scripts/calibrate_tasks.py", "--n", "100", "--loglikelihood", "forward",
         "--output-dir", "results/tasks/mc/knobs",
         "sq_code_completion_mc:mc_choices=8", "sq_code_completion_mc:completion_prefix=0.75",
         "sq_code_completion_mc:mc_distractors=other_files"),
        ("calibration.md", "calibration.csv", "calibration.json"),
        "the multiple-choice code completion task's knobs around its default (choices, prefix, distractor source)",
        code=(*DECODE, *EMBEDDED, *TASKS)),
    Job("results/tasks/passkey", "cpu",
        ("scripts/calibrate_tasks.py", "--n", "45", "--threads", "1", "--output-dir", "results/tasks/passkey",
         "sq_passkey:passkey_digits=20,passkey_distractors=32", "sq_passkey_code:passkey_distractors=1"),
        ("calibration.md", "calibration.csv", "calibration.json"),
        "the pass-key tasks with near-miss distractor keys at the YAML lengths (1K/2K/4K): bf16 accuracy with its "
        "interval (the undistracted tasks are at 1.0)",
        code=(*DECODE, *EMBEDDED, *TASKS)),
    Job("results/tasks/passkey/knobs", "cpu",
        ("scripts/calibrate_tasks.py", "--n", "40", "--threads", "1", "--output-dir", "results/tasks/passkey/knobs",
         "sq_passkey:max_seq_lengths=1024", "sq_passkey:max_seq_lengths=1024,passkey_distractors=4",
         "sq_passkey:max_seq_lengths=1024,passkey_digits=10,passkey_distractors=32",
         "sq_passkey:max_seq_lengths=1024,passkey_digits=20,passkey_distractors=32",
         "sq_passkey_code:max_seq_lengths=1024", "sq_passkey_code:max_seq_lengths=1024,passkey_distractors=1",
         "sq_passkey_code:max_seq_lengths=1024,passkey_distractors=2",
         "sq_passkey_code:max_seq_lengths=1024,passkey_distractors=4"),
        ("calibration.md", "calibration.csv", "calibration.json"),
        "the pass-key difficulty knobs at 1K (digits, near-miss distractors; repeated-sentence and code haystacks)",
        code=(*DECODE, *EMBEDDED, *TASKS)),
    _exp("rope_vs_nope", outputs=("*.md", "*.csv", "*.png", "*.pdf"),
         what="RoPE vs NoPE sensitivity of the embedded model's cache"),
    _exp("granularity_ablation", "--seq-len", "160", "--num-sequences", "16", "--prompt-len", "32",
         outputs=("table.md", "table.csv", "granularity.png", "granularity.pdf"),
         what="per-tensor / per-channel / per-token / per-token-block scales: SQNR, KL, top-1, perplexity"),
    _exp("pv_pipeline", "--seq-len", "160", "--num-sequences", "16", "--prompt-len", "32", outputs=("table.md", "table.csv", "per_layer.csv", "pv_pipeline.png", "pv_pipeline.pdf"),
         what="scale-fused vs naive FP8 P vs BF16 P, FP8 vs BF16 query"),
    _exp("long_context", "--num-sequences", "16", "--steps", "32",
         outputs=("table.md", "table.csv", "depth_change.csv", "sequences.csv", "top_positions.csv",
                  "long_context.png", "long_context.pdf"),
         what="decode KL (mean, p99) and top-1 flip rate of 32-step windows at cache depths 256-4063 (the "
              "embedded model's 4K context), per config, 16 sequences; on a CPU about 30 minutes"),
    _exp("memory_throughput", "--contexts", "256", "1024", "2048",
         outputs=("memory.md", "memory.csv", "throughput.md", "throughput.csv", "memory_throughput.png",
                  "memory_throughput.pdf"),
         what="bytes/token and tokens per GiB of every preset; decode tokens/s of the reference backend"),
    Job("results", "cpu", ("scripts/write_claims.py", "--readme"), ("claims.md",),
        "the README's comparisons (effect, 95% interval, p, n), from the experiments' tables above and "
        "results/tasks; run after them", code=("snapquant/analysis/claims.py",)),
    Job("results/bench", "cpu",
        ("scripts/bench_e2e.py", "--threads", "1", "--out", "results/bench/e2e_cpu.json"),
        ("e2e_cpu.*",), "end-to-end decode step on CPU: stock transformers vs patched (reference backend)",
        code=(*DECODE, "snapquant/bench/e2e.py")),
    Job("results/bench", "cpu",
        ("scripts/bench_refill.py", "--n", "64", "--slots", "8", "--threads", "1", "--out", "results/bench/refill_cpu.json"),
        ("refill_cpu.json",), "slot refill in the decode loop on CPU: decode steps, slot utilisation and wall time "
        "with refill off / on / auto, and the gsm8k-sized projection",
        code=(*DECODE, "snapquant/eval/refill.py", "snapquant/eval/generation.py")),
    Job("results/bench", "cpu",
        ("scripts/bench_decode.py", "--compile-stats", "--variants",
         "bf16,snapmla,snapmla+pairs,snapmla+gluon*,snapmla_kv_only,snapmla+fp8qk",
         "--shapes", "128x16x4096,32x64x8192,128x128x4096", "--tag", "sm90_triton39", "--out", "results/bench"),
        ("compile_stats_sm90_triton39.csv",),
        "what Triton compiles for sm_90 (registers, spills, SASS per page, wgmma waits); the tag names the "
        "Triton version it was written with", code=BENCH),
    # ------------------------------------------------------------------ GPU
    Job("results/bench", "gpu",
        ("scripts/bench_decode.py", "--out", "results/bench", "--budget-s", "190", "--shapes", DECODE_SHAPES,
         "--variants", DECODE_VARIANTS),
        ("decode_h200.*", "bench_h200.*"), "decode kernels: every FP8 mode and kernel variant beside BF16", code=BENCH),
    Job("results/bench", "gpu",
        ("scripts/bench_e2e.py", "--device", "cuda", "--layers", "8", "--batch", "32", "--contexts", "8192,32768",
         "--backend", "triton", "--graphs", "--out", "results/bench/e2e_h200.json"),
        ("e2e_h200.*",), "end-to-end decode step (CUDA graphs): stock vs patched bf16 vs snapmla",
        code=(*DECODE, *KERNELS, "snapquant/graphs.py", "snapquant/bench/e2e.py")),
    Job("results/bench", "gpu",
        ("scripts/bench_eval.py", "--models", "v2lite", "--presets", "snapmla", "--budget-s", "170"),
        ("eval_h200.*",), "lm-eval generation throughput: HF generate vs the snapquant decode loop (full "
        "DeepSeek-V2-Lite shape, random weights); `--presets bf16` and `--models v3` merge into the same table",
        code=(*DECODE, *KERNELS, "snapquant/graphs.py", "snapquant/bench/eval_gen.py", "snapquant/eval/generation.py",
              "snapquant/models")),
    # Against FlashMLA (what users run instead): both need `flash_mla` importable (scripts/anchor_env.sh installs
    # it from a wheel in .anchors/); scripts/device_anchor.sh runs the two in one device call.
    Job("results/bench", "gpu",
        ("scripts/bench_decode.py", "--out", "results/bench", "--tag", "anchor_h200", "--no-append", "--budget-s",
         "170", "--shapes", "128x16x4096,32x16x16384,8x16x32768,32x64x8192,4x64x8192,128x128x4096,64x128x8192,"
         "1x128x32768", "--variants", "bf16,snapmla,snapmla+gluon+fp8mma"),
        ("decode_anchor_h200.*", "bench_anchor_h200.*"), "the decode kernels beside FlashMLA's BF16 kernel, same "
        "process and values, at the headline shapes", manual=True, code=BENCH),
    Job("results/bench", "gpu",
        ("scripts/bench_e2e.py", "--device", "cuda", "--layers", "8", "--batch", "32", "--contexts", "32768",
         "--steps", "5", "--presets", "bf16@flashmla,snapmla", "--backend", "triton", "--graphs", "--no-stock",
         "--kv-budget-gib", "16", "--out", "results/bench/e2e_anchor_h200.json"),
        ("e2e_anchor_h200.*",), "end-to-end decode step: snapmla against the bf16 model on FlashMLA, at batch 32 "
        "and at equal KV-cache memory", manual=True,
        code=(*DECODE, *KERNELS, "snapquant/graphs.py", "snapquant/bench/e2e.py", "snapquant/attention/flashmla.py")),
    Job("results/kernels", "gpu",
        ("scripts/profile_decode.py", "run", "--out", "results/kernels", "--ncu-dir", "/tmp/profile_decode",
         "--budget-s", "330"),
        ("profile_h200.*", "profile_timings_h200.csv"), "Nsight Compute profiles of the decode kernels (ncu "
        "--clock-control none) and CUDA-graph timings of knob alternatives (scripts/device_profile.sh)",
        manual=True, code=(*BENCH, "scripts/device_profile.sh")),
    Job("results/kernels", "gpu",
        ("scripts/probe_stream.py", "--out", "results/kernels/stream_h200"),
        ("stream_h200.*",), "the snapmla page ring without its arithmetic: which ring structure streams 40 KB pages "
        "at the read bandwidth, with busy-wait cycles standing in for a page's arithmetic, beside FlashMLA and the "
        "decode kernels (`bash scripts/device_session.sh stream`; the committed files are from 1a28449, whose "
        "sweep stopped at 3000 cycles and whose table gave the decode kernels no FlashMLA ratio)", manual=True,
        code=(*BENCH, "snapquant/kernels/gluon/experimental/stream.py")),
    Job("results/kernels", "gpu",
        ("scripts/check_kernels_gpu.py", "--no-bench", "--out", "results/kernels"),
        ("kernels_check.*", "check_h200.log"), "every kernel checked against the reference at DeepSeek shapes",
        stdout="check_h200.log", code=(*DECODE, *KERNELS, *EMBEDDED, "snapquant/graphs.py")),
    Job("results/kernels", "gpu", ("-m", "pytest", "-m", "gpu", "-rfEs", "-q"),
        ("pytest_gpu_h200.txt",), "the GPU test suite", stdout="pytest_gpu_h200.txt", code=("snapquant", "tests")),
    Job("results/kernels", "gpu", ("-m", "pytest", "-m", "gpu", "-rfEs", "-q", "tests/test_kernels_gluon.py"),
        ("pytest_gpu_gluon_h200.txt",), "the Gluon kernels' GPU tests", stdout="pytest_gpu_gluon_h200.txt",
        code=(*KERNELS, "tests/support")),
    # The redesign's GPU check (scripts/device_check.sh runs these three in one device call, with timeouts).
    Job("results/gpu_check", "gpu", ("scripts/check_kernels_gpu.py", "--no-bench", "--out", "results/gpu_check"),
        ("check_h200.log",), "every kernel against the reference (the device call's 200 s limit cut the last five "
        "model checks at 7c2f294)", stdout="check_h200.log", code=(*DECODE, *KERNELS, *EMBEDDED, "snapquant/graphs.py")),
    Job("results/gpu_check", "gpu", ("-m", "pytest", "-m", "gpu", "-rfEs", "-q"),
        ("pytest_gpu_h200.txt",), "the GPU test suite", stdout="pytest_gpu_h200.txt", code=("snapquant", "tests")),
    Job("results/gpu_check", "gpu",
        ("scripts/bench_decode.py", "--out", "results/gpu_check", "--no-append", "--budget-s", "80", "--shapes",
         "128x16x4096,32x16x16384,8x16x32768,32x64x8192,4x64x8192,128x128x4096,64x128x8192,1x128x32768",
         "--variants", "bf16,snapmla,snapmla+gluon+fp8mma"),
        ("decode_h200.*", "bench_h200.*"), "the decode benchmark at the headline shapes (defaults and the opt-in "
        "native FP8 kernel)", code=BENCH),
    # The one device call of 2026-12-05 got an H100 (Hopper like the H200, less bandwidth): its runs are kept
    # apart from the H200 tables (`bash scripts/device_check.sh` and `device_eval.sh 6` on that machine).
    Job("results/h100", "gpu", ("scripts/check_kernels_gpu.py", "--no-bench", "--out", "results/h100"),
        ("check_h100.log", "mma_numerics.*"), "every kernel against the reference, and the native FP8 MMA numerics "
        "fit, on an H100", stdout="check_h100.log", manual=True,
        code=(*DECODE, *KERNELS, *EMBEDDED, "snapquant/graphs.py")),
    Job("results/h100", "gpu", ("-m", "pytest", "-m", "gpu", "-rfEs", "-q"),
        ("pytest_gpu_h100.txt",), "the GPU test suite on an H100", stdout="pytest_gpu_h100.txt", manual=True,
        code=("snapquant", "tests")),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "anchor_h100", "--no-append", "--budget-s",
         "170", "--shapes", "128x16x4096,32x16x16384,8x16x32768,32x64x8192,4x64x8192,128x128x4096,64x128x8192,"
         "1x128x32768", "--variants", "bf16,snapmla,snapmla+gluon+fp8mma"),
        ("decode_anchor_h100.*",), "the decode kernels beside FlashMLA's BF16 kernel on an H100", manual=True,
        code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/bench_eval.py", "--out", "results/h100/eval_h100", "--models", "v2lite", "--presets", "bf16,snapmla",
         "--paths", "loop", "--batches", "32,128", "--contexts", "1024,32768", "--new-tokens", "64",
         "--check-tokens", "0", "--no-split", "--kernels"),
        ("eval_h100.*",), "decode-loop rows with kernel tables of the captured step and of one prefill, on an H100",
        manual=True, code=(*DECODE, *KERNELS, "snapquant/graphs.py", "snapquant/bench/eval_gen.py",
                           "snapquant/eval/generation.py", "snapquant/models")),
    Job("results/h100", "gpu",
        ("scripts/bench_eval.py", "--out", "results/h100/eval_e2e_h100", "--models", "v2lite", "--presets", "bf16,snapmla",
         "--paths", "loop", "--batches", "32", "--contexts", "32768", "--new-tokens", "64", "--check-tokens", "0",
         "--no-split"),
        ("eval_e2e_h100.*",), "end to end through lm-eval's generate_until (batch 128 / 32, 1K prompts, 256 new "
        "tokens) and the 32K batch-32 loop rows, on an H100 (`bash scripts/device_eval.sh 7`, which runs the "
        "--e2e-lmeval cells first)", manual=True,
        code=(*DECODE, *KERNELS, "snapquant/graphs.py", "snapquant/bench/eval_gen.py", "snapquant/eval",
              "snapquant/models")),
    Job("results/h100", "gpu", ("scripts/probe_step_parts.py", "--out", "results/h100/probe_step_h100.json"),
        ("probe_step_h100.json",), "expert grouped GEMMs (two B layouts) and prefill SDPA backends timed in "
        "isolation, on an H100", manual=True),
    Job("results/h100", "gpu",
        ("scripts/bench_eval.py", "--out", "results/h100/eval_e2e_b32first_h100", "--models", "v2lite", "--presets",
         "snapmla,bf16", "--e2e-lmeval", "--e2e-batches", "32,128", "--e2e-prompt", "1024", "--e2e-new-tokens", "256",
         "--e2e-n-batches", "2", "--paths", "", "--budget-s", "260"),
        ("eval_e2e_b32first_h100.*",), "end to end through lm-eval with batch 32 first, so that the batch-128 cells "
        "run with every kernel compiled (lm-eval from .whl/: `source scripts/wheels_env.sh`), on an H100",
        manual=True, code=("snapquant/bench/eval_gen.py", "snapquant/eval", "snapquant/models", "snapquant/kernels")),
    Job("results/h100", "gpu", ("scripts/probe_prefill.py", "--out", "results/h100/probe_prefill_h100.json"),
        ("probe_prefill_h100.json",), "a batch-128 1K-token prefill of the V2-Lite shape operator by operator, with "
        "the fused MoE combine off and on (same logits bits), and the combine's bits and time at real sizes, on an "
        "H100", manual=True, code=("snapquant/kernels/triton", "snapquant/models/experts.py")),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "widen_h100", "--no-append", "--budget-s", "260",
         "--shapes", "128x16x4096,32x16x16384,8x16x32768,32x16x32768", "--variants",
         "bf16,snapmla,snapmla+int,snapmla+int_qk,snapmla+int_pv,snapmla+int_pv2,snapmla+int_qk_pv2"),
        ("decode_widen_h100.*", "bench_widen_h100.json"), "gluon.narrow's e4m3 widening by cvt against integer "
        "operations (five widen modes, same bits) beside FlashMLA at H = 16, on an H100 (`bash "
        "scripts/device_widen.sh`)", manual=True, code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "anchor16_h100", "--no-append", "--budget-s", "110",
         "--shapes", "128x16x4096,32x16x16384,8x16x32768,32x16x32768", "--variants", "bf16,bf16+gluon,bf16+gluon+s1,snapmla"),
        ("decode_anchor16_h100.*", "bench_anchor16_h100.json"), "our BF16 at H = 16 (gluon.narrow_bf16 with two and one "
        "slots, then opt-in; the Triton rows tile, then the default) and the FP8 default beside FlashMLA, on an H100 "
        "(`bash scripts/device_session.sh decode` at 67094b2)", manual=True, code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "anchor64_h100", "--no-append", "--budget-s", "110",
         "--shapes", "32x64x8192,4x64x8192,128x128x4096,64x128x8192,1x128x32768", "--variants", "bf16"),
        ("decode_anchor64_h100.*", "bench_anchor64_h100.json"), "our BF16 past 16 rows (gluon.wide) beside FlashMLA, "
        "on an H100; the committed file also has the rows of a softmax-under-PV variant of gluon.wide since removed "
        "(refuted: 12-28 % slower, docs/performance.md)", manual=True, code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "seesaw2_h100", "--no-append", "--budget-s", "130",
         "--shapes", "32x64x8192,4x64x8192,128x128x4096,64x128x8192,1x128x32768", "--variants", "bf16,bf16+ws"),
        ("decode_seesaw2_h100.*", "bench_seesaw2_h100.json"), "our BF16 past 16 rows: gluon.wide against the "
        "warp-specialized gluon.seesaw (opt-in) beside FlashMLA, on an H100 (`TAG=seesaw2 ... bash "
        "scripts/device_widen.sh` at 0f8a683)", manual=True, code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "seesaw3_h100", "--no-append", "--budget-s", "130",
         "--shapes", "32x64x8192,4x64x8192,128x128x4096,64x128x8192,1x128x32768", "--variants", "bf16,bf16+ws"),
        ("decode_seesaw3_h100.*", "bench_seesaw3_h100.json"), "gluon.seesaw with the other's previous page first "
        "(PV and refill before the wait for its own page), beside gluon.wide and FlashMLA, on an H100 (at 7e41fe0)",
        manual=True, code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/profile_decode.py", "run", "--shapes", "32x64x8192,64x128x8192", "--variants", "bf16,bf16+ws,flashmla",
         "--time-shapes", "32x64x8192", "--out", "results/h100", "--ncu-dir", "/tmp/ncu", "--budget-s", "300",
         "--time-budget-s", "40"),
        ("profile_h100.*", "profile_timings_h100.csv"), "Nsight Compute profiles of gluon.wide, gluon.seesaw and "
        "FlashMLA past 16 rows, on an H100 (at 0f8a683)", manual=True, code=(*BENCH, "scripts/device_profile.sh")),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "pdl_h100", "--no-append", "--budget-s", "300",
         "--shapes", ANCHOR_SHAPES,
         "--variants", "bf16,bf16+pdl,snapmla,snapmla+pdl,snapmla+gluon+fp8mma,bf16+ws"),
        ("decode_pdl_h100.*", "bench_pdl_h100.json"), "the split combine as a programmatic dependent launch with "
        "stage 1 triggering it as it started (then the default, so the file's plain rows are PDL and its +nopdl rows "
        "the combine after stage 1; the trigger is gone and pdl=True is now the opt-in), and the first gluon.seesaw "
        "pair schedule (264 B of spills), on an H100 (at a0af421)", manual=True, code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "pdl2_h100", "--no-append", "--budget-s", "130",
         "--shapes", ANCHOR_SHAPES, "--variants", "bf16,bf16+pdl,snapmla,snapmla+pdl"),
        ("decode_pdl2_h100.*", "bench_pdl2_h100.json"), "the PDL combine launched as stage 1's programs exit (then the "
        "default: the file's plain rows; its +nopdl rows the combine after stage 1), on an H100 (at 4529aae; now "
        "pdl=True is the opt-in)", manual=True, code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "pairs_h100", "--no-append", "--budget-s", "220",
         "--shapes", ANCHOR_SHAPES, "--variants", "bf16,snapmla,snapmla+gluon+fp8mma,bf16+ws"),
        ("decode_pairs_h100.csv", "bench_pairs_h100.json"), "gluon.seesaw's pair schedule without spills (opt-in then) "
        "beside gluon.wide, the FP8 kernels and FlashMLA, on an H100 (at 45f3310, run with the tag anchor_h100 and "
        "renamed; its markdown table was not kept)", manual=True, code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "seesaw4_h100", "--no-append", "--budget-s", "160",
         "--shapes", ANCHOR_SHAPES, "--variants", "bf16,bf16+wide,snapmla"),
        ("decode_seesaw4_h100.*", "bench_seesaw4_h100.json"), "our BF16 default (gluon.seesaw past 16 rows) against "
        "gluon.wide, the FP8 default and FlashMLA, on an H100 (at ce27606)", manual=True, code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/profile_decode.py", "run", "--shapes", "32x64x8192", "--variants", "bf16,bf16+ws,flashmla",
         "--time-shapes", "32x64x8192", "--out", "results/h100", "--ncu-dir", "/tmp/ncu", "--budget-s", "250",
         "--time-budget-s", "40"),
        ("profile_pairs_h100.*",), "Nsight Compute profiles of gluon.wide, the first gluon.seesaw pair schedule (264 B "
        "of spilled descriptors) and FlashMLA, on an H100 (at a0af421; written as profile_h100.* and renamed)",
        manual=True, code=(*BENCH, "scripts/device_profile.sh")),
    Job("results/h100", "gpu",
        ("scripts/profile_decode.py", "run", "--shapes", "32x64x8192", "--variants", "bf16+ws", "--time-shapes", "",
         "--out", "results/h100", "--ncu-dir", "/tmp/ncu", "--budget-s", "90", "--time-budget-s", "5"),
        ("profile_pairs_nospill_h100.md",), "the Nsight Compute profile of gluon.seesaw's pair schedule without spills, "
        "on an H100 (at 45f3310; written as profile_h100.md and renamed)", manual=True,
        code=(*BENCH, "scripts/device_profile.sh")),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "seesaw8_h100", "--no-append", "--budget-s", "180",
         "--shapes", "32x64x8192,4x64x8192,128x128x4096,64x128x8192,1x128x32768",
         "--variants", "bf16,snapmla,snapmla+ws"),
        ("decode_seesaw8_h100.*", "bench_seesaw8_h100.json"), "the first gluon.seesaw_fp8 (opt-in) beside gluon.wide, "
        "our BF16 and FlashMLA, on an H100 (at 7a8a939: ~60 us per program in its query prologue)", manual=True,
        code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "seesaw8b_h100", "--no-append", "--budget-s", "160",
         "--shapes", "32x64x8192,4x64x8192,128x128x4096,64x128x8192,1x128x32768",
         "--variants", "bf16,snapmla,snapmla+ws"),
        ("decode_seesaw8b_h100.*", "bench_seesaw8b_h100.json"), "gluon.seesaw_fp8 with the query split between the "
        "warpgroups and pages landing in the lower halves, on an H100 (at 65d362a)", manual=True, code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "wsbase_h100", "--no-append", "--budget-s", "70",
         "--shapes", "32x64x8192,4x64x8192,128x128x4096,64x128x8192,1x128x32768", "--variants", "bf16"),
        ("decode_wsbase_h100.*", "bench_wsbase_h100.json"), "our BF16 default past 16 rows (gluon.seesaw) beside "
        "FlashMLA, the baseline of the call that measured wsrefine, on an H100 (at 469025a)", manual=True, code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "wsrefine_h100", "--no-append", "--budget-s", "70",
         "--shapes", "32x64x8192,4x64x8192,128x128x4096,64x128x8192,1x128x32768", "--variants", "bf16"),
        ("decode_wsrefine_h100.*", "bench_wsrefine_h100.json"), "gluon.seesaw with warpgroup 0 queueing the next "
        "even page's first QK boxes behind its PV (the change of edeb119, re-applied on 469025a in the same device "
        "call as wsbase; not adopted), beside FlashMLA, on an H100", manual=True, code=BENCH),
    Job("results/bench", "gpu",
        ("scripts/bench_decode.py", "--out", "results/bench", "--tag", "seesaw8c_h200", "--no-append", "--budget-s", "220",
         "--shapes", ANCHOR_SHAPES, "--variants", "bf16,snapmla,snapmla+ws"),
        ("decode_seesaw8c_h200.*", "bench_seesaw8c_h200.json"), "our BF16 and FP8 defaults and gluon.seesaw_fp8 "
        "(opt-in) beside FlashMLA at the eight anchor shapes, on an H200 (at e850de4; `TAG=seesaw8c ... bash "
        "scripts/device_widen.sh`)", manual=True, code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "sidebyside_h100", "--no-append", "--budget-s",
         "260", "--shapes", ANCHOR_SHAPES, "--variants", "bf16,snapmla,snapmla+gluon+fp8mma"),
        ("decode_sidebyside_h100.*", "bench_sidebyside_h100.json"), "the side-by-side table (our BF16, the FP8 "
        "default, the native FP8 kernel, FlashMLA BF16) at the eight anchor shapes, on an H100 (`bash "
        "scripts/device_session.sh decode`, which writes decode_sidebyside_h200.* on an H200)", manual=True,
        code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "qk8_h100", "--no-append", "--budget-s", "100",
         "--shapes", "128x16x4096,32x16x32768", "--variants",
         "bf16,snapmla,snapmla+gluon+fp8qk,snapmla+gluon+fp8mma16"),
        ("decode_qk8_h100.*", "bench_qk8_h100.json"), "native FP8 products at <= 16 rows (gluon.narrow's native QK, "
        "gluon.narrow8 with 16-row programs) against the exact default and FlashMLA, on an H100 (`TEST_S=0 "
        "BENCH_S=140 SHAPES=128x16x4096,32x16x32768 bash scripts/device_session.sh qk8`)", manual=True, code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "slot1_h100", "--no-append", "--budget-s", "70",
         "--shapes", "128x16x4096", "--variants", "bf16,snapmla,snapmla+gluon+s1,snapmla+gluon+fp8qk,"
         "snapmla+gluon+fp8qk+s1,snapmla+gluon+fp8mma16,snapmla+gluon+fp8mma16+s1"),
        ("decode_slot1_h100.*", "bench_slot1_h100.json"), "one slot and three programs per SM (num_stages=1) against "
        "two slots and two programs, exact, native QK and both products native, beside FlashMLA at 128x16x4096, on "
        "an H100 (at 09a34f3: `TEST_S=50 TESTS=one_slot BENCH_S=110 SHAPES=128x16x4096 bash scripts/device_session.sh "
        "slot1`)", manual=True, code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/bench_decode.py", "--out", "results/h100", "--tag", "pf_h100", "--no-append", "--budget-s", "130",
         "--shapes", "128x16x4096,32x16x16384,32x16x32768", "--variants",
         "bf16,snapmla,snapmla+pf1,snapmla+pf2,snapmla+pf4,bf16+pf2,snapmla+splits8+narrow"),
        ("decode_pf_h100.csv", "bench_pf_h100.json"), "the narrow kernels' L2 prefetch (1, 2, 4 pages ahead) and 8 "
        "splits of 64 pages at <= 16 rows beside the defaults and FlashMLA, on an H100 (at b47338a: `bash "
        "scripts/device_session.sh step`; its markdown and plots were not brought back)", manual=True, code=BENCH),
    Job("results/h100", "gpu",
        ("scripts/probe_step_ab.py", "--switch", "projections", "--presets", "snapmla", "--batches", "32,128",
         "--contexts", "1024", "--steps", "40", "--out", "results/h100/ab_projections_h100.json"),
        ("ab_projections_h100.json",), "the fused query / output projections of absorbed attention against the torch "
        "operations, A/B in the V2-Lite decode step, on an H100 (at b47338a, `bash scripts/device_session.sh step`)",
        manual=True, code=("snapquant/attention", "snapquant/kernels", "snapquant/eval/generation.py")),
    Job("results/h100", "gpu",
        ("scripts/probe_step_ab.py", "--switch", "prefetch", "--prefetch", "2", "--presets", "snapmla", "--batches",
         "32", "--contexts", "32768", "--steps", "24", "--out", "results/h100/ab_prefetch_h100.json"),
        ("ab_prefetch_h100.json",), "the L2 prefetch (2 pages ahead) A/B in the 32K batch-32 decode step, on an H100 "
        "(at b47338a, `bash scripts/device_session.sh step`)", manual=True,
        code=("snapquant/kernels", "snapquant/eval/generation.py")),
    Job("results/research_model", "gpu", ("scripts/train_research_model.py", "all", "--out", "results/research_model"),
        ("README.md", "*.json", "*.jsonl", "*.csv", "*.npz", "*.png", "*.pdf", "device_call*.log"),
        "the research-scale model at DeepSeek-V2-Lite attention dims: data, training, card, activation study, "
        "FP8 analyses (on the H200 in back-to-back calls: `bash scripts/device_research.sh 1`, then `2`, then `3`)",
        manual=True, code=("scripts/research_card.py", "scripts/research_plots.py", "scripts/device_research.sh",
                           *DECODE, *KERNELS, *EMBEDDED, "snapquant/training", "snapquant/data", "snapquant/analysis",
                           "snapquant/eval", "snapquant/models/stepping.py")),
    Job("results/embedded", "gpu",
        ("scripts/train_embedded_model.py", "train", "--corpus", "build/corpus", "--device", "cuda",
         "--minutes", "8", "--out", "build/embedded_run", "--export", "build/embedded_export"),
        ("train_stdout_h200.log",),
        "training log of the shipped embedded model (needs `scripts/train_embedded_model.py build-data` first; "
        "`install` puts the result in snapquant/assets/embedded/)",
        stdout="train_stdout_h200.log", manual=True,
        code=("snapquant/training", "snapquant/data", "snapquant/embedded.py")),
)


def folders() -> list[str]:
    """Every results folder some job writes, in listing order."""
    return list(dict.fromkeys(j.folder for j in JOBS))


def claimed_by(path: str) -> list[Job]:
    """The jobs whose outputs match `path` (a file path relative to the root)."""
    p = Path(path)
    return [j for j in JOBS if p.parent.as_posix() == j.folder
            and any(fnmatch.fnmatch(p.name, pat) for pat in j.outputs)]


def select(device: str | None, only: list[str] | None) -> list[Job]:
    """Jobs for `device` (None: both), restricted to the folders in `only` (then `manual` jobs too)."""
    wanted = {o.rstrip("/") for o in only} if only else None
    return [j for j in JOBS if (device is None or j.device == device)
            and (j.folder in wanted if wanted else not j.manual)]


def run_job(job: Job, root: Path = ROOT) -> int:
    """Run one job from `root`; a `stdout` job's output is shown live and written to its file atomically
    when the command ends (also when it fails: the log says why)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]))
    argv = [sys.executable, *job.argv]
    (root / job.folder).mkdir(parents=True, exist_ok=True)
    if job.stdout is None:
        return subprocess.run(argv, cwd=root, env=env).returncode
    with atomic_open(root / job.folder / job.stdout) as f:
        proc = subprocess.Popen(argv, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
        for line in proc.stdout:
            sys.stdout.write(line)
            f.write(line)
        return proc.wait()


def committed_results(root: Path = ROOT) -> list[str]:
    """Files under results/ in git's index (paths relative to `root`)."""
    out = subprocess.run(["git", "ls-files", "-z", "--", "results"], cwd=root, capture_output=True, check=True)
    return [f for f in out.stdout.decode().split("\0") if f]


def print_stale(only: list[str] | None = None, root: Path = ROOT) -> int:
    """Print every job's committed results, current or stale (see snapquant.staleness); 1 if any is stale."""
    from .staleness import stale_report

    files = committed_results(root)
    if only:
        wanted = {o.rstrip("/") for o in only}
        files = [f for f in files if Path(f).parent.as_posix() in wanted]
    verdicts = stale_report(JOBS, claimed_by, files, root)
    head = _git_head(root)
    print(f"results vs the code that writes them, at HEAD {head} (a result is stale when a later commit touches "
          f"its job's script or declared code)")
    for v in verdicts:
        print(v.line())
    n = sum(v.stale for v in verdicts)
    print(f"{n} of {len(verdicts)} result groups stale")
    return 1 if n else 0


def _git_head(root: Path) -> str:
    from .environment import git_commit

    return (git_commit() or "")[:7]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="List and rerun the commands that produce results/.")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--list", action="store_true", help="print every job (folder, device, command) and exit")
    which.add_argument("--cpu", action="store_true", help="rerun the CPU jobs")
    which.add_argument("--gpu", action="store_true", help="rerun the GPU jobs (CUDA; the committed files are H200)")
    which.add_argument("--stale", action="store_true",
                       help="list committed results whose job's code changed after the commit they record (exit 1 if any)")
    p.add_argument("--only", nargs="+", metavar="FOLDER", help="only these results folders (e.g. results/bench)")
    p.add_argument("--dry-run", action="store_true", help="print the commands that would run, run nothing")
    args = p.parse_args(argv)

    if args.only:
        unknown = [o for o in args.only if o.rstrip("/") not in folders()]
        if unknown:
            print(f"error: --only {' '.join(unknown)}: not a results folder; known: {', '.join(folders())}",
                  file=sys.stderr)
            return 2
    if args.stale:
        return print_stale(args.only)
    if args.list:
        for j in (j for j in JOBS if not args.only or j.folder in {o.rstrip("/") for o in args.only}):
            flag = " [manual: runs only with --only]" if j.manual else ""
            print(f"{j.folder:32s} {j.device}  {j.what}{flag}\n    {j.command()}")
        return 0
    jobs = select("cpu" if args.cpu else "gpu", args.only)
    if not jobs:
        print("no job matches", file=sys.stderr)
        return 2
    failed = []
    for i, j in enumerate(jobs, 1):
        print(f"[{i}/{len(jobs)}] {j.command()}", flush=True)
        if args.dry_run:
            continue
        t0 = time.perf_counter()
        rc = run_job(j)
        print(f"[{i}/{len(jobs)}] {'ok' if rc == 0 else f'FAILED (rc {rc})'} in {time.perf_counter() - t0:.0f} s",
              flush=True)
        if rc:
            failed.append(j)
    for j in failed:
        print(f"failed: {j.command()}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
