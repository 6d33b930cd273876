"""MoE experts inside a captured decode step: grouped GEMMs over the routed tokens, with no host sync.

transformers 5.x runs `@use_experts_implementation` expert modules (DeepseekV3Experts and the other
DeepSeek-style families) through the implementation named by `config._experts_implementation`:

- `eager`: a Python loop over the experts that were hit, found with `nonzero` (a host sync per MoE
  layer: it cannot be captured in a CUDA graph);
- `grouped_mm` (the default where torch has grouped GEMMs): sort the (token, expert) pairs by expert
  and run one grouped GEMM per projection; each expert's weights are read once per step;
- `batched_mm`: gather every pair's expert weights (`gate_up_proj[expert_ids]`, a `[T*k, 2I, H]` copy
  per layer) and run a bmm. HF `generate` switches `grouped_mm` to it for decode on GPUs
  (`_optimize_model_for_decode`): at batch 32 and DeepSeek-V2-Lite sizes (k = 6, 17.3 MB per
  expert in bf16) that copies 3.3 GB per layer per step, against 1.1 GB for reading all 64 experts.

Two implementations are registered here, both free of host syncs and of per-token weight gathers,
for the decode loop of `snapquant.eval.generation` (which calls the model directly, so nothing
switches them back):

    snapquant_grouped_mm   the grouped_mm algorithm with counts from a scatter-add (graph-safe on any
                           transformers version); needs torch.nn.functional.grouped_mm, i.e. bf16 on
                           CUDA sm80+ (any float dtype on CPU, where 16-byte aligned rows suffice)
    snapquant_dense        every expert on every token, weighted by the dense routing matrix (zeros
                           for unselected experts): the fallback where grouped GEMMs are unavailable;
                           it reads each expert's weights once, as grouped_mm does, but does E / k
                           times its expert FLOPs (64 / 6 = 10.7x for DeepSeek-V2-Lite)

`decode_experts(model)` picks one (`plan_decode_experts`), logs a warning naming the cost when it has
to fall back, and restores the model's own implementation on exit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..errors import ConfigError

log = logging.getLogger(__name__)

GROUPED = "snapquant_grouped_mm"
DENSE = "snapquant_dense"


def _check_layout(module: torch.nn.Module) -> None:
    for attr, ok in (("has_bias", False), ("has_post_expert_norm", False), ("has_gate", True)):
        if getattr(module, attr, ok) != ok:
            raise ConfigError(f"{type(module).__name__}.{attr}={not ok}: snapquant's decode experts support gated "
                              f"experts without bias or post-expert norm; use experts_implementation='eager'")
    if getattr(module, "_is_expert_parallel", False):
        raise ConfigError(f"{type(module).__name__}: expert parallelism is not supported by snapquant's decode experts")


def _weights(module: torch.nn.Module, name: str) -> torch.Tensor:
    """Expert weights as [E, in, out] (the layout grouped_mm multiplies by)."""
    w = getattr(module, name)
    return w if getattr(module, "is_transposed", False) else w.transpose(-2, -1)


# Pairs up to which the grouping is found by comparing every pair's (expert, index) key with every other's (an
# [S, S] bool matrix, 1 MB at S = 1024) rather than by a sort: a decode step's few hundred pairs, where a radix
# sort costs ~27 us per MoE layer on an H100 (0.7 ms of a V2-Lite step) and the comparison a few small kernels.
# A prefill's ~10^6 pairs sort.
COMPARE_LIMIT = 2048
# On CUDA the comparison runs as one Triton launch (`kernels.triton.expert_groups`) instead of ~8 small
# kernels per MoE layer and step: integer ranks and counts, the same outputs.
FUSED_GROUPS = True


def group_by_expert(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, slot) pair -> expert ids `flat [S]` -> `(order, pos, offs)`: `order` lists the pairs grouped by
    expert, pair order kept within an expert (what a stable sort by expert gives); `pos` is its inverse (pair
    p sits at row pos[p] of the grouped rows); `offs [E]` int32 the end of each expert's rows (grouped_mm's
    offsets). Fixed shapes, no host sync."""
    S = flat.numel()
    if S <= COMPARE_LIMIT and FUSED_GROUPS and flat.is_cuda:
        from ..kernels.triton.expert_groups import group_pairs

        return group_pairs(flat, num_experts)  # the same ranks and counts in one launch
    arange = torch.arange(S, device=flat.device)
    if S <= COMPARE_LIMIT:
        experts = torch.arange(num_experts, device=flat.device)
        key = arange.add(flat, alpha=S)  # flat * S + index: distinct; ordered by expert, then by pair index
        pos = (key[None, :] < key[:, None]).sum(1)  # the rank of each key: its row in the grouped order
        order = torch.empty_like(pos).scatter_(0, pos, arange)
        offs = (flat[None, :] <= experts[:, None]).sum(1, dtype=torch.int32)  # pairs of experts <= e
    else:
        order = torch.sort(flat, stable=True).indices
        pos = torch.empty_like(order).scatter_(0, order, arange)
        counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))  # exact in int32; bincount would sync
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
    return order, pos, offs


