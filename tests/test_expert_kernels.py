"""The fused MoE kernels against their torch references and transformers' expressions.

Combine (`kernels.triton.expert_combine`).

Exactness argument: each term is one fp32 product of a 16- or 32-bit expert output and an fp32 weight (one
rounding, as the promoted `*` of the torch expression), and the k terms are added in a fixed order with one
rounding per addition (no fma: the launch disables fp contraction), then rounded once to the output dtype. The
reference does the same operations in the same order in torch, so the results are equal bit for bit, on the
interpreter here and compiled on a GPU; any other order, a fused multiply-add or a wrong row or weight changes
bits (checked below: the two orders disagree in fp32 on random inputs, so the equality tests can fail).
On a GPU the "lanes4" order is the order of torch's own reduction, which the GPU test checks against the
expression transformers' grouped_mm experts run.

Gate (`kernels.triton.expert_gate`): silu(gate) rounded to the dtype, times up, rounded. On the interpreter
exp is numpy's float32 exp, within 1 ulp of exp but not necessarily torch's CPU one, so the CPU test bounds
the fp32 result against float64 arithmetic: exp's error (<= 1 ulp), the 1 + e and the division roundings
(1 ulp each; the relative error of 1 + e is at most that of e) and the product's rounding give at most
5 u relative (u = 2^-24), tested at 8 u; a wrong column, operand or sign is off by O(1). In 16-bit dtypes
the intermediate rounding is the dtype's, and the test checks the result against the float64 value
rounded the same way, within one ulp of the dtype where the fp32 value sits at a rounding boundary. On the
GPU the bits must equal transformers' gate.
"""

from __future__ import annotations

import pytest
import torch

from snapquant.kernels.triton.expert_combine import combine_slots, combine_slots_reference
from snapquant.kernels.triton.expert_gate import gate_reference, silu_mul
from snapquant.kernels.triton.expert_groups import group_pairs
from snapquant.models import experts as X
from snapquant.models.tiny import tiny_model


def _inputs(T: int, k: int, H: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    y = (torch.randn(T * k, H, device=device, generator=g) * 3).to(dtype)
    pos = torch.randperm(T * k, device=device, generator=g)
    w = torch.rand(T, k, device=device, generator=g)
    return y, pos, w


@pytest.mark.parametrize("order", ["sequential", "lanes4"])
@pytest.mark.parametrize(("T", "k", "H", "y_dtype", "out_dtype"), [
    (7, 6, 300, torch.bfloat16, torch.bfloat16),  # T and H not multiples of the program's tile
    (21, 8, 256, torch.float32, torch.float32),
    (3, 1, 64, torch.float16, torch.float16),
    (40, 5, 96, torch.bfloat16, torch.float32),
    (9, 2, 512, torch.float32, torch.bfloat16),
])
def test_kernel_equals_its_reference_bit_for_bit(order, T, k, H, y_dtype, out_dtype):
    y, pos, w = _inputs(T, k, H, y_dtype, seed=T * 31 + k)
    ours = combine_slots(y, pos, w, out_dtype, order)
    ref = combine_slots_reference(y, pos, w, out_dtype, order)
    assert ours.dtype == out_dtype and ours.shape == (T, H)
    assert torch.equal(ours, ref)


def test_the_orders_differ_so_the_bit_tests_can_fail():
    y, pos, w = _inputs(64, 6, 256, torch.float32, seed=5)
    a = combine_slots_reference(y, pos, w, torch.float32, "sequential")
    b = combine_slots_reference(y, pos, w, torch.float32, "lanes4")
    assert not torch.equal(a, b)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.equal(combine_slots(y, pos, w, torch.float32, "lanes4"), a)


def test_reference_is_the_weighted_sum_of_each_tokens_rows():
    """Against float64 arithmetic: rows gathered by pos, weighted, summed (within k fp32 roundings)."""
    T, k, H = 11, 6, 32
    y, pos, w = _inputs(T, k, H, torch.float32, seed=7)
    exact = (y.double()[pos].view(T, k, H) * w.double().unsqueeze(-1)).sum(1)
    bound = (k + 1) * 2.0 ** -24 * (y.double()[pos].view(T, k, H).abs() * w.double().unsqueeze(-1)).sum(1)
    for order in ("sequential", "lanes4"):
        got = combine_slots_reference(y, pos, w, torch.float32, order).double()
        assert bool(((got - exact).abs() <= bound).all())


def test_bad_inputs_name_the_shapes():
    y, pos, w = _inputs(4, 2, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="fp32 weights"):
        combine_slots(y, pos, w.double(), torch.float32)
    with pytest.raises(ValueError, match=r"pos \[T\*k\]"):
        combine_slots(y, pos[:-1], w, torch.float32)
    with pytest.raises(ValueError, match="order must be one of"):
        combine_slots(y, pos, w, torch.float32, order="tree")


def test_the_experts_use_the_kernel_only_on_cuda():
    y, _pos, w = _inputs(4, 2, 16, torch.bfloat16, seed=2)
    assert not X.fused_combine_applies(y, w)  # CPU: the torch expression, transformers' own bits


@pytest.mark.parametrize(("R", "N"), [(37, 300), (5, 64), (1, 1408)])
def test_gate_kernel_fp32_within_the_rounding_bound(R, N):
    g = torch.Generator().manual_seed(R * 7 + N)
    gu = torch.randn(R, 2 * N, generator=g) * 6
    ours = silu_mul(gu).double()
    x, up = gu.double().chunk(2, dim=-1)
    exact = x / (1 + torch.exp(-x)) * up
    assert ours.shape == (R, N)
    assert bool(((ours - exact).abs() <= 8 * 2.0 ** -24 * exact.abs() + 1e-30).all())
    assert not torch.equal(silu_mul(gu.flip(-1)), silu_mul(gu))  # the halves' roles matter


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gate_kernel_16bit_rounds_like_torch(dtype):
    g = torch.Generator().manual_seed(17)
    gu = (torch.randn(64, 2 * 256, generator=g) * 6).to(dtype)
    ours = silu_mul(gu)
    ref = gate_reference(gu)
    assert ours.dtype == dtype
    # both round fp32 values that agree to a few ulp: equal except where one sits at a rounding boundary
    assert (ours != ref).float().mean() < 0.01
    ulp = torch.finfo(dtype).eps * ref.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert bool(((ours.float() - ref.float()).abs() <= 2 * ulp).all())


def test_gate_bad_input():
    with pytest.raises(ValueError, match=r"\[R, 2N\]"):
        silu_mul(torch.zeros(3, 5))


@pytest.mark.parametrize(("E", "T", "k"), [(8, 5, 2), (64, 37, 6), (16, 1, 4), (256, 7, 8), (300, 3, 2), (4, 70, 4)])
def test_group_pairs_equals_the_torch_grouping(E, T, k):
    """Integer ranks and counts: equal outputs, for distinct top-k ids per token and for arbitrary ids."""
    g = torch.Generator().manual_seed(E * 1000 + T)
    topk = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).reshape(-1)
    anyids = torch.randint(0, E, (T * k,), generator=g)
    for flat in (topk, anyids):
        ours = group_pairs(flat, E)
        ref = X.group_by_expert(flat, E)  # CPU: the torch operations
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ours, ref, strict=True))
        assert torch.equal(ours[0], torch.sort(flat, stable=True).indices)


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 32, 128, 341])
def test_gpu_group_pairs_equals_the_torch_grouping(T, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    E, k = 64, 6
    g = torch.Generator(device="cuda").manual_seed(T)
    flat = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)]).reshape(-1)
    ours = X.group_by_expert(flat, E)
    monkeypatch.setattr(X, "FUSED_GROUPS", False)
    ref = X.group_by_expert(flat, E)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ours, ref, strict=True))

