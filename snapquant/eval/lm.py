"""`SnapquantLM`: lm-eval's HFLM running a model patched with `snapquant.patch`.

- `generate_until` tasks decode through the quantized latent cache: every `generate` call gets a fresh
  `LatentCache` explicitly (the patch would also create one), so decode reads FP8/int codes + scales.
- loglikelihood / multiple-choice / perplexity tasks call `model(inputs)` with no decode: they see the
  quantization only with `prefill: quantized` (then every position attends to the quantized latent,
  which for per-token formats equals what step-by-step decode would see; docs/numerics.md, "Why
  per-token matters"). With
  `prefill: bf16` they reproduce the unquantized model, by design.
- `loglikelihood="decode"` reads loglikelihood requests (multiple choice) as serving reads the cache
  instead: each context is prefilled once into a fresh `LatentCache` (in the preset's format) and its
  continuations are teacher-forced one decode step at a time, batched over the continuations of a
  context (`snapquant.eval.tasks.direct.decode_loglikelihoods`); every step's attention reads the
  quantized cache, so a `prefill: bf16` preset can change an answer. The default, "forward", keeps
  lm-eval's one pass per request (cheaper: no per-token steps; existing results stay comparable).
  Perplexity (`loglikelihood_rolling`) stays on the forward pass either way: decoding whole files one
  token at a time is what `snapquant.eval.fidelity`'s decode mode measures, on fewer tokens.
- `generation="auto"|"loop"|"hf"` picks what runs `generate_until` batches: `hf` is HF `generate`; `loop`
  is `snapquant.eval.generation.DecodeLoop` (one preallocated LatentCache per batch, fixed-shape decode
  steps captured as a CUDA graph on GPUs, HF's stopping rules checked off the critical path: the same
  tokens HF generate returns, so the same strings after lm-eval's post-processing); `auto` runs the loop
  on CUDA when the model, config and backend can be captured, HF elsewhere (on CPU the loop has nothing
  to win). Requests the loop cannot reproduce (beam search, repetition penalty, ...) go to HF with one
  warning naming the reason. `gen_batch_size` overrides `batch_size` for generation only (the loop
  pays off at large batches); `gen_steps` ('auto', 'graph', 'static', 'eager') and `gen_check_every`
  are the loop's knobs. `gen_refill` (True, False, 'auto'; default False: the captured-graph path passes its
  GPU test, but on an H200 it gained only 3 % answer tokens/s where answers stop at scattered points,
  docs/performance.md, while False gives lm-eval's batches HF's exact tokens) hands each group of requests
  with the same generation kwargs to the loop as one queue over `gen_batch_size` slots, refilling a slot
  whose request stopped with the next waiting one (`snapquant.eval.refill`; 'auto': when the batch-1
  prefill costs less than the idle slot-steps it removes); False keeps lm-eval's batches and HF's rule.
- `get_model_info()` adds `snapquant_preset`, `snapquant_config`, `snapquant_backend`,
  `snapquant_kernel_options`, `snapquant_loglikelihood` and `snapquant_generation` (requested path, the
  path each batch took and why), so the results JSON (`results["config"]`) records which scheme and which decode path produced
  the numbers.

Importing this module registers the model type `snapquant` with lm-eval, so after
`import snapquant.eval.lm`, `lm_eval.simple_evaluate(model="snapquant",
model_args="pretrained=PATH,kv_config=snapmla,backend=auto", tasks=[...])` works; or build it directly:
`SnapquantLM(pretrained=model_or_path, tokenizer=tok, kv_config="snapmla", batch_size=4)`.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ..cache import LatentCache
from ..config import KVQuantConfig
from ..errors import ConfigError
from ..models.stepping import cache_kwarg
from ..patching import patch
from ..presets import resolve_config

log = logging.getLogger(__name__)
GENERATION_PATHS = ("auto", "loop", "hf")


@register_model("snapquant")
class SnapquantLM(HFLM):
    """HFLM whose model runs MLA attention over the quantized latent cache of `kv_config`."""

    def __init__(self, pretrained: Any, kv_config: str | dict | KVQuantConfig = "snapmla", backend: str = "auto",
                 kernel_options: dict[str, Any] | None = None, generation: str = "auto",
                 gen_batch_size: int | str | None = None, gen_steps: str = "auto", gen_check_every: int | str = 16,
                 gen_refill: bool | str = False, loglikelihood: str = "forward", **kwargs: Any) -> None:
        # option checks before the model loads: one line naming the field
        from .tasks.direct import check_loglikelihood_path

        self.loglikelihood_path = check_loglikelihood_path("loglikelihood", loglikelihood)
        self._ll_decode = False
        if generation not in GENERATION_PATHS:
            raise ConfigError(f"generation must be one of {', '.join(GENERATION_PATHS)}, got {generation!r}")
        from .generation import STEP_MODES

        if gen_steps not in STEP_MODES:
            raise ConfigError(f"gen_steps must be one of {', '.join(STEP_MODES)}, got {gen_steps!r}")
        self.gen_batch_size = _positive_int("gen_batch_size", gen_batch_size) if gen_batch_size is not None else None
        self.gen_check_every = _positive_int("gen_check_every", gen_check_every)
        self.gen_refill = _refill_arg(gen_refill)
        self._slots: int | None = None  # set while generate_until hands whole groups to the refill queue
        super().__init__(pretrained=pretrained, **kwargs)
        self.kv_config = resolve_config(kv_config)
        self.kv_backend = backend
        self.kv_kernel_options = dict(kernel_options or {})
        # raises for non-MLA models, naming the class
        patch(self.model, self.kv_config, backend=backend, kernel_options=self.kv_kernel_options)
        self._cache_kwarg = cache_kwarg(self.model)
        self.generation, self.gen_steps = generation, gen_steps
        self._loop = None
        self._gen_batches: Counter = Counter()  # (path, reason) -> batches
        self._warned: set[str] = set()
        self.refill_stats: list[dict] = []  # one per queue run (snapquant.eval.refill.run_queue's stats)
        self._gen_default = self._default_path()

    def _default_path(self) -> tuple[str, str]:
        """The path generation batches take unless a request's kwargs send it to HF, and why."""
        from .generation import graph_reason

        if self.generation == "hf":
            return "hf", "generation='hf'"
        if self.generation == "loop":
            return "loop", "generation='loop'"
        reason = graph_reason(self.model)
        if reason is not None:
            return "hf", f"auto: {reason}"
        return "loop", "auto: CUDA graph decode supported"

    @property
    def generation_default(self) -> tuple[str, str]:
        """The path ('loop' or 'hf') that generation batches take unless a request sends them to HF, and why."""
        return self._gen_default

    def decode_loop(self) -> Any:
        """The `DecodeLoop` that runs generation batches on the loop path (made on first use, then kept)."""
        return self._decode_loop()

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        slots = self.gen_batch_size or self.batch_size_per_gpu
        saved = self.batch_size_per_gpu
        if self._queues(slots) and len(requests) > slots:
            # one lm-eval "batch" per group of gen_kwargs (sorted longest first, as lm-eval sorts); the queue
            # runs it through `slots` slots (_model_generate)
            self._slots, self.batch_size_per_gpu = slots, len(requests)
        elif self.gen_batch_size is not None:
            self.batch_size_per_gpu = self.gen_batch_size
        try:
            return super().generate_until(requests, disable_tqdm=disable_tqdm)
        finally:
            self.batch_size_per_gpu, self._slots = saved, None

    def _queues(self, slots: Any) -> bool:
        """Whether generation groups go to the refill queue: the loop path, refill not off, a fixed slot count."""
        if self.gen_refill is False or self._gen_default[0] != "loop" or not isinstance(slots, int):
            return False
        from .refill import refill_reason

        reason = refill_reason(self._decode_loop())
        if reason is not None and self.gen_refill is True:
            raise ConfigError(f"gen_refill=True: {reason}")
        return reason is None

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        path, reason = self._gen_default
        plan = None
        if path == "loop":
            from .generation import decoding_plan

            kw = {k: v for k, v in generation_kwargs.items() if k != "attention_mask"}
            # HFLM._model_generate's own normalisation: temperature 0 means greedy
            kw["temperature"] = kw.get("temperature", 0.0)
            if kw["temperature"] == 0.0 and kw.get("do_sample") is None:
                kw["do_sample"] = False
            if kw.get("do_sample") is False and kw["temperature"] == 0.0:
                kw.pop("temperature")
            plan = decoding_plan(self.model, kw, context.shape[1])
            if isinstance(plan, str):
                path, reason = "hf", plan
        if path == "hf" and self.generation != "hf" and reason not in self._warned:
            self._warned.add(reason)
            # auto on a CPU model: HF generate is the documented path there, recorded in the results; a
            # request the loop refuses (or an explicit generation="loop" that cannot run) is worth a warning
            level = logging.WARNING if plan is not None or self.generation == "loop" else logging.INFO
            log.log(level, "snapquant generation: HF generate for these requests: %s", reason)
        if self._slots is not None and context.shape[0] > self._slots:
            return self._queue_generate(path, reason, plan, context, max_length, stop, generation_kwargs)
        self._gen_batches[(path, reason)] += 1
        if path == "loop":
            return self._decode_loop().generate(
                context, generation_kwargs.get("attention_mask"), max_length=max_length, plan=plan, stop=stop,
                pad_token_id=self.tokenizer.pad_token_id).sequences
        if generation_kwargs.get(self._cache_kwarg) is None:
            generation_kwargs[self._cache_kwarg] = LatentCache(self.kv_config, self.model)
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def _queue_generate(self, path, reason, plan, context, max_length: int, stop: list[str], kwargs: dict):
        """A whole group of requests (left-padded `context`) -> HF-shaped sequences: the refill queue on the
        loop path, else HF generate over chunks of the slot count, each row padded after its own tokens."""
        import torch

        B, P, slots = context.shape[0], context.shape[1], self._slots
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        rows: list[list[int]] = []
        if path == "loop":
            am = kwargs.get("attention_mask")
            prompts = [r[P - int(n):] for r, n in zip(context.tolist(), am.sum(1).tolist(), strict=True)]
            from .refill import run_queue

            res = run_queue(self._decode_loop(), prompts, slots=slots, max_new_tokens=max_length - P, plan=plan,
                            stop=stop, refill=self.gen_refill, pad_token_id=pad)
            self._gen_batches[(path, f"{reason}; refill={self.gen_refill!r}")] += 1
            self.refill_stats.append(res.stats)
            rows = res.tokens
        else:
            for i in range(0, B, slots):
                kw = dict(kwargs, attention_mask=kwargs["attention_mask"][i:i + slots])
                self._gen_batches[(path, reason)] += 1
                if kw.get(self._cache_kwarg) is None:
                    kw[self._cache_kwarg] = LatentCache(self.kv_config, self.model)
                out = HFLM._model_generate(self, context[i:i + slots], max_length, stop, **kw)
                rows += out[:, P:].tolist()
        T = max(len(r) for r in rows)
        new = torch.tensor([r + [pad] * (T - len(r)) for r in rows], dtype=torch.long, device=context.device)
        return torch.cat([context, new], dim=1)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        # HFLM.loglikelihood tokenizes (lm-eval's _encode_pair, prefix token for an empty context) and calls
        # _loglikelihood_tokens; the flag sends that call, and not loglikelihood_rolling's, to the decode path.
        self._ll_decode = self.loglikelihood_path == "decode"
        try:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        finally:
            self._ll_decode = False

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        if not self._ll_decode:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        from .tasks.direct import decode_loglikelihoods

        bs = override_bs or self.batch_size
        bs = bs if isinstance(bs, int) and bs > 0 else 16  # "auto": continuations of one context per batch
        res = decode_loglikelihoods(self.model, [(ctx, cont) for _, ctx, cont in requests], bs, self.max_length)
        for (request_str, _, _), answer in zip(requests, res, strict=True):
            if request_str is not None:
                self.cache_hook.add_partial("loglikelihood", request_str, answer)
        return res

    def _decode_loop(self):
        if self._loop is None:
            from .generation import DecodeLoop, graph_reason

            steps = self.gen_steps
            if steps == "auto" and self.model.device.type == "cuda" and graph_reason(self.model) is not None:
                steps = "eager"  # generation='loop' asked for it: run it, uncaptured
            self._loop = DecodeLoop(self.model, self.tokenizer, steps=steps, check_every=self.gen_check_every)
        return self._loop

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info.update({
            "snapquant_preset": self.kv_config.label(),
            "snapquant_config": self.kv_config.to_dict(),
            "snapquant_backend": self.kv_backend,
            "snapquant_kernel_options": self.kv_kernel_options,
            "snapquant_loglikelihood": self.loglikelihood_path,
            "snapquant_generation": {
                "requested": self.generation,
                "default_path": self._gen_default[0],
                "default_reason": self._gen_default[1],
                "steps": self._loop.steps if self._loop is not None else self.gen_steps,
                "fused_norms": None if self._loop is None else {"on": self._loop.fused_norms,
                                                                "why": self._loop.norms_reason,
                                                                "rotary_mode": self._loop.rotary_mode},
                "check_every": self.gen_check_every,
                "gen_batch_size": self.gen_batch_size,
                "refill": self.gen_refill,
                "refill_stats": self.refill_stats,
                "batches": [{"path": p, "reason": r, "count": n} for (p, r), n in self._gen_batches.items()],
            },
        })
        return info


def _refill_arg(value: Any) -> bool | str:
    """gen_refill from Python or an lm-eval model_args string."""
    text = str(value).lower()
    if text in ("true", "1"):
        return True
    if text in ("false", "0"):
        return False
    if text == "auto":
        return "auto"
    raise ConfigError(f"gen_refill must be true, false or auto, got {value!r}")


def _positive_int(name: str, value: Any) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or isinstance(value, bool) or (isinstance(value, float) and value != n):
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return n
