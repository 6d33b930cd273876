"""Build the corpus for, train, package, install and evaluate snapquant's embedded model.

The model is a ~14.6M-parameter DeepSeek-V3-architecture LM (MLA with q-LoRA and interleaved RoPE,
one MoE layer; `snapquant.embedded.EMBEDDED_ARCH`) trained on Python source plus synthetic
long-context retrieval documents. Steps, in order:

1. Here (CPU), once:  python scripts/train_embedded_model.py build-data
   Writes build/corpus/{train.bin,val.bin,meta.json,manifest.jsonl,tokenizer/} (~37 MB, ignored by
   git) and copies the tokenizer, corpus manifest and meta into snapquant/assets/embedded/.
2. On a CUDA GPU, with build/corpus copied there (the shipped model: one H200, under 10 minutes):
     python scripts/train_embedded_model.py train --corpus build/corpus --device cuda \\
         --minutes 9 --out /tmp/embedded_run --export EXPORT_DIR
   Trains until 9 min after start minus the evaluation reserve, saves bf16 safetensors shards
   (<14 MB each), evaluates them (BF16 task scores, direct harness), writes the model card and
   training_log.jsonl, and leaves in EXPORT_DIR: model-0000k-of-0000n.safetensors + embedded_meta.tar
   (<= 5 files). Weights are also exported every --ckpt-minutes, so a killed run still returns some.
   To continue from returned weights: add --init-from DIR_WITH_INSTALLED_WEIGHTS (copied to the GPU).
3. Here: python scripts/train_embedded_model.py install --from EXPORT_DIR (copied back)
   Unpacks into snapquant/assets/embedded/ and checks that it loads and generates.
4. Here (optional, CPU, ~10-20 min): python scripts/train_embedded_model.py eval --limit 50
   Runs the lm-eval task suite on the installed model and appends the scores to the model card.

Smoke test of the whole path on CPU (what CI's tests/test_embedded_train.py does, smaller):
    python scripts/train_embedded_model.py train --tiny --device cpu --minutes 3 --out build/tiny_run

(scripts/train_embedded_model.py is the command line; this module is its implementation.)
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import io
import json
import math
import os
import shutil
import tarfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # data workers fork; keep the Rust pool out
REPO = Path(__file__).resolve().parents[2]  # the checkout: build/ (the corpus) lives beside snapquant/

META_TAR = "embedded_meta.tar"
SHARD_BYTES = "14MB"  # transformers reads "MB" as 10**6 bytes: shards stay under 14 MB


# ------------------------------------------------------------------------------------ build-data


def _eager_experts(model) -> None:
    """Loop over the (4) experts instead of transformers' default GPU "batched_mm" path, which gathers
    one weight matrix per token (47 GB for a 16 x 4096 batch on the H200 with transformers 5.17)."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    else:  # older transformers: the MoE block reads the config
        model.config._experts_implementation = "eager"

def cmd_build_data(args: argparse.Namespace) -> None:
    from snapquant.data.build import build_corpus
    from snapquant.embedded import EMBEDDED_PATH

    meta = build_corpus(args.out, vocab_size=args.vocab_size, max_train_tokens=args.max_train_tokens,
                        include_packages=not args.stdlib_only, strict_versions=not args.no_strict_versions,
                        seed=args.seed)
    dst = Path(args.assets)
    dst.mkdir(parents=True, exist_ok=True)
    for f in (Path(args.out) / "tokenizer").iterdir():
        shutil.copy2(f, dst / f.name)
    shutil.copy2(Path(args.out) / "manifest.jsonl", dst / "corpus_manifest.jsonl")
    shutil.copy2(Path(args.out) / "meta.json", dst / "corpus_meta.json")
    print(json.dumps({k: v for k, v in meta.items() if k != "summary"}, indent=1))
    print(f"tokenizer + manifest copied to {dst} (default {EMBEDDED_PATH})")


# ----------------------------------------------------------------------------------------- train

