"""tile="gluon": the Gluon decode kernels (snapquant/kernels/gluon/, Hopper).

Gluon has no interpreter, so on CPU the kernel is compiled for Hopper (sm_90) and its structure is
checked (TMA copies, wgmma of the right operand types in the right proportions, no serialized MMA chain,
registers and shared memory within the SM's), and the host side's refusals are checked; the numbers are
checked against the reference on a GPU (`-m gpu`, and `scripts/check_kernels_gpu.py`).

The structural checks are properties that hold across Triton versions (see `tests.support.kernel_cases`);
the exact instruction counts of one Triton version are a snapshot at the end, skipped on other versions."""

from __future__ import annotations

import math

import pytest
import torch

from snapquant import PRESETS, mla_decode_reference
from snapquant.errors import ConfigError
from snapquant.kernels import PagedMLACache, mla_decode, mla_decode_plan
from snapquant.kernels.compile_stats import compile_launch
from snapquant.kernels.dispatch import gluon_format_reason
from snapquant.kernels.gluon import HAVE_GLUON
from snapquant.kernels.options import DecodeOptions
from tests.support.kernel_cases import SMEM_LIMIT, meta_plan, sm90_stats, wgmma_mix

needs_gluon = pytest.mark.skipif(not HAVE_GLUON, reason="this triton has no Gluon")
ROPE16 = "bf16.bf16 m64n16k16"  # the narrow kernels' RoPE QK: d / 16 per page (16 query rows as N)
ROPE32 = "bf16.bf16 m64n32k16"  # the 32- and 64-row kernels' RoPE QK per warpgroup
NARROW = dict(B=8, H=16, L=2048)  # <= 16 query rows: the narrow kernels
WIDE = dict(B=32, H=64, L=8192)  # 64 query rows: the 64-row (and 32-row native FP8) kernels


def _unserialized(st, max_spill=128):
    """ptxas keeps the wgmma chains asynchronous: a few waits, not one per instruction (a wgmma wait deferred
    into the next loop iteration once caused one per wgmma: the whole loop serialized), and no C75xx
    advisory (e.g. C7515: serialized wgmma). Registers within the SM's 255, spills a few bytes at most
    (Triton 3.6 (H200): none; 3.9: up to 112 bytes)."""
    if st.get("regs") is None:
        return  # cuobjdump not bundled with this triton: no SASS / register report
    assert st["regs"] <= 255 and st["spill_bytes"] <= max_spill, (st["regs"], st["spill_bytes"])
    assert st["wgmma_waits"] <= st["wgmma"] / 4, (st["wgmma_waits"], st["wgmma"])
    assert st["ptxas_advice"] in ("", None), st["ptxas_advice"]


@needs_gluon
@pytest.mark.parametrize("stages", [2, 1])
def test_narrow_gluon_kernels_compile_to_exact_16bit_wgmma(stages):
    """<= 16 rows, exact MMAs (gluon.narrow, register A operands widened from the TMA slots): per page QK r / 16
    and PV r / 16 fp16 m64n16k16 wgmma (the codes widened to fp16, by cvt e4m3x2 -> f16x2), RoPE d / 16 in
    bf16; no mma.sync, no e4m3 MMA. Two slots: <= half an SM's shared memory (two programs per SM). One slot:
    <= a third, and 168 registers with the wgmma chain still asynchronous (each box's MMA waited for before
    the next box is loaded), so three programs share an SM."""
    st = sm90_stats("snapmla", **NARROW, tile="gluon", num_stages=stages)
    assert st["kernel"] == "decode_gluon_narrow"
    assert wgmma_mix(st, ROPE16) == {ROPE16: 1, "f16.f16 m64n16k16": 2 * 512 / 64}
    assert st["mma_sync"] == 0 and st["async_loads"] > 0 and st["cvt_e4m3"] > 0
    resident = 2 if stages == 2 else 3
    assert 0 < st["smem"] <= SMEM_LIMIT // resident - 1024
    if st.get("regs") is not None:
        assert st["regs"] * 128 * resident <= 65536, st["regs"]
    # 168 registers: one slot spills a little (Triton 3.6: 48 bytes, 3.9: 168), never its wgmma chain
    _unserialized(st, max_spill=128 if stages == 2 else 320)


@needs_gluon
@pytest.mark.parametrize("stages", [2, 1])
def test_native_fp8_qk_variant_compiles_to_e4m3_qk_and_exact_pv(stages):
    """fp8_mma="qk" (gluon.narrow): QK as e4m3 m64n16k32 straight from the TMA slot (r / 32 per page, half
    the exact kernel's QK instructions), RoPE d / 16 bf16, PV still exact fp16 (r / 16). The QK widens
    nothing: only PV's codes are converted, half the exact kernel's conversions. Two slots and the fp8 query
    keep two programs on an SM; one slot (~57 KB, 168 registers) three."""
    st = sm90_stats("snapmla", **NARROW, tile="gluon", fp8_mma="qk", num_stages=stages)
    assert st["kernel"] == "decode_gluon_narrow"
    assert wgmma_mix(st, ROPE16) == {ROPE16: 1, "e4m3.e4m3 m64n16k32": 512 / 32 / 4, "f16.f16 m64n16k16": 512 / 16 / 4}
    exact = sm90_stats("snapmla", **NARROW, tile="gluon", num_stages=2)
    assert st["wgmma"] < exact["wgmma"] and st["mma_sync"] == 0
    assert st["smem"] < exact["smem"]  # the e4m3 query is half the fp16 one
    resident = 2 if stages == 2 else 3
    assert st["smem"] <= SMEM_LIMIT // resident - 1024
    if st.get("regs") is not None:
        assert st["regs"] * 128 * resident <= 65536, st["regs"]
    if st.get("loop_cvt") is not None:
        assert st["loop_cvt"] <= exact["loop_cvt"] / 2 + 8, (st["loop_cvt"], exact["loop_cvt"])
        # QK's widening, its register loads and half its MMAs leave the page's hot path (Triton 3.6: 1120 -> 913;
        # 941 with one slot at 168 registers, its spills included)
        assert st["loop_hot"] < 0.9 * exact["loop_hot"], (st["loop_hot"], exact["loop_hot"])
    # 168 registers: the one-slot kernel spills a little (Triton 3.6: 160 bytes), never its wgmma chain
    _unserialized(st, max_spill=128 if stages == 2 else 320)


@needs_gluon
@pytest.mark.parametrize("stages", [2, 1])
def test_native_fp8_16_row_programs_compile_to_fp8_mmas_only(stages):
    """fp8_mma=True at <= 16 rows (gluon.narrow8, 16-row programs): per page QK r / 32 and PV r / 32 e4m3
    m64n16k32 beside RoPE d / 16 bf16, no fp16 MMA and almost no conversions. Two slots (~97 KB): two
    programs per SM; one slot (~55 KB, 168 registers): three, its wgmma chain still asynchronous."""
    st = sm90_stats("snapmla", **NARROW, tile="gluon", fp8_mma=True, num_stages=stages)
    assert st["kernel"] == "decode_gluon_narrow8"
    assert wgmma_mix(st, ROPE16) == {ROPE16: 1, "e4m3.e4m3 m64n16k32": 2 * 512 / 32 / 4}
    resident = 2 if stages == 2 else 3
    assert st["smem"] <= SMEM_LIMIT // resident - 1024
    if st.get("regs") is not None:
        assert st["regs"] * 128 * resident <= 65536, st["regs"]
    _unserialized(st, max_spill=128 if stages == 2 else 320)


@needs_gluon
def test_channel_halves_kernel_compiles_to_half_a_chain_per_warpgroup():
    """num_warps=8 at <= 16 rows (gluon.narrow_halves): per page and warpgroup QK over two boxes as fp16
    m64n32k16 (r / 2 / 16: half the channels, both warpgroups' query columns), RoPE over half its channels
    (d / 2 / 16 bf16 m64n32k16) and PV over two boxes as fp16 m64n16k16 (r / 2 / 16); exact products (cvt).
    Two programs of 256 threads per SM: <= half an SM's shared memory and <= 128 registers, the chain
    asynchronous. Each thread's hot path is well under the four-warp kernel's (Triton 3.6: 767 against 1120)."""
    st = sm90_stats("snapmla", **NARROW, tile="gluon", num_warps=8)
    assert st["kernel"] == "decode_gluon_narrow_halves"
    assert wgmma_mix(st, ROPE32) == {ROPE32: 1, "f16.f16 m64n32k16": 512 / 2 / 16 / 2, "f16.f16 m64n16k16": 512 / 2 / 16 / 2}
    assert st["mma_sync"] == 0 and st["async_loads"] > 0 and st["cvt_e4m3"] > 0
    assert 0 < st["smem"] <= SMEM_LIMIT // 2 - 1024
    if st.get("regs") is not None:
        assert st["regs"] * 256 * 2 <= 65536, st["regs"]
        four = sm90_stats("snapmla", **NARROW, tile="gluon", num_stages=2)
        assert st["loop_hot"] < 0.8 * four["loop_hot"], (st["loop_hot"], four["loop_hot"])
    _unserialized(st, max_spill=160)


@pytest.mark.parametrize("B,L", [(128, 4096), (32, 16384), (8, 32768)])
def test_channel_halves_plan_keeps_the_default_schedule(B, L):
    """gluon.narrow_halves runs the default's schedule (two programs per SM: the same split counts and grid)
    with eight warps capped at 128 registers (two programs of 256 threads fill the register file)."""
    halves = meta_plan("snapmla", B=B, H=16, L=L, tile="gluon", num_warps=8)
    default = meta_plan("snapmla", B=B, H=16, L=L)
    assert (halves.knobs["kernel"], default.knobs["kernel"]) == ("gluon.narrow_halves", "gluon.narrow")
    assert halves.knobs["num_splits"] == default.knobs["num_splits"]
    launch = halves.launches[0]
    assert launch.grid == default.launches[0].grid
    assert launch.kwargs["num_warps"] == 8 and launch.kwargs["maxnreg"] * 256 * 2 <= 65536


def test_channel_halves_kernel_refuses_what_it_is_not_written_for():
    """num_warps=8 at <= 16 rows names the kernel and what it runs: exact MMAs, r = 512, d = 64, two slots."""
    for knobs in (dict(fp8_mma="qk"), dict(num_stages=1)):
        plan_knobs = dict(tile="gluon", num_warps=8, **knobs)
        with pytest.raises(ConfigError, match=r"gluon\.narrow_halves"):
            meta_plan("snapmla", **NARROW, **plan_knobs)
    with pytest.raises(ConfigError, match=r"gluon\.narrow_halves"):
        meta_plan("snapmla", **NARROW, d=32, tile="gluon", num_warps=8)


