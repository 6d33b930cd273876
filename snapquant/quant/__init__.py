"""Quantization formats, scales and quantizers (pure PyTorch, any device)."""

from .dtypes import ELEMENT_FORMATS, ElementFormat, get_element_format, register_element_format
from .layout import bytes_per_token, part_bytes_per_token
from .quantizer import QuantizedKV, calibrate, quantize_kv, quantize_part
from .scales import SCALE_FLOOR, SCALE_FORMATS, ScaleFormat, compute_scale, get_scale_format
from .tensor import QuantizedTensor

__all__ = [
    "ELEMENT_FORMATS", "SCALE_FLOOR", "SCALE_FORMATS", "ElementFormat", "QuantizedKV", "QuantizedTensor",
    "ScaleFormat", "bytes_per_token", "calibrate", "compute_scale", "get_element_format", "get_scale_format",
    "part_bytes_per_token", "quantize_kv", "quantize_part", "register_element_format",
]
