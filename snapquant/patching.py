"""`snapquant.patch(model, config)`: run every MLA attention of an HF model over the quantized latent cache.

How (the seams of models/registry.py, per attention module, all reversible):
1. the module's `forward` is wrapped (instance attribute; accelerate's `_old_forward` when the module is
   hooked for device_map sharding). The wrapper reads which new tokens are padding from the mask the
   model built, then calls the family's own forward with a cache proxy in place of the cache;
2. the proxy's `update(latent, k_rot, layer_idx)` quantizes and stores the new tokens in the layer's
   `LatentLayer` (creating one in any HF cache, or a throwaway one when there is no cache);
3. decode steps (S == 1; not identity configs on the reference backend, below) and, with
   `prefill: quantized`, every call run *absorbed*: the module sees a
   config copy whose `_attn_implementation` is snapquant's registered attention function, and its
   `expand_kv` skips kv_b_proj; that function absorbs W_UK into the query, runs the decode backend
   over the stored codes and scales, and applies W_UV;
4. `prefill: bf16` calls with S > 1 run the family's stock attention on the fresh activations (any
   mask, any attention implementation, bit-identical to the unpatched model), prefixed by the
   dequantized cache when one exists (chunked prefill, assisted-decoding verification).
A call is a decode step when S == 1 (HF has no separate phase), so a one-token prompt already attends
to its own quantized latent. Families whose forward caches the expanded per-head K/V (DSA families
before transformers ~5.2x: expand_kv before cache.update) are handled at expand_kv instead.

Masks: the model config itself is never changed, so HF keeps building the causal / padding masks for
its own attention implementation (the unregistered-mask trap of docs/transformers-notes.md cannot drop them). The
wrapper reads padding from that mask's diagonal; padding tokens are never stored, so the standard
padding + causal case needs only per-request lengths. Any other visibility (DSA top-k selections,
packed sequences, custom 4D masks) is detected by comparison and runs the gather path of
snapquant.attention.absorbed (each query's visible rows, as a sparse kernel reads them).

Identity configs (`bf16`): the cache keeps the activations in the model's dtype (in a bf16 model exactly
the 1152 B/token bf16 cache). With `prefill: bf16` on the reference backend every call, decode steps too,
runs the stock attention over that exact cache, so the patched model reproduces the unpatched one bit for
bit in any dtype. The Triton kernels, DecodeGraph's static step and `prefill: quantized` run the absorbed
pipeline with `round_16bit = (activations are 16-bit)`: an fp32 model to fp32 rounding, a bf16 model with
bf16 query and P, as a BF16 MLA kernel rounds them (within bf16 rounding of the stock logits, so exact
greedy ties can flip). Quantized configs always round a `bf16` query / P to bf16, as a kernel does.

`generate` without a cache (`use_cache=False`, also from a model's generation_config) is refused unless the
config quantizes prefill: every step would re-run the stock attention and silently give the unpatched
model's output. Forward calls without a cache (scoring, teacher forcing) run as described above.

Caches: `generate` on a patched model creates a `LatentCache` with the patch's config; `model(ids)`
converts the empty DynamicCache HF creates in place; a `LatentCache` the caller passes keeps its own
config (storage and decode knobs). Formats that are not causal-consistent follow the store's policy
(snapquant.attention.storage: scales frozen at the first append, KIVI residual window); with
`prefill: quantized` their prefill attends to what the cache holds after the append.
Inference only (no gradients through the quantized cache); torch.compile is not supported.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .attention.absorbed import absorbed_attention
from .attention.backends import check_backend_name, check_kernel_options, resolve_backend, static_backend
from .attention.masks import hf_visibility, indices_visibility, standard_visibility, token_validity
from .cache import LatentCache, LatentLayer, latent_layer_for
from .config import KVQuantConfig
from .errors import ConfigError, ShapeError
from .models.registry import MLAAdapter, cache_layout, find_mla_modules
from .presets import resolve_config

ATTN_IMPLEMENTATION = "snapquant_mla"
MIN_TRANSFORMERS = (5, 15)
_STATE_ATTR = "_snapquant_patch"


# ---------------------------------------------------------------------------------------------- state
@dataclass
class PatchState:
    """What `patch` installed on a model (read it with `patch_state(model)`)."""

    config: KVQuantConfig
    backend: str
    hooks: list[_MLAHook] = field(default_factory=list)
    generate_hooked: bool = False
    kernel_options: Any = None  # as the caller gave them (None: the kernels' defaults)
    parsed_options: dict[str, Any] = field(default_factory=dict)  # backend name -> its validated options

    def options_for(self, backend: str) -> Any:
        """The validated kernel options for `backend` (None: none given, or it takes none)."""
        return self.parsed_options.get(backend)

    def layer_indices(self) -> set[int]:
        """The `layer_idx` of every patched MLA attention module (the cache layers the patch decodes)."""
        return {hook.module.layer_idx for hook in self.hooks}


@dataclass
class _Call:
    """What one forward call of one attention module needs between its seams."""

    layer: LatentLayer
    valid: torch.Tensor  # [B, S] real (non-padding) new tokens
    mode: str  # "absorbed" | "stock"
    temporary: bool
    positions: torch.Tensor | None = None  # [B, S] stored row of each new token, -1 = padding
    static: bool = False  # DecodeGraph's fixed-shape step: no mask, every token real, no host sync


class _CacheProxy:
    """Stands in for the model's cache inside one attention forward; everything else is forwarded."""

    def __init__(self, cache, hook: _MLAHook, call: _Call):
        self._cache, self._hook, self._call = cache, hook, call

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._hook.layout == "expanded":  # expand_kv already stored the latent and returned the final K/V
            return key_states, value_states
        call, layer = self._call, self._call.layer
        if call.mode == "stock":
            if call.temporary:  # no cache to fill: exactly the stock computation on fresh activations
                return key_states, value_states
            past = layer.dense(key_states.dtype) if layer.seen else None
            self._hook.store_new(key_states, value_states)
            if past is None:
                return key_states, value_states
            return (torch.cat([past[0][:, None], key_states], dim=2),
                    torch.cat([past[1][:, None], value_states], dim=2))
        self._hook.store_new(key_states, value_states)
        return _placeholder(key_states, layer.seen), _placeholder(key_states, layer.seen)

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return self._call.layer.update_indexer(indexer_key_states)

    def __getattr__(self, name: str):
        if self._cache is None:
            raise AttributeError(f"no cache attribute {name!r} (the model was called without a cache)")
        return getattr(self._cache, name)


