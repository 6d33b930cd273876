"""The `triton` decode backend behind snapquant.attention.backends (the patch's seam), on CPU.

The adapter reads the patch store's row buffers in place (no copy), so it is tested on strided row
slices of larger buffers, against `mla_decode_reference`; tolerances as in test_kernels_decode.py.
The patched-model test runs a tiny DeepSeek-V3 whose widths the kernels support (kv_lora_rank 64,
RoPE 16) with the kernels in the Triton interpreter, and compares every decode step's logits with
backend='reference': max |difference| <= 2e-3 x max |logit| (observed ~1e-7 in fp32; the same bound
scripts/check_kernels_gpu.py applies on the GPU).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from snapquant import PRESETS, mla_decode_reference, quantize_kv
from snapquant.attention.backends import register_backend, resolve_backend
from snapquant.errors import ConfigError
from snapquant.kernels import supports, triton_backend
from snapquant.kernels.backend import kernel_mismatch, operands_from_kv
from snapquant.quant.quantizer import QuantizedKV
from snapquant.quant.tensor import QuantizedTensor

DS = PRESETS["ds_v32"].replace(block_size=32)


def _rows(t: torch.Tensor | None, capacity: int, device: str = "cpu") -> torch.Tensor | None:
    """t [B, T, ...] copied into a zero buffer [B, capacity, ...] and sliced back: the store's layout."""
    if t is None:
        return None
    buf = torch.zeros(t.shape[0], capacity, *t.shape[2:], dtype=torch.float32, device=device).to(t.dtype)
    buf.view(torch.uint8 if t.element_size() == 1 else t.dtype)[:, : t.shape[1]] = (
        t.view(torch.uint8) if t.element_size() == 1 else t).to(device)
    return buf[:, : t.shape[1]]


def store_like(kv: QuantizedKV, capacity: int, device: str = "cpu") -> QuantizedKV:
    lat, rope = kv.latent, kv.rope
    lat2 = QuantizedTensor(_rows(lat.data, capacity, device), _rows(lat.scale, capacity, device), lat.fmt,
                           lat.scale_fmt, lat.granularity, lat.width, lat.token_group)
    rope2 = QuantizedTensor(_rows(rope.data, capacity, device), None, rope.fmt, None, rope.granularity, rope.width, 1)
    return QuantizedKV(lat2, rope2, kv.config, kv.rope_prescaled)


def _case(config, B=3, T=90, H=4, S=1, r=64, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(B, T, r, generator=g) * torch.logspace(-1, 1, T)[:, None]
    kv = quantize_kv(latent.bfloat16(), (torch.randn(B, T, d, generator=g) * 4).bfloat16(), config)
    q = (torch.randn(B, S, H, r + d, generator=g) * 2).float()
    return q, kv, torch.tensor([90, 1, 65])[:B]


@pytest.mark.parametrize("name", ["snapmla", "snapmla_kv_only", "ds_v32", "bf16"])
@pytest.mark.parametrize("S", [1, 2])
def test_backend_reads_store_rows_in_place(name, S):
    config = DS if name == "ds_v32" else PRESETS[name]
    q, kv, lengths = _case(config, S=S)
    kv_store = store_like(kv, capacity=128)  # rows of a [B, 128, ...] buffer, as the patch keeps them
    assert kernel_mismatch(kv_store, config) is None
    ops = operands_from_kv(kv_store, lengths, config)
    assert ops.latent.data_ptr() == kv_store.latent.data.data_ptr()  # no copy
    assert ops.block_table[1].tolist()[:2] == [128, 192]  # page ids: flat row of each page's first token
    tau = 1 / math.sqrt(q.shape[-1])
    out, lse = triton_backend(q, kv_store, lengths, tau, config, causal=True, round_16bit=True)
    ref, ref_lse = mla_decode_reference(q, kv, lengths, tau, config)
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), live)
    assert ((out - ref).norm() / ref.norm()) <= 1e-3
    assert (lse[live] - ref_lse[live]).abs().max() <= 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("name", ["snapmla", "bf16"])
@pytest.mark.parametrize("H", [16, 64])
def test_backend_store_rows_through_the_gluon_kernels(name, H):
    """The patch's store rows (one-row page stride) at DeepSeek widths on a Hopper GPU: the default tile
    is a Gluon kernel (snapmla at 16 heads, both layouts at 64) reading them in place via TMA."""
    from snapquant.kernels.decode import plan_decode

    config = PRESETS[name]
    q, kv, lengths = _case(config, T=200, H=H, r=512, d=64)
    kv_store = store_like(kv, capacity=256, device="cuda")
    ops = operands_from_kv(kv_store, lengths.cuda(), config)
    assert ops.latent.data_ptr() == kv_store.latent.data.data_ptr()
    tau = 1 / math.sqrt(192)
    if name == "snapmla" or H > 16:
        assert plan_decode(q.cuda(), ops, tau, config).knobs["tile"] == "gluon"
    out, lse = triton_backend(q.cuda(), kv_store, lengths.cuda(), tau, config, causal=True, round_16bit=True)
    ref, ref_lse = mla_decode_reference(q, kv, lengths, tau, config)
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), live)
    assert ((out.cpu() - ref).norm() / ref.norm()) <= 1e-3
    assert (lse.cpu()[live] - ref_lse[live]).abs().max() <= 1e-3