class _Log:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fh = path.open("a", encoding="utf-8")
        self.t0 = time.time()

    def __call__(self, event: str, **fields) -> None:
        rec = {"event": event, "t": round(time.time() - self.t0, 2), **fields}
        self.fh.write(json.dumps(rec) + "\n")
        self.fh.flush()
        short = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in fields.items()}
        print(f"[{rec['t']:7.1f}s] {event} {json.dumps(short)[:400]}", flush=True)


def _row_stream(corpus: str, tokenizer_path: str, spec, seed: int):
    from snapquant.data.stream import row_stream

    return row_stream(corpus, tokenizer_path, spec, seed)


def _router_bias_hooks(model):
    """DeepSeek-V3's auxiliary-loss-free balancing: nudge each router's bias toward equal load."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    loads = {}

    def hook(mod, _inp, out):
        loads[mod] = out[2].detach()

    routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
    for r in routers:
        r.register_forward_hook(hook)

    def update(rate: float):
        """Apply one bias step; return the max/mean expert load per router (a tensor, not synced)."""
        import torch

        spreads = []
        with torch.no_grad():
            for r in routers:
                if r not in loads:
                    continue
                load = torch.bincount(loads[r].flatten(), minlength=r.num_experts).float()
                r.e_score_correction_bias += rate * torch.sign(load.mean() - load)
                spreads.append(load.max() / load.mean().clamp_min(1))
        loads.clear()
        return torch.stack(spreads) if spreads else None

    return update


def _save_bf16(model, tokenizer_dir: Path, out: Path) -> Path:
    """Save a bf16 copy (router weights stay fp32, as transformers keeps them) as safetensors shards."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    half = copy.deepcopy(model).to(torch.bfloat16)
    for name, mod in half.named_modules():
        if name.endswith("mlp.gate"):
            src = model.get_submodule(name)
            mod.weight.data = src.weight.data.detach().float().clone()
            mod.e_score_correction_bias.data = src.e_score_correction_bias.data.detach().float().clone()
    # Training runs without a cache; the shipped model must generate with one (generation_config.json is
    # derived from the training config, and a patched model's generate reads its quantized cache).
    half.config.use_cache = True
    half.generation_config.use_cache = True
    half.save_pretrained(out, max_shard_size=SHARD_BYTES)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(f, out / f.name)
    return out


def _export(src: Path, dst: Path) -> list[str]:
    """Copy shards as files and everything else small into one tar: few files for the device return.

    Each file is written under a temporary name in `dst` and renamed, so a run killed mid-export
    never leaves a half-written shard under its real name.
    """
    dst.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for f in sorted(src.iterdir()):
            if f.is_file() and not f.name.endswith(".safetensors"):
                tar.add(f, arcname=f.name)
    payload = [(META_TAR, buf.getvalue())] + [(f.name, f.read_bytes()) for f in sorted(src.glob("*.safetensors"))]
    for old in dst.glob("*.safetensors"):
        if old.name not in {n for n, _ in payload}:
            old.unlink()
    from snapquant.atomic import atomic_write_bytes

    for name, data in payload:
        atomic_write_bytes(dst / name, data)
    return [n for n, _ in payload]


