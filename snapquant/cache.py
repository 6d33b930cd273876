"""`LatentCache`: an HF `Cache` whose MLA layers store the quantized latent (real codes and scales).

Each MLA layer is a `LatentLayer` holding a `LatentStore` (snapquant.attention.storage): the latent and
the shared RoPE key of every real token, quantized per the `KVQuantConfig`, in ragged rows (padding
tokens are not stored). The layer also tracks HF's view of the sequence (`get_seq_length()` counts
padded positions, as masks and position ids expect) and which HF positions hold a stored token, so
crop / beam reorder / batch select / repeat keep both in step. Other layers of hybrid models (linear
attention in kimi_linear, ...) are the stock HF layers built from the model config.

A patched model (`snapquant.patch`) reads the store directly through absorbed attention. Used through
the plain HF `update()` API (an unpatched MLA model), a layer returns the dequantized cache instead,
like HF's QuantizedCache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

from .attention.storage import DenseLatentStore, LatentStore, joint_rows_reason
from .config import KVQuantConfig
from .errors import ConfigError, ShapeError
from .presets import resolve_config


class _MaxCacheLen:
    """`max_cache_len` as a settable property over `_max_len`: some transformers versions (5.17) define
    a read-only `max_cache_len` on Cache and cache layers (derived from the layers), which would make
    the plain attribute assignment fail; this one reports the preallocation and HF's init may set it."""

    _max_len: int | None = None

    @property
    def max_cache_len(self) -> int | None:
        return self._max_len

    @max_cache_len.setter
    def max_cache_len(self, value: int | None) -> None:
        self._max_len = value


