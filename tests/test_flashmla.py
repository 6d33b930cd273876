"""FlashMLA as a decode backend and layout, against the exact reference, with a pure-PyTorch fake `flash_mla`
(tests/support/fake_flash_mla.py) that computes attention from the pages it is handed: a wrong page layout,
block table, length or scale on snapquant's side gives a wrong output here.

Tolerance (relative L2 of the output): the reference rounds P to bf16 (relative error <= u = 2^-8 per
element) and the fake rounds the output to bf16 (<= u per element, so <= u in relative L2); P's rounding
errors are independent across tokens, so their effect on the output is ~u / sqrt(3) in relative L2 on
random data. Together ~ u + u / sqrt(3) = 6e-3; TOL = 1e-2. A layout error gives O(1) (checked below)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from snapquant import runtime
from snapquant.attention import flashmla
from snapquant.attention.backends import register_backend, resolve_backend, unregister_backend
from snapquant.errors import ConfigError
from snapquant.presets import PRESETS
from snapquant.quant.quantizer import QuantizedKV
from snapquant.quant.tensor import QuantizedTensor
from snapquant.reference import mla_decode_reference
from tests.support import fake_flash_mla

R, D = flashmla.DIMS
TOL = 1e-2
BF16 = PRESETS["bf16"]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def bf16_kv(latent: torch.Tensor, rope: torch.Tensor) -> QuantizedKV:
    fmt = BF16.nope_format
    return QuantizedKV(QuantizedTensor(latent, None, fmt, None, "per_token", latent.shape[-1], 1),
                       QuantizedTensor(rope, None, fmt, None, "per_token", rope.shape[-1], 1), BF16)


def rows(B: int, T: int, joint: bool, pitch: int = 192, seed: int = 0):
    """latent [B, T, R], rope [B, T, D] in bf16: two column slices of one [B, pitch, R + D] buffer, or apart."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.empty(B, pitch, 1).uniform_(math.log(0.1), math.log(3.2), generator=g))
    buf = torch.cat([torch.randn(B, pitch, R, generator=g) * mag, torch.randn(B, pitch, D, generator=g) * 4], -1)
    buf = buf.to(torch.bfloat16)
    if joint:
        return buf[:, :T, :R], buf[:, :T, R:]
    return buf[:, :T, :R].contiguous(), buf[:, :T, R:].contiguous()


@pytest.fixture
def fake(monkeypatch):
    return fake_flash_mla.install(monkeypatch)


def test_not_installed_is_one_clear_line(monkeypatch):
    fake_flash_mla.uninstall(monkeypatch)
    assert flashmla.load() is None and not flashmla.available() and not flashmla.supports(BF16)
    with pytest.raises(ConfigError, match="FlashMLA not installed"):
        flashmla.require()
    with pytest.raises(ConfigError, match=r"backend='flashmla'.*FlashMLA not installed") as e:
        resolve_backend("flashmla", BF16, torch.device("cuda"))
    assert "\n" not in str(e.value)


def test_supports_only_the_bf16_arithmetic(fake):
    assert flashmla.supports(BF16)
    reason = flashmla.unsupported_reason(PRESETS["snapmla"])
    assert reason is not None and "bf16" in reason
    with pytest.raises(ConfigError, match="does not implement"):
        resolve_backend("flashmla", PRESETS["snapmla"], torch.device("cuda"))
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        resolve_backend("flashmla", BF16, torch.device("cpu"))