def _lr_at(step: int, progress: float, peak: float, warmup: int, floor: float) -> float:
    warm = min(1.0, (step + 1) / max(1, warmup))
    return peak * warm * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def cmd_train(args: argparse.Namespace) -> None:
    t_start = time.time()
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3ForCausalLM

    from snapquant.data.build import load_corpus
    from snapquant.data.mixture import KIND_SYNTH, MixtureSpec
    from snapquant.embedded import EMBEDDED_ARCH, TINY_ARCH, embedded_config
    from snapquant.eval.tasks import direct, sq_utils

    out = Path(args.out)
    if out.exists() and not args.init_from and any(out.iterdir()) and not args.overwrite:
        raise SystemExit(f"--out {out} is not empty; pass --overwrite or choose another folder")
    out.mkdir(parents=True, exist_ok=True)
    (out / "training_log.jsonl").unlink(missing_ok=True)
    prev = {"steps": 0, "tokens": 0, "seconds": 0.0}
    if args.init_from:
        # A continued run keeps the earlier log and counts steps/tokens from where that run stopped.
        src = Path(args.init_from)
        if (src / "training_log.jsonl").is_file() and src.resolve() != out.resolve():
            shutil.copy2(src / "training_log.jsonl", out / "training_log.jsonl")
        if (src / "training_state.json").is_file():
            old = json.loads((src / "training_state.json").read_text())
            prev = {"steps": old.get("steps", 0), "tokens": old.get("tokens", 0),
                    "seconds": old.get("train_seconds", 0.0)}
    log = _Log(out / "training_log.jsonl")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(args.seed)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    corpus = Path(args.corpus)
    train_tokens, val_tokens, cmeta = load_corpus(corpus, verify=True)
    tok_dir = corpus / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    arch = dict(TINY_ARCH if args.tiny else EMBEDDED_ARCH)
    if cmeta["vocab_size"] != arch["vocab_size"]:
        raise SystemExit(f"corpus vocab_size={cmeta['vocab_size']} != model vocab_size={arch['vocab_size']}")
    seq_len = args.seq_len or arch["max_position_embeddings"]
    config = embedded_config(arch)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    if args.init_from:
        model = AutoModelForCausalLM.from_pretrained(args.init_from, dtype=torch.float32,
                                                     attn_implementation="sdpa")
        model.config.use_cache = False
        _eager_experts(model)
    else:
        model = DeepseekV3ForCausalLM(config)
    _eager_experts(model)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    spec = MixtureSpec(seq_len=seq_len, synthetic_fraction=args.synthetic_fraction)
    eval_lengths = [n for n in (1024, 2048, 4096) if n <= seq_len] or [seq_len]
    log("start", args={k: v for k, v in vars(args).items() if k != "fn"}, params=n_params, arch=arch, corpus=cmeta["train_bin_sha256"],
        train_tokens=int(train_tokens.size), mixture=spec.__dict__, torch=torch.__version__,
        transformers=__import__("transformers").__version__,
        device=torch.cuda.get_device_name(0) if cuda else "cpu")

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in name and "gate.weight" not in name else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=cuda)
    update_routers = _router_bias_hooks(model)

    workers = args.workers if args.workers is not None else (min(10, (os.cpu_count() or 2) - 2) if cuda else 1)
    loader = torch.utils.data.DataLoader(
        _row_stream(str(corpus), str(tok_dir), spec, args.seed), batch_size=args.batch_size,
        num_workers=workers, pin_memory=cuda, prefetch_factor=8 if workers else None,
        persistent_workers=bool(workers))
    deadline = t_start + args.minutes * 60 - args.eval_reserve_s
    t_train = time.time()
    next_ckpt = t_train + args.ckpt_minutes * 60
    next_probe = t_train + args.probe_minutes * 60
    step, tokens_seen = prev["steps"], prev["tokens"]
    first_step = step
    acc = {"loss": 0.0, "code": 0.0, "synth": 0.0, "n_code": 0, "n_synth": 0, "n": 0}
    t_log = time.time()
    tok_log = 0
    last = {}
    for batch, kinds in loader:
        now = time.time()
        if now >= deadline or (args.steps and step - first_step >= args.steps):
            break
        progress = (step - first_step) / args.steps if args.steps else (now - t_train) / max(1.0, deadline - t_train)
        lr = _lr_at(step - first_step, progress, args.lr, args.warmup, args.lr_floor)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = batch.to(device, non_blocking=True)
        x, y = batch[:, :-1], batch[:, 1:]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(input_ids=x).logits
        per_tok = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                  reduction="none").view(y.shape)
        loss = per_tok.mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        spread = update_routers(args.router_bias_rate)
        step += 1
        tokens_seen += x.numel()
        tok_log += x.numel()
        with torch.no_grad():
            row_loss = per_tok.mean(dim=1).detach()
            synth = (kinds.to(device) == KIND_SYNTH)
            acc["loss"] += loss.detach()
            acc["synth"] += (row_loss * synth).sum()
            acc["code"] += (row_loss * ~synth).sum()
            acc["n_synth"] += int(synth.sum())
            acc["n_code"] += int((~synth).sum())
            acc["n"] += 1
        if step % args.log_every == 0 or step == first_step + 1:
            dt = time.time() - t_log
            last = {"loss": float(acc["loss"]) / acc["n"],
                    "loss_code": float(acc["code"]) / max(1, acc["n_code"]),
                    "loss_synth": float(acc["synth"]) / max(1, acc["n_synth"])}
            log("step", step=step, tokens=tokens_seen, lr=lr, tok_s=round(tok_log / max(dt, 1e-9)),
                router_max_load=[round(float(v), 3) for v in spread] if spread is not None else None, **last)
            acc = {"loss": 0.0, "code": 0.0, "synth": 0.0, "n_code": 0, "n_synth": 0, "n": 0}
            t_log, tok_log = time.time(), 0
        now = time.time()
        if now >= next_probe and now + 30 < deadline:
            scores = direct.score_kv(model, tokenizer, eval_lengths[-2:], args.probe_samples,
                                     tokenizer_path=str(tok_dir), batch_size=args.eval_batch,
                                     **sq_utils.KV_TRAINING_FORMAT)
            model.train()
            log("probe", step=step, **scores)
            next_probe = time.time() + args.probe_minutes * 60
        if args.export and now >= next_ckpt and now + 30 < deadline:
            _save_bf16(model, tok_dir, out)
            _write_state(out, step, tokens_seen, args, last, None, n_params, cmeta,
                         prev["seconds"] + time.time() - t_train)
            log("checkpoint", step=step, files=_export(out, Path(args.export)))
            next_ckpt = time.time() + args.ckpt_minutes * 60
    train_s = time.time() - t_train
    log("train_end", step=step, tokens=tokens_seen, seconds=round(train_s, 1),
        tok_s=round((tokens_seen - prev["tokens"]) / max(train_s, 1e-9)), **last)

    del loader  # stop the data workers before evaluating
    val = _val_loss(model, val_tokens, seq_len, device, cuda)
    _save_bf16(model, tok_dir, out)
    log("saved", val_loss=val, files=sorted(f.name for f in out.iterdir()))
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    # Score the shipped artefact: the bf16 weights read back from disk (computed in fp32 on CPU,
    # where bf16 matmuls are slow; on the GPU in bf16 as the card says).
    shipped = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16 if cuda else torch.float32,
                                                   attn_implementation="sdpa")
    _eager_experts(shipped)
    shipped.to(device).eval()
    scores = direct.quick_suite(shipped, tokenizer, kv_samples=args.eval_samples,
                                passkey_samples=args.eval_passkey_samples,
                                completion_samples=args.eval_completion_samples, lengths=eval_lengths,
                                tokenizer_path=str(tok_dir), batch_size=args.eval_batch,
                                ppl_files=args.eval_ppl_files, log=lambda m: log("eval_progress", msg=m),
                                kv_knobs=sq_utils.KV_TRAINING_FORMAT)
    scores["val_loss_fp32_master"] = val
    log("eval", **scores)
    _write_state(out, step, tokens_seen, args, last, scores, n_params, cmeta, prev["seconds"] + train_s)
    write_card(out, cmeta)
    if args.export:
        log("export", files=_export(out, Path(args.export)))
    log("done", total_s=round(time.time() - t_start, 1))


