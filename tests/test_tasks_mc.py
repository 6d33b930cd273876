"""sq_code_completion_mc: the multiple-choice line completion task (documents, knobs, lm-eval loading and
scoring, the direct loglikelihood scorer, and its calibration rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from snapquant.data.corpus import load_heldout
from snapquant.embedded import TINY_ARCH, embedded_config, load_tokenizer
from snapquant.errors import ConfigError
from snapquant.eval import calibration
from snapquant.eval.calibration import Setting, parse_setting
from snapquant.eval.tasks import TASK_DIR, direct, sq_utils, task_manager

TASK = "sq_code_completion_mc"


@pytest.fixture(scope="module")
def tiny():
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(embedded_config(TINY_ARCH, max_position_embeddings=4096)).eval(), load_tokenizer()


@pytest.mark.parametrize("knobs", [{}, {"completion_prefix": 0.75}, {"mc_distractors": "other_files", "mc_choices": 6}])
def test_choices_hold_the_target_once_and_are_seeded(knobs):
    kw = sq_utils.completion_mc_knobs(knobs)
    rows = sq_utils.completion_mc_rows(seed=5, num_samples=40, **kw)
    assert rows == sq_utils.completion_mc_rows(seed=5, num_samples=40, **kw)
    other = sq_utils.completion_mc_rows(seed=6, num_samples=40, **kw)
    assert [r["choices"] for r in rows] != [r["choices"] for r in other]
    # the items are the generation task's (same seed and knobs), the target among the choices at `gold`
    base = sq_utils.completion_rows(seed=5, num_samples=40, prefix=kw["prefix"], words=0, copyable=kw["copyable"])
    assert [(r["path"], r["line"], r["context"], r["target"]) for r in rows] == [
        (r["path"], r["line"], r["context"], r["target"]) for r in base]
    files = {r["path"]: r["text"].split("\n") for r in load_heldout()}
    golds = set()
    for r in rows:
        assert len(r["choices"]) == kw["choices"] and r["choices"][r["gold"]] == r["target"]
        stripped = [c.strip() for c in r["choices"]]
        assert len(set(stripped)) == len(stripped)  # no distractor equals the target or another one
        golds.add(r["gold"])
        for j, c in enumerate(r["choices"]):
            if j == r["gold"]:
                continue
            lines = (files[r["path"]] if kw["distractors"] == "same_file" else
                     [ln for p, lns in files.items() if p != r["path"] for ln in lns])
            if kw["prefix"] > 0:  # shaped like the target: a line's end from a cut point (before a space)
                assert c.startswith(" ") and any(ln.endswith(c) and ln[-len(c) - 1] != " " for ln in lines), c
            else:
                assert any(ln.strip() == c.strip() for ln in lines), c
                indent = len(r["target"]) - len(r["target"].lstrip(" "))
                assert c[:indent].strip() == "" and c[indent] != " "  # re-indented like the target
    assert len(golds) > 1  # the target's position varies


def test_knob_validation_is_one_line_naming_the_knob():
    bad = [({"mc_choices": 1}, "mc_choices"), ({"mc_choices": "4"}, "mc_choices"), ({"mc_choices": True}, "mc_choices"),
           ({"mc_choices": 17}, "mc_choices"), ({"mc_distractors": "nearby"}, "mc_distractors"),
           ({"completion_prefix": 1.0}, "completion_prefix"), ({"completion_copyable": "yes"}, "completion_copyable")]
    for knobs, key in bad:
        with pytest.raises(ConfigError, match=key) as e:
            sq_utils.code_completion_mc_docs(num_samples=1, **knobs)
        assert "\n" not in str(e.value)
        with pytest.raises(ConfigError, match=key):
            calibration.build(Setting(TASK, knobs), 1)
    with pytest.raises(ConfigError, match="completion_words"):  # not a knob of the multiple-choice task
        calibration.build(Setting(TASK, {"completion_words": 1}), 1)


def test_yaml_metadata_holds_the_defaults():
    cfg = yaml.load((TASK_DIR / f"{TASK}.yaml").read_text(), Loader=_IgnoreTags)
    meta = {k: v for k, v in cfg["metadata"].items() if k != "version"}
    assert meta == sq_utils.MC_DEFAULTS
    assert cfg["output_type"] == "multiple_choice" and [m["metric"] for m in cfg["metric_list"]] == ["acc", "acc_norm"]
    assert parse_setting(TASK).label() == ",".join(f"{k}={v}" for k, v in sorted(sq_utils.MC_DEFAULTS.items()))


class _IgnoreTags(yaml.SafeLoader):
    pass


_IgnoreTags.add_multi_constructor("!", lambda loader, suffix, node: None)


class _FakeLM:
    """An lm-eval LM answering loglikelihood requests from the document: the target (or a distractor) best."""

    def __init__(self, prefer_target: bool):
        from lm_eval.api.model import LM

        self.lm = type("Fake", (LM,), {"loglikelihood": self._ll, "loglikelihood_rolling": None,
                                        "generate_until": None})()
        self.prefer_target = prefer_target

    def _ll(self, requests, disable_tqdm=False):
        out = []
        for req in requests:
            context, continuation = req.args
            assert context == req.doc["context"]
            is_target = continuation == req.doc["target"]
            wrong = req.doc["choices"][(req.doc["gold"] + 1) % len(req.doc["choices"])]
            out.append((0.0 if is_target == self.prefer_target and (is_target or continuation == wrong)
                        else -50.0, False))
        return out


@pytest.mark.parametrize("prefer_target,expected", [(True, 1.0), (False, 0.0)])
def test_lm_eval_loads_and_scores_the_task(prefer_target, expected):
    import lm_eval

    res = lm_eval.simple_evaluate(model=_FakeLM(prefer_target).lm, tasks=[TASK], limit=5, bootstrap_iters=0,
                                  task_manager=task_manager(include_defaults=False, num_samples=5),
                                  log_samples=True)
    r = res["results"][TASK]
    assert r["acc,none"] == expected and r["acc_norm,none"] == expected
    docs = [s["doc"] for s in res["samples"][TASK]]
    assert {d["target"] for d in docs} == {r["target"] for r in sq_utils.completion_mc_rows(num_samples=5)}


def test_metadata_knobs_reach_the_lm_eval_documents():
    tm = task_manager(include_defaults=False, num_samples=3, completion_prefix=0.5, mc_choices=3,
                      mc_distractors="other_files")
    task = tm.load([TASK])["tasks"][TASK]
    docs = list(task.test_docs())
    rows = sq_utils.completion_mc_rows(num_samples=3, prefix=0.5, choices=3, distractors="other_files")
    assert [d["choices"] for d in docs] == [r["choices"] for r in rows]
    assert [task.doc_to_choice(d) for d in docs] == [r["choices"] for r in rows]
    assert [task.doc_to_target(d) for d in docs] == [r["gold"] for r in rows]
    assert task.doc_to_text(docs[0]) == rows[0]["context"]


def test_score_picks_the_argmax(monkeypatch):
    setting = Setting(TASK, {"mc_choices": 3})

    def prefer(index_of):
        def lls(model, tok, contexts, choices, batch_size=16, through="forward"):
            assert through == "decode"  # calibration's default
            docs = sq_utils.completion_mc_rows(num_samples=len(contexts), choices=3)
            assert [d["context"] for d in docs] == list(contexts)
            return [[-1.0 if j == index_of(d) else -9.0 for j in range(3)] for d in docs]
        return lls

    monkeypatch.setattr(direct, "choice_loglikelihoods", prefer(lambda d: d["gold"]))
    assert calibration.score(None, None, setting, 6) == [1.0] * 6
    monkeypatch.setattr(direct, "choice_loglikelihoods", prefer(lambda d: (d["gold"] + 1) % 3))
    assert calibration.score(None, None, setting, 6) == [0.0] * 6
    # ties go to the first choice, as numpy's argmax in lm-eval
    assert direct.mc_pick([-2.0, -1.0, -1.0]) == 1 and direct.mc_pick([-6.0, -4.0], ["abc", "ab"]) == 0


def test_choice_loglikelihoods_match_lm_eval(tiny):
    """The shared-context path, lm-eval's path and lm-eval's HFLM give the same loglikelihoods."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    model, tok = tiny
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=4, max_length=4096)
    res = lm_eval.simple_evaluate(model=lm, tasks=[TASK], limit=2, bootstrap_iters=0, log_samples=True,
                                  task_manager=task_manager(include_defaults=False, num_samples=2,
                                                            completion_prefix=0.75))
    samples = res["samples"][TASK]
    contexts = [s["doc"]["context"] for s in samples]
    choices = [s["doc"]["choices"] for s in samples]
    theirs = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    shared = direct.choice_loglikelihoods(model, tok, contexts, choices, share_context=True)
    full = direct.choice_loglikelihoods(model, tok, contexts, choices, batch_size=3, share_context=False)
    for a, b, c in zip(theirs, shared, full, strict=True):
        assert a == pytest.approx(b, abs=1e-3) and a == pytest.approx(c, abs=1e-3)
    acc = [float(direct.mc_pick(ll) == s["doc"]["gold"]) for ll, s in zip(full, samples, strict=True)]
    assert acc == [s["acc"] for s in samples]


