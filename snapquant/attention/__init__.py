"""Absorbed MLA attention over the quantized latent cache, its storage, and the decode-backend seam."""

from .absorbed import absorbed_attention, gather_kv, merge_lse
from .backends import BACKEND_CHOICES, Backend, register_backend, resolve_backend
from .storage import DenseLatentStore, Segment, native_format

__all__ = [
    "BACKEND_CHOICES", "Backend", "DenseLatentStore", "Segment", "absorbed_attention", "gather_kv", "merge_lse",
    "native_format", "register_backend", "resolve_backend",
]