@pytest.mark.parametrize("joint", [True, False], ids=["joint", "split"])
def test_backend_matches_the_reference(fake, joint):
    B, H, T = 3, 4, 130
    latent, rope = rows(B, T, joint)
    kv = bf16_kv(latent, rope)
    q = torch.randn(B, H, R + D, generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([5, 130, 64])
    tau = 1 / math.sqrt(192)
    assert (flashmla.joint_pitch(latent, rope) is not None) == joint
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime.WARNED.clear()
        out, lse = flashmla.flashmla_backend(q, kv, lengths, tau, BF16)
    assert any("joint_rows=True" in str(w.message) for w in caught) == (not joint)  # a copy is announced
    ref_out, ref_lse = mla_decode_reference(q, kv, lengths, tau, BF16)
    assert out.dtype == torch.float32 and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert rel_l2(out, ref_out) < TOL
    assert torch.allclose(lse, ref_lse, atol=1e-3, rtol=0)
    assert fake.RECORDER.calls == 1


def test_backend_causal_multi_token_and_empty_requests(fake):
    B, S, H, T = 2, 3, 2, 100
    latent, rope = rows(B, T, joint=True)
    kv = bf16_kv(latent, rope)
    q = torch.randn(B, S, H, R + D, generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([100, 0])
    out, lse = flashmla.flashmla_backend(q, kv, lengths, 0.1, BF16, causal=True)
    ref_out, ref_lse = mla_decode_reference(q, kv, lengths, 0.1, BF16, causal=True)
    assert rel_l2(out[0], ref_out[0]) < TOL
    assert torch.allclose(lse[0], ref_lse[0], atol=1e-3, rtol=0)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # no token: out 0, lse -inf (the seam's convention)
    assert torch.isneginf(lse[1]).all() and torch.isneginf(ref_lse[1]).all()


def test_a_wrong_block_table_is_caught(fake, monkeypatch):
    """The check can fail: pages handed over in the wrong order give an O(1) error."""
    latent, rope = rows(2, 130, joint=True)
    kv = bf16_kv(latent, rope)
    q = torch.randn(2, 4, R + D, generator=torch.Generator().manual_seed(3))
    real = flashmla.pages_from_rows

    def flipped(lat, rp):
        k, bt, copied = real(lat, rp)
        return k, bt.flip(0), copied

    monkeypatch.setattr(flashmla, "pages_from_rows", flipped)
    out, _ = flashmla.flashmla_backend(q, kv, None, 0.1, BF16)
    ref, _ = mla_decode_reference(q, kv, None, 0.1, BF16)
    assert rel_l2(out, ref) > 0.3


def test_fallbacks_and_shape_errors(fake):
    latent, rope = rows(1, 64, joint=True)
    q = torch.randn(1, 2, R + D)
    kv32 = bf16_kv(latent.float(), rope.float())
    with pytest.warns(UserWarning, match="reference"):
        out, _ = flashmla.flashmla_backend(q, kv32, None, 0.1, BF16, round_16bit=False)
    assert out.shape == (1, 2, R) and fake.RECORDER.calls == 0
    small = bf16_kv(latent[..., :64], rope)
    with pytest.raises(Exception, match="kv_lora_rank=512"):
        flashmla.flashmla_backend(torch.randn(1, 2, 64 + D), small, None, 0.1, BF16)


def test_pages_from_paged_keeps_page_ids():
    lat = torch.randn(3, 64, 8).to(torch.bfloat16)
    rp = torch.randn(3, 64, 4).to(torch.bfloat16)
    k = flashmla.pages_from_paged(lat, rp)
    assert k.shape == (3, 64, 1, 12) and k.stride(-1) == 1
    assert torch.equal(k[2, 5, 0, :8], lat[2, 5]) and torch.equal(k[1, 63, 0, 8:], rp[1, 63])


def test_anchor_decode_fills_the_metadata_once(fake):
    lat = torch.randn(2, 64, R).to(torch.bfloat16)
    rp = torch.randn(2, 64, D).to(torch.bfloat16)
    k = flashmla.pages_from_paged(lat, rp)
    q = torch.randn(1, 1, 2, R + D).to(torch.bfloat16)
    call = flashmla.AnchorDecode(fake, q, k, torch.tensor([[1, 0]]), torch.tensor([100]), 0.1, R)
    assert not call.meta.have_initialized
    call.prime()
    assert call.meta.have_initialized and call.meta.calls == 1
    out, lse = call()
    assert call.meta.calls == 2 and out.shape == (1, 1, 2, R) and lse.shape == (1, 2, 1)


# ---------------------------------------------------------------------------------------------- the store
def test_joint_rows_store_keeps_one_buffer_through_growth_and_reorder():
    from snapquant.attention.storage import DenseLatentStore

    for capacity in (None, 300):
        store = DenseLatentStore(BF16, 16, 8, torch.bfloat16, capacity=capacity, joint_rows=True)
        split = DenseLatentStore(BF16, 16, 8, torch.bfloat16, capacity=capacity)
        g = torch.Generator().manual_seed(0)
        for n in (3, 70, 100):  # growth past 64 and 128 rows when not preallocated
            lat, rp = torch.randn(2, n, 16, generator=g).bfloat16(), torch.randn(2, n, 8, generator=g).bfloat16()
            store.append(lat, rp)
            split.append(lat, rp)
        store.index_select(torch.tensor([1, 0]))
        split.index_select(torch.tensor([1, 0]))
        kv = store.segments()[0].kv
        assert flashmla.joint_pitch(kv.latent.data, kv.rope.data) is not None
        assert flashmla.joint_pitch(split.segments()[0].kv.latent.data, split.segments()[0].kv.rope.data) is None
        for a, b in zip(store.dequantize(), split.dequantize(), strict=True):
            assert torch.equal(a, b)
        assert store.nbytes() == split.nbytes()


def test_joint_rows_refuses_quantized_configs():
    from snapquant.cache import LatentCache

    with pytest.raises(ConfigError, match="joint_rows=True needs a cache with nothing quantized"):
        LatentCache("snapmla", joint_rows=True)


# ---------------------------------------------------------------------------------------------- a patched model
@pytest.fixture
def cpu_flashmla(fake):
    """The registry's flashmla entry, allowed on CPU (the fake runs there), and the reference's absorbed
    pipeline under another name (the reference backend runs the stock attention for identity configs)."""
    register_backend("absorbed_reference", mla_decode_reference, needs_cuda=False)
    with fake_flash_mla.on_cpu():
        yield fake
    unregister_backend("absorbed_reference")


def test_patched_bf16_model_decodes_through_flashmla_in_place(cpu_flashmla):
    import snapquant
    from snapquant.cache import LatentCache
    from snapquant.models.stepping import cache_kwarg, decode_step
    from snapquant.models.tiny import tiny_model

    model = tiny_model("deepseek_v2", dtype=torch.bfloat16, kv_lora_rank=R, qk_rope_head_dim=D)
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = {}
    for backend in ("flashmla", "absorbed_reference"):
        snapquant.patch(model, "bf16", backend=backend)
        cache = LatentCache("bf16", model, joint_rows=True)
        runtime.WARNED.clear()
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prefill_logits = model(ids[:, :8], use_cache=True, **{cache_kwarg(model): cache}).logits
            logits[backend] = decode_step(model, ids[:, 8:], 8, cache).logits.float()
        assert not any("joint_rows" in str(w.message) for w in caught)  # the joint cache is read in place
        assert torch.isfinite(prefill_logits).all()
        snapquant.unpatch(model)
    assert cpu_flashmla.RECORDER.calls == 2  # one decode step per MLA layer
    a, b = logits["flashmla"], logits["absorbed_reference"]
    # the attention output differs by ~TOL (above), the logits by its bf16 propagation through 2 layers
    assert float((a - b).norm() / b.norm()) < 2e-2
