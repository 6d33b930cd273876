"""Query quantization for absorbed MLA decode (docs/numerics.md, "Query, per (token, head)").

    fp8_e4m3:  sigma = amax(|q_c|) / 448,  q^ = e4m3(q_c / sigma),  q~r = bf16(q_r / sigma)
    bf16:      sigma = 1,                  q^ = bf16(q_c),          q~r = bf16(q_r)

so that logits = tau * sigma * (<q^, K_nope> + <q~r, K_rope>) in one fp32 accumulator.
"""

from __future__ import annotations

import torch

from ..config import KVQuantConfig
from ..quant.dtypes import SIXTEEN_BIT_MAX, get_element_format
from ..quant.scales import compute_scale


def quantize_query(
    q: torch.Tensor, config: KVQuantConfig, kv_lora_rank: int, round_16bit: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Absorbed query `[..., H, r + d]` -> (q_nope values, q_rope values, sigma `[..., H]`), all fp32.

    The returned values are exactly what a kernel holds in registers (fp8 / bf16 numbers widened to
    fp32). With `round_16bit=False` a 'bf16' query stays in fp32 (the unquantized fp32 baseline).
    """
    q32 = q.to(torch.float32)
    qc, qr = q32[..., :kv_lora_rank], q32[..., kv_lora_rank:]
    if config.query == "fp8_e4m3":
        e4m3 = get_element_format("fp8_e4m3")
        sigma = compute_scale(qc.abs().amax(dim=-1, keepdim=True), e4m3.qmax)
        q_nope = e4m3.round_trip(qc / sigma)
        limit = SIXTEEN_BIT_MAX[torch.bfloat16]
        q_rope = (qr / sigma).clamp(-limit, limit).to(torch.bfloat16).to(torch.float32)
        return q_nope, q_rope, sigma.squeeze(-1)
    sigma = torch.ones(qc.shape[:-1], dtype=torch.float32, device=q.device)
    if round_16bit:
        return round_bf16(qc), round_bf16(qr), sigma
    return qc, qr, sigma


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)
