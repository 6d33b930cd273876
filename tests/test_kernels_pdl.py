"""The split combine as a programmatic dependent launch (`DecodeOptions.pdl`, opt-in).

With pdl=True on Hopper the combine is launched with CUDA's programmatic stream serialization: it may launch as
stage 1's programs exit, and it waits for stage 1's grid and its writes on the GPU (`griddepcontrol.wait`)
before reading the partials. These tests check the wiring on CPU: which launches carry the attribute, what the
compiled PTX holds, and the refusals. That the outputs keep their bits is checked on a GPU (`-m gpu` below, and
the benchmark's `+pdl` rows at tolerance 0)."""

from __future__ import annotations

import pytest
import torch

from snapquant import PRESETS
from snapquant.errors import ConfigError
from snapquant.kernels import PagedMLACache, mla_decode, mla_decode_plan
from snapquant.kernels.compile_stats import compile_launch
from snapquant.kernels.gluon import HAVE_GLUON
from snapquant.kernels.options import DecodeOptions
from tests.support.kernel_cases import meta_plan

WIDE = dict(B=4, H=64, L=8192)  # 64 query rows: several splits per request, so a combine launch


def _combine(plan):
    (ln,) = [ln for ln in plan.launches if ln.name.startswith("combine")]
    return ln


@pytest.mark.parametrize("schedule", ["uniform", "balanced"])
def test_hopper_plans_launch_the_combine_as_a_programmatic_dependent(schedule):
    knobs = {"tile": "rows"} if schedule == "balanced" else {}
    plan = meta_plan("snapmla", **WIDE, schedule=schedule, pdl=True, **knobs)
    assert plan.knobs["pdl"] is True
    comb = _combine(plan)
    assert comb.kwargs["launch_pdl"] is True and comb.kwargs["PDL"] is True
    # only the combine waits on its predecessor: stage 1 (and the balanced metadata) launch as usual
    assert all("launch_pdl" not in ln.kwargs for ln in plan.launches if ln is not comb)

    off = meta_plan("snapmla", **WIDE, schedule=schedule, **knobs)  # the default
    assert off.knobs["pdl"] is False
    assert "launch_pdl" not in _combine(off).kwargs and "PDL" not in _combine(off).kwargs


def test_pdl_is_off_unless_asked_for():
    assert meta_plan("bf16", **WIDE).knobs["pdl"] is False
    assert meta_plan("bf16", **WIDE, arch=80).knobs["pdl"] is False
    cfg = PRESETS["bf16"]
    cache = PagedMLACache.empty(2, 300, 64, 16, cfg)
    q = torch.randn(2, 4, 64 + 16)
    plan = mla_decode_plan(q, cache, 0.1, num_splits=2)
    assert plan.knobs["pdl"] is False and "launch_pdl" not in _combine(plan).kwargs


def test_asking_for_pdl_where_it_cannot_run_names_the_field():
    with pytest.raises(ConfigError, match=r"pdl=True needs .* compute capability >= 9.0, not compute capability 80"):
        meta_plan("bf16", **WIDE, arch=80, pdl=True)
    cfg = PRESETS["bf16"]
    cache = PagedMLACache.empty(2, 300, 64, 16, cfg)
    with pytest.raises(ConfigError, match=r"pdl=True needs .* not the Triton interpreter"):
        mla_decode(torch.randn(2, 4, 80), cache, 0.1, pdl=True)
    with pytest.raises(ConfigError, match=r"pdl='yes' is not valid"):
        DecodeOptions(pdl="yes")


def _ptx(launch) -> str:
    return compile_launch(launch, 90).asm["ptx"]


@pytest.mark.parametrize("tile", ["rows", "gluon"])
def test_compiled_kernels_signal_and_wait_on_the_grid_dependency(tile):
    """The PDL combine waits before its first load and is compiled for a programmatic launch; stage 1 (a
    Triton tile or a Gluon kernel) does not trigger it early; without PDL the combine has no wait (a wait there
    would be harmless but would mean the flag is not what selects it)."""
    if tile == "gluon" and not HAVE_GLUON:
        pytest.skip("this triton has no Gluon")
    plan = meta_plan("bf16", **WIDE, tile=tile, pdl=True)
    # no early trigger: with stage 1 signalling its dependents as it started, the combine's programs sat
    # resident beside it and made some shapes 20-30 % slower on an H100 (docs/performance.md); the implicit
    # trigger as each program exits still lets the combine launch before stage 1's grid is retired
    assert "griddepcontrol" not in _ptx(plan.launches[0])
    comb = compile_launch(_combine(plan), 90)
    ptx = comb.asm["ptx"]
    assert "griddepcontrol.wait" in ptx
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    assert comb.metadata.launch_pdl is True
    off = compile_launch(_combine(meta_plan("bf16", **WIDE, tile=tile)), 90)
    assert "griddepcontrol" not in off.asm["ptx"] and off.metadata.launch_pdl is False


@pytest.mark.gpu
@pytest.mark.parametrize("preset,H", [("bf16", 64), ("snapmla", 16), ("snapmla", 128)])
def test_pdl_combine_gives_the_same_bits_in_and_out_of_a_cuda_graph(preset, H):
    """The combine's arithmetic does not change with its launch: the outputs with and without PDL are equal
    bit for bit, eagerly and replayed from a CUDA graph (where the dependency becomes a programmatic edge)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a Hopper GPU")
    torch.manual_seed(7)
    dev = torch.device("cuda")
    B, L, r, d = 3, 3000, 512, 64
    cfg = PRESETS[preset]
    cache = PagedMLACache.empty(B, L, r, d, cfg, device=dev)
    cache.append(torch.randn(B, L, r, device=dev), torch.randn(B, L, d, device=dev))
    cache.lengths.copy_(torch.tensor([3000, 1, 2049], device=dev, dtype=torch.int32))
    q = torch.randn(B, H, r + d, device=dev, dtype=torch.bfloat16)
    plans = {pdl: mla_decode_plan(q, cache, 0.07, num_splits=5, pdl=pdl) for pdl in (True, False)}
    assert plans[True].knobs["pdl"] is True
    eager = {pdl: [t.clone() for t in p.run()] for pdl, p in plans.items()}
    torch.cuda.synchronize()
    for a, b in zip(eager[True], eager[False], strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for p in plans.values():
        p.out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plans[True].run()
    for _ in range(3):
        plans[True].out.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(plans[True].out[:, 0].view(torch.int32), eager[False][0].view(torch.int32))
