"""The decode-backend seam: a lazy registry whose names are the valid backends everywhere, and kernel options
that reach every call of the backend (snapquant.patch, the fixed-shape decode step, sweeps, command lines).

The registered test backend wraps `mla_decode_reference` and records the options each call received, so a
patched model through it must give bit-identical logits to backend='reference'.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

import snapquant
from snapquant import PRESETS
from snapquant.attention.backends import (
    BACKEND_CHOICES,
    backend_choices,
    check_kernel_options,
    kernel_options_from_text,
    parse_kernel_options,
    register_backend,
    resolve_backend,
    unregister_backend,
)
from snapquant.errors import ConfigError
from snapquant.models.tiny import tiny_model
from snapquant.patching import is_patched, patch_state

pytestmark = pytest.mark.usefixtures("one_thread")

FAKE = textwrap.dedent('''
    from snapquant.errors import ConfigError
    from snapquant.reference import mla_decode_reference

    CALLS = []

    def decode(q, kv, lengths=None, softmax_scale=None, config=None, *, causal=True, round_16bit=True,
               options=None):
        CALLS.append(options)
        return mla_decode_reference(q, kv, lengths, softmax_scale, config, causal=causal, round_16bit=round_16bit)

    def no_options(q, kv, lengths=None, softmax_scale=None, config=None, *, causal=True, round_16bit=True):
        return mla_decode_reference(q, kv, lengths, softmax_scale, config, causal=causal, round_16bit=round_16bit)

    def parse(options):
        unknown = sorted(set(options) - {"alpha", "beta"})
        if unknown:
            raise ConfigError(f"unknown option(s) {unknown}; valid options: alpha, beta")
        return ("parsed", tuple(sorted(options.items())))
''')


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A backend module `sq_fake_backend` on sys.path, registered as 'fake' by name only; removed after."""
    (tmp_path / "sq_fake_backend.py").write_text(FAKE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("sq_fake_backend", None)
    register_backend("fake", "sq_fake_backend:decode", needs_cuda=False, options="sq_fake_backend:parse")
    yield "fake"
    unregister_backend("fake")
    sys.modules.pop("sq_fake_backend", None)


def _ck(model, cache) -> dict:
    """The model's cache keyword: `cache` (transformers >= 5.2x) or `past_key_values` (5.17)."""
    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


def _steps(model, n_prompt=5, n_steps=3, seed=0):
    """Logits of a prefill and `n_steps` single-token decode steps (teacher-forced), [steps, B, V]."""
    ids = torch.randint(3, 200, (2, n_prompt + n_steps), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(ids[:, :n_prompt], use_cache=True)
        past, logits = out.past_key_values, [out.logits[:, -1]]
        for t in range(n_prompt, n_prompt + n_steps):
            out = model(ids[:, t:t + 1], use_cache=True, **_ck(model, past))
            past = out.past_key_values
            logits.append(out.logits[:, -1])
    return torch.stack(logits)


# ---------------------------------------------------------------------------------------------- registry
def test_registering_by_name_imports_nothing_until_first_use(fake):
    assert "sq_fake_backend" not in sys.modules
    assert backend_choices() == ("auto", "reference", "triton", "flashmla", "fake")
    assert "fake" in BACKEND_CHOICES and list(BACKEND_CHOICES) == list(backend_choices())
    b = resolve_backend("fake", PRESETS["snapmla"], torch.device("cpu"))
    assert "sq_fake_backend" in sys.modules and b.fn is sys.modules["sq_fake_backend"].decode
    unregister_backend("fake")
    assert "fake" not in BACKEND_CHOICES  # the choices follow the registry
    with pytest.raises(ConfigError, match="cannot be unregistered"):
        unregister_backend("reference")


def test_importing_the_seam_the_patch_and_the_graph_step_imports_no_kernel():
    code = ("import sys, snapquant.attention.backends, snapquant.patching, snapquant.graphs, snapquant.cache; "
            "print(sorted(m for m in sys.modules if m.startswith(('snapquant.kernels', 'triton'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_backend_that_cannot_be_imported_is_one_clear_error():
    register_backend("ghost", "sq_no_such_module:decode", needs_cuda=False)
    register_backend("typo", "snapquant.reference:mla_decode_referense", needs_cuda=False)
    try:
        with pytest.raises(ConfigError, match=r"backend='ghost' is not available: importing sq_no_such_module:decode"):
            resolve_backend("ghost", PRESETS["snapmla"], torch.device("cpu"))
        with pytest.raises(ConfigError, match=r"backend='typo' is not available: .*no attribute 'mla_decode_referense'"):
            resolve_backend("typo", PRESETS["snapmla"], torch.device("cpu"))
    finally:
        unregister_backend("ghost")
        unregister_backend("typo")


def test_auto_takes_the_first_auto_backend_that_supports_the_config_on_cuda_only(fake):
    register_backend("fake", "sq_fake_backend:decode", needs_cuda=False, auto=True)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # resolve_backend only looks at the device type
    kivi = PRESETS["int4_kivi"]  # the kernels do not implement it: triton is passed over
    assert resolve_backend("auto", kivi, cuda).name == "fake"
    assert resolve_backend("auto", kivi, cpu).name == "reference"
    assert resolve_backend("auto", PRESETS["snapmla"], cuda).name == "triton"  # registered first


# ---------------------------------------------------------------------------------------------- patch + options
def test_patch_selects_a_registered_backend_and_every_call_gets_the_kernel_options(fake):
    model = tiny_model("deepseek_v3")
    snapquant.patch(model, "snapmla", backend="reference")
    want = _steps(model)
    snapquant.patch(model, "snapmla", backend="fake", kernel_options={"alpha": 2})
    calls = sys.modules["sq_fake_backend"].CALLS
    got = _steps(model)
    assert torch.equal(got, want)  # the fake backend is the reference
    n_layers = len(patch_state(model).hooks)
    assert len(calls) == 3 * n_layers  # every decode step of every MLA layer (the prefill runs stock)
    assert set(calls) == {("parsed", (("alpha", 2),))}
    with snapquant.patched(model, "snapmla", backend="reference"):
        assert patch_state(model).kernel_options is None
    state = patch_state(model)  # restored with its options
    assert (state.backend, state.kernel_options) == ("fake", {"alpha": 2})
    snapquant.unpatch(model)


def test_the_fixed_shape_decode_step_gets_the_kernel_options(fake):
    from snapquant.cache import LatentCache
    from snapquant.graphs import DecodeGraph

    model = tiny_model("deepseek_v3")
    snapquant.patch(model, "snapmla", backend="fake", kernel_options={"beta": "x"})
    cache = LatentCache("snapmla", model, max_cache_len=16)
    with torch.no_grad():
        model(torch.randint(3, 200, (2, 5)), use_cache=True, **_ck(model, cache))
    calls = sys.modules["sq_fake_backend"].CALLS
    calls.clear()
    DecodeGraph(model, cache, capture=False).step(torch.randint(3, 200, (2, 1)))
    assert calls and set(calls) == {("parsed", (("beta", "x"),))}


def test_bad_kernel_options_are_refused_by_patch_naming_the_field(fake):
    model = tiny_model("deepseek_v3")
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['gamma'\]; valid options: alpha, beta"):
        snapquant.patch(model, "snapmla", backend="fake", kernel_options={"gamma": 1})
    with pytest.raises(ConfigError, match=r"backend='reference' takes no kernel options \(backends that do: .*fake"):
        snapquant.patch(model, "snapmla", backend="reference", kernel_options={"alpha": 1})
    assert not is_patched(model)
    register_backend("fake", "sq_fake_backend:no_options", needs_cuda=False)  # keeps its parser
    with pytest.raises(ConfigError, match=r"backend='fake' cannot take them: its function .* no `options`"):
        check_kernel_options("fake", {"alpha": 1})
    assert check_kernel_options("reference", {}) == {} and check_kernel_options("reference", None) == {}


def test_kernel_options_from_a_command_line():
    assert kernel_options_from_text("num_splits=8, fp8_mma=qk,tile=null,x=true") == {
        "num_splits": 8, "fp8_mma": "qk", "tile": None, "x": True}
    assert kernel_options_from_text("{num_splits: 8, p_div: exact}") == {"num_splits": 8, "p_div": "exact"}
    with pytest.raises(ConfigError, match="'num_splits' is not key=value"):
        kernel_options_from_text("num_splits")


def test_triton_kernel_options_are_checked_against_the_kernels_knobs():
    parse_kernel_options("triton", {"num_splits": 8, "fp8_mma": "qk"})
    with pytest.raises(ConfigError, match=r"'num_split'.*valid options: .*num_splits"):
        parse_kernel_options("triton", {"num_split": 8})


# ---------------------------------------------------------------------------------------------- sweeps
def _spec(**kw):
    from snapquant.sweep import SweepSpec

    return SweepSpec.from_dict({"model": "embedded", "tasks": ["sq_code_ppl"], "presets": ["snapmla"], **kw})


def test_a_sweep_selects_a_registered_backend_with_kernel_options(fake):
    from snapquant.sweep.schema import stable_hash

    plain, with_options = _spec(backend="fake"), _spec(backend="fake", kernel_options={"alpha": 1})
    assert with_options.kernel_options == {"alpha": 1} and plain.kernel_options == {}
    assert with_options.eval_key() != plain.eval_key()  # options change the numbers: new cells
    d = plain.to_dict()  # without options, the cell ids sweeps had before the key existed
    keys = ("model", "tokenizer", "dtype", "device_map", "model_kwargs", "backend", "max_length", "seed", "tasks",
            "fidelity", "include_path")
    assert plain.eval_key() == stable_hash({k: d[k] for k in keys})[:8]


def test_a_sweep_refuses_bad_backends_and_options_with_its_other_problems(fake):
    with pytest.raises(ConfigError) as e:
        _spec(backend="fake", kernel_options={"gamma": 1}, batch_size=0)
    assert "2 problem(s)" in str(e.value) and "'gamma'" in str(e.value) and "batch_size=0" in str(e.value)
    with pytest.raises(ConfigError, match=r"backend='tritn' is not valid \(did you mean 'triton'\?\); allowed values: auto, "
                                          r"reference, triton, flashmla, fake"):
        _spec(backend="tritn")
    with pytest.raises(ConfigError, match="kernel_options: expected a mapping"):
        _spec(kernel_options=[1])
    with pytest.raises(ConfigError, match="backend='reference' takes no kernel options"):
        _spec(backend="reference", kernel_options={"alpha": 1})


def test_a_sweep_cell_patches_with_its_kernel_options_for_tasks_and_fidelity(fake, monkeypatch):
    from contextlib import contextmanager

    import snapquant.eval.fidelity
    from snapquant.sweep import evaluate as ev
    from snapquant.sweep.grid import expand

    spec = _spec(backend="fake", kernel_options={"alpha": 1})
    patches, lms = [], []

    @contextmanager
    def patcher(model, cfg, backend="auto", kernel_options=None):
        patches.append((cfg.label(), backend, kernel_options))
        yield model

    class LM:
        def __init__(self, pretrained, tokenizer, batch_size, kv_config, backend="auto", kernel_options=None):
            lms.append((backend, kernel_options))

    def fidelity_metrics(model, reference, config, *, backend=None, patcher=None, **kw):
        with patcher(model, config, backend=backend):
            return {"ok": True}

    class Progress:
        def phase(self, *a):
            pass

        def advance(self, *a):
            pass

    monkeypatch.setattr(ev.LmEvalEvaluator, "_run_task", lambda self, lm, task, spec, progress: {})
    monkeypatch.setattr(ev, "extract_results", lambda res, task, metric=None: ({}, {}, {}))
    monkeypatch.setattr(snapquant.eval.fidelity, "fidelity_metrics", fidelity_metrics)
    evaluator = ev.LmEvalEvaluator(patcher=patcher, lm_class=LM)
    # the real FidelityReference carries the scored tokens, which the cell's arrays file stores
    evaluator.model, evaluator.reference = object(), SimpleNamespace(input_ids=torch.zeros(1, 4, dtype=torch.long))
    out = evaluator.evaluate(expand(spec).cells[0], spec, Progress())
    assert out["fidelity"] == {"ok": True}
    assert patches == [("snapmla", "fake", {"alpha": 1})] * 2  # the tasks' patch, then fidelity's
    assert lms == [("fake", {"alpha": 1})]  # the lm-eval model re-patches with the same options


# ---------------------------------------------------------------------------------------------- benchmarks
def test_the_decode_benchmark_runs_each_core_kernel_variant_again_with_the_kernel_options():
    from snapquant.bench.harness import RunSpec, run
    from snapquant.bench.shapes import uniform_shape
    from snapquant.bench.timing import Timing
    from snapquant.bench.variants import BY_NAME, with_kernel_options

    class OnceTimer:  # runs each callable once; timing itself is never measured by tests
        name = "once"

        def __call__(self, fns, est_us=None):
            for f in fns:
                f()
            return Timing(100.0, 99.0, 101.0, 1, len(fns), self.name)

    chosen = [BY_NAME["bf16"], BY_NAME["snapmla"], BY_NAME["torch"], BY_NAME["snapmla+balanced"]]
    variants = with_kernel_options(chosen, {"num_splits": 3})
    twins = [v for v in variants if v.name.endswith("+options")]
    assert [v.name for v in twins] == ["bf16+options", "snapmla+options"]  # core kernel variants only
    assert all(v.knobs == (("num_splits", 3),) and v.check_vs == v.name.removesuffix("+options") for v in twins)
    spec = RunSpec(shapes=[uniform_shape(2, 4, 70)], variants=variants, device=torch.device("cpu"), budget_s=600,
                   reserve_s=0, append=False, copy=False, r=64, d=16)
    rows = {r["variant"]: r for r in run(spec, OnceTimer(), log=lambda m: None)}
    for v in twins:
        row = rows[v.name]
        assert row["status"] == "ok", row.get("error")
        assert "num_splits=3" in row["resolved"]  # the option reached the kernel's launch plan
        assert "num_splits=3" not in rows[v.check_vs]["resolved"]
        assert row["check_rel_l2"] <= 2e-3  # splits only reorder the fp32 sums (the knob variants' tolerance)


def test_the_benchmarks_check_kernel_options_before_anything_runs(tmp_path, capsys):
    from typer.testing import CliRunner

    from snapquant.bench.runner import BenchOptions, plan
    from snapquant.cli import app

    bp = plan(BenchOptions(device="cpu", variants="snapmla", kernel_options="num_splits=3,p_div=exact"))
    assert bp.kernel_options == {"num_splits": 3, "p_div": "exact"}
    # the FlashMLA anchor always comes along, with no +options twin (it takes no kernel options)
    assert [v.name for v in bp.variants] == ["bf16", "snapmla", "flashmla", "bf16+options", "snapmla+options"]
    assert bp.record()["kernel_options"] == bp.kernel_options
    res = CliRunner().invoke(app, ["bench", "--device", "cpu", "--out", str(tmp_path / "b"),
                                   "--kernel-options", "num_split=8"])
    assert res.exit_code == 2 and "--kernel-options" in res.output and "'num_split'" in res.output
    assert not (tmp_path / "b").exists()
    from snapquant.bench import e2e

    assert e2e.main(["--backend", "reference", "--kernel-options", "num_splits=8", "--out", str(tmp_path / "e")]) == 2
    assert "takes no kernel options" in capsys.readouterr().err


def test_the_fidelity_command_checks_backend_and_options_before_loading_a_model(fake):
    from typer.testing import CliRunner

    from snapquant.cli import app

    res = CliRunner().invoke(app, ["fidelity", "--backend", "fake", "--kernel-options", "gamma=1"])
    assert res.exit_code == 2 and "'gamma'" in res.output  # the embedded model is not loaded: no traceback
    res = CliRunner().invoke(app, ["fidelity", "--backend", "tritn"])
    assert res.exit_code == 2 and "--backend='tritn' is not valid" in res.output and "fake" in res.output


# ---------------------------------------------------------------------------------------------- the kernels
@pytest.fixture
def triton_on_cpu():
    """Let backend='triton' run on CPU (the Triton interpreter) for this test; its registration is restored after."""
    register_backend("triton", "snapquant.kernels:triton_backend", supports="snapquant.kernels:supports",
                     needs_cuda=False)
    yield
    register_backend("triton", "snapquant.kernels:triton_backend", supports="snapquant.kernels:supports",
                     needs_cuda=True)


def test_triton_kernel_options_reach_every_kernel_launch(triton_on_cpu, monkeypatch):
    import warnings

    import snapquant.kernels.backend as kb
    from snapquant.kernels import DecodeOptions

    seen, launch = [], kb.launch_decode

    def spy(*args, options=None, **kw):
        seen.append(options)
        return launch(*args, options=options, **kw)

    monkeypatch.setattr(kb, "launch_decode", spy)
    model = tiny_model("deepseek_v3", kv_lora_rank=64, qk_rope_head_dim=16)  # widths the kernels run
    with pytest.raises(ConfigError, match=r"'num_split'.*valid options: .*num_splits"):
        snapquant.patch(model, "snapmla", backend="triton", kernel_options={"num_split": 3})
    snapquant.patch(model, "snapmla", backend="reference")
    want = _steps(model, n_steps=2)
    snapquant.patch(model, "snapmla", backend="triton", kernel_options={"num_splits": 3, "p_div": "exact"})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="snapquant triton backend")  # no silent fallback
        got = _steps(model, n_steps=2)
    assert len(seen) == 2 * len(patch_state(model).hooks)
    assert set(seen) == {DecodeOptions(num_splits=3, p_div="exact")}
    # fp32 model: the kernel and the reference read the same codes; bound as test_kernels_backend.py argues
    assert (got - want).abs().max() <= 2e-3 * want.abs().max()
    snapquant.unpatch(model)
