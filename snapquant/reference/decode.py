"""Exact PyTorch reference of absorbed MLA decode over a quantized latent cache.

This is the oracle every kernel is tested against, and what the patched model runs on CPU. It
follows docs/numerics.md step by step, vectorised over batch, query tokens and heads, looping over
blocks of `config.pv_block` (64) tokens exactly as a split-free kernel would:

  scores  logit[h, j] = tau * sigma_h * sum_k s[j, k] * <q^_hk, c^_jk>  (+ RoPE term)
          k runs over the latent's channel blocks (1 for per-token scales, 4 for DeepSeek-V3.2);
          pre-scaled RoPE joins the same accumulator before the s_j rescale: s_j * (<q^, c^> + <q~r, r~>)
  softmax online, log2 domain, per block: m_new = max(m_old, max_j x), e = exp2(x - m_new)
  PV      bf16             f = e * s_j (V's token scale folded into P), P = bf16(f), acc += P @ c^
          fp8_scale_fused  f = e * s_j, pi = max_j f / 448 per row, P^ = e4m3(f / pi),
                           beta = exp2(m_old - m_new) * pi_old / pi_new, acc = beta acc + P^ @ c^,
                           l = beta l + sum_j e / pi_new
          fp8_naive        P^ = e4m3(e) at unit scale (the misaligned pipeline), V's scale applied
                           outside the FP8 rounding: acc += (P^ * s_j) @ c^
  output  O = acc / l,  LSE = (m + log2(l * pi)) * ln 2   (natural-log LSE)

One guard beyond the paper's formula, in fp8_scale_fused only (the Triton kernel does the same):
pi is floored at max(2^-40 * the largest earlier pi (in the current max's units), 2^-100). acc is kept
in units of the current pi, so a block whose peak lies far below an earlier one's (x - m < -90 in
log2 units) would otherwise make beta = pi_old / pi_new overflow fp32. The floor only flushes
probabilities below 2^-40 of the earlier peak, which cannot change the output at fp32 precision.

Scales that vary along channels (per-token-block, per-channel) are handled per channel block k with
their own P (and pi), which is how a kernel must do it: V's scale lies on the reduction axis.
All accumulation is fp32, except where `mma` models Hopper's native FP8 MMA for the fp8 x fp8 products
(`snapquant.reference.mma`): then <q^, c^> and P^ @ c^ are computed as that model says, and nothing else
changes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..config import KVQuantConfig
from ..constants import PI_ABS_FLOOR, PI_REL_FLOOR
from ..errors import ConfigError, ShapeError
from ..quant.dtypes import get_element_format
from ..quant.quantizer import QuantizedKV
from .mma import MMANumerics, as_mma, mma_dot
from .query import quantize_query, round_bf16

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def mla_decode_reference(
    q: torch.Tensor,
    kv: QuantizedKV,
    lengths: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    config: KVQuantConfig | None = None,
    *,
    causal: bool = True,
    round_16bit: bool = True,
    mma: MMANumerics | Mapping[str, Any] | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention of `q` over the quantized cache `kv`.

    Args:
        q: absorbed query `[B, H, r + d]` (one token per request) or `[B, S, H, r + d]`.
        kv: cache entries with latent `[B, T, r]` and rope `[B, T, d]` (see `quantize_kv`).
        lengths: valid tokens per request `[B]` (<= T); the S query tokens are the last S of them.
        softmax_scale: tau; default 1 / sqrt(r + d) (models pass their own, e.g. with yarn mscale).
        config: decode knobs (query, pv, pv_block); defaults to `kv.config`.
        causal: with S > 1, query i sees cache positions < length - S + 1 + i.
        round_16bit: round 'bf16' query and P to bf16 as a 16-bit kernel does; False keeps them in
            fp32 (the unquantized baseline of an fp32 model).
        mma: the arithmetic of the fp8 x fp8 products (`MMANumerics`, a mapping of its fields or a mode
            name): None / "exact" is the default kernels' (exact products, fp32 accumulation);
            "hopper_fp8" models the opt-in native FP8 MMA kernels (`fp8_mma=True`), see
            `snapquant.reference.mma`. It needs e4m3 operands: an fp8 query and latent for QK, pv
            'fp8_scale_fused' for PV (a ConfigError otherwise).

    Returns:
        (out `[B, (S,) H, r]` fp32 in the latent space, lse `[B, (S,) H]` fp32, natural log).
        Requests (or query rows) with no visible token give out = 0 and lse = -inf.
    """
    cfg = config or kv.config
    single = q.dim() == 3
    if single:
        q = q.unsqueeze(1)
    B, S, H, r, d, T = check_decode_inputs(q, kv)
    lengths = checked_lengths(lengths, B, T, q.device)
    tau = 1.0 / math.sqrt(r + d) if softmax_scale is None else float(softmax_scale)
    numerics = as_mma(mma)
    check_mma_operands(numerics, cfg, kv)

    q_nope, q_rope, sigma = quantize_query(q, cfg, r, round_16bit)  # [B,S,H,r], [B,S,H,d], [B,S,H]
    codes = kv.latent.codes_f32()  # [B, T, r]
    s_tok = kv.latent.token_scales()  # [B, T, nb]
    nb = s_tok.shape[-1]
    bw = r // nb
    rope = kv.rope.codes_f32() if kv.rope_prescaled else kv.rope.dequantize(torch.float32)
    q_nope_blocks = q_nope.reshape(B, S, H, nb, bw)
    coef = (tau * LOG2E) * sigma  # [B, S, H]: logits go straight to the log2 domain

    # Visible cache positions per (request, query row): j < length - (S - 1 - i) when causal.
    limit = lengths.view(B, 1) - ((S - 1 - torch.arange(S, device=q.device)) if causal else 0)  # [B, S]

    p_fmt = get_element_format("fp8_e4m3")
    m = torch.full((B, S, H), -math.inf, device=q.device)
    acc = torch.zeros(B, S, H, nb, bw, device=q.device)
    l_sum = torch.zeros(B, S, H, nb, device=q.device)
    pi = torch.ones(B, S, H, nb, device=q.device)
    pi_max = torch.zeros(B, S, H, nb, device=q.device)  # largest pi so far, in the current max's units
    qmax_p = torch.tensor(p_fmt.qmax, device=q.device)  # tensor divisor: correctly rounded on CUDA too

    for start in range(0, T, cfg.pv_block):
        end = min(start + cfg.pv_block, T)
        c_blk = codes[:, start:end].reshape(B, end - start, nb, bw)
        s_blk = s_tok[:, start:end]  # [B, n, nb]
        if numerics.native_qk:  # each block's dot product as the native FP8 MMA sums it
            prods = q_nope_blocks.double()[:, :, :, None] * c_blk.double()[:, None, None]  # [B, S, H, n, nb, bw]
            partial = mma_dot(prods.new_zeros(prods.shape[:-1]), prods, numerics, numerics.qk_promote)
        else:
            partial = torch.einsum("bshkw,bnkw->bshnk", q_nope_blocks, c_blk)  # [B, S, H, n, nb]
        rope_dot = torch.einsum("bshd,bnd->bshn", q_rope, rope[:, start:end])
        if kv.rope_prescaled:  # one scaled domain: s_j * (<q^, c^> + <q~r, r~>)
            raw = s_blk[:, None, None, :, 0] * (partial[..., 0] + rope_dot)
        else:
            raw = (partial * s_blk[:, None, None]).sum(-1) + rope_dot
        x = raw * coef[..., None]  # [B, S, H, n], log2 domain
        pos = torch.arange(start, end, device=q.device)
        visible = pos.view(1, 1, -1) < limit[..., None]  # [B, S, n]
        x = x.masked_fill(~visible[:, :, None, :], -math.inf)

        m_new = torch.maximum(m, x.amax(dim=-1))
        m_ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # all-masked rows stay 0
        e = torch.exp2(x - m_ref[..., None])  # [B, S, H, n]
        alpha = torch.exp2(m - m_ref)  # exp2(-inf) = 0 on the first visible block

        if cfg.pv == "fp8_scale_fused":
            f = e[..., None] * s_blk[:, None, None]  # [B, S, H, n, nb]: V's token scale folded into P
            f_max = f.amax(dim=-2)
            pi_floor = torch.clamp_min(pi_max * alpha[..., None] * PI_REL_FLOOR, PI_ABS_FLOOR)
            pi_new = torch.where(f_max > 0, torch.maximum(f_max / qmax_p, pi_floor), pi)
            pi_max = torch.maximum(pi_max * alpha[..., None], pi_new)
            p_hat = p_fmt.round_trip(f / pi_new[..., None, :])
            beta = alpha[..., None] * pi / pi_new
            if numerics.native_pv:  # the rescaled accumulator is the MMA's C operand; K = the block's tokens
                prods = p_hat.double().permute(0, 1, 2, 4, 3)[..., None, :] * c_blk.double().permute(0, 2, 3, 1)[
                    :, None, None]  # [B, S, H, nb, bw, n]
                acc = mma_dot(beta[..., None] * acc, prods, numerics, numerics.pv_promote)
            else:
                acc = beta[..., None] * acc + torch.einsum("bshnk,bnkw->bshkw", p_hat, c_blk)
            l_sum = beta * l_sum + e.sum(dim=-1, keepdim=True) / pi_new
            pi = pi_new
        else:
            if cfg.pv == "fp8_naive":
                p = p_fmt.round_trip(e)[..., None] * s_blk[:, None, None]
            else:
                f = e[..., None] * s_blk[:, None, None]
                p = round_bf16(f) if round_16bit else f
            acc = alpha[..., None, None] * acc + torch.einsum("bshnk,bnkw->bshkw", p, c_blk)
            l_sum = alpha[..., None] * l_sum + e.sum(dim=-1, keepdim=True)
        m = m_new

    empty = l_sum[..., :1] == 0
    out = (acc / torch.where(empty, torch.ones_like(l_sum), l_sum)[..., None]).reshape(B, S, H, r)
    out = out.masked_fill(empty, 0.0)
    lse = (m + torch.log2(l_sum[..., 0] * pi[..., 0])) * LN2
    lse = lse.masked_fill(empty[..., 0], -math.inf)
    if single:
        return out[:, 0], lse[:, 0]
    return out, lse


