"""The trainer (snapquant.training.embedded, scripts/train_embedded_model.py): its whole path on CPU with the
tiny architecture: train, save, evaluate, export, install."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from snapquant.data.corpus import stdlib_root
from snapquant.data.tokenizer import load_fast_tokenizer
from snapquant.embedded import EMBEDDED_PATH, has_weights, load_embedded
from snapquant.training import embedded as trainer

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_embedded_model.py"


def _mini_corpus(d: Path) -> Path:
    """A corpus folder in the trainer's format, from a few stdlib modules, with the shipped tokenizer."""
    tok = load_fast_tokenizer(EMBEDDED_PATH)
    eos = tok.token_to_id("<|endoftext|>")
    texts = [(stdlib_root() / p).read_text() for p in ("json/encoder.py", "json/decoder.py", "textwrap.py")]
    ids = np.asarray([i for t in texts for i in [*tok.encode(t).ids, eos]], dtype=np.uint16)
    d.mkdir()
    (d / "train.bin").write_bytes(ids.tobytes())
    (d / "val.bin").write_bytes(ids[:3000].tobytes())
    shutil.copytree(EMBEDDED_PATH, d / "tokenizer", ignore=lambda _d, names: [
        n for n in names if not n.startswith(("tokenizer", "special_tokens"))])
    meta = {"format": "snapquant-corpus-v1", "dtype": "uint16", "train_tokens": int(ids.size),
            "train_files": 3, "train_bytes": sum(len(t) for t in texts), "vocab_size": tok.get_vocab_size(),
            "eos_id": eos, "manifest_sha256": "-", "tokenizer_sha256": "-",
            "train_bin_sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
            "summary": {"splits": {"train": {"files": 3, "bytes": 1}}, "origins": {}}}
    (d / "meta.json").write_text(json.dumps(meta))
    return d


@pytest.mark.slow  # covered by default: the command line (--help) and the bf16 export
def test_tiny_train_export_install(tmp_path):
    corpus = _mini_corpus(tmp_path / "corpus")
    out, export, inst = tmp_path / "run", tmp_path / "export", tmp_path / "installed"
    trainer.main(["train", "--tiny", "--device", "cpu", "--corpus", str(corpus), "--out", str(out),
                 "--export", str(export), "--steps", "3", "--seq-len", "256", "--batch-size", "2",
                 "--workers", "0", "--warmup", "2", "--log-every", "1", "--minutes", "10",
                 "--eval-reserve-s", "0", "--probe-minutes", "1000", "--ckpt-minutes", "1000",
                 "--eval-samples", "2", "--eval-passkey-samples", "1", "--eval-completion-samples", "0",
                 "--eval-ppl-files", "1", "--eval-batch", "8"])
    events = [json.loads(line)["event"] for line in (out / "training_log.jsonl").read_text().splitlines()]
    assert events[0] == "start" and events.count("step") == 3 and events[-1] == "done"
    assert {"train_end", "saved", "eval", "export"} <= set(events)
    state = json.loads((out / "training_state.json").read_text())
    assert state["steps"] == 3 and state["tokens"] == 3 * 2 * 256
    scores = state["bf16_scores"]
    assert 0 <= scores["sq_kv_retrieval_256"] <= 1 and 0 <= scores["sq_passkey_code_256"] <= 1
    assert scores["bits_per_byte"] > 0 and scores["val_loss_fp32_master"] > 0
    card = (out / "README.md").read_text()
    assert "## Architecture" in card and "sq_kv_retrieval_256" in card
    files = sorted(f.name for f in export.iterdir())
    assert files == ["embedded_meta.tar", "model.safetensors"]
    assert all((export / f).stat().st_size < 16 * 2**20 for f in files)

    trainer.main(["install", "--from", str(export), "--to", str(inst)])
    assert has_weights(inst)
    model, _tok = load_embedded(dtype="float32", path=inst)
    assert model.config.num_hidden_layers == 2
    assert (inst / "README.md").read_text() == card

    # A second run continues from the installed weights and keeps counting.
    trainer.main(["train", "--tiny", "--device", "cpu", "--corpus", str(corpus), "--out", str(tmp_path / "run2"),
                 "--init-from", str(inst), "--steps", "1", "--seq-len", "256", "--batch-size", "2",
                 "--workers", "0", "--minutes", "10", "--eval-reserve-s", "0", "--probe-minutes", "1000",
                 "--eval-samples", "1", "--eval-passkey-samples", "0", "--eval-completion-samples", "0",
                 "--eval-ppl-files", "1"])
    state2 = json.loads((tmp_path / "run2" / "training_state.json").read_text())
    assert state2["steps"] == 4 and state2["init_from"] == str(inst)
    log2 = (tmp_path / "run2" / "training_log.jsonl").read_text().splitlines()
    assert [json.loads(x)["event"] for x in log2].count("start") == 2


def test_saved_model_generates_with_a_cache(tmp_path):
    """Training runs without a cache; the saved model must not carry that into generation_config.json
    (a patched model's generate would then never read its quantized cache)."""
    from transformers import DeepseekV3ForCausalLM

    from snapquant.embedded import TINY_ARCH, embedded_config

    config = embedded_config(TINY_ARCH)
    config.use_cache = False  # as cmd_train builds the model
    model = DeepseekV3ForCausalLM(config)
    assert model.generation_config.use_cache is False
    tok_dir = tmp_path / "tok"
    shutil.copytree(EMBEDDED_PATH, tok_dir, ignore=lambda _d, names: [
        n for n in names if not n.startswith(("tokenizer", "special_tokens"))])
    out = trainer._save_bf16(model, tok_dir, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["use_cache"] is True
    assert json.loads((out / "generation_config.json").read_text()).get("use_cache", True) is True


def test_script_is_the_command_line_of_the_module():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert all(cmd in out.stdout for cmd in ("build-data", "train", "install", "eval"))
