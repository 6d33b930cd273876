"""Dump the PTX of every decode / append kernel at representative launch configs, and compare two dumps.

    python scripts/dump_ptx.py --out /tmp/ptx_after [--only gluon] [--arch 90]
    python scripts/dump_ptx.py --compare /tmp/ptx_before /tmp/ptx_after

Each config builds its launches the way the launchers do (decode plans over meta tensors of the real
shape, `native=True`: no GPU needed) and compiles every launch for the target with Triton
(`snapquant.kernels.compile_stats.compile_launch`), writing `<config>__<launch>.ptx` and a manifest.
`--compare` reports, per file, whether the PTX is byte-identical, identical once debug information is
stripped (`.file` / `.loc` directives and `.debug_*` sections: source paths and line numbers), identical
once the kernel's entry name is also replaced by a placeholder (a renamed kernel function, the same
code), or different; exit status 1 when any file differs or is missing. A refactor of the kernels'
Python must leave the default kernels' PTX identical up to that debug information and naming.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

R, D = 512, 64
SMS = 132
APPEND_HOST = "snapquant.kernels.triton.append"  # the module whose `for_device` launches the append


def _decode_plan(preset: str, B: int, H: int, L: int, *, S: int = 1, r: int = R, d: int = D, dense: bool = False,
                 **knobs):
    """A decode plan over meta tensors: a paged cache, or (dense) the patch's rows `[B, cap, ...]`."""
    from snapquant import PRESETS
    from snapquant.kernels import PagedMLACache
    from snapquant.kernels.decode import KernelOperands, plan_decode

    cfg = PRESETS[preset] if isinstance(preset, str) else preset
    cache = PagedMLACache.empty(B, L, r, d, cfg, device="meta")
    ops = KernelOperands.from_paged(cache)
    if dense:  # page stride = one row: page ids are flat token rows (snapquant.kernels.backend)
        cap = cache.capacity + 64
        nb = max(cache.num_scale_blocks, 1)
        lat = torch.empty(B, cap, r, dtype=cache.latent.dtype, device="meta")[:, :L]
        rope = torch.empty(B, cap, d, dtype=torch.bfloat16, device="meta")[:, :L]
        scale = (torch.empty(B, cap, nb, dtype=torch.float32, device="meta")[:, :L]
                 if cache.scale is not None else cache.lengths)
        s_strides = (scale.stride(1), scale.stride(1), scale.stride(2)) if cache.scale is not None else (0, 0, 0)
        bt = torch.empty(B, cache.max_pages, dtype=torch.int32, device="meta")
        ops = KernelOperands(ops.layout, lat.view(torch.int16) if ops.layout == "bf16" else lat,
                             rope.view(torch.int16), scale, (r, r), (d, d), s_strides, bt, cache.lengths, r, d, nb)
    q = torch.empty(B, S, H, r + d, dtype=torch.bfloat16, device="meta")
    splits = knobs.pop("num_splits", None)
    return plan_decode(q, ops, 0.07, cfg, splits, native=True, num_sms=SMS, **knobs).launches


def _append_launches(preset: str, n: int, tokens_per_program: int, in_dtype=torch.bfloat16, r: int = R, d: int = D):
    """The quantize-and-append launch `quantize_append` makes for n new tokens (meta tensors)."""
    from snapquant import PRESETS
    from snapquant.kernels import PagedMLACache, quantize_append

    cfg = PRESETS[preset]
    cache = PagedMLACache.empty(4, 4096, r, d, cfg, device="meta")
    latent = torch.empty(n, r, dtype=in_dtype, device="meta")
    rope = torch.empty(n, d, dtype=in_dtype, device="meta")
    slots = torch.empty(n, dtype=torch.int64, device="meta")
    captured = []

    class _Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                captured.append(SimpleNamespace(name=self.kernel.fn.__name__, kernel=self.kernel, grid=grid,
                                                args=args, kwargs=kwargs))
            return launch

    qa_host = importlib.import_module(APPEND_HOST)  # the module (the package exports the function)

    saved = qa_host.for_device, qa_host.interpreting
    qa_host.for_device = lambda kernel, device: _Recorder(kernel)
    qa_host.interpreting = lambda device: False  # the GPU build (fp8 stores, NATIVE) for the meta tensors
    try:
        quantize_append(latent, rope, cache, slots, check_bounds=False, tokens_per_program=tokens_per_program)
    finally:
        qa_host.for_device, qa_host.interpreting = saved
    return captured


