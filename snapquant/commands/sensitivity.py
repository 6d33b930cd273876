"""`snapquant sensitivity`: per-layer, per-channel statistics and quantization error of the MLA cache."""

from __future__ import annotations

from pathlib import Path

import typer

from ._app import app


@app.command("sensitivity")
def sensitivity(
    model: str = typer.Option("embedded", help="'embedded' or a Hugging Face checkpoint directory."),
    text: Path = typer.Option(None, help=".txt or .jsonl ('text' field) to run on (default: the held-out code text)."),
    seq_len: int = typer.Option(256, help="Tokens per sequence."),
    num_sequences: int = typer.Option(4, help="Sequences (rows) to analyse."),
    dtype: list[str] = typer.Option(None, "--dtype", help="Element formats to test (default fp8_e4m3, fp8_e5m2, int8, int4)."),
    granularity: list[str] = typer.Option(None, "--granularity", help="Granularities (default: all four dynamic ones)."),
    scheme: list[str] = typer.Option(None, "--scheme", help="Extra full presets for the attention error."),
    block_size: int = typer.Option(64, help="Channels per scale for per_token_block."),
    outlier_sigma: float = typer.Option(6.0, help="Outlier threshold in units of the part's RMS."),
    model_dtype: str = typer.Option("float32", help="auto | float32 | bfloat16 | float16."),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N."),
    out: Path = typer.Option(Path("runs/sensitivity"),
                             help="Output directory (CSVs, summary.md, figures); the default runs/ is ignored by git, "
                                  "results meant to be committed go under results/ only when named here."),
    no_plots: bool = typer.Option(False, "--no-plots", help="Skip the figures."),
) -> None:
    """NoPE vs RoPE: absmax/std/kurtosis/outliers per channel, MSE/SQNR per dtype x granularity, attention error."""
    from ..analysis.sensitivity import (
        DEFAULT_DTYPES,
        DEFAULT_GRANULARITIES,
        DEFAULT_SCHEMES,
        sensitivity_report,
    )
    from ..analysis.text import load_texts, token_batches
    from ..errors import ConfigError, ShapeError
    from ..eval.model import load_model

    try:
        _check_arguments(model, text, seq_len, num_sequences, dtype, granularity, scheme, block_size, outlier_sigma,
                         model_dtype, device, out)
        texts = load_texts(text) if text else default_texts()
        m, tok = load_model(model, dtype=model_dtype, device=device)
        ids = token_batches(tok, texts, seq_len, num_sequences)
        rep = sensitivity_report(m, ids, dtypes=dtype or DEFAULT_DTYPES, granularities=granularity or DEFAULT_GRANULARITIES,
                                 schemes=scheme or DEFAULT_SCHEMES, block_size=block_size, outlier_sigma=outlier_sigma,
                                 model_name=model)
    except (ConfigError, ShapeError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    files = rep.save(out)
    if not no_plots:
        from ..analysis.sensitivity_plots import plot_sensitivity

        plot_sensitivity(rep, out)
    typer.echo(rep.to_markdown())
    typer.echo(f"wrote {len(files)} tables{'' if no_plots else ' and figures'} to {out}", err=True)


def _check_arguments(model: str, text: Path | None, seq_len: int, num_sequences: int, dtypes: list[str] | None,
                     granularities: list[str] | None, schemes: list[str] | None, block_size: int,
                     outlier_sigma: float, model_dtype: str, device: str, out: Path) -> None:
    """Every option, before the model loads (ConfigError naming the option)."""
    from ..analysis.sensitivity import DEFAULT_GRANULARITIES
    from ..presets import resolve_config
    from ..quant.dtypes import ELEMENT_FORMATS
    from ._checks import (
        MODEL_DTYPES,
        check_choices,
        check_device,
        check_int,
        check_model,
        check_out_dir,
        check_positive,
        check_text,
    )

    check_choices("--dtype", dtypes, ELEMENT_FORMATS)
    check_choices("--granularity", granularities, DEFAULT_GRANULARITIES)
    for s in schemes or ():
        resolve_config(s)
    check_choices("--model-dtype", [model_dtype], MODEL_DTYPES)
    check_int("--seq-len", seq_len, minimum=2)
    check_int("--num-sequences", num_sequences, minimum=1)
    check_int("--block-size", block_size, minimum=1)
    check_positive("--outlier-sigma", outlier_sigma)
    check_model("--model", model)
    check_text("--text", text)
    check_device("--device", device)
    check_out_dir("--out", out)


def default_texts() -> list[str]:
    """The embedded model's held-out text (never trained on), shipped with the snapquant tasks."""
    from ..analysis.text import load_texts
    from ..data.corpus import HELDOUT_FILE as p
    from ..errors import ConfigError

    if not p.is_file():
        raise ConfigError(f"no default text at {p}; pass --text FILE")
    return load_texts(p)
