"""Third-party output during a sweep: lm-eval's log chatter and every tqdm bar are switched off.

What a sweep prints is snapquant's own display (the rich progress bars, or nothing with
`--no-progress`) and its results. lm-eval logs INFO/WARNING lines while it builds tasks and wraps
models ("metric ... is defined, but aggregation is not", "Passed an already-initialized model ...")
before its own `verbosity` setting takes effect, and draws tqdm bars in its request loops whatever
the caller asks; transformers draws one while loading weights. Errors are still printed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

LOGGERS = ("lm_eval", "lm-eval")


@contextmanager
def quiet_libraries() -> Iterator[None]:
    """Inside: lm-eval logs errors only, tqdm bars (lm-eval's, transformers') are disabled. Restored on exit."""
    import tqdm.std

    saved_levels = {name: logging.getLogger(name).level for name in LOGGERS}
    for name in LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # lm-eval has no switch for its bars: every tqdm is created disabled (subclasses such as
    # tqdm.auto's call this __init__ too). A disabled tqdm still iterates and counts, silently.
    tqdm_init = tqdm.std.tqdm.__init__

    def disabled_init(self, *args, **kwargs):
        kwargs["disable"] = True
        tqdm_init(self, *args, **kwargs)

    tqdm.std.tqdm.__init__ = disabled_init
    hf_logging = _transformers_logging()
    hf_bars = hf_logging is not None and hf_logging.is_progress_bar_enabled()
    if hf_bars:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        tqdm.std.tqdm.__init__ = tqdm_init
        if hf_bars:
            hf_logging.enable_progress_bar()
        for name, level in saved_levels.items():
            logging.getLogger(name).setLevel(level)


def _transformers_logging():
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    return hf_logging
