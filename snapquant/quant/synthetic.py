"""Synthetic MLA cache contents with the statistics the paper reports, for format reports and tests.

- NoPE latent: post-RMSNorm activations are centred on 0 with channel scales set by the norm's
  learned weight, so we draw Gaussian tokens with log-normal per-channel standard deviations.
- RoPE key: the rotated shared key. Each of the d/2 frequency pairs has an amplitude; a few
  low-frequency pairs carry large amplitudes (outlier channels, range up to ~100 as in SnapMLA's
  analysis), and rotation by the token position spreads them over both channels of the pair.
- Queries: absorbed queries `[B, H, r + d]` aimed at a few random cache tokens plus noise, so that
  attention is peaked on some heads and diffuse on others, as in trained models.
Everything is drawn from a `torch.Generator` seeded by the caller: same seed, same tensors.
"""

from __future__ import annotations

import math

import torch


def synthetic_latent_rope(
    num_tokens: int,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    batch: int = 1,
    seed: int = 0,
    rope_outlier_pairs: int = 4,
    rope_outlier_amplitude: float = 100.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (latent [batch, T, r], rope [batch, T, d]) in fp32."""
    g = torch.Generator().manual_seed(seed)
    channel_std = torch.exp(0.5 * torch.randn(kv_lora_rank, generator=g))
    latent = torch.randn(batch, num_tokens, kv_lora_rank, generator=g) * channel_std

    half = rope_dim // 2
    amp = 1.0 + 2.0 * torch.rand(half, generator=g)
    n_out = min(rope_outlier_pairs, half)
    amp[half - n_out:] = rope_outlier_amplitude * (0.5 + 0.5 * torch.rand(n_out, generator=g))
    phase0 = 2 * math.pi * torch.rand(batch, num_tokens, half, generator=g)
    inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    pos = torch.arange(num_tokens, dtype=torch.float32)
    angle = pos[None, :, None] * inv_freq + 0.3 * phase0  # content phase jitter per token
    jitter = 1.0 + 0.1 * torch.randn(batch, num_tokens, half, generator=g)
    a = amp * jitter
    rope = torch.cat([a * torch.cos(angle), a * torch.sin(angle)], dim=-1)  # de-interleaved layout
    return latent, rope


def synthetic_queries(
    latent: torch.Tensor, rope: torch.Tensor, num_heads: int = 16, seed: int = 1, focus: int = 4
) -> torch.Tensor:
    """Absorbed queries `[B, H, r + d]`; head h aims at `focus` random tokens with a head-specific sharpness."""
    g = torch.Generator().manual_seed(seed)
    B, T, r = latent.shape
    d = rope.shape[-1]
    keys = torch.cat([latent, rope], dim=-1)  # [B, T, r + d]
    idx = torch.randint(0, T, (B, num_heads, focus), generator=g)
    target = torch.stack([keys[b, idx[b]].mean(dim=1) for b in range(B)])  # [B, H, r + d]
    target = target / target.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    noise = torch.randn(B, num_heads, r + d, generator=g) / math.sqrt(r + d)
    q = target + 0.5 * noise
    # Rescale each head so its largest logit (tau = 1/sqrt(r + d)) is max_logit[h]: from diffuse
    # heads (3) to peaked ones (30), the range seen in trained MLA models.
    max_logit = torch.logspace(math.log10(3.0), math.log10(30.0), num_heads)[None, :]
    top = torch.einsum("bhd,btd->bht", q, keys).amax(dim=-1) / math.sqrt(r + d)
    return q * (max_logit / top.clamp_min(1e-6))[..., None]
