"""The `snapquant` command line (typer + rich).

Commands live one per module in `snapquant/commands/`; each module registers itself on `app` when
imported, so a new command is a new file. Modules import heavy dependencies inside the command
functions to keep `snapquant --help` fast.
"""

from __future__ import annotations

import importlib
import pkgutil

from . import commands
from .commands._app import app

for _mod in pkgutil.iter_modules(commands.__path__):
    if not _mod.name.startswith("_"):
        importlib.import_module(f"{commands.__name__}.{_mod.name}")

__all__ = ["app"]


if __name__ == "__main__":
    app()
