"""Exact PyTorch references: absorbed MLA decode over a quantized cache, float64 oracles, absorption."""

from .absorb import absorb_query, project_output, split_kv_b
from .decode import mla_decode_reference
from .oracle import attention_fp64, mla_decode_oracle
from .query import quantize_query

__all__ = [
    "absorb_query", "attention_fp64", "mla_decode_oracle", "mla_decode_reference", "project_output",
    "quantize_query", "split_kv_b",
]
