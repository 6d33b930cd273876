"""DeepSeek-V2's rotary embedding as one Triton launch (`kernels/triton/rotary.py`, interpreter here) and its
model switch (`models/rotary.py`).

The kernel's arithmetic per channel pair (a, b) and rotation (c, d): real a c - b d and imaginary a d + b c in
fp32, with or without an fma per part (MODES), then rounded to the input dtype. Each mode is checked against
its own definition computed here in float64 with the same fp32 roundings: a double holds an fp32 product
exactly, and an fma is taken as the float64 sum rounded to fp32, which is what the interpreter computes too
(IEEE arithmetic, the same on every CPU). That double rounding differs from a true fma's single one only when
the float64 sum lands exactly halfway between two fp32 values (about 2^-29 of random inputs), so the GPU's
modes are these; which mode equals torch's CUDA kernel is what the switch probes on the GPU, bit for bit
(and the GPU test checks).
"""

from __future__ import annotations

import pytest
import torch

from snapquant.kernels.triton.rotary import MODES, rotary_fused, rotary_reason, rotary_reference
from snapquant.models.rotary import _modules_with_rotary, fused_rotary, matching_mode
from snapquant.models.tiny import tiny_model


def _inputs(B, H, S, D, dtype, g):
    q = torch.randn(B, S, H, D + 32, generator=g).to(dtype).transpose(1, 2)[..., 32:]  # a strided channel slice
    k = torch.randn(B, 1, S, D, generator=g).to(dtype)
    pos = torch.randint(0, 4096, (B, S), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    return q, k, torch.polar(torch.ones(B, S, D // 2), pos[..., None] * inv)


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).to(torch.float64)


def _mode_value(x: torch.Tensor, f: torch.Tensor, mode: tuple[int, int]) -> torch.Tensor:
    """What the kernel computes in `mode`, from float64 arithmetic with explicit fp32 roundings."""
    a, b = x.double()[..., 0::2], x.double()[..., 1::2]
    fr = torch.view_as_real(f).double()[:, None]
    c, d = fr[..., 0], fr[..., 1]

    def part(x1, y1, x2, y2, sign, m):
        if m == 1:
            return _f32(x1 * y1 + sign * _f32(x2 * y2))
        if m == 2:
            return _f32(sign * x2 * y2 + _f32(x1 * y1))
        return _f32(_f32(x1 * y1) + sign * _f32(x2 * y2))

    re, im = part(a, c, b, d, -1.0, mode[0]), part(a, d, b, c, 1.0, mode[1])
    return torch.stack([re, im], -1).flatten(-2).to(torch.float32).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_is_its_definition_bit_for_bit(mode, dtype):
    g = torch.Generator().manual_seed(torch.seed() % 2 ** 31)
    q, k, f = _inputs(3, 5, 4, 64, dtype, g)
    oq, ok = rotary_fused(q, k, f, mode)
    assert oq.shape == q.shape and ok.shape == k.shape and oq.is_contiguous()
    assert torch.equal(oq, _mode_value(q, f, mode)) and torch.equal(ok, _mode_value(k, f, mode))


def test_modes_differ_and_are_within_rounding_of_torch():
    """fp32 inputs show the contraction: the modes give different bits somewhere, and each is within two fp32
    roundings of torch's complex product (which is one of them on the machine that built it)."""
    g = torch.Generator().manual_seed(3)
    q, k, f = _inputs(4, 8, 16, 64, torch.float32, g)
    outs = [rotary_fused(q, k, f, m)[0] for m in MODES]
    assert any(not torch.equal(outs[0], o) for o in outs[1:])
    want = rotary_reference(q, k, f)[0]
    for o in outs:
        assert ((o - want).abs() <= 2 * 2.0 ** -23 * (q.abs().amax(-1, keepdim=True) + 1e-30)).all()


def test_reason_and_the_switch_stay_off_on_cpu():
    g = torch.Generator().manual_seed(1)
    q, k, f = _inputs(2, 2, 3, 64, torch.bfloat16, g)
    assert "CUDA" in rotary_reason(q, k, f)
    model = tiny_model("deepseek_v2")
    assert [m.__name__.rsplit(".", 1)[-1] for m in _modules_with_rotary(model)] == ["modeling_deepseek_v2"]
    with fused_rotary(model) as mode:
        assert mode is None  # a CPU model: nothing switched
    assert _modules_with_rotary(tiny_model("deepseek_v3")) == []  # cos / sin RoPE: not this kernel's


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_switch_uses_a_mode_with_torchs_bits_on_the_gpu(dtype):
    """On the GPU one contraction mode reproduces transformers' apply_rotary_emb bit for bit (the switch finds
    it); inside the block the module's function is the fused one and gives those bits on fresh inputs."""
    import transformers.models.deepseek_v2.modeling_deepseek_v2 as mod

    original = mod.apply_rotary_emb
    mode = matching_mode(original, torch.device("cuda"), dtype)
    assert mode is not None, "no contraction mode reproduces torch's complex product on this GPU"
    model = tiny_model("deepseek_v2").to("cuda", dtype)
    g = torch.Generator().manual_seed(9)
    q, k, f = (t.cuda() for t in _inputs(5, 16, 7, 64, dtype, g))
    with fused_rotary(model) as used:
        assert used == mode and mod.apply_rotary_emb is not original
        got = mod.apply_rotary_emb(q, k, f)
    assert mod.apply_rotary_emb is original
    want = original(q, k, f)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_kernel_that_fails_on_the_device_keeps_torchs_function(monkeypatch):
    """Any failure of the probe (a compile error on an untested GPU) leaves the model's function in place, with
    a warning, and is remembered."""
    from snapquant.models import rotary

    def boom(*a, **k):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(rotary, "_MODES", {})
    monkeypatch.setattr(rotary, "_probe_modes", boom)
    with pytest.warns(UserWarning, match="fused rotary kernel failed"):
        assert matching_mode(rotary_reference, torch.device("cuda", 5), torch.bfloat16) is None
    assert matching_mode(rotary_reference, torch.device("cuda", 5), torch.bfloat16) is None