def _val_loss(model, val_tokens, seq_len: int, device, cuda: bool) -> float:
    import torch
    import torch.nn.functional as F

    model.eval()
    ids = torch.from_numpy(val_tokens.astype("int64"))
    total, n = 0.0, 0
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
        for s in range(0, ids.numel() - 1, seq_len):
            chunk = ids[s:s + seq_len + 1].to(device)
            if chunk.numel() < 2:
                break
            logits = model(input_ids=chunk[None, :-1]).logits[0].float()
            total += F.cross_entropy(logits, chunk[1:], reduction="sum").item()
            n += chunk.numel() - 1
    model.train()
    return total / max(1, n)


def _write_state(out: Path, step, tokens, args, last, scores, n_params, cmeta, train_s) -> None:
    import torch

    from snapquant.data.corpus import load_heldout

    state = {"steps": step, "tokens": tokens, "train_seconds": round(train_s, 1), "params": n_params,
             "batch_size": args.batch_size, "seq_len": args.seq_len or None, "lr": args.lr,
             "seed": args.seed, "tiny": args.tiny, "final_losses": last, "bf16_scores": scores,
             "corpus": {k: cmeta[k] for k in ("train_tokens", "train_files", "train_bytes", "vocab_size",
                                               "manifest_sha256", "train_bin_sha256", "tokenizer_sha256")},
             "corpus_summary": cmeta["summary"], "init_from": args.init_from,
             "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and args.device != "cpu" else "cpu",
             "torch": torch.__version__, "transformers": __import__("transformers").__version__,
             "heldout_files_scored": len(load_heldout())}  # the decontaminated list evaluation reads
    from snapquant.atomic import atomic_write_json

    atomic_write_json(out / "training_state.json", state, indent=2)


