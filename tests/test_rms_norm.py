"""The fused RMSNorm (`kernels/triton/rms_norm.py`, interpreter here, compiled on a GPU) and its model switch.

Error argument for the fp32 path, against float64 arithmetic (u = 2^-24): each square is rounded once (u);
a sum of N non-negative terms in any order is within gamma_{N-1} = (N-1)u / (1 - (N-1)u) of the exact sum
(Higham, Accuracy and Stability, eq. 4.4 with |x_i| = x_i), whatever tree the kernel or torch uses; the
factor fp32(1/N), the product and + eps add one rounding each (3u relative on var + eps); 1 / sqrt (two
roundings on the interpreter, the hardware rsqrt's 2 ulp on a GPU: <= 2u) then halves the relative error
of var + eps and adds its own; x * r and weight * y add one rounding each. So the output's relative error
is at most (gamma_{N-1} + 4u) / 2 + 4u: tested with that bound. A wrong epsilon, a sum instead of a mean,
a missing weight or a wrong column is off by far more (checked: the wrong-epsilon reference fails the same
bound on inputs whose mean square is near eps).

16-bit dtypes: the kernel rounds x * r to the hidden dtype and weight * y to the output dtype, as torch does.
Its fp32 value of x * r is within the bound above of the exact one, so the rounded value can differ from
the exact value rounded the same way only where the exact value lies within that bound of a rounding
boundary: then by one ulp of the dtype, which the weight product turns into at most two ulps of the output.
Such elements are rare (the band is ~1e-3 of a bf16 ulp wide at N = 2048): tested as at most 2 ulps, and at
most 1 % of the elements off at all.
"""

from __future__ import annotations

import pytest
import torch

from snapquant.kernels.triton.rms_norm import rms_norm, rms_norm_reference
from snapquant.models.norms import behaves_as_reference, candidate_norms, fused_rms_norms, plan_fused_norms
from snapquant.models.tiny import tiny_model

U = 2.0 ** -24


def _inputs(rows: int, n: int, scale: float, dtype: torch.dtype, w_dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=g, dtype=torch.float64) * scale).to(dtype)
    w = (torch.rand(n, generator=g, dtype=torch.float64) + 0.5).to(w_dtype)
    return x, w


