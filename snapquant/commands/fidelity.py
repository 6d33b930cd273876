"""`snapquant fidelity`: KL / top-1 / perplexity of quantized KV caches vs the unquantized model."""

from __future__ import annotations

from pathlib import Path

import typer

from ._app import app


@app.command("fidelity")
def fidelity(
    preset: list[str] = typer.Option(None, "--preset", "-p", help="Configs to measure (presets or config files); default snapmla, per_tensor_fp8."),
    model: str = typer.Option("embedded", help="'embedded' or a Hugging Face checkpoint directory."),
    text: Path = typer.Option(None, help=".txt or .jsonl ('text' field); default: the held-out code text."),
    seq_len: int = typer.Option(128, help="Tokens per sequence."),
    num_sequences: int = typer.Option(16, help="Sequences scored: one per document of the text round-robin, "
                                                 "each past the document's header."),
    seed: int = typer.Option(0, help="Which documents and token offsets the sequences are drawn at."),
    prompt_len: int = typer.Option(32, help="Decode mode: tokens prefilled before stepping."),
    mode: list[str] = typer.Option(None, "--mode", help="prefill and/or decode (default both)."),
    backend: str = typer.Option("auto", help="Decode backend: auto, reference, triton or another registered one."),
    kernel_options: str = typer.Option(None, help="The decode kernels' knobs: key=value,... (e.g. num_splits=8)."),
    model_dtype: str = typer.Option("float32", help="auto | float32 | bfloat16 | float16."),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N."),
    out: Path = typer.Option(None, help="Write fidelity.csv and fidelity.md into this directory."),
) -> None:
    """Next-token KL (mean, p99, max, share > 0.1), top-1 agreement and perplexity delta, each with a 95%
    cluster-bootstrap interval over sequences, with quantized prefill and in step-by-step decode."""
    import functools

    import pandas as pd

    from ..atomic import atomic_write_text
    from ..attention.backends import check_kernel_options, kernel_options_from_text
    from ..errors import ConfigError, ShapeError
    from ..eval.fidelity import MODES, fidelity_metrics, fidelity_reference, fidelity_sample, fidelity_table
    from ..eval.model import load_model, load_tokenizer
    from ..patching import patched
    from ..presets import resolve_config
    from ._checks import check_int

    try:
        configs = [resolve_config(p) for p in (preset or ["snapmla", "per_tensor_fp8"])]
        modes = tuple(mode or MODES)
        _check_arguments(model, text, seq_len, num_sequences, prompt_len, modes, backend, model_dtype, device, out)
        check_int("--seed", seed, minimum=0)
        options = kernel_options_from_text(kernel_options) if kernel_options else None
        check_kernel_options(backend, options)  # before any model loads, as the other options
        patcher = functools.partial(patched, kernel_options=options) if options else patched
        # the text first: a source too short for the sequences fails before the model loads
        sample = fidelity_sample(load_tokenizer(model), text, seq_len, num_sequences, seed=seed)
        m, _ = load_model(model, dtype=model_dtype, device=device)
        ref = fidelity_reference(m, sample.input_ids)
        res = {c.label(): fidelity_metrics(m, ref, c, modes=modes, prompt_len=prompt_len, backend=backend,
                                           patcher=patcher) for c in configs}
    except (ConfigError, ShapeError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    df = fidelity_table(res)
    md = summary_markdown(df)
    typer.echo(md)
    if out is not None:
        atomic_write_text(out / "fidelity.csv", df.to_csv(index=False))
        atomic_write_text(out / "fidelity.md", md)
        # where each sequence came from, to find the context of a large-KL position
        atomic_write_text(out / "sequences.csv", pd.DataFrame(sample.records()).assign(
            source=sample.source, method=sample.method, seed=sample.seed).to_csv(index=False))
        typer.echo(f"wrote {out / 'fidelity.csv'}, {out / 'fidelity.md'} and {out / 'sequences.csv'}", err=True)


SUMMARY_COLUMNS = (("KL mean", "kl_mean"), ("KL p99", "kl_p99"), ("KL max", "kl_max"), ("KL>0.1", "share_kl_gt_0.1"),
                   ("top-1", "top1_agree"), ("ppl Δ", "ppl_delta"))


def summary_markdown(df) -> str:
    """One row per (config, mode): n and each statistic as `value [95% CI]`."""
    import math

    def cell(r, key: str) -> str:
        v, lo, hi = r.get(key), r.get(f"{key}_ci_low"), r.get(f"{key}_ci_high")
        if v is None or not math.isfinite(v):
            return "n/a"
        s = f"{v:.4g}"
        if lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi):
            s += f" [{lo:.3g}, {hi:.3g}]"
        return s

    head = ["config", "mode", "n (seq / pos)", *(h for h, _ in SUMMARY_COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join([str(r["config"]), str(r["mode"]), f"{r['n_sequences']} / {r['n_positions']}",
                                        *(cell(r, k) for _, k in SUMMARY_COLUMNS)]) + " |")
    return "\n".join(lines) + ("\n\n95% intervals: cluster bootstrap over sequences (percentile); the maximum's "
                               "cannot exceed the observed maximum. Paired comparisons and the largest positions: "
                               "`snapquant table` on a sweep.\n")


def _check_arguments(model: str, text: Path | None, seq_len: int, num_sequences: int, prompt_len: int,
                     modes: tuple[str, ...], backend: str, model_dtype: str, device: str, out: Path | None) -> None:
    """Every option, before the model loads (ConfigError naming the option)."""
    from ..attention.backends import BACKEND_CHOICES
    from ..errors import ConfigError
    from ..eval.fidelity import MODES
    from ._checks import (
        MODEL_DTYPES,
        check_choices,
        check_device,
        check_int,
        check_model,
        check_out_dir,
        check_text,
    )

    check_choices("--mode", modes, MODES)
    check_choices("--backend", [backend], BACKEND_CHOICES)
    check_choices("--model-dtype", [model_dtype], MODEL_DTYPES)
    check_int("--seq-len", seq_len, minimum=3)  # a next-token KL needs a context and two targets
    check_int("--num-sequences", num_sequences, minimum=1)
    if "decode" in modes and not 1 <= prompt_len <= seq_len - 2:  # decode steps through >= 2 tokens after it
        raise ConfigError(f"--prompt-len={prompt_len} is not valid for --seq-len={seq_len}; expected an integer "
                          f"in [1, {seq_len - 2}] (decode prefills the prompt, then steps through the rest)")
    check_model("--model", model)
    check_text("--text", text)
    check_device("--device", device)
    check_out_dir("--out", out)