def test_calibration_row_and_lm_eval_path_on_a_patched_model(tiny, tmp_path, monkeypatch):
    """A multiple-choice row has the generation rows' columns; with a `prefill: bf16` preset the lm-eval
    path (no cache, loglikelihood="forward") scores exactly what the unpatched model scores, so nothing is
    discordant; the script records how the loglikelihoods were read (decode by default)."""
    import importlib.util

    import pandas as pd

    import snapquant

    model, tok = tiny
    (row,) = calibration.calibrate(model, tok, [Setting(TASK, {"completion_prefix": 0.75})], 3,
                                   compare="per_tensor_fp8", loglikelihood="forward", log=lambda m: None)
    assert set(row) == set(calibration.CSV_COLUMNS) and row["n"] == 3 and row["discordant"] == 0
    assert row["knobs"].startswith("completion_copyable=True,completion_prefix=0.75,mc_choices=")

    monkeypatch.setattr(snapquant, "load_embedded", lambda **k: (model, tok))
    spec = importlib.util.spec_from_file_location("calibrate_tasks", Path(__file__).resolve().parent.parent
                                                  / "scripts" / "calibrate_tasks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--n", "2", "--output-dir", str(tmp_path), f"{TASK}:mc_choices=2"]) == 0
    table = pd.read_csv(tmp_path / "calibration.csv")
    assert list(table["task"]) == [TASK] and list(table["n"]) == [2]
    assert "mc_choices=2" in (tmp_path / "calibration.md").read_text()
    assert json.loads((tmp_path / "calibration.json").read_text())["run"]["loglikelihood"] == "decode"
    assert mod.main([f"{TASK}:mc_choices=0"]) == 2


def test_shared_context_is_refused_on_a_patched_model(tiny):
    from snapquant.patching import patched

    model, tok = tiny
    with patched(model, "per_tensor_fp8", backend="reference"), pytest.raises(ConfigError, match="share_context"):
        direct.choice_loglikelihoods(model, tok, ["x = 1\n"], [["y = 2", "z = 3"]], share_context=True)
