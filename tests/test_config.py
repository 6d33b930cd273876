"""KVQuantConfig validation, serialisation, presets and byte counts."""

import json

import pytest
import torch

import snapquant as sq
from snapquant import ConfigError, KVQuantConfig


@pytest.mark.parametrize("name", sorted(sq.PRESETS))
def test_every_preset_round_trips_yaml_and_json(name, tmp_path):
    cfg = sq.PRESETS[name]
    assert KVQuantConfig.from_yaml(cfg.to_yaml()) == cfg
    assert KVQuantConfig.from_json(cfg.to_json()) == cfg
    assert KVQuantConfig.from_pretrained(cfg.save_pretrained(tmp_path / name)) == cfg
    assert KVQuantConfig.from_pretrained(cfg.save_pretrained(tmp_path / f"{name}.yaml")) == cfg
    assert json.loads(cfg.to_json())["name"] == name


@pytest.mark.parametrize(
    "name, expected",
    [("bf16", 1152), ("snapmla", 644), ("snapmla_kv_only", 644), ("ds_v32", 656), ("ds_model1", 648),
     ("per_tensor_fp8", 576), ("per_tensor_fp8_dynamic", 576), ("rope_fp8_per_token", 584),
     ("e5m2_per_token", 644), ("int8_per_token", 644), ("int4_kivi", 360)],
)
def test_bytes_per_token_at_deepseek_dims(name, expected):
    assert sq.bytes_per_token(sq.PRESETS[name]) == expected


def test_bytes_per_token_other_dims():
    assert sq.bytes_per_token(sq.PRESETS["snapmla"], kv_lora_rank=256, rope_dim=32) == 256 + 4 + 64
    assert sq.bytes_per_token(sq.PRESETS["ds_v32"], 256, 32) == 256 + 2 * 4 + 64
    # Group-amortised scales are fractional: 512 channels x 4 B per 48 tokens.
    cfg = sq.PRESETS["int4_kivi"].replace(token_group=48)
    assert sq.bytes_per_token(cfg) == pytest.approx(256 + 32 + 512 * 4 / 48 + 64 * 4 / 48)


@pytest.mark.parametrize("name", sorted(sq.PRESETS))
def test_stored_bytes_match_bytes_per_token(name):
    """QuantizedKV.nbytes is what a cache holds; it must agree with the formula (per-token-like formats)."""
    cfg = sq.PRESETS[name]
    B, T = 2, 192  # T a multiple of the KIVI groups (32, 64) so amortised scales divide evenly
    kv = sq.quantize_kv(torch.randn(B, T, 512), torch.randn(B, T, 64), cfg)
    expected = sq.bytes_per_token(cfg)
    if cfg.nope_granularity.startswith("per_tensor"):
        # per-tensor scales are O(1): one fp32 scale per part that has its own (pre-scaled RoPE shares it)
        assert kv.nbytes == expected * B * T + 4 * (1 if cfg.rope_prescale else 2)
    else:
        assert kv.nbytes == pytest.approx(expected * B * T)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"nope_dtype": "fp8_e4m4"}, "nope_dtype"),
        ({"rope_dtype": "int3"}, "rope_dtype"),
        ({"nope_granularity": "per_row"}, "nope_granularity"),
        ({"scale_format": "e4m3"}, "scale_format"),
        ({"query": "fp8_e5m2"}, "query"),
        ({"pv": "fp8"}, "pv"),
        ({"prefill": "fp8"}, "prefill"),
        ({"block_size": 0}, "block_size"),
        ({"token_group": -3}, "token_group"),
        ({"nope_scale": -1.0}, "nope_scale"),
        ({"nope_scale": float("nan")}, "nope_scale"),
        ({"rope_prescale": "yes"}, "rope_prescale"),
        ({"nope_granularity": "per_channel"}, "nope_granularity"),  # prescale needs per-token latent scales
        ({"nope_granularity": "per_token_block"}, "nope_granularity"),  # one latent scale per token only
        ({"scale_rule": "trtllm"}, "scale_rule"),
        ({"scale_rule": "flashmla"}, "scale_rule"),  # FlashMLA's scales are powers of two, not fp32
        ({"scale_rule": "vllm", "scale_format": "pow2"}, "scale_rule"),  # vLLM's are plain fp32
        ({"scale_divisor": 0.0}, "scale_divisor"),
        ({"scale_divisor": float("inf")}, "scale_divisor"),
        ({"nope_dtype": "bf16"}, "nope_dtype"),  # nothing to prescale by
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        KVQuantConfig(**kwargs)