def check_mma_operands(numerics: MMANumerics, cfg: KVQuantConfig, kv: QuantizedKV) -> None:
    """A native FP8 MMA multiplies e4m3 codes: QK needs an fp8 query and latent, PV e4m3 P (fp8_scale_fused;
    fp8_naive's P carries V's scale and is no e4m3 value). ConfigError naming what does not fit."""
    if numerics.mode == "exact":
        return
    if numerics.products in ("qk", "both") and not (cfg.query == "fp8_e4m3" and kv.config.nope_dtype == "fp8_e4m3"):
        raise ConfigError(f"mma={numerics.mode!r} with products={numerics.products!r} models e4m3 x e4m3 QK: it "
                          f"needs query 'fp8_e4m3' and nope_dtype 'fp8_e4m3', got query={cfg.query!r}, "
                          f"nope_dtype={kv.config.nope_dtype!r}")
    if numerics.products in ("pv", "both") and cfg.pv != "fp8_scale_fused":
        raise ConfigError(f"mma={numerics.mode!r} with products={numerics.products!r} models e4m3 x e4m3 PV: it "
                          f"needs pv 'fp8_scale_fused', got pv={cfg.pv!r}")


def check_decode_inputs(q: torch.Tensor, kv: QuantizedKV) -> tuple[int, int, int, int, int, int]:
    """(B, S, H, r, d, T) of a [B, S, H, r + d] query over a QuantizedKV; ShapeError naming what does not fit."""
    if not isinstance(kv, QuantizedKV):
        raise ShapeError(f"kv must be a QuantizedKV (from snapquant.quantize_kv), got {type(kv).__name__}")
    if q.dim() != 4:
        raise ShapeError(f"q must be [B, H, r + d] or [B, S, H, r + d], got shape {tuple(q.shape)}")
    B, S, H, D = q.shape
    r, d = kv.latent.width, kv.rope.width
    if D != r + d:
        raise ShapeError(f"q's last dim is {D} but the cache has kv_lora_rank {r} + rope {d} = {r + d}")
    if kv.latent.data.dim() != 3 or kv.latent.data.shape[0] != B:
        raise ShapeError(
            f"cache latent must be [B={B}, T, r] to match q, got {tuple(kv.latent.data.shape)}"
        )
    if kv.latent.data.device != q.device:
        raise ShapeError(f"q is on {q.device} but the cache is on {kv.latent.data.device}")
    return B, S, H, r, d, kv.num_tokens


def checked_lengths(lengths: torch.Tensor | None, B: int, T: int, device: torch.device | str) -> torch.Tensor:
    """Per-request valid lengths [B] (default: all T tokens), each checked to lie in [0, T]."""
    if lengths is None:
        return torch.full((B,), T, dtype=torch.long, device=device)
    lengths = torch.as_tensor(lengths, device=device).long()
    if lengths.shape != (B,):
        raise ShapeError(f"lengths must have shape [B={B}], got {tuple(lengths.shape)}")
    if bool((lengths < 0).any()) or bool((lengths > T).any()):
        raise ShapeError(f"lengths must lie in [0, {T}] (the cache holds {T} tokens), got {lengths.tolist()}")
    return lengths
