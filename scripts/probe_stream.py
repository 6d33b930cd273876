"""Which TMA ring streams the snapmla cache at the read bandwidth: the page ring without the arithmetic.

    python scripts/probe_stream.py [--shapes 128x16x4096,32x16x16384 --spins 0,1000,2000,3000,4000,6000,8000
        --out results/kernels/stream_h200]

For each shape (a snapmla cache of random pages), in one process with the CUDA-graph timer (n = 25 replays
per row): the read bandwidth (`torch.sum` over 4 GiB), FlashMLA BF16 (when installed) and the snapmla
default decode on the same values, then `snapquant.kernels.gluon.experimental.stream` over the same pages
in several ring structures: STAGES slots of GROUP pages per program, programs per SM (1 to 5), and SPIN
cycles of busy waiting per page standing in for the arithmetic. Each row: us, GB/s of the 40 KB pages (the
64 token scales per page, 0.6 % of the bytes, are not read), the fraction of the read bandwidth, and the
time as a ratio of FlashMLA's with its 95 % bootstrap interval. The question it answers: can a ring with
one page (or two) held for the arithmetic keep enough bytes in flight to stream 40 KB pages at FlashMLA's
bandwidth, and which structure does it with the compute of a page beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMEM_PER_SM = 233472  # bytes an H100 / H200 SM gives its resident programs (228 KB)
SMEM_PER_PROGRAM_RESERVED = 1024  # the driver's per-block reservation
PAGE_BYTES = 64 * 512 + 64 * 64 * 2  # what the probe streams per page: e4m3 latent codes and bf16 RoPE
# (stages, pages per slot, programs per SM): the narrow kernel's ring first, then one program per SM with
# more or larger slots, then more programs of one slot each
CONFIGS = ((2, 1, 2), (2, 1, 1), (3, 1, 1), (4, 1, 1), (5, 1, 1), (2, 2, 1), (1, 1, 3), (1, 1, 4), (1, 1, 5))
SPIN_CONFIGS = ((2, 1, 2), (5, 1, 1), (2, 2, 1), (1, 1, 5))  # timed at every --spins value
SPINS = (0, 1000, 2000, 3000, 4000, 6000, 8000)  # past 3000: how much of a real page's ~5500-6800 cycles the
# two-program ring still absorbs
SEED = 0  # the random pages and queries (build_shape_data)


def resident(stages: int, group: int) -> int:
    from snapquant.kernels.gluon.experimental.stream import stream_smem_bytes

    return SMEM_PER_SM // (stream_smem_bytes(stages, group) + SMEM_PER_PROGRAM_RESERVED)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="128x16x4096,32x16x16384")
    ap.add_argument("--spins", default=",".join(map(str, SPINS)), help="cycles of busy waiting per page")
    ap.add_argument("--out", type=Path, default=None, help="stem of the .json / .md outputs")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_stream: needs a Hopper GPU (the probe kernel is Gluon, sm_90)")
        return 2
    from snapquant.bench import results as res
    from snapquant.bench.harness import build_shape_data, measure_decode, measure_read
    from snapquant.bench.shapes import parse_shapes
    from snapquant.bench.timing import CudaGraphTimer
    from snapquant.bench.variants import select_variants
    from snapquant.environment import environment
    from snapquant.kernels.gluon.experimental.stream import stream_launch, stream_smem_bytes

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    timer = CudaGraphTimer(runs=25)
    spins = [int(s) for s in args.spins.split(",")]
    read = measure_read(dev)
    print(f"read bandwidth {read['gbps']:.0f} GB/s")
    rows: list[dict] = []
    for shape in parse_shapes(args.shapes):
        data = build_shape_data(shape, {"snapmla"}, dev, seed=SEED)
        anchor = {}
        for v in select_variants("flashmla,snapmla"):
            r = measure_decode(v, data, timer, sms, log=print)
            rows.append({"shape": shape.name, "what": v.name, "us": r.get("us"), "gbps": r.get("gbps"),
                         "status": r.get("status"), "error": r.get("error"), "samples": r.get("samples_us")})
            if v.name == "flashmla" and r.get("status") == "ok":
                anchor = rows[-1]
            print(f"{shape.name} {v.name}: {r.get('us')} us {r.get('status')} {r.get('error') or ''}")
        for r in rows:  # the decode kernels' ratios, once the anchor (timed last of them) is known
            if r["shape"] == shape.name and r.get("samples") and anchor.get("samples") and r is not anchor:
                _ratio(r, anchor, res)
        cache = data.caches["snapmla"][0]
        pages = int(cache.block_table.numel())
        nbytes = pages * PAGE_BYTES
        plan = [(c, 0) for c in CONFIGS] + [(c, s) for c in SPIN_CONFIGS for s in spins if s]
        for (stages, group, per_sm), spin in plan:
            row = {"shape": shape.name, "what": "stream", "stages": stages, "group": group, "per_sm": per_sm,
                   "spin_per_page": spin, "smem": stream_smem_bytes(stages, group),
                   "resident_max": resident(stages, group)}
            if row["resident_max"] < per_sm:
                row.update(status="skipped", error=f"{per_sm} programs of {row['smem']} B do not fit an SM")
                rows.append(row)
                continue
            ln = stream_launch(cache.latent, cache.rope, cache.block_table, sms * per_sm, stages, group,
                               spin * group)

            def fn(ln=ln):
                return ln.kernel[ln.grid](*ln.args, **ln.kwargs)

            try:
                fn()
                torch.cuda.synchronize()
                t = timer([fn], None)
                row.update(status="ok", us=t.us, gbps=nbytes / (t.us * 1e-6) / 1e9, samples=list(t.samples))
                row["read_frac"] = row["gbps"] / read["gbps"]
                if anchor.get("samples"):
                    _ratio(row, anchor, res)
            except Exception as e:  # a ring that does not compile or launch is a row, not the end of the run
                row.update(status="error", error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
            print(f"{shape.name} stages={stages} group={group} per_sm={per_sm} spin={spin}: "
                  f"{row.get('us', float('nan')):.1f} us {row.get('gbps', float('nan')):.0f} GB/s "
                  f"{row.get('vs_flashmla', float('nan')):.3f}x FlashMLA {row.get('error') or ''}")
        del data
        torch.cuda.empty_cache()
    env = environment()
    env.update(gpu=torch.cuda.get_device_name(dev), sms=sms, read_gbps=read["gbps"], date=time.strftime("%Y-%m-%d"),
               seed=SEED, spins=spins, shapes=args.shapes)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
        args.out.with_suffix(".md").write_text(markdown(rows, env))
        print(f"wrote {args.out}.json / .md")
    return 0


def _ratio(row: dict, anchor: dict, res) -> None:
    """The row's time over FlashMLA's, with the 95 % bootstrap interval of the ratio of medians."""
    row["vs_flashmla"] = row["us"] / anchor["us"]
    ci = res.ratio_interval(row["samples"], anchor["samples"])
    row["vs_flashmla_ci"] = list(ci) if ci else None


def markdown(rows: list[dict], env: dict) -> str:
    """The probe's table: one line per timed row, n = the timer's replays."""
    lines = [f"# Page-ring stream probe on {env.get('gpu')} (commit {env.get('git_commit')})", "",
             f"Read bandwidth (torch.sum over 4 GiB): {env.get('read_gbps', 0):.0f} GB/s. Time ratios against "
             "FlashMLA BF16 on the same values, same process, 95 % bootstrap intervals; n = timed replays.", "",
             "| shape | what | stages x pages per slot | programs / SM | spin cycles / page | us | GB/s | of read | "
             "vs FlashMLA | n |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['shape']} | {r['what']} | {r.get('stages', '')} x {r.get('group', '')} | "
                         f"{r.get('per_sm', '')} | {r.get('spin_per_page', '')} | {r.get('status')}: "
                         f"{r.get('error') or ''} | | | | |")
            continue
        ring = f"{r['stages']} x {r['group']}" if r["what"] == "stream" else "-"
        ci = r.get("vs_flashmla_ci")
        vs = f"{r['vs_flashmla']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "-"
        frac = f"{r['read_frac']:.2f}" if r.get("read_frac") else "-"
        gbps = f"{r['gbps']:.0f}" if r.get("gbps") else "-"
        lines.append(f"| {r['shape']} | {r['what']} | {ring} | {r.get('per_sm', '-')} | {r.get('spin_per_page', '-')} "
                     f"| {r['us']:.1f} | {gbps} | {frac} | {vs} | {len(r.get('samples') or [])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
