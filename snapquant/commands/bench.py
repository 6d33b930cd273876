"""`snapquant bench`: the MLA decode benchmark (also `python scripts/bench_decode.py`, the same command)."""

from __future__ import annotations

from pathlib import Path

import typer

from ._app import app


@app.command("bench")
def bench(
    out: Path = typer.Option(Path("results/bench"), help="Output directory."),
    quick: bool = typer.Option(False, "--quick", help="4 headline shapes, 8 variants, shorter budget (170 s)."),
    shapes: str = typer.Option(None, help="Comma list of shape names or BxHxL (default: the target shapes; "
                                          "on CPU tiny ones, see --list)."),
    variants: str = typer.Option(None, help="Comma list of variant names or globs (default: all)."),
    priority: int = typer.Option(2, help="Highest variant priority to run: 0 core, 1 variants, 2 sweeps."),
    budget_s: float = typer.Option(None, "--budget-s", help="Time budget of the measurements in seconds "
                                                            "(default 400, quick 170)."),
    timer: str = typer.Option("auto", help="auto (cudagraph on CUDA, wall on CPU) | cudagraph | do_bench | "
                                           "events | wall."),
    device: str = typer.Option("auto", help="auto (cuda if available) | cuda | cuda:N | cpu (Triton interpreter, "
                                            "tiny sizes only)."),
    tag: str = typer.Option(None, help="File name tag (default: h200 on an H200, else the GPU's name; cpu)."),
    append: bool = typer.Option(True, "--append/--no-append", help="Also time quantize-and-append."),
    append_tokens: int = typer.Option(None, help="Tokens per append measurement (default 65536; 16 on CPU)."),
    rotate: float = typer.Option(4.0, help="Rotate inputs over this many L2 sizes (0: no rotation)."),
    dims: str = typer.Option(None, help="kv_lora_rank,rope_dim (default 512,64; 128,16 on CPU)."),
    seed: int = typer.Option(0, help="Seed of the random caches and queries."),
    kernel_options: str = typer.Option(None, metavar="K=V,...", help="Also run each core kernel variant with these "
                                       "decode knobs (e.g. num_splits=8,fp8_mma=qk), as <variant>+options, checked "
                                       "against it."),
    list_: bool = typer.Option(False, "--list", help="Print the shapes and variants and exit."),
    replot: Path = typer.Option(None, metavar="CSV", help="Redraw the figure and summary from a run's CSV."),
    compile_stats: bool = typer.Option(False, "--compile-stats", help="Compile every selected variant for --arch "
                                       "(no GPU needed) and write compile_stats_<tag>.csv."),
    arch: int = typer.Option(90, help="Compute capability for --compile-stats."),
) -> None:
    """FP8 vs BF16 MLA decode timing, every kernel variant side by side (CUDA graphs, L2-rotated inputs).

    Writes decode_<tag>.csv/.md/.png/.pdf and bench_<tag>.json/.log into --out, the CSV and markdown
    after every shape, so a run stopped by its budget or killed still leaves results.
    """
    from ..bench.runner import BenchOptions, run_bench
    from ..errors import ConfigError

    opts = BenchOptions(out=out, quick=quick, shapes=shapes, variants=variants, priority=priority, budget_s=budget_s,
                        timer=timer, device=device, tag=tag, append=append, append_tokens=append_tokens, rotate=rotate,
                        dims=dims, seed=seed, kernel_options=kernel_options, list=list_, replot=replot, compile_stats=compile_stats, arch=arch)
    try:
        rc = run_bench(opts)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(rc)
