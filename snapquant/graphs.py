"""A decode step of a patched model that a CUDA graph can capture, and a guard against host syncs.

    no_host_sync()       raise HostSyncError at any op that makes the host wait for the device (works on
                         CPU too, where it proves a code path free of them before it meets a GPU);
                         defined in snapquant.runtime with `allow_host_sync`, and public here too
    DecodeGraph          one fixed-shape decode step (B requests x 1 token) over a preallocated
                         LatentCache: captured as a torch.cuda.CUDAGraph on CUDA, run eagerly elsewhere

Benchmark use (CUDA, backend='triton'; the cache is filled with L random tokens per request directly):

    model = snapquant.patch(model, "snapmla", backend="triton")
    cache = snapquant.LatentCache("snapmla", model, max_cache_len=L + 64)
    for i, layer in enumerate(cache.latent_layers):      # or cache.layer(i, 512, 64) by layer index
        layer.append(latent_bf16[B, L, 512], rope_bf16[B, L, 64])
    g = DecodeGraph(model, cache)                         # warms up, then captures one step
    ids = torch.randint(0, V, (B, 1), device="cuda")
    for _ in range(n):
        g.step(ids)                                       # replay: writes token L, attends L + 1 rows
        g.rewind(1)                                       # back to L tokens, no host sync
"""

from __future__ import annotations

import inspect

import torch

from .cache import LatentCache, LatentLayer
from .errors import ConfigError, ShapeError
from .patching import patch_state
from .runtime import allow_host_sync, no_host_sync

__all__ = ["DecodeGraph", "allow_host_sync", "no_host_sync"]