def _placeholder(like: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-stride stand-in for K or V with HF's key length (DSA code sizes its index mask from it); never read."""
    return like.new_zeros(()).expand(like.shape[0], 1, length, 1)


class _MLAHook:
    """The per-module patch: forward wrapper, expand_kv bypass, absorbed attention."""

    def __init__(self, module: nn.Module, adapter: MLAAdapter, state: PatchState):
        self.module, self.adapter, self.state = module, adapter, state
        self.forward_fn = type(module).forward
        self.sig = inspect.signature(self.forward_fn)
        params = self.sig.parameters
        self.cache_param = "cache" if "cache" in params else "past_key_values"
        self.dims = adapter.dims(module)
        self.layout = cache_layout(type(module))
        self.original_config = module.config
        self.absorbed_config = copy.copy(module.config)
        # Set the backing field directly: the property setter would also touch shared sub-configs.
        self.absorbed_config.__dict__["_attn_implementation_internal"] = ATTN_IMPLEMENTATION
        self.call: _Call | None = None
        self._accelerate = hasattr(module, "_hf_hook") and hasattr(module, "_old_forward")
        self._weights: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        m = self.module
        if self._accelerate:
            self._prev_old_forward = m._old_forward
            m._old_forward = self.forward
        else:
            m.forward = self.forward
        m.expand_kv = self.expand_kv
        m._snapquant_hook = self

    def remove(self) -> None:
        m = self.module
        if self._accelerate:
            m._old_forward = self._prev_old_forward
        else:
            m.__dict__.pop("forward", None)
        m.__dict__.pop("expand_kv", None)
        m.__dict__.pop("_snapquant_hook", None)
        m.config = self.original_config

    # ------------------------------------------------------------------ seams
    def forward(self, *args, **kwargs):
        m = self.module
        if self.cache_param == "cache" and "past_key_values" in kwargs and "cache" not in kwargs:
            kwargs["cache"] = kwargs.pop("past_key_values")
        bound = self.sig.bind(m, *args, **kwargs)
        a = bound.arguments
        hidden = a["hidden_states"]
        B, S = hidden.shape[:2]
        cache = a.get(self.cache_param)
        r, d = self.dims
        if cache is None:
            layer, temporary = LatentLayer(self.state.config, r, d), True
        else:
            cfg = cache.kv_config if isinstance(cache, LatentCache) else self.state.config
            _reject_foreign_cache(cache, m.layer_idx)
            layer, temporary = latent_layer_for(cache, m.layer_idx, cfg, r, d), False
        cfg = layer.config
        static = bool(getattr(cache, "static_step", False))
        if static:
            # snapquant.graphs.DecodeGraph: one real token per request, no mask (any mask HF built for this
            # step is not read: it is plain causal); nothing here may read device values on the host.
            if S != 1:
                raise ShapeError(f"a static decode step takes one token per request, got S={S}")
            valid = torch.ones(B, S, dtype=torch.bool, device=hidden.device)
            mode = "absorbed"
        else:
            valid = token_validity(a.get("attention_mask"), B, S, layer.get_seq_length()).to(hidden.device)
            stock = (S > 1 and cfg.prefill != "quantized") or self._exact_identity(cfg, hidden.device)
            mode = "stock" if stock else "absorbed"
        call = _Call(layer, valid, mode, temporary, static=static)
        a[self.cache_param] = _CacheProxy(cache, self, call)
        self.call = call
        if mode == "absorbed":
            m.config = self.absorbed_config
        try:
            return self.forward_fn(*bound.args, **bound.kwargs)
        finally:
            m.config = self.original_config
            self.call = None

    def _exact_identity(self, cfg: KVQuantConfig, device: torch.device) -> bool:
        """An identity config (nothing quantized, `prefill: bf16`) on the reference backend decodes through the
        stock attention over the exact cache: the unpatched model's own operation order and dtypes are then the
        reference, so it is reproduced bit for bit in any dtype (the absorbed pipeline rounds its bf16 query
        and P elsewhere, which moves a bf16 model's logits by an ulp and flips greedy ties). The kernels and
        DecodeGraph's static step run the absorbed BF16 pipeline; `prefill: quantized` asks for it eagerly."""
        return (cfg.is_identity and cfg.prefill == "bf16"
                and resolve_backend(self.state.backend, cfg, device).name == "reference")

    def expand_kv(self, kv_nope: torch.Tensor, k_rot: torch.Tensor):
        expand = type(self.module).expand_kv
        call = self.call
        if call is None:
            return expand(self.module, kv_nope, k_rot)
        if self.layout == "latent":
            if call.mode == "absorbed":
                return kv_nope, k_rot  # placeholders from the proxy: absorbed attention reads the store
            return expand(self.module, kv_nope, k_rot)
        # "expanded" layout: expand_kv sees the fresh latent first, so the latent is stored here.
        layer = call.layer
        if call.mode == "absorbed":
            self.store_new(kv_nope, k_rot)
            return _placeholder(kv_nope, layer.seen), _placeholder(kv_nope, layer.seen)
        if call.temporary:
            return expand(self.module, kv_nope, k_rot)
        past = layer.dense(kv_nope.dtype) if layer.seen else None
        self.store_new(kv_nope, k_rot)
        k_new, v_new = expand(self.module, kv_nope, k_rot)
        if past is None:
            return k_new, v_new
        k_old, v_old = expand(self.module, past[0][:, None], past[1][:, None])
        return torch.cat([k_old, k_new], dim=2), torch.cat([v_old, v_new], dim=2)

    def store_new(self, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> None:
        """Append the new tokens' latent `[B, 1, S, r]` and RoPE key to the layer; record their stored rows."""
        call, layer = self.call, self.call.layer
        if call.static:  # one real token per request: the attention reads the store's lengths after it
            layer.append_static(kv_nope[:, 0], k_rot[:, 0])
            return
        before = layer.lengths.clone() if layer.lengths is not None else torch.zeros(
            kv_nope.shape[0], dtype=torch.long, device=kv_nope.device)
        layer.append(kv_nope[:, 0], k_rot[:, 0], call.valid)
        valid = call.valid.to(before.device)
        call.positions = torch.where(valid, before[:, None] + valid.long().cumsum(1) - 1,
                                     torch.full_like(before[:, None], -1))

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = getattr(self.module.kv_b_proj, "weight", None)
        if isinstance(w, torch.Tensor) and isinstance(self.module.kv_b_proj, nn.Linear) and w.device.type != "meta" \
                and w.dtype.is_floating_point and w.element_size() >= 2:
            return self.adapter.absorb_weights(self.module)  # a view: follows weight updates
        if self._weights is None:
            self._weights = self.adapter.absorb_weights(self.module)
        return self._weights

    def attend(self, query: torch.Tensor, attention_mask, scaling: float | None, kwargs: dict) -> torch.Tensor:
        call = self.call
        layer = call.layer
        if call.static:
            return self._attend_static(query, scaling, kwargs)
        B, _, S, _ = query.shape
        T = layer.seen
        vis = hf_visibility(attention_mask, B, S, T)
        indices = kwargs.get("indices")
        if indices is not None:
            sel = indices_visibility(indices, T)
            vis = sel & (vis if vis is not None else standard_visibility(torch.ones_like(layer.stored), S))
        valid = call.valid
        visibility = None
        if vis is not None:
            std = standard_visibility(layer.stored, S)
            if bool(((vis ^ std) & valid[:, :, None]).any()):
                hf_pos = layer.hf_positions()  # [B, L]
                L = hf_pos.shape[1]
                rows = torch.arange(L, device=hf_pos.device).view(1, -1) < layer.lengths.view(-1, 1)
                visibility = torch.gather(vis, 2, hf_pos[:, None, :].expand(B, S, L))
                visibility = visibility & rows[:, None, :] & valid[:, :, None]
        return self._absorbed(query, scaling, kwargs, static=False, visibility=visibility)


    def _attend_static(self, query: torch.Tensor, scaling: float | None, kwargs: dict) -> torch.Tensor:
        """The fixed-shape decode step: the whole preallocated store, valid rows given by device lengths."""
        if kwargs.get("indices") is not None:
            raise ConfigError("DSA top-k attention (index_topk) is not supported by the static decode step")
        return self._absorbed(query, scaling, kwargs, static=True, visibility=None)

    def _absorbed(self, query: torch.Tensor, scaling: float | None, kwargs: dict, *, static: bool,
                  visibility: torch.Tensor | None) -> torch.Tensor:
        """Absorbed attention over this layer's store: every segment as stored (eager), or the whole
        preallocated capacity with device lengths and no host checks (static decode step)."""
        layer, call = self.call.layer, self.call
        cfg = layer.config
        backend = resolve_backend(self.state.backend, cfg, query.device)
        options = self.state.options_for(backend.name)
        round_16bit = query.dtype in (torch.bfloat16, torch.float16) if cfg.is_identity else True
        w_uk, w_uv = self.weights()
        tau = scaling if scaling is not None else float(self.module.qk_head_dim) ** -0.5
        return absorbed_attention(
            query, w_uk, w_uv, layer.store.segments(static=static), None if static else call.positions,
            lengths=layer.lengths if static else None, softmax_scale=tau,
            config=cfg, backend=static_backend(backend, options) if static else backend.bind(options),
            round_16bit=round_16bit,
            visibility=visibility, sinks=kwargs.get("s_aux"),
        )


def _reject_foreign_cache(cache, layer_idx: int) -> None:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ConfigError(f"a patched model needs an HF Cache object, got {type(cache).__name__}")
    if layer_idx < len(layers) and "Quantized" in type(layers[layer_idx]).__name__:
        raise ConfigError(
            f"cache layer {layer_idx} is HF's {type(layers[layer_idx]).__name__}: HF's QuantizedCache cannot be "
            f"combined with snapquant.patch (the patched model quantizes the latent itself)"
        )


def _snapquant_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as `snapquant_mla`; only patched MLA modules dispatch to it."""
    hook = getattr(module, "_snapquant_hook", None)
    if hook is None or hook.call is None or hook.call.mode != "absorbed":
        raise ConfigError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} is internal to snapquant.patch; do not set it on a model "
            f"config (got a call from {type(module).__name__})"
        )
    if dropout and module.training:
        raise ConfigError("patched MLA attention is inference-only (attention dropout > 0 in training mode)")
    if kwargs.get("softcap") is not None:
        raise ConfigError("attention logit softcapping is not supported by patched MLA attention")
    return hook.attend(query, attention_mask, scaling, kwargs), None


_REGISTERED = False


def _register_attention() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _snapquant_attention)
    # The model config never names this implementation, but register a mask for it anyway: an
    # unregistered name would silently get mask None (causal mask and padding dropped).
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    _REGISTERED = True


# ---------------------------------------------------------------------------------------------- API
def check_transformers_version() -> None:
    import transformers

    parts = []
    for p in transformers.__version__.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    if tuple(parts) < MIN_TRANSFORMERS:
        raise ConfigError(
            f"transformers {transformers.__version__} is too old for snapquant.patch: MLA models cache the "
            f"compressed latent only since 5.15 (this needs transformers>=5.15)"
        )


def patch(model: nn.Module, config: KVQuantConfig | str | dict = "snapmla", *, backend: str = "auto",
          kernel_options: Mapping[str, Any] | Any | None = None) -> nn.Module:
    """Make every MLA attention of `model` read and write the quantized latent cache. Returns `model`.

    config: a preset name, dict, file path or `KVQuantConfig`. backend: auto | reference | triton, or any
    name registered with `snapquant.attention.backends.register_backend` (the decode kernel seam).
    kernel_options: the decode kernels' knobs (a mapping, or the kernels' typed options), validated here and
    passed to every decode launch of the backend that takes them; with backend="auto" they apply when the
    kernels run and are ignored by the reference fallback. Patching a patched model re-configures it.
    """
    check_transformers_version()
    cfg = resolve_config(config)
    check_backend_name(backend)
    parsed = check_kernel_options(backend, kernel_options)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"patch expects a transformers model (nn.Module), got {type(model).__name__}")
    found = list(find_mla_modules(model))  # raises for non-MLA models and unknown families
    for _, module, adapter in found:
        adapter.validate(module)
        cfg.check_dims(*adapter.dims(module))
    if backend != "auto":  # an explicit request fails now, not at the first decode step
        device = next((p.device for p in found[0][1].parameters() if p.device.type != "meta"), torch.device("cpu"))
        resolve_backend(backend, cfg, device)
    _register_attention()
    state: PatchState | None = getattr(model, _STATE_ATTR, None)
    if state is not None:  # re-configure in place; hooks read the shared state
        state.config, state.backend = cfg, backend
        state.kernel_options, state.parsed_options = kernel_options, parsed
        return model
    state = PatchState(cfg, backend, kernel_options=kernel_options, parsed_options=parsed)
    for _, module, adapter in found:
        hook = _MLAHook(module, adapter, state)
        hook.install()
        state.hooks.append(hook)
    _hook_generate(model, state)
    model.__dict__[_STATE_ATTR] = state
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Remove the patch; the model computes exactly what it computed before `patch`."""
    state: PatchState | None = model.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return model
    for hook in state.hooks:
        hook.remove()
    if state.generate_hooked:
        model.__dict__.pop("_prepare_cache_for_generation", None)
    return model


@contextmanager
def patched(model: nn.Module, config: KVQuantConfig | str | dict = "snapmla", *, backend: str = "auto",
            kernel_options: Mapping[str, Any] | Any | None = None) -> Iterator[nn.Module]:
    """`with snapquant.patched(model, "snapmla"): ...` patches for the block and restores the previous state."""
    previous: PatchState | None = getattr(model, _STATE_ATTR, None)
    prev = (previous.config, previous.backend, previous.kernel_options) if previous is not None else None
    patch(model, config, backend=backend, kernel_options=kernel_options)
    try:
        yield model
    finally:
        if prev is None:
            unpatch(model)
        else:
            patch(model, prev[0], backend=prev[1], kernel_options=prev[2])


def patch_state(model: nn.Module) -> PatchState | None:
    """What `patch` installed on `model` (config, backend, kernel options, hooks); None when unpatched."""
    return getattr(model, _STATE_ATTR, None)


def is_patched(model: nn.Module) -> bool:
    return patch_state(model) is not None


def patched_config(model: nn.Module) -> KVQuantConfig | None:
    state = getattr(model, _STATE_ATTR, None)
    return None if state is None else state.config


def _check_generation_uses_cache(model: nn.Module, state: PatchState, generation_config, model_kwargs) -> None:
    """Refuse a `generate` that would never read the quantized cache.

    Without a cache, HF's generate re-runs the whole sequence every step (S > 1), and with `prefill: bf16`
    every such call is the stock attention on fresh activations: the output would be the unpatched
    model's, silently. With `prefill: quantized` those calls attend to the quantized latent (for
    causal-consistent formats exactly what cached decode gives), so they are allowed. Forward calls
    without a cache (lm-eval loglikelihood scoring, teacher-forced fidelity) never reach this check.
    """
    if generation_config is None or generation_config.use_cache is not False:
        return
    kw = model_kwargs or {}
    given = [c for c in (kw.get("cache"), kw.get("past_key_values")) if isinstance(c, LatentCache)]
    config = given[0].kv_config if given else state.config  # a LatentCache passed in keeps its own config
    if config.prefill == "quantized":
        return
    default = getattr(getattr(model, "generation_config", None), "use_cache", None) is False
    source = "the model's generation_config has use_cache=False" if default else "use_cache=False was passed"
    raise ConfigError(
        f"use_cache: generate on a model patched with {config.label()!r} would not read the quantized "
        f"cache ({source}; without a cache every step re-runs the stock attention, so the output is the "
        f"unpatched model's); pass use_cache=True, or patch with prefill: quantized"
    )


def _hook_generate(model: nn.Module, state: PatchState) -> None:
    """Let `generate` build a LatentCache where it would build its default DynamicCache, and refuse a
    `generate` without a cache where it would bypass the quantized one."""
    original = getattr(model, "_prepare_cache_for_generation", None)
    if original is None:
        return
    from transformers.cache_utils import DynamicCache

    def prepare(*args, **kwargs):
        model_kwargs = kwargs.get("model_kwargs")
        if model_kwargs is None:
            model_kwargs = next((a for a in args if isinstance(a, dict)), {})
        _check_generation_uses_cache(model, state, kwargs.get("generation_config", args[0] if args else None),
                                     model_kwargs)
        result = original(*args, **kwargs)
        for key in ("cache", "past_key_values"):
            c = model_kwargs.get(key)
            if type(c) is DynamicCache and not getattr(c, "_is_user_defined", False) and c.get_seq_length() == 0:
                # FlashMLA reads latent and RoPE from one row: give it that layout, read in place
                model_kwargs[key] = LatentCache(state.config, model, joint_rows=state.backend == "flashmla")
        return result

    model.__dict__["_prepare_cache_for_generation"] = prepare
    state.generate_hooked = True

