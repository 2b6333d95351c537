"""MoE load balancing and router statistics over every rank of an engine.

Each ``MoE`` module counts the real tokens it routed on its own rank (``models.common.moe``);
this module turns those counts into global ones and acts on them, so that the loss, the
routing bias and the statistics are the same whatever the allocation:

* counts are summed over every rank of the engine (data, context, tensor/expert-parallel
  ranks that route different tokens, and the pipeline stages, each of which holds its own
  layers) and divided by the number of ranks that route the same tokens
  (``parallel.expert_parallel.moe_token_replication``);
* ``aux_loss``: the Switch load-balancing loss of every MoE layer over the global batch of
  the step, as Megatron's ``switch_load_balancing_loss_func`` defines it for global-batch
  balancing (Qiu et al. 2025, "Demons in the Detail")::

      L = E / (k * T^2) * sum_e c_e * sum_t p[t, e]

  with ``c_e`` the expert's token choices over the whole step, ``T`` the step's real tokens,
  ``p`` the router probabilities; ``L`` is 1 for perfectly even routing.  The training loss
  gets ``moe_aux_loss_coef * sum over layers of L`` (Megatron's convention).  Because ``c``
  must be known before the first backward, a step with the aux loss first routes its
  microbatches in a forward pass without gradients (one extra forward per step);
* ``aux_free``: after each optimizer step, every layer's bias moves by
  ``moe_bias_update_rate * sign(mean_e c_e - c_e)`` (DeepSeek-V3): up for experts below the
  mean load, down above it.  The bias only changes which experts are chosen.

Router statistics of the step (under ``moe/``): ``load_imbalance`` (max over mean tokens per
expert) per layer, the worst and the mean layer, ``zero_load_expert_frac`` (Archon's MoE is
dropless: no token is ever dropped, so idle experts are what imbalance costs), and the
auxiliary loss or the largest bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from archon.config import ArchonEngineConfig
from models.common.moe import MoE
from parallel.dims import ParallelDims
from parallel.expert_parallel import moe_token_replication
from parallel.fqn import clean_fqn


@dataclass
class _Layer:
    layer_id: int
    """Block index in the full model."""
    moe: MoE
    """The block's MoE module on this rank."""


def _step_counts(moe: MoE) -> torch.Tensor:
    """The MoE buffer of the step's tokens per expert (registered buffers are untyped)."""
    return cast(torch.Tensor, moe.step_tokens_per_expert)


