"""What the compiler makes of a decode plan's kernels, without a GPU.

Triton compiles for any target on any machine: given a launch plan built over meta tensors of the
real shape (`plan_decode(native=True)`), this module specializes the arguments as the JIT
would (pointer alignment, integers equal to 1 or divisible by 16), compiles each kernel for the
target (sm_90 = Hopper by default) and reads back:

    regs, spill_bytes   from the cubin's resource usage (cuobjdump), spills = local-memory stack
    smem                shared memory per program
    async_loads         cp.async / TMA copies in the TTGIR (prologue and loop)
    async_tiles         2-D tiles the page loop copies asynchronously (software-pipelined,
                        `num_stages - 1` pages ahead), e.g. "64x512:f8E4M3FN" = the latent tile
    sync_tiles          2-D tiles the page loop loads synchronously (it waits for them each page)
    wgmma, mma_sync     Hopper warp-group MMAs vs Ampere-style MMAs in the PTX
    wgmma_kinds         the wgmma instructions by operand types and shape, e.g. {"e4m3.e4m3 m64n32k32": 16}
    wgmma_waits         SASS waits on the warpgroup MMA pipe (WARPGROUP.DEPBAR); one per wgmma means
                        ptxas serialized them, costly for the MMA chain
    mufu_under_wgmma    MUFU instructions (the softmax's exp2) placed while a wgmma group is still pending
                        (after its commit, before the wait that retires it): CUDA-core work that overlaps the
                        tensor cores; ptxas may sink such work below the wait whatever the source order says
    ptxas_advice        the performance advisories ptxas prints and Triton hides (its C75xx codes, e.g.
                        C7512 "wgmma serialized: insufficient register resources", C7515 "...: non
                        wgmma instructions defining accumulator registers"), "" when none
    cvt_e4m3            fp8 -> 16-bit conversion instructions in the PTX
    l2_prefetch         bulk L2 prefetches (cp.async.bulk.prefetch.L2) in the PTX
    loop_*              the SASS instruction mix of the page loop (the backward branch whose body
                        holds the most MMA instructions): total, MMA, conversions (F2FP/F2F/I2F...),
                        shared-memory loads/stores, global loads, MUFU (exp2, rcp), FP32 ALU
    loop_hot, loop_hot_ops  the loop's hot path: its instructions less those a conditional forward branch inside
                        the loop jumps over (on a full page: the tail-zeroing block of a request's last page, the
                        divisions' slow paths), and that path's opcodes by count (the per-page issue work)
These are predictions' raw material (docs/kernels.md), not timings. Triton versions differ in the
exact numbers (the H200 machine runs 3.6, CI 3.9); the benchmark's `--compile-stats`
(`snapquant.bench.compile_stats`) writes them per variant and shape.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter
from typing import Any

import torch

SASS_GROUPS = {
    "mma": ("HMMA", "HGMMA", "IMMA", "QMMA", "WGMMA"),
    "cvt": ("F2FP", "F2F", "I2F", "F2I", "I2FP", "HADD2.F32"),
    "lds": ("LDS", "LDSM"),
    "sts": ("STS",),
    "ldg": ("LDG", "LDGSTS", "UTMALDG"),
    "mufu": ("MUFU",),
    "falu": ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FCHK"),
}


def _specialize(value: Any) -> tuple[str, list | None]:
    """(signature type, attributes) of one runtime argument, as the JIT specializes it."""
    from triton.backends.compiler import BaseBackend

    try:
        from triton._C.libtriton import native_specialize_impl

        t, a = native_specialize_impl(BaseBackend, value, False, True, True)[:2]
        return t, (BaseBackend.parse_attr(a) if isinstance(a, str) else None)
    except ImportError:  # older triton: the same rules by hand
        if isinstance(value, torch.Tensor):
            names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
                     torch.int64: "i64", torch.int16: "i16", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}
            return "*" + names[value.dtype], [["tt.divisibility", 16]] if value.data_ptr() % 16 == 0 else None
        if isinstance(value, bool):
            return "u1", None
        if isinstance(value, int):
            if value == 1:
                return "constexpr", None
            return ("i32" if -(2**31) <= value < 2**31 else "i64"), ([["tt.divisibility", 16]] if value % 16 == 0 else None)
        return "fp32", None


def compile_launch(launch: Any, arch: int = 90) -> Any:
    """Compile one `KernelLaunch` of a plan for CUDA compute capability `arch`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = launch.kernel
    names = [p.name for p in kernel.params]
    values = dict(zip(names, launch.args, strict=False))
    options = {}
    for k, v in launch.kwargs.items():
        if k in names:
            values[k] = v
        if k not in names or k == "num_warps":  # a Gluon kernel also reads num_warps as a constexpr
            options[k] = v
    # FP fusion as the launch gets it (the launch passes no enable_fp_fusion, so Triton applies
    # TRITON_DEFAULT_FP_FUSION: on in 3.9, off from 3.10). Asking for it explicitly compiles the same
    # kernel without Triton 3.9's warning that the unset default will change.
    default_fusion = getattr(triton.knobs.language, "default_fp_fusion", None) if hasattr(triton, "knobs") else None
    if default_fusion is not None:
        options.setdefault("enable_fp_fusion", bool(default_fusion))
    sig, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        v = values[p.name] if p.name in values else p.default  # a constexpr left at its default
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            constexprs[(i,)] = v
            continue
        t, a = _specialize(v)
        sig[p.name] = t
        if t == "constexpr":
            constexprs[(i,)] = v
        elif a:
            attrs[(i,)] = a
    if getattr(kernel, "is_gluon", lambda: False)():  # a Gluon kernel (tile="gluon") has its own source type
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    else:
        src = ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _tool(name: str) -> str | None:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else None


