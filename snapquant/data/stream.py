"""Training rows as a torch `IterableDataset`: each data worker builds its own `RowBuilder`.

Shared by the embedded-model and research-model trainers. Worker `i` draws from stream
`stream_offset + i` of the mixture's seed namespace, so a resumed run (a new offset) continues
with fresh, still deterministic rows instead of replaying the ones already trained on.
"""

from __future__ import annotations

from typing import Any


def row_stream(corpus: str, tokenizer_path: str, spec: Any, seed: int, stream_offset: int = 0):
    """An IterableDataset of (row [seq_len + 1] int64, kind) from a `load_corpus` folder."""
    import numpy as np
    import torch

    from .build import load_corpus
    from .mixture import RowBuilder
    from .tokenizer import load_fast_tokenizer

    class RowStream(torch.utils.data.IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            stream = stream_offset + (info.id if info is not None else 0)
            train, _, meta = load_corpus(corpus)
            builder = RowBuilder(train, load_fast_tokenizer(tokenizer_path), meta["eos_id"], spec, seed, stream)
            for row, kind in builder.rows():
                yield torch.from_numpy(row.astype(np.int64)), kind

    return RowStream()
