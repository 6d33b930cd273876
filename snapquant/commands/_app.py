"""The shared typer application every command module registers on."""

import typer

app = typer.Typer(
    name="snapquant",
    help="FP8 latent KV-cache quantization for MLA models: formats, patching, sweeps, tables, kernels.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


@app.callback()
def _main() -> None:
    """FP8 latent KV-cache quantization for MLA models."""