# ------------------------------------------------------------------------------------- the card

def write_card(model_dir: Path, cmeta: dict | None = None, lm_eval_scores: dict | None = None) -> Path:
    """(Re)write README.md of a model folder from training_state.json (+ lm-eval scores if given)."""
    model_dir = Path(model_dir)
    state = json.loads((model_dir / "training_state.json").read_text())
    cfg = json.loads((model_dir / "config.json").read_text())
    if lm_eval_scores is not None:
        state["lm_eval_scores"] = lm_eval_scores
        from snapquant.atomic import atomic_write_json

        atomic_write_json(model_dir / "training_state.json", state, indent=2)
    weights = sorted(model_dir.glob("*.safetensors"))
    wbytes = sum(f.stat().st_size for f in weights)
    dims = ["hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size", "first_k_dense_replace",
            "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
            "vocab_size", "max_position_embeddings", "rope_interleave", "tie_word_embeddings"]
    lines = [
        "# snapquant embedded model", "",
        "A small DeepSeek-V3-architecture causal LM (MLA with q-LoRA, interleaved RoPE, one MoE layer), "
        "trained from scratch by `scripts/train_embedded_model.py` on Python source code plus synthetic "
        "long-context retrieval documents, so that KV-cache quantization experiments have a real model "
        "to measure offline. It is a research fixture, not a useful code assistant.", "",
        "Load: `from snapquant import load_embedded; model, tok = load_embedded()` or "
        "`AutoModelForCausalLM.from_pretrained(path)`.", "",
        "## Architecture", "", "| field | value |", "|---|---|",
        *[f"| {k} | {cfg.get(k)} |" for k in dims],
        f"| parameters | {state['params']:,} |",
        f"| weights | {len(weights)} bf16 safetensors files, {wbytes / 1e6:.1f} MB |", "",
        "## Data", "",
        f"- Training text: {state['corpus']['train_files']} Python files, {state['corpus']['train_bytes'] / 1e6:.1f} MB, "
        f"{state['corpus']['train_tokens'] / 1e6:.2f}M tokens (CPython 3.11 standard library and pinned packages; "
        "full list with sha256 in `corpus_manifest.jsonl`, manifest sha256 "
        f"`{state['corpus']['manifest_sha256'][:16]}...`).",
        "- Held-out files (never trained on, excluded by content hash): `snapquant/eval/tasks/data/heldout_code.jsonl`.",
        "- Synthetic documents generated on the fly (seed namespace `train`; the evaluation tasks use `eval`): "
        "key-value lookups written as Python dicts with answered asserts, classic pass keys, and pass keys "
        "hidden in real code.",
        f"- Tokenizer: byte-level BPE, {state['corpus']['vocab_size']} tokens, newline-isolated, trained on "
        "the training split.", "",
        "| split / origin | files | MB |", "|---|---|---|",
        *[f"| {k} | {v['files']} | {v['bytes'] / 1e6:.2f} |" for k, v in state["corpus_summary"]["splits"].items()],
        *[f"| {k} | {v['files']} | {v['bytes'] / 1e6:.2f} |" for k, v in state["corpus_summary"]["origins"].items()],
        "", "## Training", "",
        f"- {state['steps']} steps x {state['batch_size']} rows x {state['seq_len'] or cfg['max_position_embeddings']} "
        f"tokens = {state['tokens'] / 1e6:.1f}M tokens in {state['train_seconds']:.0f}s on {state['device']} "
        f"(torch {state['torch']}, transformers {state['transformers']}); AdamW, peak lr {state['lr']}, seed "
        f"{state['seed']}{', initialised from ' + str(state['init_from']) if state['init_from'] else ''}.",
        f"- Final training losses (nats/token, last logging window): {json.dumps(state['final_losses'])}.",
        "- Full log: `training_log.jsonl`.", "",
        "## BF16 scores (direct harness, same documents and metrics as the lm-eval tasks)", "",
        "| metric | value |", "|---|---|",
        *[f"| {k} | {v:.4f} |" for k, v in (state.get("bf16_scores") or {}).items()],
    ]
    if state.get("lm_eval_scores"):
        lm_scores = dict(state["lm_eval_scores"])
        limit = lm_scores.pop("limit", {}).get("docs")
        lines += ["", "## BF16 scores through lm-eval (CPU)", "",
                  f"`scripts/train_embedded_model.py eval`: the same tasks run by lm-eval on the bf16 weights, "
                  f"first {limit} documents of each task (code ppl: the {limit} smallest held-out files).", "",
                  "| task | metric | value |", "|---|---|---|",
                  *[f"| {t} | {m} | {v:.4f} |" for t, ms in lm_scores.items() for m, v in ms.items()]]
    lines += ["", "Quality bar: key-value retrieval exact match >= 0.90 at 1K and 2K, >= 0.70 at 4K.", ""]
    decontam = model_dir / "heldout_decontam.json"
    if decontam.is_file():  # written by scripts/decontam_heldout.py for this model's corpus
        from snapquant.data.decontam import heldout_card_lines

        lines += [*heldout_card_lines(json.loads(decontam.read_text())), ""]
    path = model_dir / "README.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------- install

