"""The benchmark's variants against the kernels they time: every knob a variant passes is a valid decode
option, and every kernel variant plans at the shapes it runs (over meta tensors for an H200: nothing
compiles or runs)."""

from __future__ import annotations

import pytest
import torch

from snapquant.bench.shapes import BENCH_SHAPES
from snapquant.bench.variants import VARIANTS
from snapquant.kernels import KERNELS, DecodeOptions, PagedMLACache
from snapquant.kernels.decode import plan_decode
from snapquant.kernels.gluon import HAVE_GLUON
from snapquant.kernels.operands import KernelOperands


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.impl == "kernel"], ids=lambda v: v.name)
def test_every_benchmark_variant_plans_on_hopper_at_its_shapes(variant):
    """The benchmark's knobs are valid options, and on an H200 (arch 90, 132 SMs) every kernel variant builds
    its plan at the shapes it runs (a knob the default kernel cannot honour would fail the benchmark there)."""
    if not HAVE_GLUON and variant.knob_dict.get("tile") == "gluon":
        pytest.skip("this triton has no Gluon")
    DecodeOptions.from_dict({k: v for k, v in variant.knobs if k != "parts_per_sm"})
    cfg = variant.config()
    for shape in BENCH_SHAPES:
        if not variant.applies(shape):
            continue
        cache = PagedMLACache.empty(shape.batch, shape.max_len, 512, 64, cfg, device="meta")
        q = torch.empty(shape.batch, shape.q_tokens, shape.heads, 576, dtype=torch.bfloat16, device="meta")
        ops = KernelOperands.from_paged(cache)
        plan = plan_decode(q, ops, 0.1, cfg, native=True, num_sms=132, arch=90, **variant.kernel_kwargs(shape, 132))
        assert plan.launches and plan.knobs["kernel"] in KERNELS