class LatentLayer(_MaxCacheLen, CacheLayerMixin):
    """One MLA layer's quantized latent cache, behind the HF cache-layer API."""

    is_sliding = False
    is_croppable = True
    is_compileable = False
    supports_early_init = False  # sized by the first real append (widths, dtype, device), not by export
    def __init__(self, config: KVQuantConfig | str = "snapmla", kv_lora_rank: int | None = None,
                 rope_dim: int | None = None, max_cache_len: int | None = None, joint_rows: bool = False,
                 **kwargs) -> None:
        super().__init__()
        self.config = resolve_config(config)
        self.joint_rows = joint_rows  # the store keeps latent and RoPE in one row (DenseLatentStore)
        if joint_rows and (reason := joint_rows_reason(self.config)) is not None:
            raise ConfigError(reason)
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        if max_cache_len is not None and (not isinstance(max_cache_len, int) or isinstance(max_cache_len, bool)
                                          or max_cache_len < 1):
            raise ShapeError(f"max_cache_len must be a positive int, got {max_cache_len!r}")
        self._max_len = max_cache_len  # HF positions (padding included), as in HF's StaticCache
        self.store: LatentStore | None = None
        self.seen = 0  # HF positions so far (padding included)
        # [B, seen] bool: HF positions that hold a stored token, kept as a materialized prefix plus a count
        # of trailing positions stored for every request (the graph-safe decode step only bumps the count).
        self._stored: torch.Tensor | None = None
        self._stored_pending = 0  # trailing positions, all stored, not yet materialized into _stored
        self._full_tail = 0  # trailing positions known to be stored for every request (rewind needs no sync)
        self.indexer_keys: torch.Tensor | None = None  # DSA indexer keys [B, seen, D], unquantized as in HF
        self.indexer_position_ids = None
        self.is_indexer_initialized = False

    def __repr__(self) -> str:
        return f"LatentLayer({self.config.label()}, seen={self.seen})"

    @property
    def stored(self) -> torch.Tensor | None:
        """`[B, seen]` bool: HF positions that hold a stored token."""
        if self._stored_pending and self._stored is not None:
            B = self._stored.shape[0]
            tail = torch.ones(B, self._stored_pending, dtype=torch.bool, device=self._stored.device)
            self._stored = torch.cat([self._stored, tail], dim=1)
            self._stored_pending = 0
        return self._stored

    @stored.setter
    def stored(self, value: torch.Tensor | None) -> None:
        self._stored, self._stored_pending = value, 0

    @property
    def batch_size(self) -> int:
        return 0 if self._stored is None else int(self._stored.shape[0])

    # ------------------------------------------------------------------ writing
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        r, d = key_states.shape[-1], value_states.shape[-1]
        for name, want, got in (("kv_lora_rank", self.kv_lora_rank, r), ("qk_rope_head_dim", self.rope_dim, d)):
            if want is not None and want != got:
                raise ShapeError(f"LatentLayer was built for {name}={want} but received width {got}")
        self.kv_lora_rank, self.rope_dim = r, d
        self.dtype, self.device = key_states.dtype, key_states.device
        self.store = DenseLatentStore(self.config, r, d, key_states.dtype, capacity=self.max_cache_len,
                                      joint_rows=self.joint_rows)
        self.is_initialized = True

    def check_room(self, new_positions: int) -> None:
        """Refuse (ShapeError) appending `new_positions` beyond `max_cache_len`; a no-op without one."""
        if self.max_cache_len is not None and self.seen + new_positions > self.max_cache_len:
            raise ShapeError(
                f"appending {new_positions} position(s) to {self.seen} would exceed max_cache_len="
                f"{self.max_cache_len} (the cache was preallocated for that many positions, padding included)"
            )

    def append(self, latent: torch.Tensor, rope: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Store `latent [B,S,r]` and `rope [B,S,d]`; `valid [B,S]` marks real tokens (None = all)."""
        if not self.is_initialized:
            self.lazy_initialization(latent, rope)
        B, S = latent.shape[:2]
        if valid is None:
            valid = torch.ones(B, S, dtype=torch.bool, device=latent.device)
        if self._stored is not None and self._stored.shape[0] != B:
            raise ShapeError(f"batch size changed from {self._stored.shape[0]} to {B} without batch_select/repeat")
        self.check_room(S)
        self.store.append(latent, rope, valid)
        valid = valid.to(latent.device, torch.bool)
        all_valid = valid is None
        self.stored = valid.clone() if self.stored is None else torch.cat([self.stored, valid], dim=1)
        self.seen += S
        self._full_tail = self._full_tail + S if all_valid else 0

    def append_static(self, latent: torch.Tensor, rope: torch.Tensor) -> None:
        """Graph-safe append of `latent [B,S,r]`, `rope [B,S,d]`, every token real, with no host sync.

        Needs a preallocated, non-empty layer (`max_cache_len`); checks room on the host (positions never
        exceed HF positions, so `seen + S <= max_cache_len` guarantees the rows exist)."""
        if self.store is None:
            raise ShapeError("append_static needs a layer that already holds tokens (prefill first)")
        B, S = latent.shape[:2]
        if B != self.batch_size:
            raise ShapeError(f"batch size changed from {self.batch_size} to {B} without batch_select/repeat")
        self.check_room(S)
        self.store.append_static(latent, rope)
        self.advance(S)

    def advance(self, n: int) -> None:
        """Host bookkeeping of `n` positions stored for every request (a replayed decode step's append);
        negative n undoes it (a captured step, whose device work was only recorded)."""
        self.seen += n
        self._full_tail += n
        if n >= 0:
            self._stored_pending += n
        else:
            self._drop_positions(-n)

    def _drop_positions(self, n: int) -> None:
        if n <= self._stored_pending:
            self._stored_pending -= n
        else:
            stored = self.stored
            self._stored = stored[:, : stored.shape[1] - n]

    def rewind(self, n: int) -> None:
        """Remove the last `n` positions. With no host sync when they were all real tokens of every request
        (e.g. decode steps); otherwise the same as `crop(-n)` (which reads the stored mask)."""
        if n <= 0 or self.store is None:
            return
        if n > self._full_tail or self.config.token_group is not None:
            self.crop(-n)
            return
        self.store.rewind(n)
        self.seen -= n
        self._full_tail -= n
        self._drop_positions(n)
        if self.indexer_keys is not None:
            self.indexer_keys = self.indexer_keys[:, : self.seen]

    def load_request(self, slot: int, src: LatentLayer | None, n: int) -> None:
        """Make request `slot` hold the first `n` stored tokens of `src` (a batch-1 layer of the same config;
        None or n == 0: hold nothing). The buffers are written in place, so a captured DecodeGraph keeps
        reading them; the caller then sets the host view with `set_lengths`."""
        from .attention.store_policies import PassThrough, RowScales

        store = self.store
        if store is None or store.capacity is None or n > store.capacity:
            raise ShapeError(f"load_request needs a preallocated, prefilled layer with room for {n} tokens")
        if src is not None and n:
            for name, part in store.parts.items():
                if not isinstance(part, (PassThrough, RowScales)):  # a shared or grouped scale spans requests
                    raise ConfigError(f"load_request: {type(part).__name__} scales are not per token")
                other = src.store.parts[name]
                part.codes[slot, :n].copy_(other.codes[0, :n])
                if part.scale is not None:
                    part.scale[slot, :n].copy_(other.scale[0, :n])
        store.lengths[slot].fill_(n)  # in place: graphs read this tensor

    def set_lengths(self, lengths: list[int]) -> None:
        """The host view after requests were loaded or emptied: request b holds `lengths[b]` tokens, as if
        left-padded to the longest (HF positions = cumsum of the stored mask - 1 = each request's own)."""
        seen = max(lengths)
        want = torch.tensor(lengths, device=self.store.lengths.device).view(-1, 1)
        self.stored = torch.arange(seen, device=want.device).view(1, -1) >= seen - want
        self.seen = seen
        self._full_tail = min(lengths)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Plain HF API (unpatched model): store every token, return the dequantized cache `[B, 1, T, r|d]`."""
        self.append(key_states[:, 0], value_states[:, 0])
        lat, rope = self.dense(key_states.dtype)
        return lat[:, None], rope[:, None]

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """DSA indexer keys, kept unquantized and HF-aligned (exactly as DynamicIndexedLayer does)."""
        if self.indexer_keys is None:
            self.indexer_keys = indexer_key_states
        else:
            self.indexer_keys = torch.cat([self.indexer_keys, indexer_key_states], dim=1)
        self.is_indexer_initialized = True
        return self.indexer_keys

    # ------------------------------------------------------------------ reading
    def dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized cache at HF positions: (latent [B, seen, r], rope [B, seen, d]); padding rows are 0."""
        lat, rope = self.store.dequantize(torch.float32)
        B = lat.shape[0]
        out_l = lat.new_zeros(B, self.seen, self.kv_lora_rank, dtype=dtype)
        out_r = lat.new_zeros(B, self.seen, self.rope_dim, dtype=dtype)
        rows = torch.arange(lat.shape[1], device=lat.device).view(1, -1) < self.store.lengths.view(B, 1)
        # Row-major order matches: the k-th True of `stored[b]` is stored row k of request b.
        out_l[self.stored] = lat[rows].to(dtype)
        out_r[self.stored] = rope[rows].to(dtype)
        return out_l, out_r

    def hf_positions(self) -> torch.Tensor:
        """HF position of every stored row: `[B, L]` long (rows past a request's length hold 0)."""
        L = self.store.max_length
        order = torch.sort((~self.stored).to(torch.int8), dim=1, stable=True).indices[:, :L]
        rows = torch.arange(L, device=order.device).view(1, -1) < self.store.lengths.view(-1, 1)
        return torch.where(rows, order, torch.zeros_like(order))

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return self.seen + q, 0

    def get_max_length(self) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    @property
    def lengths(self) -> torch.Tensor | None:
        return None if self.store is None else self.store.lengths

    def nbytes(self) -> int:
        return 0 if self.store is None else self.store.nbytes()

    def num_stored_tokens(self) -> int:
        return 0 if self.store is None or self.store.lengths is None else int(self.store.lengths.sum())

    # ------------------------------------------------------------------ reshaping
    def crop(self, tokens_to_remove: int | None = None, max_length: int | None = None) -> None:
        """Negative: remove that many positions (HF >= 5.18). Positive / max_length: keep that many (older HF)."""
        if max_length is not None:
            keep = max_length
        elif tokens_to_remove is None or tokens_to_remove == 0:
            return
        elif tokens_to_remove < 0:
            keep = self.seen + tokens_to_remove
        else:
            keep = tokens_to_remove
        if keep >= self.seen or self.store is None:
            return
        keep = max(keep, 0)
        self._full_tail = max(0, self._full_tail - (self.seen - keep))
        self.stored = self.stored[:, :keep]
        self.store.truncate(self.stored.sum(dim=1))
        self.seen = keep
        if self.indexer_keys is not None:
            self.indexer_keys = self.indexer_keys[:, :keep]

    def _select(self, idx: torch.Tensor) -> None:
        if self.store is None:
            return
        idx = idx.to(self.stored.device).long()
        self.store.index_select(idx)
        self.stored = self.stored.index_select(0, idx)
        if self.indexer_keys is not None:
            self.indexer_keys = self.indexer_keys.index_select(0, idx.to(self.indexer_keys.device))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.store is None:
            return
        idx = torch.as_tensor(indices, device=self.stored.device)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        self._select(idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store is None:
            return
        self._select(torch.arange(self.stored.shape[0], device=self.stored.device).repeat_interleave(repeats))

    def reset(self) -> None:
        self.store = None
        self.stored = None  # (also clears the pending count)
        self._full_tail = 0
        self.seen = 0
        self.indexer_keys = None
        self.is_indexer_initialized = False
        self.is_initialized = False

    def offload(self) -> None:  # the quantized cache stays on its device
        return

    def prefetch(self) -> None:
        return


class LatentCache(_MaxCacheLen, DynamicCache):
    """HF cache whose MLA layers are `LatentLayer`s; other layers are the stock layers of the model config.

    `LatentCache("snapmla", model)` builds the layer list for a model (patched or not);
    `LatentCache("snapmla")` alone starts empty and turns each MLA layer into a `LatentLayer` the first
    time a patched model writes it. A patched model's `generate` creates one automatically.

    `max_cache_len=N` (HF StaticCache naming) preallocates every MLA layer's store for N positions per
    request (rounded up to the 64-token page) at its first append and never reallocates it; going past
    N raises a ShapeError naming max_cache_len. That is what `snapquant.graphs.DecodeGraph` needs.
    Without it the stores grow by doubling.

    `joint_rows=True` (16-bit caches with nothing quantized, e.g. the bf16 preset) stores each token's latent
    and RoPE key in one row of r + d values, the page layout of FlashMLA and vLLM, so `backend="flashmla"`
    reads the cache in place (`snapquant.attention.flashmla`).
    """

    def __init__(self, config: KVQuantConfig | str = "snapmla", model=None, max_cache_len: int | None = None,
                 joint_rows: bool = False, **kwargs) -> None:
        self.kv_config = resolve_config(config)
        self.joint_rows = joint_rows
        if joint_rows and (reason := joint_rows_reason(self.kv_config)) is not None:
            raise ConfigError(reason)
        if max_cache_len is not None and (not isinstance(max_cache_len, int) or isinstance(max_cache_len, bool)
                                          or max_cache_len < 1):
            raise ShapeError(f"max_cache_len must be a positive int, got {max_cache_len!r}")
        self._max_len = max_cache_len
        self.static_step = False  # set by snapquant.graphs.DecodeGraph around its fixed-shape decode step
        if model is None:
            super().__init__(**kwargs)
            self._max_len = max_cache_len  # again: an HF __init__ may have reset it through the setter
            return
        from .models.registry import find_mla_modules

        super().__init__(config=model.config.get_text_config(decoder=True), **kwargs)
        self._max_len = max_cache_len
        for _, module, adapter in find_mla_modules(model):
            r, d = adapter.dims(module)
            self._install(module.layer_idx, LatentLayer(self.kv_config, r, d, max_cache_len=max_cache_len,
                                                        joint_rows=joint_rows))

    def _install(self, layer_idx: int, layer: CacheLayerMixin) -> None:
        while len(self.layers) <= layer_idx:
            self.layers.append(DynamicLayer())
        self.layers[layer_idx] = layer

    def layer(self, layer_idx: int, kv_lora_rank: int | None = None, rope_dim: int | None = None) -> LatentLayer:
        """The LatentLayer at `layer_idx`, creating it (in place of an empty stock layer) if needed."""
        return latent_layer_for(self, layer_idx, self.kv_config, kv_lora_rank, rope_dim)

    @property
    def latent_layers(self) -> list[LatentLayer]:
        return [layer for layer in self.layers if isinstance(layer, LatentLayer)]

    def nbytes(self) -> int:
        """Bytes held by all latent layers (codes + scales + KIVI residuals; allocation slack excluded)."""
        return sum(layer.nbytes() for layer in self.latent_layers)

    def bytes_per_token(self) -> float:
        """Bytes per stored token per layer (e.g. 644 for snapmla at DeepSeek dims); 0 when empty."""
        tokens = sum(layer.num_stored_tokens() for layer in self.latent_layers)
        return self.nbytes() / tokens if tokens else 0.0


def latent_layer_for(cache: Cache, layer_idx: int, config: KVQuantConfig, kv_lora_rank: int | None = None,
                     rope_dim: int | None = None) -> LatentLayer:
    """Find or create the LatentLayer for `layer_idx` in any HF `Cache`.

    An empty stock layer (e.g. of the DynamicCache HF builds for `model(ids)`) is replaced in place;
    a stock layer that already holds tokens (written by an unpatched model) cannot be converted.
    """
    layers = cache.layers
    if len(layers) <= layer_idx:
        while len(layers) <= layer_idx:
            layers.append(DynamicLayer())
    current = layers[layer_idx]
    if isinstance(current, LatentLayer):
        return current
    kind = type(current).__name__
    if getattr(current, "max_cache_len", None) is not None or "Static" in kind:
        raise ConfigError(
            f"cache layer {layer_idx} is a {kind}: static caches are not supported by patched MLA attention; "
            f"use the default dynamic cache (a LatentCache is created automatically)"
        )
    if not isinstance(current, (DynamicLayer, CacheLayerMixin)) or current.get_seq_length() > 0:
        held = current.get_seq_length() if hasattr(current, "get_seq_length") else "?"
        raise ConfigError(
            f"cache layer {layer_idx} is a {kind} already holding {held} tokens written without snapquant; "
            f"start from a fresh cache (or a snapquant.LatentCache) on the patched model"
        )
    new = LatentLayer(config, kv_lora_rank, rope_dim, max_cache_len=getattr(cache, "max_cache_len", None)
                      if isinstance(cache, LatentCache) else None, joint_rows=getattr(cache, "joint_rows", False))
    layers[layer_idx] = new
    return new
