"""The sentences of the README's results section that compare two configurations, written from results.

Every claim is computed from a committed results table (never typed by hand): its effect, its 95%
interval, the test's p-value where there is one, and n. `scripts/write_claims.py` writes them to
`results/claims.md`; the README quotes that file between `<!-- BEGIN claims -->` and
`<!-- END claims -->`, and a test checks that both agree with the tables they come from. A table that
is missing (an experiment not run yet) gives no claim, and the file says which.

The statistics behind the numbers are the experiments' (cluster bootstrap over sequences, sign-flip
permutation p-values over sequences: `snapquant.analysis.uncertainty`); the RoPE/NoPE layer count is an
exact two-sided binomial sign test over layers (`scipy.stats.binomtest`), whose n is the number of layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

BEGIN, END = "<!-- BEGIN claims -->", "<!-- END claims -->"


@dataclass(frozen=True)
class Claim:
    topic: str
    text: str
    source: str
    """The results file it is computed from, relative to the repository root."""


def _g(x: float, digits: int = 2) -> str:
    if not math.isfinite(x):
        return "n/a"
    return f"{x:.{digits}g}" if abs(x) < 0.01 or abs(x) >= 1000 else f"{x:.{digits}f}"


def _ci(row: pd.Series, col: str, digits: int = 2) -> str:
    return f"{_g(row[col], digits)} [{_g(row[col + '_ci_low'], digits)}, {_g(row[col + '_ci_high'], digits)}]"


def _p(p: float) -> str:
    return "p = n/a" if not math.isfinite(p) else f"p = {p:.2g}" if p >= 1e-3 else "p < 0.001"


def _n(seqs: float, positions: float) -> str:
    return f"n = {int(seqs)} sequences, {int(positions)} positions"


def _read(root: Path, rel: str) -> pd.DataFrame | None:
    f = root / rel
    return pd.read_csv(f) if f.is_file() else None


# ------------------------------------------------------------------------------------------ claims
def pv_pipeline_claims(root: Path) -> list[Claim]:
    rel = "results/pv_pipeline/table.csv"
    df = _read(root, rel)
    if df is None or "kl_vs_snapmla_p" not in df:
        return []
    base = df.set_index("pipeline").loc["snapmla"]
    words = {"snapmla_naive_pv": "naive FP8 P (the value scale applied after the PV product)",
             "snapmla_q_fp8": "BF16 P (FP8 query)", "snapmla_kv_only": "BF16 query and BF16 P"}
    out = []
    for name, what in words.items():
        if name not in set(df["pipeline"]):
            continue
        r = df.set_index("pipeline").loc[name]
        out.append(Claim("PV pipeline", (
            f"Decode KL of {what} over SnapMLA's scale-fused FP8 P, same cache and positions: ratio "
            f"{_ci(r, 'kl_ratio_vs_snapmla')} ({_p(r['kl_vs_snapmla_p'])}, sign-flip over sequences; "
            f"{_n(r['decode_kl_mean_n_sequences'], r['decode_kl_mean_n_positions'])}); mean KL "
            f"{_ci(r, 'decode_kl_mean')} vs {_ci(base, 'decode_kl_mean')}, largest single position "
            f"{_g(r['decode_kl_max'])} vs {_g(base['decode_kl_max'])}."), rel))
    return out


def granularity_claims(root: Path) -> list[Claim]:
    rel = "results/granularity_ablation/table.csv"
    df = _read(root, rel)
    if df is None or "decode_kl_ratio_vs_per_token" not in df:
        return []
    out = []
    for scope, what in (("latent", "the latent in FP8, RoPE in BF16"), ("both", "latent and RoPE in FP8")):
        sel = df[df["scope"] == scope].set_index("variant")
        parts = []
        for v in sel.index:
            if v == "per_token":
                continue
            r = sel.loc[v]
            parts.append(f"{v} {_ci(r, 'decode_kl_ratio_vs_per_token')} ({_p(r['decode_kl_vs_per_token_p'])})")
        if parts:
            r0 = sel.iloc[0]
            out.append(Claim("granularity", (
                f"Decode KL over per-token scales ({what}), paired on the same positions: " + "; ".join(parts)
                + f" ({_n(r0['decode_n_sequences'], r0['decode_n_positions'])}; a per_channel/gN cache keeps "
                "its last, not yet grouped, < N tokens in 16 bits, as KIVI does)."), rel))
        if "per_channel" in sel.index and "decode_kl_ratio_frozen_vs_grouped" in sel:
            r = sel.loc["per_channel"]
            if math.isfinite(r["decode_kl_ratio_frozen_vs_grouped"]):
                out.append(Claim("granularity", (
                    f"The scale policy alone ({what}): per-channel scales frozen at prefill have "
                    f"{_ci(r, 'decode_kl_ratio_frozen_vs_grouped')}x the decode KL of per-channel scales "
                    f"recomputed per token group (KIVI) ({_p(r['decode_kl_frozen_vs_grouped_p'])}; "
                    f"{_n(r['decode_n_sequences'], r['decode_n_positions'])}); under quantized prefill, where "
                    f"no scale is frozen, {_ci(r, 'prefill_kl_ratio_frozen_vs_grouped')}."), rel))
    return out


def rope_vs_nope_claims(root: Path) -> list[Claim]:
    from scipy import stats

    rel = "results/rope_vs_nope/table.csv"
    df = _read(root, rel)
    if df is None or not {"attn_err_fp8_only_rope", "attn_err_fp8_only_nope"} <= set(df):
        return []
    worse = int((df["attn_err_fp8_only_rope"] > df["attn_err_fp8_only_nope"]).sum())
    n = len(df)
    p = stats.binomtest(worse, n, 0.5).pvalue
    ratio = df["attn_err_fp8_only_rope"] / df["attn_err_fp8_only_nope"]
    return [Claim("RoPE vs NoPE", (
        f"Attention-output error with only the RoPE key in FP8 exceeds that with only the latent in FP8 in "
        f"{worse} of {n} layers (exact sign test over layers, {_p(p)}); per layer the ratio ranges "
        f"{_g(ratio.min())}-{_g(ratio.max())} (median {_g(ratio.median())})."), rel)]


def long_context_claims(root: Path) -> list[Claim]:
    """Per config: decode KL of the shallowest and the deepest window, and their paired change."""
    rel = "results/long_context/table.csv"
    df = _read(root, rel)
    if df is None or not {"depth", "kl_mean_ci_low"} <= set(df):
        return []
    change = _read(root, "results/long_context/depth_change.csv")
    out = []
    for cfg, g in df.groupby("config", sort=False):
        if cfg == "bf16":
            continue
        g = g.sort_values("depth")
        first, last = g.iloc[0], g.iloc[-1]
        text = (f"{cfg}: decode KL of {int(last['n_positions'] // last['n_sequences'])}-step windows "
                f"{_ci(first, 'kl_mean', 3)} at cache depth {int(first['depth'])}, {_ci(last, 'kl_mean', 3)} at "
                f"{int(last['depth'])} (flip rate {_ci(first, 'flip_rate', 3)} and {_ci(last, 'flip_rate', 3)}")
        c = None if change is None else change[(change["config"] == cfg) & (change["metric"] == "kl_mean")]
        if c is not None and len(c):
            c = c.iloc[0]
            text += (f"; paired change {_g(c['delta'], 3)} [{_g(c['ci_low'], 3)}, {_g(c['ci_high'], 3)}], "
                     f"{_p(c['p_value'])}")
        out.append(Claim("long context", text + f"; {_n(last['n_sequences'], last['n_positions'])} per depth).", rel))
    return out


def task_claims(root: Path) -> list[Claim]:
    rel = "results/tasks/calibration.csv"
    df = _read(root, rel)
    need = {"task", "accuracy", "ci_low", "ci_high", "n"}
    if df is None or not need <= set(df):
        return []
    out = []
    for _, r in df.iterrows():
        if "default" in df and not bool(r["default"]):
            continue
        mde = f"; minimum detectable paired drop at n = {int(r['n'])}: {_g(r['mde'])}" if "mde" in df and \
            math.isfinite(r["mde"]) else ""
        out.append(Claim("tasks", (
            f"{r['task']} at its default difficulty: BF16 accuracy {_g(r['accuracy'])} "
            f"[{_g(r['ci_low'])}, {_g(r['ci_high'])}] (Clopper-Pearson, n = {int(r['n'])}){mde}."), rel))
    return out


def _delta(r: pd.Series) -> str:
    return (f"{_g(r['delta'])} [{_g(r['ci_low'])}, {_g(r['ci_high'])}] ({_p(r['p_value'])}; "
            f"{_n(r['n_sequences'], r['n_positions'])})")


RESEARCH = "results/research_model"
# (a, b) pairs of each analysis the research model's claims state, as named in its comparisons files.
RESEARCH_PAIRS = {
    "rope_vs_nope": (("bf16", "latent_fp8_rope_bf16", "the latent in FP8, RoPE in BF16"),
                     ("bf16", "latent_bf16_rope_fp8", "the RoPE key in FP8, the latent in BF16"),
                     ("latent_fp8_rope_bf16", "both_fp8_per_token", "adding the RoPE key in FP8 to an FP8 latent")),
    "granularity": (("per_token", "per_tensor_dynamic", "per-tensor (dynamic) instead of per-token scales"),
                    ("per_token", "per_channel_group64", "per-channel scales per group of 64 tokens instead of "
                                                         "per-token"),
                    ("per_channel_frozen", "per_channel_group64", "per-channel scales recomputed per 64-token group "
                                                                  "instead of frozen at prefill")),
    "pv_pipeline": (("fp8_q_fp8_p_scale_fused", "fp8_q_fp8_p_naive", "naive FP8 P instead of scale-fused FP8 P"),
                    ("bf16_q_bf16_p", "fp8_q_fp8_p_scale_fused", "FP8 query and scale-fused FP8 P instead of BF16 "
                                                                 "query and P")),
}


def research_model_claims(root: Path) -> list[Claim]:
    """The research-scale model's (DeepSeek-V2-Lite attention dims, trained on the H200) analyses: each
    comparison as a paired difference of mean decode KL with its interval, p and n."""
    out = []
    for part, pairs in RESEARCH_PAIRS.items():
        rel = f"{RESEARCH}/comparisons_{part}.csv"
        df = _read(root, rel)
        if df is None:
            continue
        df = df[df["metric"] == "kl_mean"]
        said = []
        for a, b, what in pairs:
            hit = df[(df["a"] == a) & (df["b"] == b)]
            if len(hit):
                said.append(f"{what}: {_delta(hit.iloc[0])}")
        if said:
            out.append(Claim(f"research model (V2-Lite attention dims), {part.replace('_', ' ')}",
                             "Mean decode KL against the unpatched BF16 model: the difference each change makes, "
                             "paired on the same positions (sign-flip p over sequences): " + "; ".join(said) + ".", rel))
    rel = f"{RESEARCH}/eval.json"
    f = root / rel
    if f.is_file():
        import json

        tasks = (json.loads(f.read_text()).get("models", {}).get("research", {}) or {}).get("tasks", {})
        if tasks:
            inside = [k for k, v in tasks.items() if 0.4 <= v["score"] <= 0.9]
            lo, hi = min(v["score"] for v in tasks.values()), max(v["score"] for v in tasks.values())
            out.append(Claim("research model, tasks", (
                f"BF16 accuracy {_g(lo)}-{_g(hi)} over {len(tasks)} task settings (n = "
                f"{min(v['n'] for v in tasks.values())} each); "
                + (f"{len(inside)} in [0.4, 0.9]." if inside else
                   "none lies in [0.4, 0.9], so its task scores cannot show an FP8 effect.")), rel))
    out += _research_task_fp8_claims(root)
    return _research_model_summary(root) + out


def _research_model_summary(root: Path) -> list[Claim]:
    """What the research model is (training, held-out loss beside the embedded model's on the same held-out
    code) and whether its activations have the outliers of real LLMs."""
    import json

    out = []
    info, ev = root / RESEARCH / "training_info.json", root / RESEARCH / "eval.json"
    if info.is_file() and ev.is_file():
        t = json.loads(info.read_text())
        models = json.loads(ev.read_text()).get("models", {})

        def nll(model: str, text: str) -> str:
            h = models.get(model, {}).get("heldout", {}).get(text)
            if not h:
                return "n/a"
            ci = h.get("nll_ci", [math.nan, math.nan])
            return (f"{h['nll']:.2f} [{ci[0]:.2f}, {ci[1]:.2f}] nats/token ({h['windows']} windows of "
                    f"{h['window']} tokens)")

        out.append(Claim("research model, training", (
            f"{t['params'] / 1e6:.0f}M parameters, {t['step']} steps, {t['tokens'] / 1e6:.1f}M tokens "
            f"({t['train_seconds']:.0f} s on one GPU). Held-out code: {nll('research', 'code')}; the embedded model "
            f"on the same files: {nll('embedded', 'code')}. Intervals: 95% bootstrap over windows."),
            f"{RESEARCH}/eval.json"))
    st = root / RESEARCH / "study.json"
    if st.is_file():
        m = json.loads(st.read_text()).get("models", {}).get("research")
        if m:
            rope = max(r["absmax_over_rms"] for r in m["cache"] if r["part"] == "rope")
            nope = max(r["absmax_over_rms"] for r in m["cache"] if r["part"] == "nope")
            mm = max(r["max_over_median"] for r in m["massive"])
            out.append(Claim("research model, activations", (
                f"largest |x| / RMS over {len(m['massive'])} layers: RoPE key {rope:.1f}, normalised latent "
                f"{nope:.1f}; residual-stream max / median {mm:.1f} (real LLMs show a few activations up to 100,000x "
                "larger than the rest: Sun et al. 2024, docs/references.md): the outliers SnapMLA is designed around "
                "are absent."),
                f"{RESEARCH}/study.json"))
    return out


def _research_task_fp8_claims(root: Path) -> list[Claim]:
    """Task accuracy under each FP8 preset on the settings where the research model's BF16 score is in
    [0.4, 0.9]: Clopper-Pearson intervals, and the exact McNemar test on the same documents."""
    import json

    from .significance import proportion_interval

    rel = f"{RESEARCH}/analyses.json"
    f = root / rel
    if not f.is_file():
        return []
    rows = ((json.loads(f.read_text()).get("parts", {}) or {}).get("tasks", {}) or {}).get("rows", [])
    out = []
    for task in dict.fromkeys(r["task"] for r in rows):
        said = []
        mine = [r for r in rows if r["task"] == task]
        for r in mine:
            n = int(r["n"])
            lo, hi = proportion_interval(round(r["score"] * n), n)
            said.append(f"{r['config']} {_g(r['score'])} [{_g(lo)}, {_g(hi)}]"
                        + ("" if r["config"] == "bf16" else
                           f" (vs unpatched BF16 {_g(r['delta'])}; documents right only in BF16 / only under FP8: "
                           f"{r['discordant'][0]}/{r['discordant'][1]}, exact McNemar {_p(r['p_value'])})"))
        if said:
            out.append(Claim("research model, tasks under FP8", (
                f"{task} (BF16 score in [0.4, 0.9]), accuracy with Clopper-Pearson 95% intervals, n = "
                f"{mine[0]['n']} documents: " + "; ".join(said) + "."), rel))
    return out


KERNEL_TABLES = ("results/bench/decode_anchor_h200.csv", "results/gpu_check/decode_h200.csv")


def kernel_claims(root: Path) -> list[Claim]:
    """Decode time against FlashMLA's BF16 kernel, same process and values, at the headline shapes: from the
    dedicated anchor run (`device_anchor.sh`) when there is one, else from the kernels' GPU check."""
    rel = next((r for r in KERNEL_TABLES if (root / r).is_file()), KERNEL_TABLES[-1])
    df = _read(root, rel)
    if df is None or "vs_flashmla" not in df:
        return []
    df = df[(df["op"] == "decode") & df["vs_flashmla"].notna()]
    out = []
    for variant, what in (("snapmla", "FP8 (SnapMLA, default kernels)"), ("snapmla+gluon+fp8mma",
                          "FP8 with the opt-in native FP8 MMA kernels"), ("bf16", "our BF16 kernel")):
        rows = df[df["variant"] == variant]
        if rows.empty:
            continue
        cells = [f"{r['shape']} {_g(r['vs_flashmla'])} [{_g(r['vs_flashmla_lo'])}, {_g(r['vs_flashmla_hi'])}]"
                 for _, r in rows.iterrows()]
        runs = int(rows["runs"].min())
        out.append(Claim("kernels (H200)", (
            f"Decode time of {what} over FlashMLA's BF16 kernel on the same values in the same process (B x H x L; "
            f"below 1 is faster; 95% bootstrap over >= {runs} timed runs each): " + "; ".join(cells) + "."), rel))
    return out


