"""Which storage policy each format gets (snapquant.attention.store_policies), and the store's interface.

The stored bits of every policy are tested against `quantize_kv` and the documented freezing / grouping
rules in test_cache_store.py and test_cache_layer.py; here: the mapping from a config to its policies,
which is what the store's behaviour per format hangs on.
"""

from __future__ import annotations

import pytest
import torch

from snapquant import PRESETS
from snapquant.attention.storage import DenseLatentStore, LatentStore
from snapquant.attention.store_policies import FrozenScales, GroupScales, KiviWindow, PassThrough, RowScales

R, D = 64, 16


@pytest.mark.parametrize("preset,nope,rope,window", [
    ("bf16", PassThrough, PassThrough, False),           # identity: the model's own values
    ("snapmla", RowScales, PassThrough, False),          # fp8 latent, one scale per token; bf16 pre-scaled RoPE
    ("rope_fp8_per_token", RowScales, RowScales, False),
    ("ds_v32", RowScales, PassThrough, False),           # per_token_block: a row of block scales per token
    ("per_tensor_fp8", FrozenScales, FrozenScales, False),
    ("int4_kivi", GroupScales, GroupScales, True),       # per_channel over groups of 32 tokens + the raw window
])
def test_each_format_gets_its_documented_policies(preset, nope, rope, window):
    cfg = PRESETS[preset].replace(block_size=32) if preset == "ds_v32" else PRESETS[preset]
    store = DenseLatentStore(cfg, R, D, torch.float32)
    assert isinstance(store, LatentStore)
    assert type(store.parts["nope"]) is nope and type(store.parts["rope"]) is rope
    assert isinstance(store.window, KiviWindow) == window
    assert store.group == (cfg.token_group if window else None)


def test_per_channel_without_groups_freezes_its_scale_at_the_first_append():
    cfg = PRESETS["int4_kivi"].replace(token_group=None)
    store = DenseLatentStore(cfg, R, D, torch.float32)
    assert type(store.parts["nope"]) is FrozenScales and store.window is None
    g = torch.Generator().manual_seed(0)
    store.append(torch.randn(2, 5, R, generator=g), torch.randn(2, 5, D, generator=g))
    frozen = store.parts["nope"].scale.clone()
    store.append(10 * torch.randn(2, 1, R, generator=g), torch.randn(2, 1, D, generator=g))
    assert torch.equal(store.parts["nope"].scale, frozen)  # a larger token saturates; the scale stays