@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 32, 128, 4096, 65536])
def test_gpu_lanes4_gives_the_bits_of_the_torch_expression(T):
    """The expression transformers' grouped_mm experts end with, on the GPU, at decode and prefill sizes."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    k, H = 6, 2048
    y, pos, w = _inputs(T, k, H, torch.bfloat16, seed=T, device="cuda")
    stock = (y.index_select(0, pos).view(T, k, H) * w.unsqueeze(-1)).sum(dim=1).to(torch.bfloat16)
    ours = combine_slots(y, pos, w, torch.bfloat16, "lanes4")
    assert torch.equal(ours, combine_slots_reference(y, pos, w, torch.bfloat16, "lanes4"))
    assert torch.equal(ours, stock)


@pytest.mark.gpu
@pytest.mark.parametrize("R", [6, 768, 100000])
def test_gpu_gate_gives_the_bits_of_transformers_gate(R):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers.integrations.moe import _default_apply_gate

    class _Experts(torch.nn.Module):
        act_fn = torch.nn.SiLU()

    g = torch.Generator(device="cuda").manual_seed(R)
    gu = (torch.randn(R, 2 * 1408, device="cuda", generator=g) * 4).to(torch.bfloat16)
    assert torch.equal(silu_mul(gu), _default_apply_gate(_Experts(), gu))
    gu32 = torch.randn(R, 2 * 1408, device="cuda", generator=g) * 4
    assert torch.equal(silu_mul(gu32), _default_apply_gate(_Experts(), gu32))


@pytest.mark.gpu
def test_gpu_grouped_experts_with_the_fused_combine_are_bitwise_transformers():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = tiny_model("deepseek_v3", moe=True).to("cuda", torch.bfloat16)
    mod = X.expert_modules(model)[0]
    g = torch.Generator(device="cuda").manual_seed(11)
    T, k, E = 300, 2, mod.num_experts
    x = torch.randn(T, mod.gate_up_proj.shape[-1], device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, device="cuda", generator=g)
    assert X.fused_combine_applies(torch.empty(1, 1, device="cuda", dtype=torch.bfloat16), w)
    assert X.fused_gate_applies(mod, torch.empty(1, 2, device="cuda", dtype=torch.bfloat16))
    with torch.no_grad():
        with X.decode_experts(model, X.GROUPED):
            ours = mod(x, idx, w)
        with X.decode_experts(model, "grouped_mm"):
            stock = mod(x, idx, w)
    assert torch.equal(ours, stock)