def configs() -> dict[str, callable]:
    """name -> a function returning the config's launches (objects with name, kernel, args, kwargs)."""
    c: dict[str, callable] = {}
    # ---- Triton decode (the default off Hopper; knob variants) and its combine
    c["triton_snapmla_h16_pairs"] = lambda: _decode_plan("snapmla", 8, 16, 2048, tile="pairs")
    c["triton_snapmla_h64_pairs"] = lambda: _decode_plan("snapmla", 8, 64, 2048, tile="pairs")
    c["triton_snapmla_h16_pairs_s2_1split"] = lambda: _decode_plan("snapmla", 4, 16, 1024, S=2, tile="pairs",
                                                                   num_splits=1)
    c["triton_snapmla_h16_rows_exact"] = lambda: _decode_plan("snapmla", 8, 16, 2048, tile="rows", p_div="exact")
    c["triton_snapmla_h16_tokens"] = lambda: _decode_plan("snapmla", 8, 16, 2048, tile="tokens")
    c["triton_snapmla_h16_rows_fp8mma"] = lambda: _decode_plan("snapmla", 8, 16, 2048, tile="rows", fp8_mma=True)
    c["triton_kv_only_h16_rows"] = lambda: _decode_plan("snapmla_kv_only", 8, 16, 2048, tile="rows")
    c["triton_q_fp8_h64_rows"] = lambda: _decode_plan("snapmla_q_fp8", 8, 64, 2048, tile="rows")
    c["triton_bf16_h16_rows"] = lambda: _decode_plan("bf16", 8, 16, 2048, tile="rows")
    c["triton_bf16_h64_rows"] = lambda: _decode_plan("bf16", 8, 64, 2048, tile="rows")
    c["triton_ds_v32_h16_rows"] = lambda: _decode_plan("ds_v32", 8, 16, 2048, tile="rows")
    c["triton_snapmla_dense_pairs"] = lambda: _decode_plan("snapmla", 4, 16, 1000, tile="pairs", dense=True)
    c["triton_snapmla_balanced"] = lambda: _decode_plan("snapmla", 8, 16, 2048, tile="pairs", schedule="balanced")
    c["triton_bf16_balanced_bm64"] = lambda: _decode_plan("bf16", 8, 16, 2048, tile="rows", schedule="balanced",
                                                          block_m=64)
    # ---- quantize-and-append
    for preset in ("snapmla", "ds_v32", "bf16"):
        c[f"append_{preset}_1"] = lambda p=preset: _append_launches(p, 64, 1)
        c[f"append_{preset}_8"] = lambda p=preset: _append_launches(p, 8192, 8)
    c["append_snapmla_fp32in_1"] = lambda: _append_launches("snapmla", 64, 1, torch.float32)
    # ---- Gluon (Hopper): the defaults at <= 16 rows and past them, then the opt-in native FP8 kernels
    c["gluon_regs_h16"] = lambda: _decode_plan("snapmla", 8, 16, 2048, tile="gluon")
    c["gluon_regs_h16_dense_s2"] = lambda: _decode_plan("snapmla", 4, 8, 1000, S=2, tile="gluon", dense=True)
    c["gluon_regs_h16_1split"] = lambda: _decode_plan("snapmla", 8, 16, 2048, tile="gluon", num_splits=1)
    c["gluon_tile_r256"] = lambda: _decode_plan("snapmla", 4, 16, 1024, r=256, d=32, tile="gluon")
    c["gluon_tile_r128"] = lambda: _decode_plan("snapmla", 4, 16, 1024, r=128, d=64, tile="gluon")
    c["gluon_narrow_s1"] = lambda: _decode_plan("snapmla", 8, 16, 2048, tile="gluon", num_stages=1)
    c["gluon_tile_fp8qk_s2"] = lambda: _decode_plan("snapmla", 8, 16, 2048, tile="gluon", fp8_mma="qk")
    c["gluon_narrow_fp8qk_s1"] = lambda: _decode_plan("snapmla", 8, 16, 2048, tile="gluon", fp8_mma="qk",
                                                    num_stages=1)
    c["gluon_wide_snapmla_h64"] = lambda: _decode_plan("snapmla", 32, 64, 8192, tile="gluon")
    c["gluon_wide_bf16_h64"] = lambda: _decode_plan("bf16", 32, 64, 8192, tile="gluon")
    c["gluon_narrow_bf16_h16"] = lambda: _decode_plan("bf16", 8, 16, 2048, tile="gluon")
    c["gluon_narrow_bf16_h16_s1"] = lambda: _decode_plan("bf16", 8, 16, 2048, tile="gluon", num_stages=1)
    c["gluon_wide_snapmla_h20_s2_dense"] = lambda: _decode_plan("snapmla", 3, 20, 1000, S=2, tile="gluon",
                                                                dense=True)
    c["gluon_narrow8_h64"] = lambda: _decode_plan("snapmla", 32, 64, 8192, tile="gluon", fp8_mma=True)
    c["gluon_narrow8_h64_s3"] = lambda: _decode_plan("snapmla", 32, 64, 8192, tile="gluon", fp8_mma=True,
                                                     num_stages=3)
    c["gluon_wide8_h64"] = lambda: _decode_plan("snapmla", 32, 64, 8192, tile="gluon", fp8_mma=True, block_m=64)
    c["gluon_wide8_h128_s4"] = lambda: _decode_plan("snapmla", 8, 128, 4096, tile="gluon", fp8_mma=True, block_m=64,
                                                    num_stages=4)
    return c