def test_unknown_value_lists_allowed_values_and_suggests():
    with pytest.raises(ConfigError) as e:
        KVQuantConfig(nope_dtype="fp8_e4m2")
    msg = str(e.value)
    assert "allowed values" in msg and "fp8_e4m3" in msg and "int4" in msg and "did you mean" in msg


def test_unknown_field_is_rejected():
    with pytest.raises(ConfigError, match="nope_dtyp"):
        KVQuantConfig.from_dict({"nope_dtyp": "int8"})
    with pytest.raises(ConfigError, match="KVQuantConfig field"):
        KVQuantConfig.from_yaml("granularity: per_token\n")
    with pytest.raises(ConfigError, match="pv_mode"):
        sq.PRESETS["snapmla"].replace(pv_mode="bf16")


def test_width_dependent_errors_before_compute():
    cfg = sq.PRESETS["ds_v32"]
    with pytest.raises(ConfigError, match="block_size=128 does not divide the nope width 96"):
        sq.quantize_kv(torch.randn(3, 96), torch.randn(3, 64), cfg)
    with pytest.raises(ConfigError, match="block_size=128 does not divide the nope width 96"):
        sq.bytes_per_token(cfg, kv_lora_rank=96)
    kivi = sq.PRESETS["int4_kivi"]
    with pytest.raises(ConfigError, match=r"int4.*even width; rope width is 63"):
        sq.quantize_kv(torch.randn(3, 64), torch.randn(3, 63), kivi)


def test_per_tensor_static_needs_a_scale():
    cfg = sq.PRESETS["per_tensor_fp8"].replace(nope_scale=None)
    with pytest.raises(ConfigError, match="nope_scale"):
        sq.quantize_kv(torch.randn(4, 64), torch.randn(4, 16), cfg)
    lat, rope = torch.randn(8, 64) * 3, torch.randn(8, 16) * 50
    cal = sq.calibrate(cfg, lat, rope)
    assert cal.nope_scale == pytest.approx(float(lat.abs().max()) / 448)
    assert cal.rope_scale == pytest.approx(float(rope.abs().max()) / 448)  # every static part is (re)calibrated
    p99 = sq.calibrate(cfg, lat, rope, percentile=99.0)
    assert p99.nope_scale < cal.nope_scale
    with pytest.raises(ConfigError, match="percentile"):
        sq.calibrate(cfg, lat, rope, percentile=0)


def test_resolve_config_accepts_names_dicts_files(tmp_path):
    assert sq.resolve_config("snapmla") is sq.PRESETS["snapmla"]
    assert sq.resolve_config({"query": "bf16"}).query == "bf16"
    p = sq.PRESETS["ds_v32"].save_pretrained(tmp_path / "x.yaml")
    assert sq.resolve_config(str(p)) == sq.PRESETS["ds_v32"]
    with pytest.raises(ConfigError, match="did you mean 'snapmla'"):
        sq.resolve_config("snapmlaa")


