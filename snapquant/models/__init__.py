"""Model families whose attention is MLA, and how snapquant hooks into each (see `registry`)."""

from .registry import ADAPTERS, REFUSED, MLAAdapter, find_mla_modules, mla_attention_classes

__all__ = ["ADAPTERS", "REFUSED", "MLAAdapter", "find_mla_modules", "mla_attention_classes"]
