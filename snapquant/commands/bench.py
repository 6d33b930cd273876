"""`snapquant bench`: the MLA decode benchmark (same options as scripts/bench_decode.py)."""

from __future__ import annotations

import typer

from ._app import app


@app.command(
    "bench",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def bench(ctx: typer.Context) -> None:
    """FP8 vs BF16 MLA decode timing on the benchmark shapes (CUDA graphs, L2-rotated inputs); `--help` for options."""
    from ..bench.runner import main

    raise typer.Exit(main(list(ctx.args)))