def test_backend_copies_rows_when_strides_disagree():
    config = PRESETS["snapmla"]
    q, kv, lengths = _case(config)
    mixed = QuantizedKV(store_like(kv, 128).latent, store_like(kv, 192).rope, kv.config, kv.rope_prescaled)
    ops = operands_from_kv(mixed, lengths, config)
    assert ops.latent.data_ptr() != mixed.latent.data.data_ptr()  # made dense
    out, _ = triton_backend(q, mixed, lengths, 0.1, config)
    ref, _ = mla_decode_reference(q, kv, lengths, 0.1, config)
    assert ((out - ref).norm() / ref.norm()) <= 1e-3


def test_backend_falls_back_to_the_reference_where_it_cannot_be_exact():
    config = PRESETS["snapmla"]
    q, kv, lengths = _case(config)
    with pytest.warns(UserWarning, match="round_16bit=False"):
        out, lse = triton_backend(q, kv, lengths, 0.1, config, round_16bit=False)
    ref, ref_lse = mla_decode_reference(q, kv, lengths, 0.1, config, round_16bit=False)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    # An fp32 model's identity cache stores fp32 activations: not a kernel layout.
    _, kv2, _ = _case(PRESETS["bf16"])
    fp32_kv = QuantizedKV(QuantizedTensor(kv2.latent.data.float(), None, kv2.latent.fmt, None, "per_token", 64, 1),
                          kv2.rope, kv2.config, False)
    assert "not bf16" in kernel_mismatch(fp32_kv, PRESETS["bf16"])
    # The tiny test models' RoPE is 8 wide: below the kernels' minimum.
    _, kv3, _ = _case(config, d=8)
    assert "rope_dim=8" in kernel_mismatch(kv3, config)


def _register():
    register_backend("triton", triton_backend, supports=supports, needs_cuda=True)


def test_registration_with_the_seam():
    """The seam names `triton` by "module:attr" strings and loads them on first use (the kernels import nothing
    from it)."""
    register_backend("triton", "snapquant.kernels:triton_backend", supports="snapquant.kernels:supports",
                     needs_cuda=True)
    cuda = torch.device("cuda")  # resolve_backend only looks at the device type
    assert resolve_backend("triton", PRESETS["snapmla"], cuda).fn is triton_backend
    assert resolve_backend("auto", PRESETS["ds_v32"], cuda).fn is triton_backend
    assert resolve_backend("auto", PRESETS["int4_kivi"], cuda).name == "reference"
    assert resolve_backend("auto", PRESETS["snapmla"], torch.device("cpu")).name == "reference"
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        resolve_backend("triton", PRESETS["snapmla"], torch.device("cpu"))


# ---------------------------------------------------------------------------------- patched model
@pytest.fixture
def triton_on_cpu():
    """Let backend='triton' run on CPU (the interpreter) for this test; restore the registration after."""
    register_backend("triton", triton_backend, supports=supports, needs_cuda=False)
    yield
    _register()


def _decode_logits(model, ids, prefix):
    steps = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values -> cache rename in transformers 5.2x
        warnings.filterwarnings("error", message="snapquant triton backend")  # no silent fallback
        out = model(ids[:, :prefix], use_cache=True)
        past = out.past_key_values
        for t in range(prefix, ids.shape[1]):
            out = model(ids[:, t:t + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            steps.append(out.logits[:, -1].float())
    return torch.stack(steps, 1)


@pytest.mark.parametrize("name,dtype", [
    ("snapmla", torch.float32), ("ds_v32", torch.float32),
    # the absorbed BF16 pipeline: with the plain bf16 preset the reference backend decodes through the
    # stock attention instead (bit-exact to the unpatched model), which is not what the kernel computes
    ("bf16_absorbed", torch.bfloat16),
    ("snapmla_quantized_prefill", torch.float32),  # prefill runs absorbed: the backend sees s_q > 1
])
def test_patched_model_triton_matches_reference(triton_on_cpu, name, dtype):
    from snapquant.models.tiny import tiny_model
    from snapquant.patching import patch, unpatch

    config = {"ds_v32": DS, "snapmla_quantized_prefill": PRESETS["snapmla"].replace(prefill="quantized"),
              "bf16_absorbed": PRESETS["bf16"].replace(prefill="quantized")}.get(name, PRESETS.get(name))
    model = tiny_model("deepseek_v3", kv_lora_rank=64, qk_rope_head_dim=16, dtype=dtype)
    ids = torch.randint(3, 256, (2, 26), generator=torch.Generator().manual_seed(0))
    logits = {}
    for backend in ("reference", "triton"):
        patch(model, config, backend=backend)
        try:
            logits[backend] = _decode_logits(model, ids, 20)
        finally:
            unpatch(model)
    diff = (logits["triton"] - logits["reference"]).abs().amax(dim=(0, 2))
    scale = logits["reference"].abs().amax(dim=(0, 2))
    # fp32 models: kernel and reference differ only in fp32 summation order (~1e-6 relative), so 2e-3
    # leaves room for its growth through the layers. A bf16 model rounds every layer output to bf16
    # (8 significant bits): an order-of-summation difference that crosses one rounding boundary is a
    # full bf16 ulp, 2^-8..2^-7 of the value, and reaches the logits as a few ulps of their scale. So
    # bf16 is held to 2^-6 of the scale (2-4 ulps); a real kernel error (wrong scale, mask, head) is O(scale).
    rel = 2.0 ** -6 if dtype == torch.bfloat16 else 2e-3
    assert (diff <= rel * scale).all(), (diff / scale).max()
