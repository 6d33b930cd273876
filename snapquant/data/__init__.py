"""Training data for the embedded model: source corpus, tokenizer, synthetic long-context documents.

Pure Python + numpy + tokenizers (no transformers, no lm-eval), so the same code runs in the
trainer's data workers on the GPU machine and in the lm-eval tasks here.
"""

from .corpus import PINNED_PACKAGES, load_heldout
from .synthetic import (
    kv_retrieval_example,
    kv_training_document,
    passkey_example,
    passkey_training_document,
)

__all__ = [
    "PINNED_PACKAGES", "kv_retrieval_example", "kv_training_document", "load_heldout",
    "passkey_example", "passkey_training_document",
]
