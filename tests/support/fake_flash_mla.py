"""A pure-PyTorch stand-in for the `flash_mla` package (its dense decode API and page layout), for CPU tests.

It reads what the real kernel reads and nothing else: the query, the pages of `k_cache` [pages, 64, 1, r + d]
named by `block_table`, `cache_seqlens` tokens per request, the metadata object (filled by the first call,
then checked against later ones, as upstream's wrapper does). Attention is computed in fp32 from those
pages (scores over all r + d columns, values = the first head_dim_v), the output rounded to bf16 and the
LSE returned [B, H, S] in natural log, +inf (and a zero output) for a query that sees no token. So a wrong
layout conversion, block table, length or softmax scale on snapquant's side gives a wrong answer here.

    install(monkeypatch) -> the fake module, importable as `flash_mla` for the rest of the test
    on_cpu()             -> (a context manager) the registry's `flashmla` backend allowed on CPU, where the fake runs
"""

from __future__ import annotations

import contextlib
import math
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class FakeSchedMeta:
    have_initialized: bool = False
    config: tuple | None = None
    calls: int = 0


@dataclass
class Recorder:
    calls: int = 0  # every call
    fills: int = 0  # calls that found their metadata empty and filled it (the schedule computation)


def get_mla_metadata(*args, **kwargs) -> tuple[FakeSchedMeta, None]:
    return FakeSchedMeta(), None


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata: FakeSchedMeta,
                           num_splits: None = None, softmax_scale: float | None = None, causal: bool = False,
                           **unsupported) -> tuple[torch.Tensor, torch.Tensor]:
    if unsupported:
        raise TypeError(f"fake flash_mla: unexpected arguments {sorted(unsupported)}")
    meta = tile_scheduler_metadata
    assert isinstance(meta, FakeSchedMeta), "tile_scheduler_metadata must come from get_mla_metadata()"
    assert num_splits is None, "num_splits must be None"
    assert q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16, (q.dtype, k_cache.dtype)
    assert q.dim() == 4 and k_cache.dim() == 4 and k_cache.shape[1] == 64 and k_cache.shape[2] == 1, (
        tuple(q.shape), tuple(k_cache.shape))
    assert k_cache.stride(-1) == 1, "k_cache needs a contiguous last dimension"
    assert q.shape[-1] == k_cache.shape[-1], (q.shape, k_cache.shape)
    assert block_table.dtype == torch.int32 and cache_seqlens.dtype == torch.int32
    B, S, H, D = q.shape
    assert block_table.shape[0] == B and cache_seqlens.shape == (B,)
    config = (B, S, H, k_cache.shape[1], k_cache.shape[2], causal)
    if not meta.have_initialized:
        meta.have_initialized, meta.config = True, config
        RECORDER.fills += 1
    else:
        assert meta.config == config, "metadata reused with other shapes"
    meta.calls += 1
    RECORDER.calls += 1
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(B, S, H, head_dim_v, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, S), math.inf, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(cache_seqlens[b])
        if n == 0:
            continue
        pages = block_table[b, : math.ceil(n / 64)].long()
        kv = k_cache[pages, :, 0, :].reshape(-1, D)[:n].float()  # [n, D]
        s = torch.einsum("shd,nd->shn", q[b].float(), kv) * scale  # [S, H, n]
        if causal:
            limit = n - (S - 1 - torch.arange(S, device=q.device))  # query i sees tokens < n - S + 1 + i
            s = s.masked_fill(torch.arange(n, device=q.device).view(1, 1, n) >= limit.view(S, 1, 1), -math.inf)
        row_lse = torch.logsumexp(s, dim=-1)  # [S, H]
        seen = torch.isfinite(row_lse)
        p = torch.exp(s - torch.where(seen, row_lse, 0.0)[..., None])
        p = torch.where(seen[..., None], p, 0.0)
        out[b] = torch.einsum("shn,nv->shv", p, kv[:, :head_dim_v])
        lse[b] = torch.where(seen, row_lse, math.inf).transpose(0, 1)
    return out.to(torch.bfloat16), lse


RECORDER = Recorder()


def module() -> types.ModuleType:
    mod = types.ModuleType("flash_mla")
    mod.get_mla_metadata = get_mla_metadata
    mod.flash_mla_with_kvcache = flash_mla_with_kvcache
    mod.RECORDER = RECORDER
    mod.__version__ = "fake"
    return mod


def install(monkeypatch) -> types.ModuleType:
    """Make `import flash_mla` return the fake for the rest of the test (monkeypatch undoes it)."""
    RECORDER.calls = RECORDER.fills = 0
    mod = module()
    monkeypatch.setitem(sys.modules, "flash_mla", mod)
    return mod


def uninstall(monkeypatch) -> None:
    """Make `import flash_mla` fail for the rest of the test, whatever is installed."""
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # a None entry makes the import raise ImportError


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """The `flashmla` backend registered with needs_cuda=False while the block runs (the fake runs on CPU)."""
    from snapquant.attention.backends import register_backend

    entry = dict(fn="snapquant.attention.flashmla:flashmla_backend", supports="snapquant.attention.flashmla:supports")
    register_backend("flashmla", **entry, needs_cuda=False)
    try:
        yield
    finally:
        register_backend("flashmla", **entry, needs_cuda=True)