def cmd_install(args: argparse.Namespace) -> None:
    import torch

    from snapquant.embedded import EMBEDDED_PATH, load_embedded

    src, dst = Path(args.src), Path(args.dst or EMBEDDED_PATH)
    shards = sorted(src.glob("*.safetensors"))
    tar_path = src / META_TAR
    if not shards or not tar_path.is_file():
        raise SystemExit(f"{src} must hold *.safetensors and {META_TAR} (the train --export output)")
    dst.mkdir(parents=True, exist_ok=True)
    for old in dst.glob("model*.safetensors*"):
        old.unlink()
    with tarfile.open(tar_path) as tar:
        for m in tar.getmembers():
            if not m.isfile() or "/" in m.name or m.name.startswith("."):
                raise SystemExit(f"{tar_path}: unexpected member {m.name!r}")
        tar.extractall(dst, filter="data")
    for f in shards:
        shutil.copy2(f, dst / f.name)
    model, tok = load_embedded(dtype=torch.float32, path=dst)
    ids = tok("def main():\n", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=16, do_sample=False)
    print(f"installed into {dst}; sample: {tok.decode(out[0])!r}")
    for f in sorted(dst.iterdir()):
        print(f"  {f.name}  {f.stat().st_size:,} B  sha256 {hashlib.sha256(f.read_bytes()).hexdigest()[:16]}")


# ------------------------------------------------------------------------------------------ eval

def cmd_eval(args: argparse.Namespace) -> None:
    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM

    from snapquant.embedded import EMBEDDED_PATH, load_embedded
    from snapquant.eval.tasks import task_manager

    path = Path(args.model or EMBEDDED_PATH)
    model, tok = load_embedded(dtype=getattr(torch, args.dtype), path=path)
    torch.set_num_threads(os.cpu_count() or 1)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=args.batch_size)
    res = lm_eval.simple_evaluate(model=lm, tasks=args.tasks, task_manager=task_manager(tokenizer=str(path)),
                                  limit=args.limit, bootstrap_iters=0, log_samples=False)
    scores = {t: {k.split(",")[0]: v for k, v in r.items() if "," in k and "stderr" not in k
                  and isinstance(v, (int, float)) and v != -1} for t, r in res["results"].items()}
    print(json.dumps(scores, indent=1))
    if (path / "training_state.json").is_file():
        write_card(path, lm_eval_scores={"limit": {"docs": args.limit}, **scores})
        print(f"card updated: {path / 'README.md'}")


