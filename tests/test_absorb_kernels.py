"""The fused projections of absorbed MLA (`kernels/triton/absorb.py`): interpreter here, compiled on a GPU.

Error argument, against float64 (u = 2^-24): every product is exact in fp32 (bf16 x bf16 on the GPU's tensor
cores; the interpreter widens the same values to fp32 and rounds each product at most once) and a sum of K
terms in any order is within gamma_K * sum |terms| of the exact sum, gamma_K = K u / (1 - K u) (Higham,
eq. 3.5). The query projection sums dn products: bound gamma_{dn+1} sum |q| |w|. The output projection splits
fp32 o into three bf16 parts whose sum is o exactly, so it sums 3 r exact products: bound
gamma_{3r+1} sum |o| |w|; rounded once to bf16 (8 significant bits), it moves by at most 2^-8 of its value more. A wrong head,
channel or transposed weight is off by O(sum |terms|) on random inputs, far outside these bounds.
"""

from __future__ import annotations

import pytest
import torch

from snapquant.kernels.triton.absorb import (
    absorb_query_fused,
    absorb_reason,
    project_output_fused,
    project_reason,
)
from snapquant.reference import absorb_query, project_output

U = 2.0 ** -24


def _gamma(k: int) -> float:
    return k * U / (1 - k * U)


def _query(B, S, H, dn, d, g):
    """q_nope / q_rope as the attention hands them over: channel slices of one [B, S, H, dn + d] query."""
    q = torch.randn(B, H, S, dn + d, generator=g).to(torch.bfloat16).transpose(1, 2)
    return q[..., :dn], q[..., dn:]


def _weights(H, dn, dv, r, g):
    """W_UK [H, dn, r] and W_UV [H, dv, r] as views of kv_b_proj's weight [H (dn + dv), r] (as the adapter does)."""
    w = (torch.randn(H * (dn + dv), r, generator=g) / r ** 0.5).to(torch.bfloat16).view(H, dn + dv, r)
    return w[:, :dn], w[:, dn:]


@pytest.mark.parametrize(("B", "S", "H", "dn", "d", "r"), [(3, 1, 4, 128, 64, 512), (2, 3, 2, 64, 32, 256),
                                                           (37, 1, 2, 128, 64, 512)])
def test_absorb_query_within_fp32_accumulation_of_exact_arithmetic(B, S, H, dn, d, r):
    g = torch.Generator().manual_seed(torch.seed() % 2 ** 31)
    q_nope, q_rope = _query(B, S, H, dn, d, g)
    w_uk, _ = _weights(H, dn, 128, r, g)
    got = absorb_query_fused(q_nope, q_rope, w_uk)
    assert got.shape == (B, S, H, r + d) and got.dtype == torch.float32
    exact = torch.einsum("bshn,hnr->bshr", q_nope.double(), w_uk.double())
    bound = _gamma(dn + 1) * torch.einsum("bshn,hnr->bshr", q_nope.double().abs(), w_uk.double().abs())
    err = (got[..., :r].double() - exact).abs()
    assert (err <= bound).all(), float((err / bound.clamp(min=1e-300)).max())
    assert torch.equal(got[..., r:], q_rope.float())  # RoPE columns copied exactly
    ref = absorb_query(q_nope, q_rope, w_uk, fp32=True)  # the torch path: the same bound, another order
    assert ((got.double() - ref.double()).abs()[..., :r] <= 2 * bound).all()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("B", "S", "H", "dv", "r"), [(3, 1, 4, 128, 512), (2, 2, 3, 64, 256), (40, 1, 1, 128, 512)])
def test_project_output_within_fp32_accumulation_of_exact_arithmetic(B, S, H, dv, r, out_dtype):
    g = torch.Generator().manual_seed(torch.seed() % 2 ** 31)
    o = torch.randn(B, S, H, r, generator=g) * torch.rand(B, S, H, 1, generator=g)  # fp32, varied row scales
    _, w_uv = _weights(H, 128, dv, r, g)
    got = project_output_fused(o, w_uv, out_dtype)
    assert got.shape == (B, S, H, dv) and got.dtype == out_dtype
    exact = torch.einsum("bshr,hvr->bshv", o.double(), w_uv.double())
    bound = _gamma(3 * r + 1) * torch.einsum("bshr,hvr->bshv", o.double().abs(), w_uv.double().abs())
    if out_dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * (exact.abs() + bound)
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), float((err / bound.clamp(min=1e-300)).max())