# The weighted sum of each token's k expert outputs: on CUDA one Triton pass (`kernels.triton.expert_combine`)
# instead of a gather, an fp32 product tensor and a reduction (~25 GB of traffic per MoE layer of a batch-128
# 1K prefill at V2-Lite sizes, against 3.7). It adds the fp32 products in the order of torch's CUDA reduction
# (COMBINE_ORDER), so its bits are those of the torch expression; FUSED_COMBINE = False keeps the torch ops.
FUSED_COMBINE = True
COMBINE_ORDER = "lanes4"
# The gate, silu(gate) * up over the grouped rows: one Triton pass on CUDA instead of two kernels and an
# intermediate (~13 GB -> 6.6 GB per MoE layer of that prefill); the same operations, so the same bits.
FUSED_GATE = True


def fused_combine_applies(out: torch.Tensor, top_k_weights: torch.Tensor) -> bool:
    """Whether `grouped_experts_forward` combines the slots with the fused kernel (CUDA, fp32 routing weights)."""
    return (FUSED_COMBINE and out.is_cuda and top_k_weights.dtype == torch.float32 and out.dim() == 2
            and out.dtype in (torch.bfloat16, torch.float16, torch.float32))


def fused_gate_applies(module: torch.nn.Module, h: torch.Tensor) -> bool:
    """Whether the gate runs as one Triton pass (`kernels.triton.expert_gate`): CUDA, transformers' default
    gate (split [gate; up], act(gate) * up) with SiLU, 16- or 32-bit floats. Same bits as the two torch ops."""
    if not (FUSED_GATE and h.is_cuda and h.dim() == 2 and h.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        return False
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return False
    act = getattr(module, "act_fn", None)
    return type(module)._apply_gate is _default_apply_gate and type(act) in _silu_types()


def _silu_types() -> tuple[type, ...]:
    from transformers.activations import ACT2CLS

    cls = ACT2CLS.get("silu")
    cls = cls[0] if isinstance(cls, tuple) else cls
    return tuple(t for t in (torch.nn.SiLU, cls) if isinstance(t, type))


def grouped_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """`hidden_states [T, H]`, top-k expert ids and weights `[T, k]` -> `[T, H]`, through two grouped GEMMs.

    Bit for bit transformers' `grouped_mm` algorithm (the same grouping, products and fp32 slot sum). On CUDA
    the grouping (decode sizes), the gate and the weighted slot sum each run as one Triton pass with the
    torch operations' arithmetic (`kernels.triton.expert_*`; GPU tests check the bits): on an H100 the fused
    combine took a batch-128 1K-token prefill of the V2-Lite shape from 2.05 to 1.78 s."""
    _check_layout(self)
    T, k = top_k_index.shape
    order, pos, offs = group_by_expert(top_k_index.reshape(-1), self.num_experts)
    x = hidden_states.index_select(0, order // k)
    w_up = _weights(self, "gate_up_proj")
    h = torch.nn.functional.grouped_mm(x.to(w_up.dtype), w_up, offs=offs)
    if fused_gate_applies(self, h):
        from ..kernels.triton.expert_gate import silu_mul

        h = silu_mul(h)
    else:
        h = self._apply_gate(h)
    out = torch.nn.functional.grouped_mm(h, _weights(self, "down_proj"), offs=offs)
    if fused_combine_applies(out, top_k_weights):
        from ..kernels.triton.expert_combine import combine_slots

        return combine_slots(out, pos, top_k_weights, hidden_states.dtype, order=COMBINE_ORDER)
    pairs = out.index_select(0, pos).view(T, k, -1)
    # The k slots of each token weighted and summed in slot order (the promoted dtype: fp32 routing weights).
    return (pairs * top_k_weights.unsqueeze(-1)).sum(dim=1).to(hidden_states.dtype)


def dense_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """Every expert on every token (`[E, T, H]` bmm), weighted by the dense routing matrix (0 if unselected)."""
    _check_layout(self)
    T = hidden_states.shape[0]
    E = self.num_experts
    w_up = _weights(self, "gate_up_proj")
    x = hidden_states.to(w_up.dtype).unsqueeze(0).expand(E, T, -1)
    h = self._apply_gate(torch.bmm(x, w_up))  # [E, T, I]
    out = torch.bmm(h, _weights(self, "down_proj"))  # [E, T, H]
    dense = torch.zeros(T, E, dtype=top_k_weights.dtype, device=top_k_weights.device)
    dense.scatter_add_(1, top_k_index, top_k_weights)  # a token's duplicate picks (none in top-k) would add
    return (out * dense.t().unsqueeze(-1)).sum(dim=0).to(hidden_states.dtype)


def register() -> None:
    """Make both implementations selectable by name (`model.set_experts_implementation(GROUPED)`)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(GROUPED, grouped_experts_forward)
    ExpertsInterface.register(DENSE, dense_experts_forward)


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The `@use_experts_implementation` expert modules of a model (those with a `gate_up_proj` tensor)."""
    return [m for m in model.modules() if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)
            and hasattr(m, "num_experts") and hasattr(m, "_apply_gate")]


def grouped_mm_reason(dtype: torch.dtype, device: torch.device | str, *dims: int) -> str | None:
    """Why torch's grouped GEMM cannot run these experts here (None when it can)."""
    device = torch.device(device)
    if not hasattr(torch.nn.functional, "grouped_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return f"grouped_mm on CUDA needs bfloat16 weights, the experts are {str(dtype).replace('torch.', '')}"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return f"grouped_mm needs CUDA sm80+, this GPU is sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    elif device.type != "cpu":
        return f"grouped_mm is not available on {device.type}"
    size = torch.empty((), dtype=dtype).element_size()
    bad = [d for d in dims if (d * size) % 16]
    if bad:
        return f"grouped_mm needs rows of a multiple of 16 bytes; expert widths {bad} in {dtype} are not"
    return None


@dataclass(frozen=True)
class ExpertsPlan:
    """Which experts implementation a decode step runs, and why; `warning` names the cost of a fallback."""

    implementation: str | None  # None: the model has no `@use_experts_implementation` experts
    reason: str
    warning: str | None = None


def plan_decode_experts(model: torch.nn.Module) -> ExpertsPlan:
    """GROUPED where torch's grouped GEMM runs the model's experts, else DENSE with the cost spelled out."""
    mods = expert_modules(model)
    if not mods:
        return ExpertsPlan(None, "no @use_experts_implementation experts in the model")
    m = mods[0]
    w = m.gate_up_proj
    E, I2, H = w.shape[0], w.shape[1], w.shape[2]
    k = int(getattr(getattr(model, "config", None), "num_experts_per_tok", 0) or 0)
    reason = grouped_mm_reason(w.dtype, w.device, H, I2, I2 // 2)
    if reason is None:
        return ExpertsPlan(GROUPED, "grouped GEMMs over the routed tokens (sync-free, each expert read once)")
    ratio = f"{E / k:.1f}x" if k else f"E / k = {E} / k times"
    warning = (f"experts: {reason}; the decode step computes all {E} experts for every token instead "
               f"({ratio} the routed expert FLOPs, each expert's weights still read once; capturable)")
    return ExpertsPlan(DENSE, reason, warning)


@contextmanager
def decode_experts(model: torch.nn.Module, implementation: str | None = "auto") -> Iterator[ExpertsPlan]:
    """Run the model's experts with a sync-free implementation inside the block, then restore its own.

    `implementation`: 'auto' (`plan_decode_experts`), GROUPED, DENSE, any registered transformers name
    ('grouped_mm', 'eager', ...), or None to leave the model as it is."""
    if implementation is None or not expert_modules(model):
        yield ExpertsPlan(None, "experts left as the model has them")
        return
    plan = plan_decode_experts(model) if implementation == "auto" else ExpertsPlan(implementation, "requested")
    if plan.warning:
        log.warning(plan.warning)
    register()
    original = experts_implementation(model)
    _set(model, plan.implementation)
    try:
        yield plan
    finally:
        _set(model, original)


def experts_implementation(model: torch.nn.Module) -> str | dict | None:
    """The experts implementation a model runs now (transformers' getter, or its config field where the
    installed transformers has no getter)."""
    if hasattr(model, "get_experts_implementation"):
        return model.get_experts_implementation()
    return getattr(model.config, "_experts_implementation", None)


def _set(model: torch.nn.Module, implementation: str | dict) -> None:
    try:
        model.set_experts_implementation(implementation)
    except (AttributeError, ValueError, KeyError):
        # a transformers without the setter, or one that validates names against a fixed list: the experts
        # dispatch on their config's field at every call, so setting it is enough
        value = implementation.get("", None) if isinstance(implementation, dict) else implementation
        for m in {id(e.config): e for e in expert_modules(model)}.values():
            m.config._experts_implementation = value
