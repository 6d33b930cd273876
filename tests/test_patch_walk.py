"""Walk every attention class of the installed transformers that has `kv_a_proj_with_mqa`.

Each must be either supported and exact (preset bf16 reproduces the unpatched model on a tiny random
instance of its family) or refused with a ConfigError that names the class. A family that appears in a
newer transformers without a tiny config here fails the test on purpose: add it to
snapquant/models/tiny.py and decide (adapter or refusal) in snapquant/models/registry.py.
"""

from __future__ import annotations

import pytest
import torch

import snapquant
from snapquant.errors import ConfigError
from snapquant.models.registry import ADAPTERS, REFUSED, mla_attention_classes
from snapquant.models.tiny import FAMILIES, available_families, tiny_model
from tests.support.patching import batch_inputs, greedy, rel_diff

CLASSES = mla_attention_classes()


pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_walk_finds_the_known_families():
    for family in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "longcat_flash", "glm4_moe_lite", "minicpm3",
                   "mistral4", "youtu", "kimi_linear"):
        if family not in available_families():  # kimi_linear arrived in transformers 5.17
            continue
        assert family in CLASSES, f"{family} not found among MLA attention classes"


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_every_mla_class_is_supported_and_exact_or_refused_by_name(family):
    names = [c.__name__ for c in CLASSES[family]]
    assert family in ADAPTERS, f"{family} ({names}) has no adapter or refusal in snapquant.models.registry"
    assert family in FAMILIES, f"{family} ({names}) has no tiny config in snapquant.models.tiny"
    model = tiny_model(family)
    mla = [m for m in model.modules() if type(m) in CLASSES[family]]
    assert mla, f"the tiny {family} model has none of {names}"
    if family in REFUSED:
        with pytest.raises(ConfigError, match="|".join(names)):
            snapquant.patch(model, "bf16")
        return
    ids, am = batch_inputs()
    p0, s0, t0, _ = greedy(model, ids, am, 4)
    with snapquant.patched(model, "bf16"):
        p1, s1, t1, _ = greedy(model, ids, am, 4)
    valid = am.bool()
    assert rel_diff(p0[valid], p1[valid]) <= 1e-4 and rel_diff(s0, s1, s0) <= 1e-4 and torch.equal(t0, t1)
    assert all("_snapquant_hook" not in m.__dict__ for m in mla)