def strip_debug(ptx: str) -> str:
    """PTX without its debug information: the `.debug_*` sections (which close the file), `.file` / `.loc`
    directives and the `$L__func_*` / `$L__tmp*` labels that only they refer to."""
    cut = re.search(r"^\s*\.section\s+\.debug_", ptx, re.M)
    if cut:
        ptx = ptx[:cut.start()]
    keep = [ln for ln in ptx.splitlines() if not re.match(r"\s*\.(loc|file)\b", ln)
            and not re.match(r"\s*\$L__(func_begin|func_end|tmp)\d+:\s*$", ln)]
    return "\n".join(keep).strip() + "\n"


def strip_entry_names(ptx: str) -> str:
    """`strip_debug` with every `.entry` name (and the `<name>_param_<i>` parameters derived from it) replaced
    by a placeholder, and runs of blanks squeezed (comments are padded to the name's length)."""
    ptx = strip_debug(ptx)
    for i, name in enumerate(re.findall(r"\.entry\s+([A-Za-z_$][\w$]*)", ptx)):
        ptx = re.sub(rf"(?<![\w$]){re.escape(name)}(?![\w$])", f"KERNEL{i}", ptx)
        ptx = re.sub(rf"(?<![\w$]){re.escape(name)}(_param_\d+)", rf"KERNEL{i}\1", ptx)
    return re.sub(r"[ \t]+", " ", ptx)


def dump(out: Path, only: str | None, arch: int) -> int:
    from snapquant.kernels.compile_stats import compile_launch

    out.mkdir(parents=True, exist_ok=True)
    manifest, failures = {}, 0
    for name, build in configs().items():
        if only and only not in name:
            continue
        t0 = time.time()
        try:
            launches = build()
        except Exception as e:
            print(f"{name}: plan failed: {type(e).__name__}: {e}", file=sys.stderr)
            manifest[name] = {"error": f"{type(e).__name__}: {e}"}
            failures += 1
            continue
        for ln in launches:
            key = f"{name}__{ln.name}"
            try:
                compiled = compile_launch(ln, arch)
            except Exception as e:
                print(f"{key}: compile failed: {type(e).__name__}: {e}", file=sys.stderr)
                manifest[key] = {"error": f"{type(e).__name__}: {e}"[:500]}
                failures += 1
                continue
            (out / f"{key}.ptx").write_text(compiled.asm["ptx"])
            constexprs = {k: (v if isinstance(v, (bool, int, float, str)) or v is None else repr(v))
                          for k, v in ln.kwargs.items()}
            manifest[key] = {"kernel": ln.kernel.fn.__name__, "grid": list(ln.grid), "kwargs": constexprs,
                             "shared": getattr(compiled.metadata, "shared", None)}
        print(f"{name}: {len(launches)} launch(es), {time.time() - t0:.1f} s", flush=True)
    import triton

    (out / "manifest.json").write_text(json.dumps({"triton": triton.__version__, "arch": arch,
                                                   "launches": manifest}, indent=1, sort_keys=True))
    return 1 if failures else 0


def compare(before: Path, after: Path) -> int:
    names = sorted({p.name for p in before.glob("*.ptx")} | {p.name for p in after.glob("*.ptx")})
    counts = {"identical": 0, "identical_without_debug_info": 0, "identical_but_kernel_name": 0, "different": 0,
              "missing": 0}
    for n in names:
        a, b = before / n, after / n
        if not (a.exists() and b.exists()):
            status = "missing"
            print(f"missing    {n} ({'after' if a.exists() else 'before'})")
        else:
            ta, tb = a.read_text(), b.read_text()
            if ta == tb:
                status = "identical"
            elif strip_debug(ta) == strip_debug(tb):
                status = "identical_without_debug_info"
            elif strip_entry_names(ta) == strip_entry_names(tb):
                status = "identical_but_kernel_name"
                print(f"renamed    {n}")
            else:
                status = "different"
                print(f"DIFFERENT  {n}")
        counts[status] += 1
    print(json.dumps(counts))
    return 1 if counts["different"] or counts["missing"] else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/ptx_after"))
    ap.add_argument("--only", default=None, help="only configs whose name contains this string")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability to compile for")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    return dump(args.out, args.only, args.arch)


if __name__ == "__main__":
    sys.exit(main())
