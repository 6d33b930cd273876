"""Which decode kernel runs (snapquant.kernels.dispatch) and the knobs that reach it (DecodeOptions).

Plans are built over meta tensors for a GPU target (`native=True`, `arch=90`: an H100/H200; `arch=None`:
a GPU of unknown kind, where Gluon is never the default): nothing compiles or runs, so these are fast and
hold on any machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from snapquant import PRESETS
from snapquant.errors import ConfigError
from snapquant.kernels import KERNELS, DecodeOptions, PagedMLACache, choose_kernel
from snapquant.kernels.decode import plan_decode
from snapquant.kernels.dispatch import Target
from snapquant.kernels.gluon import HAVE_GLUON
from snapquant.kernels.operands import KernelOperands
from snapquant.kernels.options import FIELDS, as_options

ROOT = Path(__file__).resolve().parents[1]
needs_gluon = pytest.mark.skipif(not HAVE_GLUON, reason="this triton has no Gluon")


def _plan(preset, H, *, S=1, B=2, L=256, r=512, d=64, arch=90, **knobs):
    cfg = PRESETS[preset] if isinstance(preset, str) else preset
    cache = PagedMLACache.empty(B, L, r, d, cfg, device="meta")
    q = torch.empty(B, S, H, r + d, dtype=torch.bfloat16, device="meta")
    return plan_decode(q, KernelOperands.from_paged(cache), 0.1, cfg, native=True, num_sms=132, arch=arch, **knobs)


def _kernel(preset, H, **kw):
    return _plan(preset, H, **kw).knobs["kernel"]


# ------------------------------------------------------------------------------------------- DecodeOptions
@pytest.mark.parametrize("field,value,allowed", [
    ("tile", "cols", "rows, tokens, pairs, gluon"), ("schedule", "balance", "uniform, balanced"),
    ("p_div", "fast", "exact, rcp, fma"), ("fp8_mma", "kq", "False, qk, pv, True"),
    ("num_splits", 0, "a positive int"), ("num_stages", -1, "a positive int"), ("maxnreg", 1.5, "a positive int"),
    ("num_warps", 6, "a power of two >= 1"), ("block_m", 8, "a power of two >= 16"),
    ("num_splits", True, "a positive int"),
])
def test_options_reject_bad_values_in_one_line_naming_field_and_values(field, value, allowed):
    with pytest.raises(ConfigError) as err:
        DecodeOptions(**{field: value})
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{field}={value!r} is not valid") and allowed in msg, msg


def test_options_from_dict_aliases_and_merging():
    with pytest.raises(ConfigError, match=r"unknown decode option\(s\) 'numwarps'; valid options: tile, schedule"):
        DecodeOptions.from_dict({"numwarps": 4})
    assert DecodeOptions(fp8_mma="none").fp8_mma is False and DecodeOptions(fp8_mma="both").fp8_mma is True
    opts = as_options({"tile": "rows", "num_warps": 4}, num_splits=3, num_warps=None)
    assert (opts.tile, opts.num_warps, opts.num_splits) == ("rows", 4, 3)  # None knobs leave a field unset
    assert as_options(opts, num_warps=8).num_warps == 8 and opts.replace(p_div="exact").p_div == "exact"
    assert DecodeOptions.from_dict(opts.as_dict()) == opts and set(opts.as_dict()) == set(FIELDS)
    assert opts.launch_knobs == {"num_warps": 4}
    with pytest.raises(ConfigError, match="options must be a DecodeOptions or a mapping"):
        as_options(["tile"])



# ------------------------------------------------------------------------------------------- the table
@needs_gluon
@pytest.mark.parametrize("preset,H,S,r,knobs,kernel", [
    ("snapmla", 16, 1, 512, {}, "gluon.narrow"),
    ("snapmla", 8, 2, 512, {}, "gluon.narrow"),  # S * H query rows
    ("snapmla", 16, 1, 256, {}, "gluon.narrow_tile"),
    ("snapmla", 16, 1, 512, {"num_stages": 1}, "gluon.narrow"),  # one slot: 3 per SM
    ("snapmla", 16, 1, 512, {"fp8_mma": "qk", "tile": "gluon"}, "gluon.narrow"),
    ("snapmla", 16, 1, 512, {"fp8_mma": "qk", "tile": "gluon", "num_stages": 1}, "gluon.narrow"),  # 3 per SM
    ("snapmla", 16, 1, 512, {"fp8_mma": True, "tile": "gluon"}, "gluon.narrow8"),  # both native: 16-row programs
    ("snapmla", 16, 1, 512, {"fp8_mma": True}, "triton.rows"),  # at <= 16 rows Gluon is the default for exact MMAs
    ("snapmla", 17, 1, 512, {}, "gluon.wide"),
    ("snapmla", 64, 1, 512, {}, "gluon.wide"),
    ("bf16", 64, 1, 512, {}, "gluon.seesaw"),
    ("bf16", 32, 1, 512, {}, "gluon.seesaw"),
    ("bf16", 64, 1, 512, {"warp_specialize": False}, "gluon.wide"),
    ("bf16", 64, 1, 256, {}, "gluon.wide"),
    ("snapmla", 64, 1, 512, {"fp8_mma": True}, "gluon.narrow8"),
    ("snapmla", 64, 1, 512, {"fp8_mma": True, "block_m": 64}, "gluon.wide8"),
    ("snapmla", 64, 1, 512, {"schedule": "balanced"}, "triton.pairs"),
    ("snapmla", 16, 1, 512, {"fp8_mma": "qk"}, "triton.rows"),  # the Gluon narrow kernels' default is exact
    ("snapmla", 64, 1, 512, {"fp8_mma": "pv"}, "triton.rows"),
    ("bf16", 16, 1, 512, {}, "gluon.narrow_bf16"),
    ("bf16", 16, 1, 512, {"tile": "rows"}, "triton.rows"),
    ("bf16", 8, 2, 256, {"tile": "gluon", "num_stages": 1}, "gluon.narrow_bf16"),
    ("snapmla_kv_only", 64, 1, 512, {}, "triton.rows"),
    ("ds_v32", 64, 1, 512, {}, "triton.rows"),
    ("snapmla", 64, 1, 512, {"tile": "tokens"}, "triton.tokens"),
    ("snapmla", 16, 1, 512, {"tile": "pairs", "num_warps": 4}, "triton.pairs"),
])
def test_default_kernel_per_format_rows_and_options_on_hopper(preset, H, S, r, knobs, kernel):
    plan = _plan(preset, H, S=S, r=r, d=64 if r == 512 else 32, **knobs)
    assert plan.knobs["kernel"] == kernel
    assert KERNELS[kernel].family == plan.knobs["tile"]


def test_gluon_is_never_the_default_off_hopper_or_in_the_interpreter():
    for arch in (None, 80, 100):
        assert _kernel("snapmla", 16, arch=arch) == "triton.pairs"
        assert _kernel("bf16", 64, arch=arch) == "triton.rows"
    ops = KernelOperands.from_paged(PagedMLACache.empty(2, 64, 64, 16, PRESETS["snapmla"]))
    cpu = choose_kernel(ops, PRESETS["snapmla"], 16, Target.of(ops.device), DecodeOptions())
    assert (cpu.kernel, cpu.num_warps) == ("triton.pairs", None)
    with pytest.raises(ConfigError, match=r"Hopper \(sm_90\) only, not sm_80"):
        _plan("snapmla", 16, arch=80, tile="gluon")


@needs_gluon
@pytest.mark.parametrize("preset,H", [("snapmla", 16), ("snapmla", 64), ("bf16", 64)])
@pytest.mark.parametrize("knob,value", [("num_warps", 4), ("num_warps", 8), ("num_warps", 16), ("num_stages", 1),
                                        ("num_stages", 2), ("num_stages", 3), ("block_m", 32), ("block_m", 64),
                                        ("maxnreg", 128)])
def test_a_launch_knob_never_switches_the_kernel_family(preset, H, knob, value):
    """On Hopper the default is a Gluon kernel; a launch knob is honoured by it or refused with an error that
    names the knob and how to ask for the Triton kernel; it never silently runs the Triton tiles instead."""
    try:
        plan = _plan(preset, H, **{knob: value})
    except ConfigError as e:
        assert f"{knob}={value}" in str(e) and "pass tile=" in str(e), str(e)
        return
    assert plan.knobs["tile"] == "gluon" and plan.knobs[knob] == value


def test_resolved_knobs_of_the_default_kernels():
    narrow = _plan("snapmla", 16).knobs
    assert (narrow["num_warps"], narrow["num_stages"], narrow["block_m"]) == (4, 2, 16)
    wide = _plan("snapmla", 64).knobs
    assert (wide["kernel"], wide["num_warps"], wide["num_stages"], wide["block_m"]) == ("gluon.wide", 8, 2, 64)
    seesaw = _plan("bf16", 64).knobs  # two warpgroups of 4 warps in roles
    assert (seesaw["kernel"], seesaw["num_warps"], seesaw["num_stages"], seesaw["block_m"]) == ("gluon.seesaw", 4, 2, 64)
    rows = _plan("bf16", 16, arch=None).knobs  # the Triton tiles: 8 warps; 3 stages for bf16 at 16-row tiles
    assert (rows["kernel"], rows["num_warps"], rows["num_stages"], rows["block_m"]) == ("triton.rows", 8, 3, 16)
    assert "maxnreg" not in rows and _plan("bf16", 16, arch=None, maxnreg=128).knobs["maxnreg"] == 128


# ------------------------------------------------------------------------------------------- consistency
def test_kernel_table_names_real_modules_and_docs_list_every_kernel():
    docs = (ROOT / "docs" / "kernels.md").read_text()
    for name, spec in KERNELS.items():
        assert (ROOT / "snapquant" / "kernels" / spec.module).is_file(), spec.module
        assert spec.status in ("default", "opt-in", "experimental")
        assert f"`{name}`" in docs and spec.module in docs, name


def test_dense_block_tables_are_built_once_and_reused():
    """The dense rows' block table (every decode step of a preallocated cache asks for the same one) is
    built once per shape and device and reused; its values are the row layout's."""
    from snapquant.kernels.backend import dense_block_table

    t = dense_block_table(3, 200, 4, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [[b * 200 + 64 * p for p in range(4)] for b in range(3)]
    assert dense_block_table(3, 200, 4, torch.device("cpu")) is t
    assert dense_block_table(3, 201, 4, torch.device("cpu")) is not t