def moe_layers(model: nn.Module) -> list[tuple[int, MoE]]:
    """``(layer id, MoE module)`` of every MoE block this rank holds (wrapper prefixes ignored)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            parts = clean_fqn(name).split(".")
            found.append((int(parts[parts.index("layers") + 1]), module))
    return sorted(found, key=lambda item: item[0])


class MoEBalancer:
    """Per-step router bookkeeping of one engine: begin, (aux-loss pre-pass), end with stats and bias update."""

    def __init__(
        self,
        model: nn.Module,
        model_args: Any,
        archon_cfg: ArchonEngineConfig,
        replication: int,
        fsdp_grad_scale: float,
        device: torch.device,
    ) -> None:
        self.layers = [_Layer(i, m) for i, m in moe_layers(model)]
        self.n_layers = int(model_args.n_layers)
        self.mode = archon_cfg.moe_load_balance
        self.aux_coef = float(archon_cfg.moe_aux_loss_coef)
        self.bias_rate = float(archon_cfg.moe_bias_update_rate)
        self.replication = replication
        # Gradients of every rank are divided by this (FSDP's mean); the main loss is scaled by it too.
        self.fsdp_grad_scale = fsdp_grad_scale
        self.num_experts = int(model_args.num_experts)
        self.top_k = int(model_args.top_k)
        # Where collectives run (CUDA under NCCL); a pipeline stage without MoE blocks joins them too.
        self.device = device

    @property
    def aux_loss_enabled(self) -> bool:
        return self.mode == "aux_loss" and self.aux_coef > 0

    # ------------------------------------------------------------------ per step
    def begin_step(self) -> None:
        """Zero the counters and start counting the training forwards of a step."""
        for layer in self.layers:
            _step_counts(layer.moe).zero_()
            layer.moe.step_aux_loss.zero_()
            layer.moe.count_tokens = True
            layer.moe.aux_loss_weights = None

    def use_prepass_counts(self) -> None:
        """After a pre-pass forward of the whole step: arm every layer's aux loss with the global counts."""
        counts, _, present = self._reduce()
        for layer in self.layers:
            c = counts[layer.layer_id]
            tokens = c.sum() / self.top_k
            scale = self.aux_coef * self.num_experts / (self.top_k * tokens.clamp_min(1.0) ** 2)
            layer.moe.aux_loss_weights = (scale * c).to(self.device)
            # The loss of every rank is scaled by the FSDP factor before backward; ranks routing
            # the same tokens all add this loss, so each adds its share.
            layer.moe.aux_loss_grad_scale = self.fsdp_grad_scale / self.replication
            _step_counts(layer.moe).zero_()
            layer.moe.step_aux_loss.zero_()

    def end_step(self, optimizer_stepped: bool) -> dict[str, float]:
        """Global statistics of the step's training forwards; the aux-free bias update; counting off."""
        counts, aux, present = self._reduce()
        for layer in self.layers:
            layer.moe.count_tokens = False
            layer.moe.aux_loss_weights = None
        if self.mode == "aux_free" and optimizer_stepped:
            self._update_bias(counts)
        return self._stats(counts, aux, present)

    # ------------------------------------------------------------------ internals
    def _reduce(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``counts [n_layers, E]``, ``aux [n_layers]`` (coef * L) and ``present [n_layers]`` over all ranks."""
        packed = torch.zeros(self.n_layers, self.num_experts + 2, dtype=torch.float64, device=self.device)
        for layer in self.layers:
            packed[layer.layer_id, : self.num_experts] = _step_counts(layer.moe).double()
            packed[layer.layer_id, self.num_experts] = float(layer.moe.step_aux_loss)
            packed[layer.layer_id, self.num_experts + 1] = 1.0
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(packed)
        counts = packed[:, : self.num_experts] / self.replication
        aux = packed[:, self.num_experts] / self.replication
        present = packed[:, self.num_experts + 1] > 0
        return counts.float().cpu(), aux.cpu(), present.cpu()

    @torch.no_grad()
    def _update_bias(self, counts: torch.Tensor) -> None:
        for layer in self.layers:
            c = counts[layer.layer_id]
            if c.sum() == 0:
                continue
            step = self.bias_rate * torch.sign(c.mean() - c)
            layer.moe.expert_bias.add_(step.to(layer.moe.expert_bias.device))

    def _stats(self, counts: torch.Tensor, aux: torch.Tensor, present: torch.Tensor) -> dict[str, float]:
        ids = [i for i in range(self.n_layers) if present[i] and counts[i].sum() > 0]
        if not ids:
            return {}
        stats: dict[str, float] = {}
        imbalance = []
        for i in ids:
            c = counts[i]
            value = float(c.max() / c.mean())
            imbalance.append(value)
            stats[f"moe/load_imbalance/layer_{i}"] = value
        stats["moe/load_imbalance_max"] = max(imbalance)
        stats["moe/load_imbalance_mean"] = sum(imbalance) / len(imbalance)
        stats["moe/zero_load_expert_frac"] = float((counts[ids] == 0).float().mean())
        if self.aux_loss_enabled:
            # The loss each layer adds (coef * L); reported as the mean L, 1 for even routing.
            stats["moe/aux_loss"] = float(aux[ids].sum() / self.aux_coef / len(ids))
            stats["moe/aux_loss_term"] = float(aux[ids].sum())
        if self.mode == "aux_free":
            local = max((float(layer.moe.expert_bias.abs().max()) for layer in self.layers), default=0.0)
            top = torch.tensor([local], dtype=torch.float64, device=self.device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(top, op=dist.ReduceOp.MAX)
            stats["moe/expert_bias_abs_max"] = float(top)
        return stats


def build_moe_balancer(
    model: nn.Module, model_args: Any, archon_cfg: ArchonEngineConfig, parallel_dims: ParallelDims, device: torch.device
) -> MoEBalancer | None:
    """The balancer of an engine's model, or None when the model has no MoE block."""
    is_moe = getattr(model_args, "is_moe_layer", None)
    if is_moe is None or not any(is_moe(i) for i in range(int(model_args.n_layers))):
        return None
    return MoEBalancer(
        model,
        model_args,
        archon_cfg,
        moe_token_replication(parallel_dims),
        float(parallel_dims.fsdp_gradient_divide_factor),
        device,
    )