# ------------------------------------------------------------------------------------------- cli

def main(argv: list[str] | None = None) -> None:
    from snapquant.embedded import EMBEDDED_PATH

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build-data", help="build build/corpus and copy the tokenizer into the assets")
    b.add_argument("--out", default=str(REPO / "build" / "corpus"))
    b.add_argument("--assets", default=str(EMBEDDED_PATH))
    b.add_argument("--vocab-size", type=int, default=8192)
    b.add_argument("--max-train-tokens", type=int, default=18_000_000)
    b.add_argument("--stdlib-only", action="store_true")
    b.add_argument("--no-strict-versions", action="store_true")
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(fn=cmd_build_data)

    t = sub.add_parser("train", help="train, save bf16 shards, evaluate, write card (+ export)")
    t.add_argument("--corpus", default=str(REPO / "build" / "corpus"))
    t.add_argument("--out", required=True, help="HF model folder to write")
    t.add_argument("--export", default=None, help="folder for the few files to copy back (weights + metadata)")
    t.add_argument("--device", default="cuda")
    t.add_argument("--tiny", action="store_true", help="TINY_ARCH, short rows: a CPU smoke run")
    t.add_argument("--minutes", type=float, default=9.0, help="wall budget of the whole command")
    t.add_argument("--eval-reserve-s", type=float, default=110.0, help="seconds kept for eval + save")
    t.add_argument("--steps", type=int, default=0, help="fixed step count (LR schedule by step); 0 = by time")
    t.add_argument("--seq-len", type=int, default=0, help="0 = max_position_embeddings")
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--lr", type=float, default=1.5e-3)
    t.add_argument("--lr-floor", type=float, default=0.1)
    t.add_argument("--warmup", type=int, default=150)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--router-bias-rate", type=float, default=1e-3)
    t.add_argument("--synthetic-fraction", type=float, default=0.45)
    t.add_argument("--workers", type=int, default=None)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--log-every", type=int, default=25)
    t.add_argument("--ckpt-minutes", type=float, default=2.5)
    t.add_argument("--probe-minutes", type=float, default=1.5)
    t.add_argument("--probe-samples", type=int, default=16)
    t.add_argument("--eval-samples", type=int, default=100, help="key-value questions per length")
    t.add_argument("--eval-passkey-samples", type=int, default=4, help="per (length, depth) and haystack")
    t.add_argument("--eval-completion-samples", type=int, default=200)
    t.add_argument("--eval-batch", type=int, default=25)
    t.add_argument("--eval-ppl-files", type=int, default=0, help="held-out files for code ppl (0 = all)")
    t.add_argument("--init-from", default=None, help="continue from a saved model folder")
    t.add_argument("--overwrite", action="store_true")
    t.set_defaults(fn=cmd_train)

    i = sub.add_parser("install", help="unpack a train --export folder into snapquant/assets/embedded")
    i.add_argument("--from", dest="src", required=True)
    i.add_argument("--to", dest="dst", default=None)
    i.set_defaults(fn=cmd_install)

    e = sub.add_parser("eval", help="run the lm-eval task suite on the installed model, update the card")
    e.add_argument("--model", default=None)
    e.add_argument("--tasks", nargs="+", default=["sq_code_ppl", "sq_code_completion", "sq_kv_retrieval",
                                                  "sq_passkey", "sq_passkey_code"])
    e.add_argument("--limit", type=int, default=50)
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--dtype", default="bfloat16")
    e.set_defaults(fn=cmd_eval)

    args = p.parse_args(argv)
    args.fn(args)