def test_register_and_load_presets(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("my_int8_kv:\n  nope_dtype: int8\n  query: bf16\n  pv: bf16\n")
    try:
        assert sq.load_presets(f) == ["my_int8_kv"]
        assert sq.PRESETS["my_int8_kv"].nope_dtype == "int8"
        assert sq.PRESETS["my_int8_kv"].name == "my_int8_kv"
        with pytest.raises(ConfigError, match="already exists"):
            sq.load_presets(f)
    finally:
        sq.PRESETS.pop("my_int8_kv", None)
    bad = tmp_path / "bad.yaml"
    bad.write_text("broken:\n  pv: nope\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: preset 'broken': pv='nope'"):
        sq.load_presets(bad)


def test_semantic_properties():
    assert sq.PRESETS["bf16"].is_identity
    assert not sq.PRESETS["snapmla"].is_identity
    assert sq.PRESETS["snapmla"].causal_consistent
    assert sq.PRESETS["ds_v32"].causal_consistent
    assert sq.PRESETS["per_tensor_fp8"].causal_consistent  # static scale: frozen
    assert not sq.PRESETS["per_tensor_fp8_dynamic"].causal_consistent
    assert not sq.PRESETS["int4_kivi"].causal_consistent
    assert not sq.PRESETS["fp8_kivi"].causal_consistent  # a group's scale depends on its later tokens
    assert not sq.PRESETS["per_tensor_fp8_vllm"].causal_consistent  # frozen at the prefill, by the cache
    assert sq.PRESETS["ds_v32_vllm"].causal_consistent


def test_an_unknown_keyword_gets_the_same_error_as_the_dict_form():
    with pytest.raises(ConfigError) as kw:
        KVQuantConfig(nope_dtyp="int8")
    with pytest.raises(ConfigError) as d:
        KVQuantConfig.from_dict({"nope_dtyp": "int8"})
    assert str(kw.value) == str(d.value)
    assert "did you mean 'nope_dtype'" in str(kw.value) and "token_group" in str(kw.value)


def test_an_unknown_preset_lookup_names_the_valid_ones_and_the_nearest():
    with pytest.raises(ConfigError) as e:
        sq.PRESETS["snapmlaa"]
    msg = str(e.value)
    assert "did you mean 'snapmla'" in msg and "int4_kivi" in msg and "ds_v32" in msg
    assert isinstance(e.value, KeyError)  # `except KeyError` around a lookup still works
    assert sq.PRESETS.get("snapmlaa") is None and "snapmlaa" not in sq.PRESETS


# (preset, change, the knob that then does nothing)
INERT = [
    ("snapmla", {"token_group": 32}, "token_group"),  # fp8 per-token latent: no per-channel part
    ("snapmla", {"block_size": 64}, "block_size"),  # no per_token_block part
    ("snapmla", {"nope_scale": 1.0}, "nope_scale"),  # dynamic per-token scales
    ("snapmla", {"rope_scale": 1.0}, "rope_scale"),  # pre-scaled RoPE has no scale of its own
    ("snapmla", {"rope_granularity": "per_channel"}, "rope_granularity"),  # ... nor a granularity
    ("bf16", {"nope_granularity": "per_channel"}, "nope_granularity"),  # 16-bit latent: no scales at all
    ("bf16", {"scale_format": "pow2"}, "scale_format"),
    ("bf16", {"scale_rule": "vllm"}, "scale_rule"),
    ("bf16", {"scale_divisor": 200.0}, "scale_divisor"),
    ("int4_kivi", {"nope_dtype": "bf16", "rope_dtype": "bf16", "nope_granularity": "per_token",
                   "rope_granularity": "per_token"}, "token_group"),  # the preset's token_group now reads nothing
]


@pytest.mark.parametrize("preset, change, knob", INERT)
def test_a_knob_the_chosen_formats_never_read_is_an_error(preset, change, knob):
    with pytest.raises(ConfigError, match=rf"^{knob}=\S+ has no effect in this config: it is read only with"):
        sq.PRESETS[preset].replace(**change)
    with pytest.raises(ConfigError, match=knob):  # every construction path
        KVQuantConfig.from_dict({**sq.PRESETS[preset].to_dict(), **change})


def test_all_knobs_that_do_nothing_are_named_at_once():
    with pytest.raises(ConfigError) as e:
        KVQuantConfig(nope_dtype="bf16", rope_prescale=False, nope_granularity="per_channel", token_group=8)
    assert "nope_granularity='per_channel' has no effect" in str(e.value)
    assert "token_group=8 has no effect" in str(e.value)


def test_every_knob_of_the_scope_table_is_tested_and_accepted_where_read():
    from snapquant.config import KNOB_SCOPE

    covered = {knob for _, _, knob in INERT}
    assert covered == set(KNOB_SCOPE)
    # the same knobs where the formats read them
    assert sq.PRESETS["int4_kivi"].replace(token_group=48).token_group == 48
    assert sq.PRESETS["ds_v32"].replace(block_size=64).block_size == 64
    assert sq.PRESETS["per_tensor_fp8"].replace(nope_scale=2.0, rope_scale=3.0).rope_scale == 3.0
    assert sq.PRESETS["rope_fp8_per_token"].replace(rope_granularity="per_channel").rope_granularity == "per_channel"
    assert sq.PRESETS["snapmla"].replace(scale_format="pow2").scale_format == "pow2"
    assert sq.PRESETS["snapmla"].replace(scale_rule="vllm", scale_divisor=200.0).scale_divisor == 200.0
    # a knob left at its default is never an error, whatever the format
    assert sq.PRESETS["bf16"].replace(block_size=128, token_group=None) == sq.PRESETS["bf16"]


def test_every_shipped_sweep_config_still_expands(tmp_path):
    from pathlib import Path

    import yaml

    from snapquant.sweep import SweepSpec, expand

    configs = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert len(configs) >= 4
    for p in configs:
        d = yaml.safe_load(p.read_text())
        d.update(model="embedded", output_dir=str(tmp_path / p.stem))
        ex = expand(SweepSpec.from_dict(d))
        assert len(ex.cells) >= 2, p
        assert not [why for _, why in ex.skipped if "has no effect" in why], p


def test_grid_base_knobs_apply_only_to_the_cells_that_read_them(tmp_path):
    from snapquant.sweep import SweepSpec, expand

    base = {"nope_dtype": "fp8_e4m3", "rope_dtype": "bf16", "rope_prescale": False, "query": "bf16", "pv": "bf16",
            "block_size": 64}
    d = {"name": "g", "model": "embedded", "tasks": ["sq_code_completion"], "presets": ["bf16"], "fidelity": False,
         "output_dir": str(tmp_path), "grid": {"base": base, "axes": {"nope_granularity": ["per_token", "per_token_block"],
                                                                      "rope_granularity": ["per_token", "per_channel"]}}}
    ex = expand(SweepSpec.from_dict(d))
    grid = {c.axes["nope_granularity"]: c.config for c in ex.cells if c.source == "grid"}
    assert grid["per_token_block"].block_size == 64 and grid["per_token"].block_size == 128
    # an axis value that does nothing (RoPE granularity of a BF16 RoPE) is skipped, naming the knob
    assert len(ex.cells) == 3 and len(ex.skipped) == 2
    assert all("rope_granularity='per_channel' has no effect" in why for _, why in ex.skipped)


def test_sweep_cell_ids_hash_the_later_scale_knobs_only_when_set():
    from snapquant.sweep.grid import cell_hash
    from snapquant.sweep.schema import stable_hash

    cfg = sq.PRESETS["snapmla"]
    before = {k: v for k, v in cfg.to_dict().items() if k not in ("name", "scale_rule", "scale_divisor")}
    assert cell_hash(cfg, "e") == stable_hash({"kv": before, "eval": "e"})[:10]  # the id earlier sweeps gave it
    assert cell_hash(cfg.replace(scale_rule="vllm"), "e") != cell_hash(cfg, "e")
    assert cell_hash(cfg.replace(scale_divisor=200.0), "e") != cell_hash(cfg, "e")