def _cache(B=2, L=100, H=16):
    cfg = PRESETS["snapmla"]
    cache = PagedMLACache.empty(B, L, 512, 64, cfg)
    q = torch.randn(B, H, 576)
    return cfg, cache, q


def test_gluon_tile_refuses_cpu_with_a_clear_error():
    cfg, cache, q = _cache()
    with pytest.raises(ConfigError, match="Hopper"):
        mla_decode(q, cache, 0.1, cfg, tile="gluon")


@needs_gluon
@pytest.mark.parametrize("r,d", [(256, 32), (128, 64)])
def test_gluon_kernel_compiles_at_other_widths(r, d):
    """kv_lora_rank 256 / 128 (two / one 128-code boxes): the in-place slot's chunk 0 then overlaps a box
    still being read, which the kernel guards with a barrier. QK and PV r / 16 each per RoPE's d / 16."""
    st = sm90_stats("snapmla", B=4, H=16, L=1024, r=r, d=d, tile="gluon")
    assert st["kernel"] == "decode_gluon_narrow_tile"
    assert wgmma_mix(st, ROPE16) == {ROPE16: 1, "f16.f16 m64n16k16": 2 * r / d}
    assert st["smem"] <= SMEM_LIMIT // 2 - 1024


def test_gluon_tile_refuses_other_formats_and_schedules():
    cfg, cache, q = _cache()
    with pytest.raises(ConfigError, match=r"tile='gluon'.*snapmla"):
        mla_decode(q, cache, 0.1, cfg.replace(query="bf16"), tile="gluon")
    with pytest.raises(ConfigError, match="uniform"):
        mla_decode(q, cache, 0.1, cfg, tile="gluon", schedule="balanced")
    meta_cache = PagedMLACache.empty(2, 128, 256, 64, cfg, device="meta")
    meta_q = torch.empty(2, 16, 320, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ConfigError, match="kv_lora_rank 512"):  # the native FP8 QK's four boxes
        from snapquant.kernels.decode import plan_decode
        from snapquant.kernels.operands import KernelOperands

        plan_decode(meta_q, KernelOperands.from_paged(meta_cache), 0.1, cfg, native=True, num_sms=132,
                    tile="gluon", fp8_mma="qk")
    from snapquant.kernels.dispatch import narrow_stages

    # gluon.narrow's two slots at r = 512 (exact or native QK), the in-place slot elsewhere or when asked for
    assert narrow_stages(None, 512) == 2 and narrow_stages(None, 256) == 1
    assert narrow_stages(1, 512) == 1 and narrow_stages(None, 256, "bf16") == 2