def _exact(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * rsqrt(mean(x^2) + eps) in float64, the fp32 relative bound of the kernel's value of it)."""
    xd = x.double()
    n = x.shape[-1]
    y = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    gamma = (n - 1) * U / (1 - (n - 1) * U)
    return y, torch.full_like(y, (gamma + 4 * U) / 2 + 4 * U)


def _ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at |v| (its normal range)."""
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    e = torch.floor(torch.log2(v.abs().clamp(min=torch.finfo(dtype).tiny)))
    return torch.exp2(e - mant)


@pytest.mark.parametrize(("rows", "n", "scale", "w_dtype"), [
    (3, 2048, 1.0, torch.float32), (5, 300, 3.0, torch.float32), (2, 7168, 0.5, torch.float32),
    (4, 512, 1e-3, torch.float32), (3, 1536, 1.0, torch.bfloat16)])  # a bf16 weight promotes to fp32 exactly
def test_fp32_within_the_error_bound_of_exact_arithmetic(rows, n, scale, w_dtype):
    seed = torch.seed()
    eps = 1e-6
    x, w = _inputs(rows, n, scale, torch.float32, w_dtype, seed)
    out = rms_norm(x, w, eps)
    y, rel = _exact(x, w, eps)
    exact = w.double() * y
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert ((out.double() - exact).abs() <= rel * exact.abs() + 1e-300).all(), seed


def test_the_bound_catches_a_wrong_epsilon():
    """Inputs whose mean square (~1e-6) is comparable to eps: the wrong-eps expression leaves the bound."""
    seed = torch.seed()
    x, w = _inputs(4, 512, 1e-3, torch.float32, torch.float32, seed)
    y, rel = _exact(x, w, 1e-6)
    exact = w.double() * y
    wrong = rms_norm(x, w, 1e-5).double()
    assert not ((wrong - exact).abs() <= rel * exact.abs()).all(), seed


@pytest.mark.parametrize(("dtype", "w_dtype"), [
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
def test_16bit_roundings_as_torch_orders_them(dtype, w_dtype):
    seed = torch.seed()
    eps = 1e-6
    x, w = _inputs(16, 2048, 2.0, dtype, w_dtype, seed)
    out = rms_norm(x, w, eps)
    out_dtype = torch.promote_types(w_dtype, dtype)
    assert out.dtype == out_dtype and out.shape == x.shape
    y, _ = _exact(x, w, eps)
    ref = (w.double() * y.to(dtype).double()).to(out_dtype).double()  # exact value, rounded where torch rounds
    diff = (out.double() - ref).abs()
    assert (diff <= 2 * _ulp(ref, out_dtype)).all(), seed
    assert (diff > 0).float().mean() <= 0.01, seed
    # and against torch's own expression on the same inputs (its fp32 sum in another order): where that order
    # puts torch's fp32 y on the other side of a rounding boundary of `dtype`, the two differ by one ulp of
    # y in `dtype` times w (with fp32 weights, 2^16 fp32 ulps: seed 13667594222257809916, 21 of 32768 elements)
    torch_out = rms_norm_reference(x, w, eps).double()
    y16 = y.to(dtype).double()
    tol = 2 * _ulp(torch_out, out_dtype) + w.double().abs() * _ulp(y16, dtype)
    assert ((out.double() - torch_out).abs() <= tol).all(), seed
    assert (out.double() != torch_out).float().mean() <= 0.01, seed


def test_shapes_strides_and_bad_inputs():
    x = torch.randn(2, 3, 64)[..., :48]  # leading dims kept, a row stride that is not the width
    w = torch.rand(48) + 0.5
    out = rms_norm(x, w, 1e-6)
    assert out.shape == (2, 3, 48)
    assert torch.allclose(out, rms_norm_reference(x, w, 1e-6), rtol=1e-5, atol=0)
    assert rms_norm(torch.empty(0, 48), w, 1e-6).shape == (0, 48)
    with pytest.raises(ValueError, match=r"weight \(47,\) does not match .* \(2, 3, 48\)"):
        rms_norm(x, w[:47], 1e-6)
    with pytest.raises(ValueError, match="float64"):
        rms_norm(x.double(), w, 1e-6)


# ------------------------------------------------------------------------------------------ the model switch
class _OnePlusRMSNorm(torch.nn.Module):
    """Gemma's form, (1 + weight): named like an RMSNorm, but not the T5 expression."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n) * 0.1)
        self.variance_epsilon = 1e-6

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        v = h.float().pow(2).mean(-1, keepdim=True)
        return ((1.0 + self.weight) * (h.float() * torch.rsqrt(v + self.variance_epsilon))).to(h.dtype)


def test_switch_takes_only_t5_norms_and_undoes_itself():
    torch.manual_seed(torch.seed() % 2**31)
    model = tiny_model("deepseek_v2", moe=True)
    other = _OnePlusRMSNorm(model.config.hidden_size)
    model.add_module("extra_norm", other)
    norms = candidate_norms(model)
    assert other in norms and not behaves_as_reference(other)
    t5 = [m for m in norms if m is not other]
    # per layer: input, post-attention, kv_a (and q_a with q-LoRA); then the final norm
    per_layer = 3 + (model.config.q_lora_rank is not None)
    assert len(t5) == model.config.num_hidden_layers * per_layer + 1 and all(behaves_as_reference(m) for m in t5)
    ids = torch.randint(3, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        stock = model(input_ids=ids).logits
        with fused_rms_norms(model) as n:
            assert n == len(t5)
            assert all("forward" in m.__dict__ for m in t5) and "forward" not in other.__dict__
            fused = model(input_ids=ids).logits
        assert all("forward" not in m.__dict__ for m in norms)
        again = model(input_ids=ids).logits
    assert torch.equal(again, stock)
    # fp32 model: per-norm relative differences of ~1e-6 through two layers
    assert (fused - stock).abs().max() <= 1e-4 * stock.abs().max()
    assert not torch.equal(fused, stock) or n == 0  # the kernel did run (its sum order differs somewhere)


def test_plan():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert plan_fused_norms(cpu, "static", "auto")[0] is False
    assert plan_fused_norms(cuda, "graph", "auto") == (True, "auto: CUDA fixed-shape steps")
    assert plan_fused_norms(cuda, "eager", "auto")[0] is False
    assert plan_fused_norms(cpu, "static", True)[0] is True
    with pytest.raises(ValueError, match="fused_norms"):
        plan_fused_norms(cpu, "static", "yes")


def test_decode_loop_runs_fused_norms_when_asked():
    import snapquant
    from snapquant.eval.generation import DecodeLoop, decoding_plan

    torch.manual_seed(torch.seed() % 2**31)
    model = snapquant.patch(tiny_model("deepseek_v2", moe=True), "bf16", backend="reference")
    ids = torch.randint(3, model.config.vocab_size, (2, 7))
    plan = decoding_plan(model, {"do_sample": False})
    runs = {}
    for flag in (False, True):
        loop = DecodeLoop(model, steps="static", fused_norms=flag)
        assert loop.fused_norms is flag
        with loop.step_modules():
            assert any("forward" in m.__dict__ for m in candidate_norms(model)) is flag
        runs[flag] = loop.generate(ids, None, max_length=7 + 4, plan=plan, keep_logits=4)
    assert all("forward" not in m.__dict__ for m in candidate_norms(model))
    for a, b in zip(runs[False].logits, runs[True].logits, strict=True):
        assert (a - b).abs().max() <= 1e-4 * a.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "n"), [(32, 2048), (128, 512), (131072, 2048), (128, 7168)])
def test_gpu_against_torch(rows, n):
    """Compiled: bf16 outputs within one bf16 rounding of torch's expression (its fp32 sum order differs)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    seed = torch.seed()
    x, w = _inputs(rows, n, 2.0, torch.bfloat16, torch.bfloat16, seed)
    x, w = x.cuda(), w.cuda()
    out = rms_norm(x, w, 1e-6)
    ref = rms_norm_reference(x, w, 1e-6)
    diff = (out.double() - ref.double()).abs()
    assert (diff <= 2 * _ulp(ref.double(), torch.bfloat16)).all(), seed
    assert (diff > 0).float().mean() <= 0.01, seed
    f32 = rms_norm(x.float(), w.float(), 1e-6).double()
    y, rel = _exact(x.float().cpu(), w.float().cpu(), 1e-6)
    exact = (w.double().cpu() * y)
    assert ((f32.cpu() - exact).abs() <= rel * exact.abs() + 1e-300).all(), seed