def test_a_wrong_weight_is_caught_by_the_bound():
    """The bounds are tight enough to see a transposed head or a dropped split part (what the kernels could get
    wrong): W_UV of the next head gives errors far beyond them."""
    g = torch.Generator().manual_seed(5)
    o = torch.randn(4, 1, 2, 256, generator=g)
    _, w_uv = _weights(2, 64, 64, 256, g)
    got = project_output_fused(o, w_uv.flip(0), torch.float32)
    exact = torch.einsum("bshr,hvr->bshv", o.double(), w_uv.double())
    bound = _gamma(3 * 256 + 1) * torch.einsum("bshr,hvr->bshv", o.double().abs(), w_uv.double().abs())
    assert ((got.double() - exact).abs() > bound).float().mean() > 0.9


def test_reasons_keep_the_cpu_and_other_dtypes_on_the_torch_path():
    g = torch.Generator().manual_seed(1)
    q_nope, q_rope = _query(2, 1, 2, 128, 64, g)
    w_uk, w_uv = _weights(2, 128, 128, 512, g)
    assert "CUDA" in absorb_reason(q_nope, q_rope, w_uk)
    assert "CUDA" in project_reason(torch.zeros(2, 1, 2, 512), w_uv, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(("B", "H"), [(1, 16), (32, 16), (128, 16), (5, 128)])
def test_fused_projections_on_the_gpu_within_the_bounds(B, H, dn=128, d=64, dv=128, r=512):
    """Compiled (bf16 tensor-core dots, the three-part split): the same bounds as the interpreter's, and within
    twice the bound of the torch operations they replace."""
    g = torch.Generator().manual_seed(7)
    q_nope, q_rope = (t.cuda() for t in _query(B, 1, H, dn, d, g))
    w_uk, w_uv = (t.cuda() for t in _weights(H, dn, dv, r, g))
    assert absorb_reason(q_nope, q_rope, w_uk) is None
    got = absorb_query_fused(q_nope, q_rope, w_uk)
    exact = torch.einsum("bshn,hnr->bshr", q_nope.double(), w_uk.double())
    bound = _gamma(dn + 1) * torch.einsum("bshn,hnr->bshr", q_nope.double().abs(), w_uk.double().abs())
    assert ((got[..., :r].double() - exact).abs() <= bound).all()
    assert torch.equal(got[..., r:], q_rope.float())
    o = torch.randn(B, 1, H, r, generator=g).cuda()
    assert project_reason(o, w_uv, torch.bfloat16) is None
    for dtype in (torch.float32, torch.bfloat16):
        out = project_output_fused(o, w_uv, dtype)
        exact = torch.einsum("bshr,hvr->bshv", o.double(), w_uv.double())
        bound = _gamma(3 * r + 1) * torch.einsum("bshr,hvr->bshv", o.double().abs(), w_uv.double().abs())
        if dtype == torch.bfloat16:
            bound = bound + 2.0 ** -8 * (exact.abs() + bound)
        assert ((out.double() - exact).abs() <= bound).all()
    ref = project_output(o, w_uv, fp32=True).to(torch.bfloat16)
    assert ((out.double() - ref.double()).abs() <= 2 * bound + 2.0 ** -8 * ref.double().abs()).all()


def test_the_runtime_check_passes_the_kernels_and_catches_a_wrong_one(monkeypatch):
    """`fused_projections_ok` (run once per GPU before the kernels are used) accepts the kernels and, given a
    projection that is off, refuses them with a warning, so the attention keeps the torch operations."""
    from snapquant.kernels.triton import absorb

    assert absorb._probe(torch.device("cpu")) == (True, "ok")
    real = absorb.project_output_fused
    monkeypatch.setattr(absorb, "project_output_fused", lambda o, w, dt: real(o, w, dt) * 1.01)
    assert absorb._probe(torch.device("cpu")) == (False, "output projection outside its bound")
    monkeypatch.setattr(absorb, "_VERIFIED", {})
    monkeypatch.setattr(absorb, "_probe", lambda device: (False, "output projection outside its bound"))
    with pytest.warns(UserWarning, match="fused MLA projections failed their check"):
        assert absorb.fused_projections_ok(torch.device("cuda", 7)) is False
    assert absorb.fused_projections_ok(torch.device("cuda", 7)) is False  # remembered: checked once


def test_the_runtime_check_may_read_the_device_inside_a_sync_free_block(monkeypatch):
    """The one-off check reads its verdict on the host; a first decode step run inside `no_host_sync()` must not
    fail on that (the check is exempt by name), and nothing is checked again afterwards."""
    from snapquant.graphs import no_host_sync
    from snapquant.kernels.triton import absorb

    monkeypatch.setattr(absorb, "_VERIFIED", {})
    monkeypatch.setattr(absorb, "_probe", lambda device: (bool((torch.ones(3) > 0).all()), "ok"))
    with no_host_sync():
        assert absorb.fused_projections_ok(torch.device("cuda", 6)) is True
