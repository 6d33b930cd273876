"""Absorbed MLA attention over the quantized latent cache, its storage, and the decode-backend seam."""

from .absorbed import absorbed_attention, gather_kv, merge_lse
from .backends import (
    BACKEND_CHOICES,
    Backend,
    backend_choices,
    check_kernel_options,
    register_backend,
    resolve_backend,
)
from .storage import DenseLatentStore, LatentStore, Segment, native_format

__all__ = [
    "BACKEND_CHOICES", "Backend", "DenseLatentStore", "LatentStore", "Segment", "absorbed_attention",
    "backend_choices", "check_kernel_options", "gather_kv", "merge_lse", "native_format", "register_backend",
    "resolve_backend",
]