CLAIMS: tuple[Callable[[Path], list[Claim]], ...] = (
    pv_pipeline_claims, granularity_claims, rope_vs_nope_claims, long_context_claims, task_claims,
    research_model_claims, kernel_claims)


def collect(root: str | Path) -> tuple[list[Claim], list[str]]:
    """(claims, names of the claim families whose table is missing) from the results under `root`."""
    claims, missing = [], []
    for fn in CLAIMS:
        got = fn(Path(root))
        claims += got
        if not got:
            missing.append(fn.__name__.removesuffix("_claims"))
    return claims, missing


def render(claims: list[Claim], missing: list[str]) -> str:
    """The Markdown block the README quotes (without the BEGIN/END markers)."""
    lines = []
    for c in claims:
        lines.append(f"- **{c.topic}.** {c.text} (`{c.source}`)")
    if missing:
        lines.append(f"- Not measured in the committed results: {', '.join(missing)}.")
    return "\n".join(lines) + "\n"


def claims_file(root: str | Path) -> str:
    claims, missing = collect(root)
    return ("# Claims the results support\n\nWritten by `python scripts/write_claims.py` from the tables named "
            "in each line; the README quotes the list below. Intervals are 95%.\n\n"
            f"{BEGIN}\n{render(claims, missing)}{END}\n")


def quoted_block(text: str) -> str:
    """The text between the BEGIN and END markers of a README or claims file."""
    i, j = text.find(BEGIN), text.find(END)
    if i == -1 or j == -1 or j < i:
        raise ValueError(f"no {BEGIN} ... {END} block")
    return text[i + len(BEGIN):j].strip("\n") + "\n"
