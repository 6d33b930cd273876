"""`snapquant formats`: the table of every preset with bytes/token and measured error."""

from __future__ import annotations

from pathlib import Path

import typer

from ._app import app

OUT_SUFFIXES = (".csv", ".md", ".json")


@app.command("formats")
def formats(
    preset: list[str] = typer.Option(None, "--preset", "-p", help="Presets to include (default: all)."),
    tokens: int = typer.Option(2048, help="Synthetic context length."),
    kv_lora_rank: int = typer.Option(512, help="Latent width (DeepSeek: 512)."),
    rope_dim: int = typer.Option(64, help="RoPE width (DeepSeek: 64)."),
    heads: int = typer.Option(16, help="Query heads."),
    seed: int = typer.Option(0, help="Seed of the synthetic cache and queries."),
    out: Path = typer.Option(None, help="Also write the table here (.csv, .md or .json, chosen by the suffix)."),
) -> None:
    """Every KV format: bytes/token and its error on a synthetic latent with RoPE-like outlier channels."""
    from rich.console import Console
    from rich.table import Table

    from ..errors import ConfigError
    from ..quant.report import format_report
    from ._checks import check_int, check_suffix

    console = Console(width=None if Console().is_terminal else 120)
    try:
        for option, value in (("--tokens", tokens), ("--kv-lora-rank", kv_lora_rank), ("--rope-dim", rope_dim),
                              ("--heads", heads)):
            check_int(option, value, minimum=1)
        check_suffix("--out", out, OUT_SUFFIXES)
        with console.status("quantizing and decoding every preset..."):
            df = format_report(preset or None, tokens, kv_lora_rank, rope_dim, heads, seed=seed)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None

    table = Table(title=f"KV formats on a synthetic MLA cache (r={kv_lora_rank}, d={rope_dim}, T={tokens}, "
                        f"H={heads}, seed={seed}); errors vs exact fp64 attention")
    headers = {"preset": "preset", "bytes_per_token": "B/token", "ratio_vs_bf16": "x bf16",
               "nope_sqnr_db": "NoPE dB", "rope_sqnr_db": "RoPE dB", "out_rel_l2": "out relL2",
               "out_rel_l2_worst_row": "worst row", "lse_abs_err_max": "LSE err"}
    cols = list(headers)
    for c in cols:
        table.add_column(headers[c], justify="left" if c == "preset" else "right", no_wrap=True)
    for _, row in df.iterrows():
        table.add_row(*(_fmt(row[c]) for c in cols))
    console.print(table)
    if out is not None:
        import json

        from ..atomic import atomic_write_text
        from ..environment import environment

        meta = {"command": "snapquant formats", "parameters": dict(df.attrs), "environment": environment()}
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.suffix == ".csv":
            atomic_write_text(out, df.to_csv(index=False))
        elif out.suffix == ".md":
            atomic_write_text(out, df.to_markdown(index=False, floatfmt=".4g") + "\n\n```json\n"
                              + json.dumps(meta, indent=1) + "\n```\n")
        else:  # .json (the suffix was checked before computing)
            atomic_write_text(out, json.dumps({**meta, "rows": df.to_dict(orient="records")}, indent=2))
        if out.suffix == ".csv":
            atomic_write_text(out.with_suffix(".meta.json"), json.dumps(meta, indent=2))
        console.print(f"wrote {out}")


def _fmt(v: object) -> str:
    if isinstance(v, float):
        if v == float("inf"):
            return "exact"
        return f"{v:.4g}"
    return str(v)
