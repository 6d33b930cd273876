"""`SnapquantLM`: lm-eval's HFLM running a model patched with `snapquant.patch`.

- `generate_until` tasks decode through the quantized latent cache: every `generate` call gets a fresh
  `LatentCache` explicitly (the patch would also create one), so decode reads FP8/int codes + scales.
- loglikelihood / multiple-choice / perplexity tasks call `model(inputs)` with no decode: they see the
  quantization only with `prefill: quantized` (then every position attends to the quantized latent,
  which for per-token formats equals what step-by-step decode would see; docs/numerics.md, "Why
  per-token matters"). With
  `prefill: bf16` they reproduce the unquantized model, by design.
- `get_model_info()` adds `snapquant_preset`, `snapquant_config`, `snapquant_backend` and
  `snapquant_kernel_options`, so the results JSON (`results["config"]`) records which scheme produced
  the numbers.

Importing this module registers the model type `snapquant` with lm-eval, so after
`import snapquant.eval.lm`, `lm_eval.simple_evaluate(model="snapquant",
model_args="pretrained=PATH,kv_config=snapmla,backend=auto", tasks=[...])` works; or build it directly:
`SnapquantLM(pretrained=model_or_path, tokenizer=tok, kv_config="snapmla", batch_size=4)`.
"""

from __future__ import annotations

from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ..cache import LatentCache
from ..config import KVQuantConfig
from ..models.stepping import cache_kwarg
from ..patching import patch
from ..presets import resolve_config


@register_model("snapquant")
class SnapquantLM(HFLM):
    """HFLM whose model runs MLA attention over the quantized latent cache of `kv_config`."""

    def __init__(self, pretrained: Any, kv_config: str | dict | KVQuantConfig = "snapmla", backend: str = "auto",
                 kernel_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(pretrained=pretrained, **kwargs)
        self.kv_config = resolve_config(kv_config)
        self.kv_backend = backend
        self.kv_kernel_options = dict(kernel_options or {})
        # raises for non-MLA models, naming the class
        patch(self.model, self.kv_config, backend=backend, kernel_options=self.kv_kernel_options)
        self._cache_kwarg = cache_kwarg(self.model)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        if generation_kwargs.get(self._cache_kwarg) is None:
            generation_kwargs[self._cache_kwarg] = LatentCache(self.kv_config, self.model)
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info.update({
            "snapquant_preset": self.kv_config.label(),
            "snapquant_config": self.kv_config.to_dict(),
            "snapquant_backend": self.kv_backend,
            "snapquant_kernel_options": self.kv_kernel_options,
        })
        return info