def kernel_stats(compiled: Any) -> dict[str, Any]:
    """Resource usage and instruction mix of a compiled kernel (see the module docstring)."""
    asm = compiled.asm
    ttgir, ptx = asm.get("ttgir", ""), asm.get("ptx", "")
    st: dict[str, Any] = {
        "smem": getattr(compiled.metadata, "shared", None),
        "async_loads": ttgir.count("async_copy_global_to_local") + ttgir.count("async_tma_copy"),
        **tile_loads(ttgir),
        "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"), "wgmma_kinds": wgmma_kinds(ptx),
        "cvt_e4m3": len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)),
        "l2_prefetch": ptx.count("cp.async.bulk.prefetch.L2"),
    }
    cubin = asm.get("cubin")
    tool = _tool("cuobjdump")
    if cubin and tool:
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(cubin)
            path = f.name
        try:
            res = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, timeout=60).stdout
            m = re.search(r"REG:(\d+)", res)
            st["regs"] = int(m.group(1)) if m else None
            m = re.search(r"STACK:(\d+)", res)
            st["spill_bytes"] = int(m.group(1)) if m else None
            sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, timeout=120).stdout
            st.update(loop_mix(sass))
            st["mufu_under_wgmma"] = mufu_under_wgmma(sass)
            st["wgmma_waits"] = sass.count("WARPGROUP.DEPBAR")
            st["ptxas_advice"] = ptxas_advice(ptx)
        finally:
            os.unlink(path)
    return st


_WGMMA = re.compile(r"wgmma\.mma_async(?:\.sp)?\.sync\.aligned\.(m\d+n\d+k\d+)\.\w+\.(\w+)\.(\w+)")


def wgmma_kinds(ptx: str) -> dict[str, int]:
    """wgmma instructions of `ptx` by "A.B mMnNkK" (operand types, shape), e.g. {"f16.f16 m64n16k16": 36}."""
    return dict(sorted(Counter(f"{a}.{b} {shape}" for shape, a, b in _WGMMA.findall(ptx)).items()))


