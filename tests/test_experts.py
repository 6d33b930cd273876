"""snapquant.models.experts: the sync-free decode experts against transformers' stock eager experts loop.

Tolerance. Every implementation computes, per token, y = sum_e w_e D_e (silu(G_e x) * (U_e x)) in fp32 with
its own summation orders, so each differs from the exact (fp64) value by at most the textbook bound of
fp32 dot products (Higham: |fl(a.b) - a.b| <= gamma_n sum |a_i b_i|, gamma_n = n u / (1 - n u),
u = 2^-24) carried through the gate (silu' <= 1.1; silu itself within 4 u relative), the down projection
and the weighted sum over the k experts. That bound is computed per output element in fp64 from absolute
values; two implementations may differ by twice it. A wrong routing, weight or ordering is off by the
size of an expert output, orders of magnitude above it.
"""

from __future__ import annotations

import logging

import pytest
import torch

from snapquant.errors import HostSyncError
from snapquant.graphs import no_host_sync
from snapquant.models import experts as X
from snapquant.models.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
U = 2.0 ** -24


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _bound(mod, x, idx, w) -> torch.Tensor:
    """|fp32 result - exact| <= this, per element of [T, H] (fp64, from absolute values)."""
    x, w = x.double(), w.double()
    inter = mod.down_proj.shape[-1]
    H = x.shape[-1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            gu = mod.gate_up_proj[idx[t, j]].double()
            d = mod.down_proj[idx[t, j]].double()
            g, u = (gu @ x[t]).split(inter)
            ag, au = (gu.abs() @ x[t].abs()).split(inter)
            eg, eu = _gamma(H) * ag, _gamma(H) * au
            silu = torch.nn.functional.silu(g)
            h = silu * u
            eh = 1.1 * eg * (u.abs() + eu) + silu.abs() * eu + 4 * U * h.abs() + U * h.abs()
            o = d @ h
            eo = d.abs() @ eh + _gamma(inter) * (d.abs() @ h.abs())
            out[t] += w[t, j].abs() * (eo + U * o.abs()) + _gamma(idx.shape[1]) * (w[t, j] * o).abs()
    return out


@pytest.fixture(scope="module")
def moe():
    model = tiny_model("deepseek_v3", moe=True)
    mod = X.expert_modules(model)[0]
    g = torch.Generator().manual_seed(0)
    T, k, E = 9, 2, mod.num_experts
    x = torch.randn(T, mod.gate_up_proj.shape[-1], generator=g)
    # distinct experts per token; expert E-1 never picked (an empty group)
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    return model, mod, x, idx, w


def _run(model, mod, impl, x, idx, w):
    with X.decode_experts(model, impl), torch.no_grad():
        return mod(x, idx, w)


@pytest.mark.parametrize("impl", [X.GROUPED, X.DENSE, "grouped_mm"])
def test_decode_experts_match_the_eager_loop_within_the_fp32_bound(moe, impl):
    model, mod, x, idx, w = moe
    eager = _run(model, mod, "eager", x, idx, w)
    got = _run(model, mod, impl, x, idx, w)
    bound = _bound(mod, x, idx, w)
    assert bool(((got.double() - eager.double()).abs() <= 2 * bound).all())
    assert eager.abs().max() > 1e3 * bound.max()  # the bound is far below the signal: the test can fail
    wrong = _run(model, mod, impl, x, idx.flip(-1), w)  # weights applied to the other expert
    assert not bool(((wrong.double() - eager.double()).abs() <= 2 * bound).all())


def test_decode_experts_are_sync_free_and_the_stock_loop_is_not(moe):
    model, mod, x, idx, w = moe
    X.register()
    with no_host_sync(), torch.no_grad():
        X.grouped_experts_forward(mod, x, idx, w)
        X.dense_experts_forward(mod, x, idx, w)
    with X.decode_experts(model, "eager"), pytest.raises(HostSyncError), no_host_sync(), torch.no_grad():
        mod(x, idx, w)


def test_whole_model_logits_and_restore(moe):
    model = moe[0]
    ids = torch.randint(3, 256, (3, 7), generator=torch.Generator().manual_seed(1))
    before = model.get_experts_implementation()
    with torch.no_grad():
        ref = model(ids).logits
        with X.decode_experts(model) as plan:
            assert plan.implementation == X.GROUPED and model.config._experts_implementation == X.GROUPED
            got = model(ids).logits
    assert model.get_experts_implementation() == before
    # two layers of fp32 reassociation through attention and norms: ~1e-7 relative per op
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_unaligned_widths_fall_back_to_dense_with_the_cost_in_the_warning(caplog):
    model = tiny_model("deepseek_v3", moe=True, moe_intermediate_size=30)  # 120-byte fp32 rows
    plan = X.plan_decode_experts(model)
    assert plan.implementation == X.DENSE and "multiple of 16 bytes" in plan.reason
    with caplog.at_level(logging.WARNING, logger="snapquant.models.experts"), X.decode_experts(model):
        pass
    assert "all 4 experts for every token" in caplog.text and "2.0x the routed expert FLOPs" in caplog.text
    assert X.grouped_mm_reason(torch.float32, "cpu", 64, 32) is None
    assert X.plan_decode_experts(tiny_model("deepseek_v3")).implementation is None  # dense MLP only


@pytest.mark.parametrize("limit", [X.COMPARE_LIMIT, 0])  # the key comparison, and the sort past the limit
def test_group_by_expert_is_the_stable_sort_and_its_inverse(monkeypatch, limit):
    monkeypatch.setattr(X, "COMPARE_LIMIT", limit)
    g = torch.Generator().manual_seed(limit % 97 + 3)
    for E, T, k in [(8, 5, 2), (64, 37, 6), (16, 1, 4)]:
        flat = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).reshape(-1)
        order, pos, offs = X.group_by_expert(flat, E)
        assert torch.equal(order, torch.sort(flat, stable=True).indices)
        assert torch.equal(order[pos], torch.arange(T * k))
        assert offs.dtype == torch.int32
        assert torch.equal(offs, torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_are_bitwise_transformers_grouped_mm(moe, dtype):
    """Same grouping, products and slot sum as transformers' grouped_mm: equal bits, not just within the bound."""
    model, mod, x, idx, w = moe
    mod.to(dtype)
    try:
        ours = _run(model, mod, X.GROUPED, x.to(dtype), idx, w)
        stock = _run(model, mod, "grouped_mm", x.to(dtype), idx, w)
        swapped = _run(model, mod, X.GROUPED, x.to(dtype), idx.flip(-1), w)
    finally:
        mod.float()
    assert ours.dtype == stock.dtype == dtype
    assert torch.equal(ours, stock)
    assert not torch.equal(ours, swapped)