# ---------------------------------------------------------------------------------------------- DecodeGraph
class DecodeGraph:
    """One decode step of a patched MLA model over a preallocated `LatentCache`, with static shapes.

    `DecodeGraph(model, cache, capture=None, warmup=2)`: `model` patched with `snapquant.patch`; `cache` a
    `LatentCache(..., max_cache_len=N)` whose MLA layers already hold the prompt (prefilled by the model
    or by `layer.append`; left padding in the prefill is fine). `capture=None` captures a CUDA graph
    when the cache lives on CUDA (after `warmup` eager steps, each rewound) and otherwise runs the same
    fixed-shape step eagerly (CPU tests); `capture=True` insists on it.

    `step(input_ids [B, 1]) -> logits [B, 1, V]`: writes each request's new token at its current length
    and advances the cache by one position: device lengths (in place), and on the host `seen` and the
    stored-position mask, so eager forwards, `cache.crop(...)` and further steps all see a consistent
    cache. Position ids are derived on the device from the stored lengths (HF generate's convention,
    cumsum(attention_mask) - 1, for padded prompts). Attention reads the whole preallocated store with
    the device lengths marking the valid rows. With a graph the returned logits are a static buffer
    overwritten by the next replay (clone to keep them). `replay()` re-runs the step on the current
    static input ids; `rewind(n)` removes the last n positions of every layer (as `crop(-n)`, with no
    host sync when they were all decode steps). The step always runs the absorbed pipeline; an identity
    config with `prefill: bf16` on the reference backend decodes eagerly through the stock attention instead
    (bit-exact to the unpatched model), so there the step differs from eager decode by bf16 rounding.

    What may change between replays: the token ids (copied into the static buffer by `step`), the
    cache's contents and lengths (each step's append, rewind / crop, eager forwards of one token per
    request or more). Nothing shape-related: the batch, the store buffers (a `reset`, or a
    `batch_select_indices` / `reorder_cache` that changes the batch, reallocates them and is refused
    at the next step: build a new DecodeGraph), the model's weights' storage, the backend.

    Refused with a clear error: an `attention_mask` (padding masks; the step is plain causal), S > 1
    (`input_ids` must be [B, 1]), a cache without `max_cache_len`, an empty layer, a config whose store
    is not one fixed-capacity dense segment (KIVI `token_group` residual windows), DSA sparse attention
    (`index_topk`), dynamic RoPE (`rope_type` 'dynamic' reads the max position on the host), non-MLA
    cache layers (hybrid models), going past max_cache_len, and capture on CUDA with a backend other
    than the Triton kernel or FlashMLA (the reference decode and quantizer create host constants each call).
    Not covered: model parts outside attention that sync (e.g. transformers' eager MoE expert loop,
    which calls nonzero); `no_host_sync()` finds them.
    """

    def __init__(self, model: torch.nn.Module, cache: LatentCache, *, capture: bool | None = None,
                 warmup: int = 2) -> None:
        state = patch_state(model)
        if state is None:
            raise ConfigError("model: DecodeGraph needs a model patched with snapquant.patch(model, preset, backend=...)")
        if not isinstance(cache, LatentCache):
            raise ConfigError(f"cache must be a snapquant.LatentCache(config, model, max_cache_len=N), got "
                              f"{type(cache).__name__}")
        if cache.max_cache_len is None:
            raise ConfigError("max_cache_len: DecodeGraph needs a preallocated cache; build it with "
                              "LatentCache(config, model, max_cache_len=N)")
        if not isinstance(warmup, int) or warmup < 1:
            raise ConfigError(f"warmup must be a positive int, got {warmup!r}")
        self.model, self.cache, self.state = model, cache, state
        self.layers = self._check_layers(model, cache, state)
        self.check_model(model)
        first = self.layers[0].store
        self.batch_size, self.device = first.batch_size, first.lengths.device
        for i, layer in enumerate(self.layers):
            if layer.batch_size != self.batch_size or layer.store.lengths.device != self.device:
                raise ShapeError(f"cache layer {i} holds {layer.batch_size} requests on {layer.store.lengths.device}, "
                                 f"layer 0 {self.batch_size} on {self.device}")
        capture = self.device.type == "cuda" if capture is None else bool(capture)
        if capture:
            self._check_capturable()
        self.capture = capture
        B = self.batch_size
        self.input_ids = torch.zeros(B, 1, dtype=torch.long, device=self.device)
        self.position_ids = torch.zeros(B, 1, dtype=torch.long, device=self.device)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self._ptrs = self._buffer_ptrs()
        if capture:
            self._capture(warmup)

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check_layers(model, cache: LatentCache, state) -> list[LatentLayer]:
        mla = state.layer_indices()
        for i, layer in enumerate(cache.layers):
            if not isinstance(layer, LatentLayer):
                raise ConfigError(f"cache layer {i} is a {type(layer).__name__}: DecodeGraph needs every cache layer "
                                  f"to be an MLA LatentLayer (hybrid models with other attention are not supported)")
        layers = []
        for idx in sorted(mla):
            layer = cache.layers[idx] if idx < len(cache.layers) else None
            if layer is None or layer.store is None or layer.store.lengths is None:
                raise ShapeError(f"cache layer {idx} is empty: prefill the cache (or append to every layer) before "
                                 f"building a DecodeGraph")
            if layer.max_cache_len is None:
                raise ConfigError(f"max_cache_len: cache layer {idx} was not preallocated (build the LatentCache "
                                  f"with max_cache_len=N before its first append)")
            if layer.config.token_group is not None:
                raise ConfigError(f"token_group={layer.config.token_group}: the KIVI residual window is a second "
                                  f"segment whose rows move every step; DecodeGraph needs a fixed-capacity dense store")
            reason = layer.store.static_reason()
            if reason is not None:
                raise ConfigError(f"cache layer {idx}: {reason}")
            if layer.indexer_keys is not None:
                raise ConfigError("index_topk: DSA sparse attention (indexer keys) is not supported by DecodeGraph")
            layers.append(layer)
        if not layers:
            raise ConfigError("the patched model has no MLA layer in this cache")
        return layers

    @staticmethod
    def check_model(model) -> None:
        cfg = getattr(model, "config", None)
        text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        if getattr(text, "index_topk", None):
            raise ConfigError(f"index_topk={text.index_topk}: DSA sparse attention is not supported by DecodeGraph")
        for name, m in model.named_modules():
            rope_type = getattr(m, "rope_type", None)
            types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
            if any(isinstance(t, str) and "dynamic" in t for t in types):
                raise ConfigError(f"rope_parameters.rope_type={rope_type!r} ({name}): dynamic RoPE reads the largest "
                                  f"position on the host every step; use a static RoPE type")

    def _check_capturable(self) -> None:
        from .attention.backends import resolve_backend

        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise ConfigError(f"capture=True needs the model and cache on CUDA (the cache is on {self.device})")
        for layer in self.layers:
            backend = resolve_backend(self.state.backend, layer.config, self.device)
            round_16bit = layer.dtype in (torch.bfloat16, torch.float16) or not layer.config.is_identity
            if backend.name == "flashmla":  # FlashMLA's BF16 decode: device work only, a fresh schedule per call
                from .attention.flashmla import mismatch_reason

                reason = mismatch_reason(layer.store.segments(static=True)[0].kv, layer.config, round_16bit)
                if reason is not None:
                    raise ConfigError(f"backend='flashmla' would fall back to the reference for this cache ({reason}); "
                                      f"it cannot be captured")
                continue
            if backend.name != "triton":
                raise ConfigError(
                    f"backend={self.state.backend!r} runs {backend.name!r} for config {layer.config.label()!r}: "
                    f"capturing a CUDA graph needs backend='triton' with a kernel layout, or 'flashmla' for the bf16 "
                    f"preset (the reference decode and "
                    f"quantizer create host constants every call); use capture=False to run the step eagerly"
                )
            from .kernels.backend import kernel_mismatch

            kv = layer.store.segments(static=True)[0].kv
            reason = kernel_mismatch(kv, layer.config, round_16bit=round_16bit)
            if reason is not None:
                raise ConfigError(f"backend='triton' would fall back to the reference for this cache ({reason}); "
                                  f"it cannot be captured")

    def _buffer_ptrs(self) -> list[tuple]:
        out = []
        for layer in self.layers:
            st = layer.store
            if st is None or st.lengths is None:
                out.append(None)
                continue
            out.append((id(st), st.lengths.data_ptr(), st.batch_size,
                        *(t.data_ptr() if t is not None else 0 for p in st.parts.values() for t in (p.codes, p.scale))))
        return out

    def _check_live(self) -> None:
        if self._buffer_ptrs() != self._ptrs:
            raise ShapeError("the cache's buffers changed since this DecodeGraph was built (reset, or a "
                             "batch_select / reorder that changed the batch size); build a new DecodeGraph")

    # ------------------------------------------------------------------ the step
    def _forward(self) -> torch.Tensor:
        """The fixed-shape step (what the graph records): positions from the device lengths, then the model."""
        self.position_ids.copy_(self.layers[0].store.lengths.view(-1, 1))
        self.cache.static_step = True
        try:
            with torch.no_grad():
                out = self.model(input_ids=self.input_ids, position_ids=self.position_ids, attention_mask=None,
                                 use_cache=True, **{self._cache_kw: self.cache})
        finally:
            self.cache.static_step = False
        return out.logits if hasattr(out, "logits") else out.last_hidden_state

    def _capture(self, warmup: int) -> None:
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compile kernels, probe torch paths, fill allocator pools
            for _ in range(warmup):
                self._forward()
                self.rewind(1)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()
        # Capture ran the Python once (host bookkeeping advanced) but only recorded the device work.
        for layer in self.layers:
            layer.advance(-1)

    def _prepare(self) -> None:
        self._check_live()
        for layer in self.layers:
            layer.check_room(1)

    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one token per request: `input_ids [B, 1]` -> logits `[B, 1, V]` (see the class docstring)."""
        self._check_live()
        if attention_mask is not None:
            raise ConfigError("attention_mask: a DecodeGraph step takes no mask (every request decodes one real "
                              "token; padding belongs to the prefill); call the model eagerly for masked steps")
        if not isinstance(input_ids, torch.Tensor) or input_ids.shape != (self.batch_size, 1):
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ShapeError(f"input_ids must be [B={self.batch_size}, 1] (one new token per request; S > 1 is not "
                             f"a decode step), got {shape}")
        self._prepare()
        self.input_ids.copy_(input_ids)
        return self._run()

    def replay(self) -> torch.Tensor:
        """Run the step again on the current static input ids (`self.input_ids`)."""
        self._prepare()
        return self._run()

    def _run(self) -> torch.Tensor:
        if self.graph is None:
            self.logits = self._forward()
            return self.logits
        self.graph.replay()
        for layer in self.layers:
            layer.advance(1)
        return self.logits

    def rewind(self, n: int = 1) -> None:
        """Remove the last `n` positions from every layer (as `cache.crop(-n)`; no host sync after steps)."""
        if not isinstance(n, int) or n < 0:
            raise ShapeError(f"rewind takes a non-negative int, got {n!r}")
        for layer in self.cache.layers:
            if isinstance(layer, LatentLayer):
                layer.rewind(n)