def ptxas_advice(ptx: str, arch: str = "sm_90a") -> str | None:
    """The C75xx performance advisory codes `ptxas -v` prints for `ptx` (comma list; None without ptxas).
    Uses the ptxas Triton itself compiles sm_90 with (3.9 ships two and picks the newer)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        tool = get_ptxas(90).path
    except Exception:
        tool = _tool("ptxas")
    if tool is None or not ptx:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([tool, f"-arch={arch}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, timeout=300)
    return ",".join(sorted(set(re.findall(r"\((C75\d\d)\)", res.stdout + res.stderr))))


_ASYNC = re.compile(r"async_copy_global_to_local [^\n]*?tensor<(\d+)x(\d+)x!tt\.ptr<(\w+)>")
_LOAD = re.compile(r"= tt\.load [^\n]*?tensor<(\d+)x(\d+)x!tt\.ptr<(\w+)>")


def tile_loads(ttgir: str) -> dict[str, str]:
    """2-D tiles loaded inside the main loop: `async_tiles` (software-pipelined: copied to shared
    memory pages ahead) and `sync_tiles` (plain loads: the loop waits for them), as RxC:dtype."""
    body = ttgir[ttgir.find("scf.for"):] if "scf.for" in ttgir else ""

    def shapes(rx: re.Pattern) -> str:
        return ",".join(sorted({f"{a}x{b}:{t}" for a, b, t in rx.findall(body)}))

    return {"async_tiles": shapes(_ASYNC), "sync_tiles": shapes(_LOAD)}


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def loop_mix(sass: str) -> dict[str, Any]:
    """Instruction mix of the SASS loop (a backward branch) holding the most MMA instructions."""
    instrs = [(int(m.group(1), 16), bool(m.group(2)), m.group(3), m.group(4)) for m in _INSTR.finditer(sass)]
    loops = []
    for addr, _, op, args in instrs:
        if op.startswith("BRA"):
            m = re.search(r"0x([0-9a-f]+)", args)
            if m and int(m.group(1), 16) < addr:
                loops.append((int(m.group(1), 16), addr))
    best: tuple[int, Counter, list] | None = None
    for lo, hi in loops:
        body = [ins for ins in instrs if lo <= ins[0] <= hi]
        ops = Counter(op.split(".")[0] for _, _, op, _ in body)
        n_mma = sum(ops[o] for o in SASS_GROUPS["mma"])
        if best is None or n_mma > best[0]:
            best = (n_mma, ops, body)
    if best is None:
        return {"loop_total": None}
    ops, body = best[1], best[2]
    out: dict[str, Any] = {"loop_total": sum(ops.values())}
    for g, names in SASS_GROUPS.items():
        out[f"loop_{g}"] = sum(ops[o] for o in names)
    hot = _hot_path(body)
    out["loop_hot"] = sum(hot.values())
    out["loop_hot_ops"] = dict(hot.most_common())
    return out


def _hot_path(body: list[tuple[int, bool, str, str]]) -> Counter:
    """Opcodes of a loop body less every instruction that a predicated forward branch inside the body jumps
    over: the blocks a full page does not run."""
    end = body[-1][0]
    cold: set[int] = set()
    for addr, predicated, op, args in body:
        m = re.search(r"0x([0-9a-f]+)", args) if predicated and op.startswith("BRA") else None
        if m and addr < int(m.group(1), 16) <= end:
            cold.update(a for a, _, _, _ in body if addr < a < int(m.group(1), 16))
    return Counter(op.split(".")[0] for a, _, op, _ in body if a not in cold)


_DEPBAR = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)")


def mufu_under_wgmma(sass: str) -> int:
    """MUFU instructions between a wgmma group's commit (an HGMMA carrying `gsb0`) and the wait that leaves
    no group pending, in address order (straight-line: a loop's body is read once)."""
    pending, count = 0, 0
    for m in _INSTR.finditer(sass):
        op, args = m.group(3), m.group(4)
        if op.startswith("HGMMA") and "gsb0" in args:
            pending += 1
        elif op.startswith("WARPGROUP.DEPBAR"):
            w = _DEPBAR.search(f"{op} {args}")
            pending = min(pending, int(w.group(1), 16)) if w else 0
        elif op.startswith("MUFU") and pending > 0:
            count += 1
    return count


def plan_compile_stats(plan: Any, arch: int = 90) -> list[dict[str, Any]]:
    """Compile every launch of a `DecodePlan` for `arch`; one dict per kernel: its name, grid, warps and
    stages, and `kernel_stats` (or `error` when it does not compile: one failure must not hide the others)."""
    out = []
    for ln in plan.launches:
        row = {"kernel": ln.name, "grid": "x".join(map(str, ln.grid)), "num_warps": ln.kwargs.get("num_warps"),
               "num_stages": ln.kwargs.get("num_stages")}
        try:
            row.update(kernel_stats(compile_launch(ln, arch)))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        out.append(row)
    return out