@needs_gluon
def test_gluon_format_reason_names_the_field():
    lat = torch.empty(4, 64, 512, dtype=torch.float8_e4m3fn, device="meta")
    rope = torch.empty(4, 64, 64, dtype=torch.int16, device="meta")
    ok = gluon_format_reason("snapmla", True, True, 16, 512, 64, lat, (64 * 512, 512), rope, (64 * 64, 64))
    assert ok is None
    # at any row count: snapmla (fp8 query and P) or bf16 (16-bit query and P) only
    assert gluon_format_reason("snapmla", True, True, 32, 512, 64, lat, (64 * 512, 512), rope, (64 * 64, 64)) is None
    lat16 = torch.empty(4, 64, 512, dtype=torch.int16, device="meta")
    for rows in (16, 64):
        assert gluon_format_reason("bf16", False, False, rows, 512, 64, lat16, (64 * 512, 512), rope,
                                   (64 * 64, 64)) is None
        assert "bf16 layout" in gluon_format_reason("snapmla", False, True, rows, 512, 64, lat, (64 * 512, 512), rope,
                                                         (64 * 64, 64))
    assert "up to 512" in gluon_format_reason("snapmla", True, True, 64, 1024, 64, lat, (64 * 512, 512), rope,
                                                   (64 * 64, 64))
    assert "snapmla" in gluon_format_reason("ds_v32", True, True, 16, 512, 64, lat, (64 * 512, 512), rope,
                                                 (64 * 64, 64))
    assert "kv_lora_rank" in gluon_format_reason("snapmla", True, True, 16, 96, 64, lat, (64 * 512, 512), rope,
                                                      (64 * 64, 64))
    odd = torch.empty(4, 64, 520, dtype=torch.float8_e4m3fn, device="meta")[..., :512]
    assert "TMA" in gluon_format_reason("snapmla", True, True, 16, 512, 64, odd, (64 * 520, 520), rope,
                                             (64 * 64, 64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("fp8_mma,stages,warps", [(False, 2, None), (False, 1, None), (False, 3, None), ("qk", 2, None),
                                                  ("qk", 1, None), (True, 2, None), (True, 1, None), (False, 2, 8)])
@pytest.mark.parametrize("B,H,S,L,splits", [(6, 16, 1, 700, None), (3, 8, 2, 130, 1), (5, 16, 1, 64, 3)])
def test_gluon_kernel_matches_the_reference(B, H, S, L, splits, fp8_mma, stages, warps, r=512, d=64):
    """Against `mla_decode_reference` (CPU, the definitive semantics) on requests of mixed lengths
    (partial pages, empty splits): the same arithmetic up to fp32 summation order inside the MMAs."""
    torch.manual_seed(B * 100 + L)
    cfg = PRESETS["snapmla"]
    lengths = torch.tensor([max(S, L - 97 * i) for i in range(B)], dtype=torch.int32)
    cache = PagedMLACache.empty(B, L, r, d, cfg, device="cuda")
    cache.append(torch.randn(B, L, r, device="cuda"), torch.randn(B, L, d, device="cuda"))
    cache.lengths.copy_(lengths.cuda())  # shorter requests leave written tokens past their length
    if L % 64:  # e4m3 NaN codes past the longest request's length: P = 0 must not meet them as NaN
        cache.latent[cache.block_table[0, (L - 1) // 64], L % 64:].view(torch.uint8).fill_(0x7F)
    q = torch.randn(B, S, H, r + d, device="cuda").to(torch.bfloat16)
    tau = 1 / math.sqrt(192)
    out, lse = mla_decode(q, cache, tau, cfg, num_splits=splits, tile="gluon", fp8_mma=fp8_mma,
                          num_stages=stages, num_warps=warps)
    kernel = mla_decode_plan(q, cache, tau, cfg, num_splits=splits, tile="gluon", fp8_mma=fp8_mma,
                             num_stages=stages, num_warps=warps).launches[0].name
    assert kernel == ("decode_gluon_narrow8" if fp8_mma is True else "decode_gluon_narrow_halves" if warps == 8
                      else "decode_gluon_narrow" if r == 512 else "decode_gluon_narrow_tile")
    assert torch.isfinite(out).all()
    base, base_lse = mla_decode(q, cache, tau, cfg, num_splits=splits, tile="pairs")
    kv = cache.to_quantized_kv(int(cache.lengths.max())).to("cpu")
    ref, ref_lse = mla_decode_reference(q.cpu(), kv, cache.lengths.cpu(), tau, cfg)
    # exact fp16 MMAs: summation order only; native fp8 QK (per 128-channel box promoted to fp32): ~1e-4;
    # both products native (gluon.narrow8 at 16 rows): as its 32-row programs past 16 rows (that test's bound)
    tol, lse_tol = (2e-5, 1e-4) if not fp8_mma else (3e-3, 5e-3) if fp8_mma == "qk" else (1e-2, 1e-2)
    rel = ((out.cpu() - ref).norm() / ref.norm()).item()
    assert rel < tol, rel
    assert (lse.cpu() - ref_lse).abs().max().item() < lse_tol
    assert ((out - base).norm() / base.norm()).item() < tol
    assert (lse - base_lse).abs().max().item() < lse_tol



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("fp8_mma,kernel,stages", [("qk", "gluon.narrow", 2), ("qk", "gluon.narrow", 1),
                                                   (True, "gluon.narrow8", 2), (True, "gluon.narrow8", 1)])
def test_native_narrow_kernels_follow_the_mma_model(fp8_mma, kernel, stages, B=3, H=16, L=900, r=512, d=64):
    """The <= 16-row native FP8 kernels against the reference's model of their MMAs (`MMANumerics.for_kernel`:
    ~14 bits kept inside a chain, two 256-channel QK chains, PV carried through the MMA): the model must
    explain the kernel's outputs far better than exact arithmetic does (bf16-rounded bit agreement and the
    median row error, one split so that PV is one chain per request, as the model has it)."""
    from snapquant.reference.mma import MMANumerics

    torch.manual_seed(4242)
    cfg = PRESETS["snapmla"]
    cache = PagedMLACache.empty(B, L, r, d, cfg, device="cuda")
    cache.append(torch.randn(B, L, r, device="cuda"), torch.randn(B, L, d, device="cuda"))
    cache.lengths.copy_(torch.tensor([L - 211 * i for i in range(B)], dtype=torch.int32).cuda())
    q = torch.randn(B, 1, H, r + d, device="cuda").to(torch.bfloat16)
    tau = 1 / math.sqrt(192)
    knobs = dict(num_splits=1, tile="gluon", fp8_mma=fp8_mma, num_stages=stages)
    assert mla_decode_plan(q, cache, tau, cfg, **knobs).knobs["kernel"] == kernel
    out = mla_decode(q, cache, tau, cfg, **knobs)[0].cpu()
    kv = cache.to_quantized_kv(int(cache.lengths.max())).to("cpu")
    lengths = cache.lengths.cpu()
    scores = {}
    for name, mma in (("model", MMANumerics.for_kernel(kernel, fp8_mma)), ("exact", None)):
        ref = mla_decode_reference(q.cpu(), kv, lengths, tau, cfg, mma=mma)[0]
        agree = (out.bfloat16() == ref.bfloat16()).double().mean().item()
        row_err = ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).flatten().median().item()
        scores[name] = (agree, row_err)
    (agree_m, err_m), (agree_x, err_x) = scores["model"], scores["exact"]
    # narrow8 past 16 rows on an H100: 0.95 agreement and 5.7e-5 median row error under the model, 0.83 and
    # ~1e-3 under exact arithmetic (results/h100/mma_numerics.md); a kernel the model missed would sit at exact's
    assert agree_m > agree_x and err_m < err_x / 4, scores


@needs_gluon
def test_rows_view_addresses_paged_and_dense_row_caches():
    """The TMA descriptor sees the cache as one table of rows; page p starts at row p * page_rows."""
    from snapquant.kernels.gluon.common import _rows_view, make_descriptors

    paged = torch.empty(10, 64, 512, dtype=torch.float8_e4m3fn, device="meta")
    assert _rows_view(paged, 512) == ([640, 512], [512, 1])
    # the patch's dense store: a [B, T, r] view of a preallocated [B, T_max, r] buffer
    dense = torch.empty(3, 1000, 512, dtype=torch.float8_e4m3fn, device="meta")[:, :130]
    assert _rows_view(dense, 512) == ([2 * 1000 + 130, 512], [512, 1])
    rope = torch.empty(10, 64, 64, dtype=torch.bfloat16, device="meta")
    lat_desc, rope_desc = make_descriptors(paged, 512, rope, 64)
    assert list(lat_desc.block_shape) == [64, 128] and list(rope_desc.block_shape) == [64, 64]
    assert list(rope_desc.shape) == [640, 64]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("r,d", [(256, 32), (128, 64)])
def test_gluon_kernel_matches_the_reference_at_other_widths(r, d):
    test_gluon_kernel_matches_the_reference(4, 16, 1, 300, None, False, 1, r=r, d=d)


# ------------------------------------------------------------------ the 64-row kernel (gluon/wide.py)
@needs_gluon
@pytest.mark.parametrize("preset", ["snapmla", "bf16"])
def test_wide_gluon_kernel_compiles_unserialized(preset):
    """Past 16 rows tile="gluon" is gluon.wide's two-warpgroup kernel: per page and warpgroup QK r / 16
    (m64n32k16) beside RoPE d / 16, and PV as r / 128 m64n256k16 (two warpgroups split the 512 channels);
    16-bit operands (the fp8 codes widened to fp16, the bf16 cache read by wgmma directly), asynchronous
    within one SM's shared memory (two TMA slots: one program per SM)."""
    st = sm90_stats(preset, **WIDE, tile="gluon", warp_specialize=False)  # bf16's default past 16 rows: seesaw
    assert st["kernel"] == "decode_gluon_wide"
    if preset == "snapmla":
        assert wgmma_mix(st, ROPE32) == {ROPE32: 1, "f16.f16 m64n32k16": 8, "f16.f16 m64n256k16": 1}
        assert st["cvt_e4m3"] > 0
    else:  # QK and RoPE are both bf16 m64n32k16: 32 + 4 per 4 PV
        assert wgmma_mix(st, "bf16.bf16 m64n256k16") == {"bf16.bf16 m64n256k16": 1, ROPE32: 9}
        assert st["cvt_e4m3"] == 0
    assert st["mma_sync"] == 0 and st["async_loads"] > 0
    assert SMEM_LIMIT // 2 < st["smem"] <= SMEM_LIMIT
    _unserialized(st)


@needs_gluon
def test_wide_gluon_grid_keeps_a_requests_row_tiles_adjacent():
    assert meta_plan("snapmla", **WIDE, tile="gluon").launches[0].grid[:2] == (1, 32)  # one 64-row tile, 32 requests
    # the row tiles of a request are adjacent programs (they share its pages in L2)
    assert meta_plan("bf16", B=4, H=128, L=1024, tile="gluon").launches[0].grid[:2] == (2, 4)


@needs_gluon
@pytest.mark.parametrize("block_m", [32, 64])
def test_native_fp8_kernels_compile_to_fp8_mmas(block_m):
    """fp8_mma=True past 16 rows: per page and warpgroup QK r / 32 e4m3 (m64n32k32) beside RoPE d / 16 bf16
    wgmma, PV e4m3 from V^T in registers, no fp16 widening (no cvt e4m3 -> f16). block_m 32
    (gluon.narrow8): PV r / 32 m64n32k32 too, <= half an SM's shared memory (two programs per SM); 64
    (gluon.wide8): PV r / 64 m64n64k32 per warpgroup, one program per SM."""
    st = sm90_stats("snapmla", **WIDE, tile="gluon", fp8_mma=True, **({"block_m": 64} if block_m == 64 else {}))
    if block_m == 32:
        assert st["kernel"] == "decode_gluon_narrow8"
        assert wgmma_mix(st, ROPE32) == {ROPE32: 1, "e4m3.e4m3 m64n32k32": 8}  # QK 16 + PV 16 per RoPE 4
        assert st["smem"] <= SMEM_LIMIT // 2
    else:
        assert st["kernel"] == "decode_gluon_wide8"
        assert wgmma_mix(st, ROPE32) == {ROPE32: 1, "e4m3.e4m3 m64n32k32": 4, "e4m3.e4m3 m64n64k32": 2}
        assert SMEM_LIMIT // 2 < st["smem"] <= SMEM_LIMIT
    assert st["mma_sync"] == 0 and st["async_loads"] > 0 and st["cvt_e4m3"] == 0
    _unserialized(st)


def _meta_plan(layout_cfg, H, r=512, d=64, **knobs):
    return meta_plan(layout_cfg, B=2, H=H, L=256, r=r, d=d, arch=None, **knobs)


@needs_gluon
def test_wide_gluon_tile_plans_and_refusals():
    for name in ("snapmla", "bf16"):
        plan = _meta_plan(PRESETS[name], 64, tile="gluon", warp_specialize=False)
        assert plan.launches[0].name == "decode_gluon_wide"
        assert plan.knobs["block_m"] == 64 and plan.knobs["num_warps"] == 8 and plan.knobs["num_stages"] == 2
        assert plan.knobs["num_splits"] == 4  # one wave: 132 SMs / 2 programs, capped by the 4 pages
    from snapquant.kernels.dispatch import one_wave_splits as _one_wave_splits

    assert _one_wave_splits(32, 128, 132) == 4 and _one_wave_splits(256, 64, 132) == 1
    assert _one_wave_splits(2, 512, 132) == 64 and _one_wave_splits(128, 64, 264) == 2
    assert _one_wave_splits(8, 512, 264) == 33 and _one_wave_splits(8, 20, 264) == 20  # capped by the pages
    # the narrow kernel's run cap: a table 512 pages wide (a 32K request among shorter ones) gets 16 splits
    assert _one_wave_splits(64, 512, 264, 32) == 16 and _one_wave_splits(128, 64, 264, 32) == 2
    # ... unless the cap spills programs into a partial last wave: 32 requests of a 514-page table (a 32K cache
    # with room for 64 new tokens) would take 17 splits = 544 programs = 3 waves of 31 pages; 16 splits are 2 waves
    # of 33. It stops there: 8 splits (one wave of 65 pages) would cost 1 % less for equal lengths but double the
    # run of a long request among short ones (the rule minimises waves x run^2). Full last waves stay as they were.
    assert _one_wave_splits(32, 514, 264, 32) == 16 and _one_wave_splits(32, 512, 264, 32) == 16
    assert _one_wave_splits(64, 1030, 264, 32) == 33 and _one_wave_splits(300, 514, 264, 32) == 17
    from snapquant.kernels import dispatch

    dispatch.TRIM_PARTIAL_WAVES = False  # the A/B probe's "off": the plain 32-page cap
    try:
        assert _one_wave_splits(32, 514, 264, 32) == 17 and _one_wave_splits(32, 512, 264, 32) == 16
    finally:
        dispatch.TRIM_PARTIAL_WAVES = True
    for programs, pages in [(32, 514), (8, 514), (64, 512), (300, 514), (100, 700), (3, 9000), (128, 66)]:
        s_cap = min(max(264 // programs, -(-pages // 32)), pages, 64)  # the plain cap's count
        chosen = _one_wave_splits(programs, pages, 264, 32)

        def waves_run(s: int, programs: int = programs, pages: int = pages) -> tuple[int, int]:
            return -(-programs * s // 264), -(-pages // s)

        (w, r), (w0, r0) = waves_run(chosen), waves_run(s_cap)
        # never worse than the cap for equal lengths, never longer runs than the waves saved pay for
        assert chosen <= s_cap and w * r <= w0 * r0 and w * r * r <= w0 * r0 * r0, (programs, pages)
    with pytest.raises(ConfigError, match="fp8_mma"):
        _meta_plan(PRESETS["snapmla"], 64, tile="gluon", fp8_mma="qk")
    with pytest.raises(ConfigError, match="fp8_mma=True"):  # native FP8 MMAs need the snapmla layout
        _meta_plan(PRESETS["bf16"], 64, tile="gluon", fp8_mma=True)
    plan8 = _meta_plan(PRESETS["snapmla"], 64, tile="gluon", fp8_mma=True)  # (also the default on a Hopper GPU)
    assert plan8.launches[0].name == "decode_gluon_narrow8" and plan8.knobs["kernel"] == "gluon.narrow8"
    assert plan8.launches[0].kwargs["STAGES"] == plan8.knobs["num_stages"] == 2
    assert plan8.knobs["block_m"] == 32 and plan8.knobs["num_warps"] == 4 and plan8.launches[0].grid[0] == 2
    assert plan8.knobs["num_splits"] == 4  # one wave of 2 x 132 slots, capped by the 4 pages
    wide8 = _meta_plan(PRESETS["snapmla"], 64, tile="gluon", fp8_mma=True, block_m=64, num_stages=4)
    assert wide8.launches[0].name == "decode_gluon_wide8" and wide8.launches[0].kwargs["STAGES"] == 4
    assert wide8.knobs["num_warps"] == 8 and wide8.launches[0].grid[0] == 1
    with pytest.raises(ConfigError, match="num_stages 2, 3 or 4"):
        _meta_plan(PRESETS["snapmla"], 64, tile="gluon", fp8_mma=True, num_stages=5)
    with pytest.raises(ConfigError, match=r"block_m 32 \(gluon.narrow8\) or 64"):
        _meta_plan(PRESETS["snapmla"], 64, tile="gluon", fp8_mma=True, block_m=16)
    with pytest.raises(ConfigError, match="block_m is a knob"):
        _meta_plan(PRESETS["snapmla"], 64, tile="gluon", block_m=32)
    with pytest.raises(ConfigError, match="num_warps=8"):
        _meta_plan(PRESETS["snapmla"], 64, tile="gluon", num_warps=4)
    with pytest.raises(ConfigError, match="num_warps=8"):  # gluon.wide asked for: its 8 warps
        _meta_plan(PRESETS["bf16"], 64, tile="gluon", num_warps=4, warp_specialize=False)
    with pytest.raises(ConfigError, match="num_stages=2"):
        _meta_plan(PRESETS["bf16"], 64, tile="gluon", num_stages=3)
    with pytest.raises(ConfigError, match="bf16 layout"):
        _meta_plan(PRESETS["snapmla_kv_only"], 64, tile="gluon")



# ------------------------------------------------ the <= 16-row bf16 kernel (gluon/narrow_bf16.py, opt-in)
@needs_gluon
@pytest.mark.parametrize("stages", [2, 1])
def test_narrow_bf16_gluon_kernel_compiles_to_bf16_wgmma_from_the_slot(stages):
    """tile="gluon" on the bf16 layout at <= 16 rows: per page QK r / 16, RoPE d / 16 and PV r / 16 bf16
    m64n16k16 wgmma, all operands from shared memory (no conversion), asynchronous; two slots take more than
    half an SM's shared memory (one program per SM), one slot at most half (two)."""
    st = sm90_stats("bf16", **NARROW, tile="gluon", num_stages=stages)
    assert st["kernel"] == "decode_gluon_narrow_bf16"
    per_page = 2 * 512 // 16 + 64 // 16
    assert set(st["wgmma_kinds"]) == {ROPE16} and st["wgmma"] % per_page == 0, st["wgmma_kinds"]
    assert st["mma_sync"] == 0 and st["cvt_e4m3"] == 0 and st["async_loads"] > 0
    if stages == 2:
        assert SMEM_LIMIT // 2 < st["smem"] <= SMEM_LIMIT
    else:
        assert 0 < st["smem"] <= SMEM_LIMIT // 2 - 1024
    _unserialized(st)


@needs_gluon
@pytest.mark.parametrize("stages,r,d", [(2, 512, 64), (1, 512, 64), (2, 256, 64), (2, 256, 32), (1, 128, 32)])
def test_narrow_bf16_shared_memory_estimate_matches_the_compiled_kernel(stages, r, d):
    """The dispatch's estimate (which sets programs per SM, hence the split count) within 1 KB of what the
    compiler allocates, on the same side of half an SM."""
    from snapquant.kernels.dispatch import HALF_SM_SMEM, narrow_bf16_smem

    st = sm90_stats("bf16", B=4, H=16, L=1024, r=r, d=d, tile="gluon", num_stages=stages)
    est = narrow_bf16_smem(stages, r, d)
    assert abs(est - st["smem"]) <= 1024, (est, st["smem"])
    assert (est <= HALF_SM_SMEM) == (st["smem"] <= HALF_SM_SMEM)


def test_narrow_bf16_gluon_plans_and_refusals():
    plan = _meta_plan(PRESETS["bf16"], 16, tile="gluon")
    assert plan.launches[0].name == "decode_gluon_narrow_bf16" and plan.knobs["kernel"] == "gluon.narrow_bf16"
    assert plan.launches[0].kwargs["STAGES"] == plan.knobs["num_stages"] == 2 and plan.launches[0].grid[1] == 1
    assert plan.knobs["block_m"] == 16 and plan.knobs["num_warps"] == 4
    one = _meta_plan(PRESETS["bf16"], 16, tile="gluon", num_stages=1)
    assert one.launches[0].kwargs["STAGES"] == 1
    # one wave of program slots on 132 SMs: 8 requests x 16 splits with two slots (one program per SM), x 33
    # with one slot (two per SM)
    long = dict(B=8, H=16, L=8192, arch=None, tile="gluon")
    assert meta_plan("bf16", **long).knobs["num_splits"] == 16
    assert meta_plan("bf16", **long, num_stages=1).knobs["num_splits"] == 33
    # the default on Hopper (arch=None plans are built for a GPU of unknown kind: the Triton tile unless asked)
    assert meta_plan("bf16", B=2, H=16, L=256).knobs["kernel"] == "gluon.narrow_bf16"
    assert _meta_plan(PRESETS["bf16"], 16).knobs["kernel"] == "triton.rows"
    assert meta_plan("bf16", B=2, H=16, L=256, r=64, d=32).knobs["kernel"] == "triton.rows"  # below one 128-byte box
    with pytest.raises(ConfigError, match="num_stages 1 or 2"):
        _meta_plan(PRESETS["bf16"], 16, tile="gluon", num_stages=3)
    with pytest.raises(ConfigError, match="fp8_mma"):
        _meta_plan(PRESETS["bf16"], 16, tile="gluon", fp8_mma="qk")
    with pytest.raises(ConfigError, match="num_warps=4"):
        _meta_plan(PRESETS["bf16"], 16, tile="gluon", num_warps=8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("layout,fp8_mma,stages,block_m", [
    ("snapmla", False, None, None), ("bf16", False, None, None), ("snapmla", True, None, None),
    ("snapmla", True, 3, 32), ("snapmla", True, None, 64), ("snapmla", True, 4, 64)])
@pytest.mark.parametrize("B,H,S,L,splits", [(5, 64, 1, 700, None), (3, 20, 2, 130, 1), (4, 128, 1, 64, 3),
                                            (2, 32, 2, 1000, 2)])
def test_wide_gluon_kernel_matches_the_reference(layout, fp8_mma, stages, block_m, B, H, S, L, splits, r=512, d=64):
    """64-row tiles (full, partial: 40 rows, several per request) against `mla_decode_reference` and the
    Triton tile, with stale tokens past each request's length in its last page. fp8_mma=True runs
    `gluon.narrow8` (32 rows) or `gluon.wide8` (block_m 64), native e4m3 MMAs: NaN codes past the length
    must not reach their accumulators."""
    torch.manual_seed(B * 1000 + H + L)
    cfg, cache, q, tau = _case(layout, B, H, S, L, r, d)
    out, lse = mla_decode(q, cache, tau, cfg, num_splits=splits, tile="gluon", fp8_mma=fp8_mma, num_stages=stages,
                          block_m=block_m)
    if fp8_mma:
        name = mla_decode_plan(q, cache, tau, cfg, num_splits=splits, tile="gluon", fp8_mma=True, block_m=block_m,
                               num_stages=stages).launches[0].name
        assert name == ("decode_gluon_wide8" if block_m == 64 else "decode_gluon_narrow8")
    base, base_lse = mla_decode(q, cache, tau, cfg, num_splits=splits, tile="pairs" if layout == "snapmla" else "rows")
    kv = cache.to_quantized_kv(int(cache.lengths.max())).to("cpu")
    ref, ref_lse = mla_decode_reference(q.cpu(), kv, cache.lengths.cpu(), tau, cfg)
    assert torch.isfinite(out).all()
    # snapmla: exact fp16 MMAs, summation order only. bf16: P = bf16(e) may round differently where the
    # reference's summation order moves e by an ulp
    # fp8_mma: Hopper's FP8 MMA keeps ~14 bits per accumulation; the scores move by ~2^-14 relative, which
    # flips some e4m3 roundings of P^ (12.5 % steps). H200: 4.8e-3 here at L = 700, 3.1e-3 / 4.0e-3 from the
    # exact kernel at B=32 H=64 L=8K / B=128 H=128 L=4K; a wrong page would be ~1
    tol, lse_tol = (1e-2, 1e-2) if fp8_mma else (5e-5, 1e-4) if layout == "snapmla" else (1e-3, 1e-3)
    for o, lz in ((ref, ref_lse), (base.cpu(), base_lse.cpu())):
        assert ((out.cpu() - o).norm() / o.norm()).item() < tol
        assert (lse.cpu() - lz).abs().max().item() < lse_tol


def _case(layout, B, H, S, L, r, d):
    """A cache of `layout` (its preset's) with B requests of mixed lengths (L, L - 97, ...) and NaN in the longest
    request's stale last-page tail (bf16 NaN, or the e4m3 NaN code: P = 0 must meet it as a zero, and NaN codes
    must not reach an accumulator), a bf16 query and MLA's 1 / sqrt(192)."""
    cfg = PRESETS[layout]
    lengths = torch.tensor([max(S, L - 97 * i) for i in range(B)], dtype=torch.int32)
    cache = PagedMLACache.empty(B, L, r, d, cfg, device="cuda")
    cache.append(torch.randn(B, L, r, device="cuda"), torch.randn(B, L, d, device="cuda"))
    cache.lengths.copy_(lengths.cuda())
    if L % 64:
        tail = cache.latent[cache.block_table[0, (L - 1) // 64], L % 64:]
        if layout == "bf16":
            tail.fill_(float("nan"))
        else:
            tail.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
    return cfg, cache, torch.randn(B, S, H, r + d, device="cuda").to(torch.bfloat16), 1 / math.sqrt(192)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("stages", [2, 1])
@pytest.mark.parametrize("B,H,S,L,splits,r", [(6, 16, 1, 700, None, 512), (3, 8, 2, 130, 1, 512),
                                              (5, 16, 1, 64, 3, 512), (4, 16, 1, 300, None, 256)])
def test_narrow_bf16_gluon_kernel_matches_the_reference(stages, B, H, S, L, splits, r, d=64):
    """gluon.narrow_bf16 against `mla_decode_reference` and the Triton rows tile on requests of mixed lengths
    (partial pages, empty splits), with NaN in a last page's stale tail: P = 0 must meet it as a zero."""
    torch.manual_seed(B * 1000 + H + L + stages)
    cfg, cache, q, tau = _case("bf16", B, H, S, L, r, d)
    kw = dict(num_splits=splits, tile="gluon", num_stages=stages)
    assert mla_decode_plan(q, cache, tau, cfg, **kw).launches[0].name == "decode_gluon_narrow_bf16"
    out, lse = mla_decode(q, cache, tau, cfg, **kw)
    base, base_lse = mla_decode(q, cache, tau, cfg, num_splits=splits, tile="rows")
    kv = cache.to_quantized_kv(int(cache.lengths.max())).to("cpu")
    ref, ref_lse = mla_decode_reference(q.cpu(), kv, cache.lengths.cpu(), tau, cfg)
    assert torch.isfinite(out).all()
    # P = bf16(e): an ulp of e from another fp32 summation order can round P to the neighbouring bf16
    # (2^-8 relative) on a few tokens; the output moves by ~1e-4 relative, a wrong page or slot by ~1
    for o, lz in ((ref, ref_lse), (base.cpu(), base_lse.cpu())):
        assert ((out.cpu() - o).norm() / o.norm()).item() < 1e-3
        assert (lse.cpu() - lz).abs().max().item() < 1e-3


# ------------------------------------------ past 16 rows with warp specialization (gluon/seesaw.py, opt-in)
@needs_gluon
def test_seesaw_kernel_compiles_to_two_warpgroups_in_roles():
    """warp_specialize=True: a 4-warp default partition and a 4-warp worker in lockstep over pairs of pages. Each
    computes the scores of its pages as m64n64k16 box by box ((r + d) / 64 boxes of 64 / 16 steps), in two
    places (its first page before the loop, the next pair's page in it), and PV on its 256 channels (m64n256k16,
    64 / 16 per page) of every page: warpgroup 0 at two sites (its page, the other's), warpgroup 1 at three (the
    other's page inside and after the branch on whether the pair has its page, its own). Every box has its own
    TMA barrier, so each QK waits box by box; shared memory within one SM (the query's RoPE part in registers
    makes it fit)."""
    st = sm90_stats("bf16", **WIDE, tile="gluon", warp_specialize=True)
    assert st["kernel"] == "decode_gluon_seesaw" and st["grid"][:2] == (1, 32)
    # 4 QK sites x 36 m64n64k16 against 5 PV sites x 4 m64n256k16
    assert wgmma_mix(st, "bf16.bf16 m64n256k16") == {"bf16.bf16 m64n256k16": 1, "bf16.bf16 m64n64k16": 36 * 4 / 20}
    assert st["mma_sync"] == 0 and st["cvt_e4m3"] == 0
    assert SMEM_LIMIT // 2 < st["smem"] <= SMEM_LIMIT
    ptx = compile_launch(meta_plan("bf16", **WIDE, tile="gluon", warp_specialize=True).launches[0], 90).asm["ptx"]
    # one wait per box at each QK site (4 x 9), plus the hand-overs: warpgroup 0 waits for the other's page and
    # for P tile 0 to be free, warpgroup 1 for warpgroup 0's page
    assert ptx.count("mbarrier.try_wait") == 4 * 9 + 3
    # each warpgroup asks for its part of a page (4 latent boxes; warpgroup 1 also the RoPE rows) at four sites
    # (the run's first two pages, then slot 0's and slot 1's next pages in the loop), one byte count per box
    assert ptx.count("expect_tx") == (4 + 5) * 4


@needs_gluon
def test_seesaw_plans_and_refusals():
    plan = _meta_plan(PRESETS["bf16"], 64, tile="gluon", warp_specialize=True)
    assert plan.launches[0].name == "decode_gluon_seesaw" and plan.knobs["kernel"] == "gluon.seesaw"
    assert plan.knobs["block_m"] == 64 and plan.knobs["num_warps"] == 4 and plan.launches[0].grid[:2] == (1, 2)
    assert _meta_plan(PRESETS["bf16"], 128, tile="gluon", warp_specialize=True).launches[0].grid[0] == 2
    # the default where it runs (measured faster than gluon.wide at every shape); False or 8 warps: gluon.wide
    assert _meta_plan(PRESETS["bf16"], 64, tile="gluon").knobs["kernel"] == "gluon.seesaw"
    assert meta_plan(PRESETS["bf16"], B=2, H=64, L=256).knobs["kernel"] == "gluon.seesaw"  # on sm_90 by default
    assert _meta_plan(PRESETS["bf16"], 64, tile="gluon", warp_specialize=False).knobs["kernel"] == "gluon.wide"
    assert _meta_plan(PRESETS["bf16"], 64, tile="gluon", num_warps=8).knobs["kernel"] == "gluon.wide"
    assert meta_plan(PRESETS["bf16"], B=2, H=64, L=256, r=256).knobs["kernel"] == "gluon.wide"  # seesaw: r = 512 only
    for knobs, field in ((dict(layout="ds_v32", H=64), "got ds_v32"), (dict(layout="bf16", H=16), "16 query rows"),
                         (dict(layout="bf16", H=64, r=256), "kv_lora_rank 256"),
                         (dict(layout="bf16", H=64, d=32), "rope_dim 32")):
        extra = {k: knobs[k] for k in ("r", "d") if k in knobs}
        with pytest.raises(ConfigError, match=field):
            _meta_plan(PRESETS[knobs["layout"]], knobs["H"], tile="gluon", warp_specialize=True, **extra)
    with pytest.raises(ConfigError, match="fp8_mma=True"):  # the pair schedule runs exact MMAs only
        _meta_plan(PRESETS["snapmla"], 64, tile="gluon", warp_specialize=True, fp8_mma=True)
    with pytest.raises(ConfigError, match=r"knob of gluon\.seesaw"):  # the Triton tiles have no warpgroup roles
        _meta_plan(PRESETS["bf16"], 64, tile="rows", warp_specialize=True)
    with pytest.raises(ConfigError, match="num_warps=4"):
        _meta_plan(PRESETS["bf16"], 64, tile="gluon", warp_specialize=True, num_warps=8)
    with pytest.raises(ConfigError, match="warp_specialize='yes' is not valid"):
        DecodeOptions(warp_specialize="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("B,H,S,L,splits", [(5, 64, 1, 700, None), (3, 20, 2, 130, 1), (4, 128, 1, 64, 3),
                                            (2, 32, 2, 1000, 2), (3, 64, 1, 321, 1), (2, 64, 1, 2000, 3)])
def test_seesaw_kernel_matches_the_reference(B, H, S, L, splits, r=512, d=64):
    """gluon.seesaw against `mla_decode_reference`, the Triton rows tile and gluon.wide: full and partial
    (40-row) tiles, two row tiles per request, runs of one page (the other warpgroup only multiplies by its
    P), odd and even page counts (the last page either warpgroup's), empty splits, mixed lengths, NaN in a
    last page's stale tail (each warpgroup zeroes its half before its PV)."""
    torch.manual_seed(B * 1000 + H + L)
    cfg, cache, q, tau = _case("bf16", B, H, S, L, r, d)
    kw = dict(num_splits=splits, tile="gluon", warp_specialize=True)
    assert mla_decode_plan(q, cache, tau, cfg, **kw).launches[0].name == "decode_gluon_seesaw"
    out, lse = mla_decode(q, cache, tau, cfg, **kw)
    base, base_lse = mla_decode(q, cache, tau, cfg, num_splits=splits, tile="rows")
    wide, wide_lse = mla_decode(q, cache, tau, cfg, num_splits=splits, tile="gluon", warp_specialize=False)
    kv = cache.to_quantized_kv(int(cache.lengths.max())).to("cpu")
    ref, ref_lse = mla_decode_reference(q.cpu(), kv, cache.lengths.cpu(), tau, cfg)
    assert torch.isfinite(out).all()
    # as gluon.narrow_bf16: P = bf16(e) may round to the neighbouring bf16 where another fp32 summation order
    # moves e by an ulp (~1e-4 relative on the output); a wrong page, slot, half or hand-over is ~1
    for o, lz in ((ref, ref_lse), (base.cpu(), base_lse.cpu()), (wide.cpu(), wide_lse.cpu())):
        assert ((out.cpu() - o).norm() / o.norm()).item() < 1e-3
        assert (lse.cpu() - lz).abs().max().item() < 1e-3


# --------------------------------------- the pair schedule on the snapmla layout (gluon/seesaw_fp8.py, opt-in)
@needs_gluon
def test_seesaw_fp8_kernel_compiles_to_two_warpgroups_widening_their_own_pages():
    """warp_specialize=True on the snapmla layout: the bf16 seesaw's two 4-warp warpgroups over page pairs, each
    widening its own page's four e4m3 boxes to fp16 in place (cvt e4m3x2 -> f16x2) before its QK. QK as
    m64n64k16 f16 (two per 128-channel chunk: 8 x 4 k-steps per page) plus the bf16 RoPE part (4), at two sites
    per warpgroup; PV on 256 channels (f16 m64n256k16, 4 per page) at five sites, as gluon.seesaw. Shared
    memory fills one SM; no div.rn slow-path call in the loop (`div_rn_fast`), whose register-saving spilled
    the kernel by 224 bytes: Triton 3.6 (the H200's) spills one 8-byte value (stored once, reloaded twice per
    pair), 3.9 a little more."""
    import triton

    st = sm90_stats("snapmla", **WIDE, tile="gluon", warp_specialize=True)
    assert st["kernel"] == "decode_gluon_seesaw_fp8" and st["grid"][:2] == (1, 32)
    assert wgmma_mix(st, "f16.f16 m64n256k16") == {"f16.f16 m64n256k16": 1, "f16.f16 m64n64k16": 32 * 4 / 20,
                                                   "bf16.bf16 m64n64k16": 4 * 4 / 20}
    assert st["mma_sync"] == 0 and st["cvt_e4m3"] > 0
    assert SMEM_LIMIT // 2 < st["smem"] <= SMEM_LIMIT
    _unserialized(st, max_spill=8 if triton.__version__.startswith("3.6") else 256)
    ptx = compile_launch(meta_plan("snapmla", **WIDE, tile="gluon", warp_specialize=True).launches[0], 90).asm["ptx"]
    # div.rn (whose slow path is a call) only in the query's prologues: per warpgroup 4 of its 32 rows per thread,
    # sigma = amax / 448 and 1 / sigma each (the page loop's divisions by pi would add 12)
    assert ptx.count("div.rn.f32") == 2 * 4 * 2
    # one wait per e4m3 box and the RoPE rows at each widening site (4 x 5), plus the hand-overs: warpgroup 0
    # waits for the other's page and for slot 0's upper half (and P tile 0) to be read, warpgroup 1 for warpgroup
    # 0's page; and each for both halves of the query
    assert ptx.count("mbarrier.try_wait") == 4 * 5 + 3 + 2
    # a page is asked for whole (4 boxes + RoPE rows) by one warpgroup: each its first page, then warpgroup 0
    # both slots' next pages in the loop (after its PVs on their lower halves)
    assert ptx.count("expect_tx") == 5 * 4


@needs_gluon
def test_seesaw_fp8_plans():
    plan = _meta_plan(PRESETS["snapmla"], 64, tile="gluon", warp_specialize=True)
    assert plan.launches[0].name == "decode_gluon_seesaw_fp8" and plan.knobs["kernel"] == "gluon.seesaw_fp8"
    assert plan.knobs["block_m"] == 64 and plan.knobs["num_warps"] == 4
    assert "FP8" not in plan.launches[0].kwargs and "STAGES" not in plan.launches[0].kwargs
    # opt-in: the snapmla default past 16 rows stays gluon.wide until measured faster
    assert _meta_plan(PRESETS["snapmla"], 64, tile="gluon").knobs["kernel"] == "gluon.wide"
    assert meta_plan(PRESETS["snapmla"], B=2, H=64, L=256).knobs["kernel"] == "gluon.wide"
    with pytest.raises(ConfigError, match="kv_lora_rank 256"):
        _meta_plan(PRESETS["snapmla"], 64, tile="gluon", warp_specialize=True, r=256)
    with pytest.raises(ConfigError, match="snapmla layout, 16 query rows"):
        _meta_plan(PRESETS["snapmla"], 16, tile="gluon", warp_specialize=True)


def _round_f32(x):
    """The float32 nearest the exact rational x (ties to even), as a Fraction: normal range only."""
    from fractions import Fraction

    if x == 0:
        return Fraction(0)
    sign, x = (-1 if x < 0 else 1), abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** e > x:
        e -= 1
    assert -126 <= e <= 127, "outside the normal range"
    scaled = x / Fraction(2) ** (e - 23)  # in [2^23, 2^24)
    n, rem = divmod(scaled.numerator, scaled.denominator)
    twice = 2 * rem
    if twice > scaled.denominator or (twice == scaled.denominator and n % 2):
        n += 1
    return sign * Fraction(n) * Fraction(2) ** (e - 23)


def test_div_rn_fast_sequence_is_the_correctly_rounded_quotient():
    """`common.div_rn_fast` (div.rn's fast path without its slow-path call), the arithmetic argument: from any
    reciprocal approximation within 2^-22 relative (rcp.approx.f32: about 2^-23), one Newton step and one fma
    correction give the correctly rounded a / b for normal a, b and quotient. Every step emulated exactly in
    rationals, each rounded once to float32 as the fma.rn / mul.rn of the PTX; fresh random operands over the
    ranges the softmax divides (pi in [2^-100, 2^20], numerators 2^-60 .. 2^40) and the worst approximations."""
    import random
    from fractions import Fraction

    from snapquant.kernels.gluon.common import DIV_RN_FAST_PTX

    assert "rcp.approx.ftz.f32" in DIV_RN_FAST_PTX and DIV_RN_FAST_PTX.count("fma.rn.f32") == 4
    rng = random.Random()  # fresh operands every run: the claim holds for all of them
    r32 = _round_f32
    for _ in range(4000):
        b = r32(Fraction(rng.uniform(1, 2)) * Fraction(2) ** rng.randint(-100, 20))
        a = r32(Fraction(rng.uniform(1, 2)) * Fraction(2) ** rng.randint(-60, 40))
        if not Fraction(2) ** -126 <= a / b < Fraction(2) ** 127:
            continue
        delta = rng.choice([-1, 1]) * Fraction(rng.choice([1.0, rng.random()])) * Fraction(2) ** -22
        r = r32(1 / b * (1 + delta))  # rcp.approx
        e = r32(1 - b * r)  # fma.rn e = -b r + 1
        r = r32(r * e + r)  # fma.rn r = r e + r
        q = r32(a * r)  # mul.rn
        s = r32(a - b * q)  # fma.rn s = -b q + a (exact: the residual of a rounded quotient)
        assert r32(r * s + q) == r32(a / b), (a, b, delta)
    assert r32(Fraction(0) * r) == 0  # a = 0 gives 0 (q = 0, s = 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
def test_div_rn_fast_matches_div_rn_bits_on_the_gpu():
    """div_rn_fast against div.rn on the GPU: the same bits for 4M fresh operand pairs of normal quotients
    (pi-like denominators 2^-100 .. 2^20, numerators 2^-60 .. 2^40)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from snapquant.kernels.gluon.common import div_rn_fast

    @gluon.jit
    def _divide(A, B, FAST, EXACT, N, BLOCK: gl.constexpr):
        lay: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
        offs = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=lay)
        ok = offs < N
        a = gl.load(A + offs, mask=ok, other=1.0)
        b = gl.load(B + offs, mask=ok, other=1.0)
        gl.store(FAST + offs, div_rn_fast(a, b), mask=ok)
        gl.store(EXACT + offs, gl.div_rn(a, b), mask=ok)

    n = 1 << 22
    b = torch.exp2(torch.empty(n, device="cuda").uniform_(-100, 20))
    sign = torch.randint(0, 2, (n,), device="cuda") * 2 - 1
    a = torch.exp2(torch.empty(n, device="cuda").uniform_(-60, 40)) * sign
    quotient = (a.double() / b.double()).abs()
    keep = (quotient >= 2.0 ** -126) & (quotient < 2.0 ** 126)  # normal quotients (the fast path's domain)
    a, b = a[keep].contiguous(), b[keep].contiguous()
    assert a.numel() > n // 2
    fast, exact = torch.empty_like(a), torch.empty_like(a)
    _divide[(triton_cdiv(a.numel(), 512),)](a, b, fast, exact, a.numel(), BLOCK=512, num_warps=4)
    assert torch.equal(fast.view(torch.int32), exact.view(torch.int32))


def triton_cdiv(n, d):
    return (n + d - 1) // d


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("B,H,S,L,splits", [(5, 64, 1, 700, None), (3, 20, 2, 130, 1), (4, 128, 1, 64, 3),
                                            (2, 32, 2, 1000, 2), (3, 64, 1, 321, 1), (2, 64, 1, 2000, 3)])
def test_seesaw_fp8_kernel_matches_the_reference(B, H, S, L, splits, r=512, d=64):
    """gluon.seesaw_fp8 against `mla_decode_reference`, the Triton pairs tile and gluon.wide: full and partial
    (40-row) tiles, two row tiles per request, runs of one page, odd and even page counts (the last page either
    warpgroup's), empty splits, mixed lengths, e4m3 NaN codes in a last page's stale tail (the widening zeroes
    them)."""
    torch.manual_seed(B * 1000 + H + L + 7)
    cfg, cache, q, tau = _case("snapmla", B, H, S, L, r, d)
    kw = dict(num_splits=splits, tile="gluon", warp_specialize=True)
    assert mla_decode_plan(q, cache, tau, cfg, **kw).launches[0].name == "decode_gluon_seesaw_fp8"
    out, lse = mla_decode(q, cache, tau, cfg, **kw)
    base, base_lse = mla_decode(q, cache, tau, cfg, num_splits=splits, tile="pairs")
    wide, wide_lse = mla_decode(q, cache, tau, cfg, num_splits=splits, tile="gluon", warp_specialize=False)
    kv = cache.to_quantized_kv(int(cache.lengths.max())).to("cpu")
    ref, ref_lse = mla_decode_reference(q.cpu(), kv, cache.lengths.cpu(), tau, cfg)
    assert torch.isfinite(out).all()
    # exact fp16 products, fp32 sums in another order: as gluon.wide's 5e-5 (a P^ code may round to its
    # neighbour where an ulp of f / pi crosses a midpoint); a wrong page, slot, half or hand-over is ~1
    for o, lz in ((ref, ref_lse), (base.cpu(), base_lse.cpu()), (wide.cpu(), wide_lse.cpu())):
        assert ((out.cpu() - o).norm() / o.norm()).item() < 5e-5
        assert (lse.cpu() - lz).abs().max().item() < 1e-4


# ------------------------------------------- the register-operand kernels' box views (gluon/box_views.py)
@pytest.mark.parametrize("boxes,warp_bits", [(4, 3), (2, 2)])
def test_slot_view_reads_v_transposed_as_pv8_rows(boxes, warp_bits):
    """The native FP8 kernels' view of stacked swizzled TMA boxes (gluon.wide8: a page slot, 8 warps;
    gluon.narrow8: a pair of boxes, 4 warps): byte offset -> logical (m, token) is linear and names the
    byte of (token, pv8_channel(m)); the transposed view trades rows m bits 3, 4 + warp_bits with tokens
    bits 0, 1 (undone by the kernels' 4 x 4 byte transpose). Every offset."""
    from snapquant.kernels.gluon.box_views import pv8_channel, slot_view_bases

    rows, j0 = boxes * 128, 1 << (4 + warp_bits)
    assert sorted(pv8_channel(m, warp_bits) for m in range(rows)) == list(range(rows))
    for transposed in (False, True):
        bases = slot_view_bases(transposed, boxes, warp_bits)
        assert len(bases) == (boxes * 8192).bit_length() - 1
        for off in range(boxes * 8192):
            m = t = 0
            for i, (bm, bt) in enumerate(bases):
                if off >> i & 1:
                    m, t = m ^ bm, t ^ bt
            if transposed:
                m, t = ((m & ~(8 | j0)) | ((t & 1) << 3) | (j0 if t & 2 else 0),
                        (t & ~3) | ((m >> 3) & 1) | (2 if m & j0 else 0))
            box, within = divmod(off, 64 * 128)
            row, pos = within // 128, (within // 16) % 8
            assert (t, pv8_channel(m, warp_bits)) == (row, box * 128 + ((pos ^ (row % 8)) * 16) + within % 16), off


@pytest.mark.parametrize("warp_bits", [3, 2])
def test_v_operand_load_and_transpose_give_the_mma_fragment(warp_bits):
    """The native FP8 kernels' V^T operand, simulated byte by byte: every thread loads through the
    transposed view with `v_load_bases`, the 4 x 4 byte transpose moves register slot r to
    `transposed_register(r)`, and then each slot must hold V^T at the coordinate its layout names, i.e.
    the byte of (token, pv8_channel(m)) of a random swizzled page. The load layout must differ from
    wgmma's own A layout only in whole registers (the kernels' conversion is a renaming)."""
    from snapquant.kernels.gluon.box_views import (
        mma_a_bases,
        pv8_channel,
        slot_view_bases,
        transposed_register,
        v_load_bases,
    )

    boxes = 4 if warp_bits == 3 else 2
    regs, lanes, warps = v_load_bases(warp_bits)
    a_regs, a_lanes, a_warps = mma_a_bases(warp_bits)
    assert (lanes, warps) == (a_lanes, a_warps) and regs[:2] == a_regs[:2]
    assert sorted(map(tuple, regs)) == sorted(map(tuple, a_regs))
    view = slot_view_bases(True, boxes, warp_bits)
    offset_of = {}
    for off in range(boxes * 8192):  # the view is linear: offset -> (m, token) by XOR of bases
        m = t = 0
        for i, (bm, bt) in enumerate(view):
            if off >> i & 1:
                m, t = m ^ bm, t ^ bt
        offset_of[(m, t)] = off
    page = torch.randint(0, 256, (boxes * 8192,), generator=torch.Generator().manual_seed(warp_bits)).tolist()

    def physical(m, t):  # byte offset of (token t, channel c) in the swizzled boxes
        c = pv8_channel(m, warp_bits)
        return (c // 128) * 8192 + t * 128 + ((((c % 128) // 16) ^ (t % 8)) * 16) + c % 16

    def coord(bases, idx):
        m = t = 0
        for i, (bm, bt) in enumerate(bases):
            if idx >> i & 1:
                m, t = m ^ bm, t ^ bt
        return m, t

    for lane in range(32):
        for warp in range(1 << warp_bits):
            m0, t0 = coord(lanes, lane)
            m1, t1 = coord(warps, warp)
            loaded = [0] * 128
            for r in range(128):
                m, t = coord(regs, r)
                loaded[transposed_register(r)] = page[offset_of[(m ^ m0 ^ m1, t ^ t0 ^ t1)]]
            for r in range(128):
                m, t = coord(regs, r)
                assert loaded[r] == page[physical(m ^ m0 ^ m1, t ^ t0 ^ t1)], (lane, warp, r)

def _swizzled(rows: torch.Tensor) -> torch.Tensor:
    """A [n, 128-byte] tile as TMA's 128-byte swizzle stores it: 16-byte chunk c of row t at position c ^ (t % 8)."""
    n = rows.shape[0]
    smem = torch.empty(n * 128, dtype=torch.uint8)
    for t in range(n):
        for c in range(128):
            smem[t * 128 + (((c // 16) ^ (t % 8)) * 16) + c % 16] = rows[t, c]
    return smem


def _read_view(smem: torch.Tensor, bases: list, shape: tuple, unit: int = 1) -> torch.Tensor:
    """What a SharedLinearLayout with `bases` reads from `smem` (elements of `unit` bytes, as int64 of their
    bytes): the logical index of element offset o is the XOR of the bases of o's set bits, every offset once."""
    view = torch.full(shape, -1, dtype=torch.int64)
    for off in range(smem.numel() // unit):
        i = j = 0
        for bit, (bi, bj) in enumerate(bases):
            if off >> bit & 1:
                i, j = i ^ bi, j ^ bj
        assert view[i, j] == -1, "two offsets map to one logical element"
        view[i, j] = int.from_bytes(bytes(smem[off * unit:(off + 1) * unit].tolist()), "little")
    return view


@pytest.mark.parametrize("kind", ["qk", "pv"])
def test_pair_views_give_each_warpgroup_its_box(kind):
    """gluon.narrow_halves' views of two consecutive TMA boxes (16 KB), applied as Triton applies a
    SharedLinearLayout: QK [128, 128] rows 0-63 = box 0's tokens, 64-127 = box 1's, k -> qk_channel; PV
    [256 m, 64 tokens] = the pair's channel pv_channel_pair(m), rows of the second warpgroup (m bit 6) in
    box 1, a thread's four rows (m bits 3, 7) four contiguous bytes. A random pair, every offset."""
    from snapquant.kernels.gluon.box_views import pair_view_bases, pv_channel_pair, qk_channel

    gen = torch.Generator().manual_seed(11)
    pair = torch.randint(0, 256, (2, 64, 128), generator=gen, dtype=torch.uint8)
    smem = torch.cat([_swizzled(pair[0]), _swizzled(pair[1])])
    bases = pair_view_bases(kind)
    assert len(bases) == 14
    if kind == "qk":
        view = _read_view(smem, bases, (128, 128))
        expect = torch.cat([pair[0], pair[1]])[:, [qk_channel(k) for k in range(128)]]
    else:
        view = _read_view(smem, bases, (256, 64))
        both = torch.cat([pair[0], pair[1]], dim=1)  # [64 tokens, 256 channels of the pair]
        expect = both[:, [pv_channel_pair(m) for m in range(256)]].T
        assert all(pv_channel_pair(m) // 128 == (m >> 6) & 1 for m in range(256))  # warpgroup -> box
        for m in range(0, 256, 1):  # a thread's rows m, m + 8, m + 128, m + 136: four contiguous channels
            if m & 0b10001000 == 0:
                chans = sorted(pv_channel_pair(m + o) for o in (0, 8, 128, 136))
                assert chans == list(range(chans[0], chans[0] + 4)) and chans[0] % 4 == 0
    assert torch.equal(view, expect.to(torch.int64))


def test_rope_halves_view_splits_the_rope_channels_by_warpgroup():
    """The RoPE view of gluon.narrow_halves: a [64, 64] bf16 tile (128-byte swizzle) read as [128, 32], row
    t + 64 h, column k = token t, channel 32 h + k. A random tile, every element."""
    from snapquant.kernels.gluon.box_views import rope_halves_bases

    gen = torch.Generator().manual_seed(12)
    tile = torch.randint(0, 2**15, (64, 64), generator=gen, dtype=torch.int16)
    smem = _swizzled(tile.view(torch.uint8).view(64, 128))
    view = _read_view(smem, rope_halves_bases(64), (128, 32), unit=2)
    expect = torch.cat([tile[:, :32], tile[:, 32:]]).to(torch.int64)
    assert torch.equal(view, expect)
    with pytest.raises(ValueError, match="rope_dim 64"):
        rope_halves_bases(32)



@pytest.mark.parametrize("kind", ["qk", "pv"])
def test_box_views_read_the_swizzled_box_in_the_mma_order(kind):
    """The SharedLinearLayout of each view, applied as Triton does (the logical index of a byte offset is
    the XOR of the bases of its set bits), must read a TMA box ([64 tokens, 128 codes], 128-byte swizzle:
    chunk c of row t at chunk position c ^ (t % 8)) at the channel the map names: QK view [t, k] =
    box[t, qk_channel(k)], PV view [m, t] = box[t, pv_channel(m)]. A random box, every offset."""
    from snapquant.kernels.gluon.box_views import box_view_bases, pv_channel, qk_channel

    bases = box_view_bases(kind)
    assert len(bases) == 13  # 8 KB
    gen = torch.Generator().manual_seed(7)
    box = torch.randint(0, 256, (64, 128), generator=gen, dtype=torch.uint8)
    smem = torch.empty(64 * 128, dtype=torch.uint8)
    for t in range(64):
        for c in range(128):
            smem[t * 128 + (((c // 16) ^ (t % 8)) * 16) + c % 16] = box[t, c]
    view = torch.full((64, 128) if kind == "qk" else (128, 64), -1, dtype=torch.int32)
    for off in range(64 * 128):
        i = j = 0
        for bit, (bi, bj) in enumerate(bases):
            if off >> bit & 1:
                i, j = i ^ bi, j ^ bj
        assert view[i, j] == -1, "two offsets map to one logical element"
        view[i, j] = int(smem[off])
    if kind == "qk":
        expect = box[:, [qk_channel(k) for k in range(128)]]
    else:
        expect = box[:, [pv_channel(m) for m in range(128)]].T
    assert torch.equal(view, expect.to(torch.int32))
    # across the four boxes of a page the QK map keeps each box's channels in that box
    assert sorted(qk_channel(k) for k in range(512)) == list(range(512))
    assert all(qk_channel(k) // 128 == k // 128 for k in range(512))
    with pytest.raises(ValueError, match="kind"):
        box_view_bases("kv")


@needs_gluon
def test_register_operand_kernel_plans_and_refusals():
    plan = _meta_plan(PRESETS["snapmla"], 16, tile="gluon", num_stages=2)
    assert plan.launches[0].name == "decode_gluon_narrow"
    assert plan.knobs["num_splits"] == 4  # two programs per SM: 264 slots / 2 requests, capped by the 4 pages
    qk = _meta_plan(PRESETS["snapmla"], 16, tile="gluon", num_stages=2, fp8_mma="qk")
    assert qk.launches[0].name == "decode_gluon_narrow" and qk.knobs["num_splits"] == 4  # two programs per SM too
    # one slot, exact or with the native QK: gluon.narrow at 168 registers, three programs per SM (one wave:
    # 132 x 3 slots / 33 requests = 12 splits, against 8 with two slots)
    for fp8_mma in (False, "qk"):
        kw = dict(B=33, H=16, L=64 * 100, arch=None, tile="gluon", fp8_mma=fp8_mma)
        one, two = meta_plan("snapmla", num_stages=1, **kw), meta_plan("snapmla", num_stages=2, **kw)
        assert one.launches[0].name == "decode_gluon_narrow" and one.launches[0].kwargs["maxnreg"] == 168
        assert one.launches[0].kwargs["STAGES"] == 1 and one.knobs["num_splits"] == 12
        assert "maxnreg" not in two.launches[0].kwargs and two.knobs["num_splits"] == 8
    # other widths: the in-place tile, one slot
    assert _meta_plan(PRESETS["snapmla"], 16, r=256, d=32, tile="gluon").launches[0].name == "decode_gluon_narrow_tile"
    with pytest.raises(ConfigError, match=r"widen='int_qk'.*fp8_mma='qk'"):
        _meta_plan(PRESETS["snapmla"], 16, tile="gluon", fp8_mma="qk", widen="int_qk")
    assert _meta_plan(PRESETS["snapmla"], 16, tile="gluon", fp8_mma="qk", widen="int_pv").launches[0].name \
        == "decode_gluon_narrow"
    with pytest.raises(ConfigError, match="kv_lora_rank 512"):
        _meta_plan(PRESETS["snapmla"], 16, r=256, d=32, tile="gluon", num_stages=2)


@needs_gluon
@pytest.mark.parametrize("widen,cvt_share", [("int", 0.0), ("int_qk", 0.5), ("int_pv2", 0.75), ("int_qk_pv2", 0.25)])
def test_integer_widening_replaces_the_conversions_it_names(widen, cvt_share):
    """widen=...: the same MMAs (the same wgmma mix as the cvt kernel) with the named share of the page's
    e4m3 -> fp16 conversions done by integer operations: the kernel's cvt.rn.f16x2.e4m3x2 count falls to
    cvt_share of the default's page widening (QK and PV each widen the page; PV in four boxes). The conversions
    outside it (the query's e4m3 rounding, the zeroed tail) are those of widen="int", which has no cvt in its
    page products: the integer path's count is the same in every mode's tail, so the difference is the page's."""
    base = sm90_stats("snapmla", **NARROW, tile="gluon", num_stages=2)
    rest = sm90_stats("snapmla", **NARROW, tile="gluon", num_stages=2, widen="int")["cvt_e4m3"]
    st = sm90_stats("snapmla", **NARROW, tile="gluon", num_stages=2, widen=widen)
    assert st["kernel"] == "decode_gluon_narrow"
    assert st["wgmma_kinds"] == base["wgmma_kinds"]
    page = base["cvt_e4m3"] - rest
    assert page >= 2 * 64 * 512 / 128 / 2  # QK + PV: 64 x 512 codes each, 128 threads, 2 per cvt (>=: unrolled)
    assert st["cvt_e4m3"] - rest == round(page * cvt_share)
    assert st["smem"] == base["smem"]
    _unserialized(st)


@needs_gluon
def test_integer_widening_is_refused_where_gluon_narrow_does_not_run():
    """widen is gluon.narrow's knob: asked of another kernel it is an error naming the knob and the kernel."""
    assert _meta_plan(PRESETS["snapmla"], 16, tile="gluon", widen="int").launches[0].name == "decode_gluon_narrow"
    assert _meta_plan(PRESETS["snapmla"], 16, tile="gluon", widen="cvt").launches[0].name == "decode_gluon_narrow"
    for knobs, kernel in [(dict(tile="gluon", r=256, d=32), "gluon.narrow_tile"), (dict(tile="pairs"), "triton.pairs")]:
        with pytest.raises(ConfigError, match=f"widen='int' is a knob of gluon.narrow.*{kernel}"):
            _meta_plan(PRESETS["snapmla"], 16, widen="int", **knobs)
    with pytest.raises(ConfigError, match=r"widen='int' is a knob of gluon.narrow.*gluon.wide"):
        _meta_plan(PRESETS["snapmla"], 64, tile="gluon", widen="int")
    with pytest.raises(ConfigError, match=r"widen='integer' is not valid.*allowed values: cvt, int"):
        _meta_plan(PRESETS["snapmla"], 16, tile="gluon", widen="integer")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("widen", ["int", "int_qk", "int_pv", "int_pv2", "int_qk_pv2"])
def test_integer_widening_gives_the_cvt_kernels_bits(widen, B=6, H=16, L=700, r=512, d=64):
    """The integer widening computes the codes' values times 2^-8 and undoes it on the fp32 accumulators by
    a power of two: the output and LSE are the cvt kernel's bit for bit, on mixed lengths with NaN codes
    written past the longest request (zeroed before the products in both)."""
    torch.manual_seed(11)
    cfg = PRESETS["snapmla"]
    lengths = torch.tensor([max(1, L - 97 * i) for i in range(B)], dtype=torch.int32)
    cache = PagedMLACache.empty(B, L, r, d, cfg, device="cuda")
    cache.append(3 * torch.randn(B, L, r, device="cuda"), torch.randn(B, L, d, device="cuda"))
    cache.lengths.copy_(lengths.cuda())
    cache.latent[cache.block_table[0, (L - 1) // 64], L % 64:].view(torch.uint8).fill_(0x7F)
    q = torch.randn(B, 1, H, r + d, device="cuda").to(torch.bfloat16)
    base = mla_decode(q, cache, 0.07, cfg, tile="gluon", num_stages=2, widen="cvt")
    got = mla_decode(q, cache, 0.07, cfg, tile="gluon", num_stages=2, widen=widen)
    assert torch.isfinite(got[0]).all()
    assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("fp8_mma", [False, "qk", True])
def test_one_slot_gives_the_two_slot_kernels_bits(fp8_mma, B=6, H=16, L=1500, r=512, d=64):
    """One slot and three programs per SM change when pages arrive and which registers hold what, not the
    products or their order: output and LSE bit for bit the two-slot kernel's (exact, native QK, both native),
    with the same splits, on mixed lengths with NaN codes past the longest request."""
    torch.manual_seed(12)
    cfg = PRESETS["snapmla"]
    lengths = torch.tensor([max(1, L - 211 * i) for i in range(B)], dtype=torch.int32)
    cache = PagedMLACache.empty(B, L, r, d, cfg, device="cuda")
    cache.append(torch.randn(B, L, r, device="cuda"), torch.randn(B, L, d, device="cuda"))
    cache.lengths.copy_(lengths.cuda())
    cache.latent[cache.block_table[0, (L - 1) // 64], L % 64:].view(torch.uint8).fill_(0x7F)
    q = torch.randn(B, 1, H, r + d, device="cuda").to(torch.bfloat16)
    knobs = dict(tile="gluon", fp8_mma=fp8_mma, num_splits=5)
    two = mla_decode(q, cache, 0.07, cfg, num_stages=2, **knobs)
    one = mla_decode(q, cache, 0.07, cfg, num_stages=1, **knobs)
    assert mla_decode_plan(q, cache, 0.07, cfg, num_stages=1, **knobs).launches[0].kwargs["STAGES"] == 1
    assert torch.isfinite(one[0]).all()
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@needs_gluon
@pytest.mark.parametrize("preset,kernel", [("snapmla", "decode_gluon_narrow"), ("bf16", "decode_gluon_narrow_bf16")])
@pytest.mark.parametrize("ahead", [1, 2, 4])
def test_l2_prefetch_adds_bulk_prefetches_and_nothing_else(preset, kernel, ahead):
    """l2_prefetch=n: the narrow kernels ask the L2 for a page (latent and RoPE rows: two bulk prefetches) in
    the loop and for the n - 1 pages the loop's first prefetch passes over in the prologue; the same MMAs and
    shared memory as without (the prefetch holds no slot), none at n = 0."""
    base = sm90_stats(preset, **NARROW, tile="gluon", num_stages=2)
    st = sm90_stats(preset, **NARROW, tile="gluon", num_stages=2, l2_prefetch=ahead)
    assert st["kernel"] == kernel
    assert base["l2_prefetch"] == 0
    assert st["l2_prefetch"] >= 2 * ahead  # >=: the compiler may peel or unroll the loop's
    assert st["wgmma_kinds"] == base["wgmma_kinds"] and st["smem"] == base["smem"]
    _unserialized(st)


@needs_gluon
def test_l2_prefetch_is_refused_where_the_narrow_kernels_do_not_run():
    assert _meta_plan(PRESETS["snapmla"], 16, tile="gluon", l2_prefetch=2).launches[0].name == "decode_gluon_narrow"
    for knobs, kernel in [(dict(tile="gluon", r=256, d=32), "gluon.narrow_tile"), (dict(tile="pairs"), "triton.pairs")]:
        with pytest.raises(ConfigError, match=f"l2_prefetch=2 is a knob of gluon.narrow / gluon.narrow_bf16.*{kernel}"):
            _meta_plan(PRESETS["snapmla"], 16, l2_prefetch=2, **knobs)
    with pytest.raises(ConfigError, match=r"l2_prefetch=2 is a knob.*gluon.wide"):
        _meta_plan(PRESETS["snapmla"], 64, tile="gluon", l2_prefetch=2)
    for bad in (-1, 9, 1.5, True):
        with pytest.raises(ConfigError, match=r"l2_prefetch=.* is not valid; allowed values: an int from 0"):
            _meta_plan(PRESETS["snapmla"], 16, tile="gluon", l2_prefetch=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("preset", ["snapmla", "bf16"])
@pytest.mark.parametrize("ahead", [1, 3])
def test_l2_prefetch_gives_the_same_bits(preset, ahead, B=6, H=16, L=1500, r=512, d=64):
    """A prefetch changes when bytes arrive, not which: output and LSE bit for bit those without it, on mixed
    lengths (runs shorter than the prefetch distance included) and several splits."""
    torch.manual_seed(12)
    cfg = PRESETS[preset]
    lengths = torch.tensor([max(1, L - 230 * i) for i in range(B)], dtype=torch.int32)
    cache = PagedMLACache.empty(B, L, r, d, cfg, device="cuda")
    cache.append(3 * torch.randn(B, L, r, device="cuda"), torch.randn(B, L, d, device="cuda"))
    cache.lengths.copy_(lengths.cuda())
    q = torch.randn(B, 1, H, r + d, device="cuda").to(torch.bfloat16)
    for splits in (1, 3):
        base = mla_decode(q, cache, 0.07, cfg, tile="gluon", num_stages=2, num_splits=splits)
        got = mla_decode(q, cache, 0.07, cfg, tile="gluon", num_stages=2, num_splits=splits, l2_prefetch=ahead)
        assert torch.isfinite(got[0]).all()
        assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])


# ------------------------------------------------------------------ one Triton version's exact counts
# The wgmma instructions each case compiles to, per Triton version: an exact record (a change means the
# kernel or the compiler changed what a page issues) that the properties above only bound. Other
# versions skip; to add one, print `sm90_stats(...)["wgmma_kinds"]` of each case there.
SNAPSHOT_CASES = {
    "narrow": ("snapmla", NARROW, {"tile": "gluon", "num_stages": 2}),
    "narrow s1": ("snapmla", NARROW, {"tile": "gluon", "num_stages": 1}),
    "narrow_tile": ("snapmla", dict(NARROW, r=256, d=32), {"tile": "gluon"}),
    "narrow fp8 qk s1": ("snapmla", NARROW, {"tile": "gluon", "fp8_mma": "qk", "num_stages": 1}),
    "narrow fp8 qk": ("snapmla", NARROW, {"tile": "gluon", "fp8_mma": "qk", "num_stages": 2}),
    "wide": ("snapmla", WIDE, {"tile": "gluon"}),
    "wide bf16": ("bf16", WIDE, {"tile": "gluon", "warp_specialize": False}),
    "narrow bf16": ("bf16", NARROW, {"tile": "gluon", "num_stages": 2}),
    "narrow8": ("snapmla", WIDE, {"tile": "gluon", "fp8_mma": True}),
    "wide8": ("snapmla", WIDE, {"tile": "gluon", "fp8_mma": True, "block_m": 64}),
}
WGMMA_SNAPSHOTS = {
    "3.9.0": {
        "narrow": {ROPE16: 4, "f16.f16 m64n16k16": 64},
        "narrow s1": {ROPE16: 4, "f16.f16 m64n16k16": 64},
        "narrow_tile": {ROPE16: 2, "f16.f16 m64n16k16": 32},
        "narrow fp8 qk s1": {ROPE16: 4, "e4m3.e4m3 m64n16k32": 16, "f16.f16 m64n16k16": 32},
        "narrow fp8 qk": {ROPE16: 4, "e4m3.e4m3 m64n16k32": 16, "f16.f16 m64n16k16": 32},
        "wide": {ROPE32: 4, "f16.f16 m64n256k16": 4, "f16.f16 m64n32k16": 32},
        "wide bf16": {"bf16.bf16 m64n256k16": 4, ROPE32: 36},
        "narrow bf16": {ROPE16: 68},
        "narrow8": {ROPE32: 4, "e4m3.e4m3 m64n32k32": 32},
        "wide8": {ROPE32: 4, "e4m3.e4m3 m64n32k32": 16, "e4m3.e4m3 m64n64k32": 8},
    },
}
# the H200 machine's Triton: the same counts (compiled on a CPU machine with triton 3.6.0 installed by
# `pip install --no-deps --target DIR` and DIR first on PYTHONPATH)
WGMMA_SNAPSHOTS["3.6.0"] = WGMMA_SNAPSHOTS["3.9.0"]


def _triton_version() -> str:
    import triton

    return triton.__version__


@needs_gluon
@pytest.mark.skipif(_triton_version() not in WGMMA_SNAPSHOTS, reason="no wgmma snapshot for this Triton version")
@pytest.mark.parametrize("case", sorted(SNAPSHOT_CASES))
def test_wgmma_counts_match_this_triton_versions_snapshot(case):
    preset, shape, knobs = SNAPSHOT_CASES[case]
    assert sm90_stats(preset, **shape, **knobs)["wgmma_kinds"] == WGMMA_SNAPSHOTS[_triton_version()][case]
