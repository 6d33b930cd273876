"""The fused MoE combine (`kernels.triton.expert_combine`) against its torch reference and transformers' expression.

Exactness argument: each term is one fp32 product of a 16- or 32-bit expert output and an fp32 weight (one
rounding, as the promoted `*` of the torch expression), and the k terms are added in a fixed order with one
rounding per addition (no fma: the launch disables fp contraction), then rounded once to the output dtype. The
reference does the same operations in the same order in torch, so the results are equal bit for bit, on the
interpreter here and compiled on a GPU; any other order, a fused multiply-add or a wrong row or weight changes
bits (checked below: the two orders disagree in fp32 on random inputs, so the equality tests can fail).
On a GPU the "lanes4" order is the order of torch's own reduction, which the GPU test checks against the
expression transformers' grouped_mm experts run.
"""

from __future__ import annotations

import pytest
import torch

from snapquant.kernels.triton.expert_combine import combine_slots, combine_slots_reference
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


# ------------------------------------------------------------------------------------------------ GPU
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
    with torch.no_grad():
        with X.decode_experts(model, X.GROUPED):
            ours = mod(x, idx, w)
        with X.decode_experts(model, "grouped_mm"):
            stock = mod(x, idx, w)
    assert torch.equal(ours, stock)
