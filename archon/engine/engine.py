"""ArchonEngine: one of Archon's own models laid over the ranks by an ``archon:`` allocation string.

All five parallel dims: FSDP2 (``d``), tensor (``t``), pipeline (``p``), context (``c``) and
expert (``e``) parallel, applied by the model's ``ModelSpec`` (``models/``).  The engine cuts the
global batch into data-parallel shares and packed microbatches the same way on every rank, and
normalises the loss by the global batch, so a step's loss and gradients do not depend on the
allocation or on microbatching.  Under context parallel, the ``cp`` ranks of one data-parallel
share get the same microbatches: each runs the model on one chunk of every packed row, and the
loss sees the full rows.  Under pipeline parallel a step's microbatches are padded to one length
and run through this rank's stages by the schedule (``pipeline/``); what the last stage computes
reaches every rank.  MoE models keep router statistics (``moe_balance``) and can replay the
experts the rollout servers chose.

This module builds the model and runs a step; packing and running microbatches is
``archon_runner``, the rest is shared with ``FSDPEngine``: the layout (``layout``), the
microbatch loop (``microbatch_loop``), the optimizer step (``step_runner``) and checkpoints
(``checkpointing``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar, cast

import torch

from archon.alloc import ModelAllocation
from archon.checkpoint.state import TrainState
from archon.config import ConfigError, TrainEngineConfig
from archon.engine.archon_runner import ArchonModelRunner
from archon.engine.errors import EngineError
from archon.engine.interface import TrainEngine
from archon.engine.layout import init_layout, load_model_config
from archon.engine.lora import add_adapters, init_adapters, lora_adapter, peft_config, peft_tensors, write_peft_folder
from archon.engine.microbatch import Batch, on_host, to_device
from archon.engine.microbatch_loop import (
    forward_microbatches,
    microbatch_rows,
    plan_rank_microbatches,
    train_microbatches,
)
from archon.engine.moe_balance import build_moe_balancer
from archon.engine.options import parameter_device, pipeline_options
from archon.engine.prefix_sharing import check_prefix_sharing, prompt_groups
from archon.engine.step_loss import (
    LossFn,
    LossWeightFn,
    StepTotals,
    microbatch_loss,
    reduce_step_totals,
    token_count_weight,
)
from archon.engine.step_runner import StepRunner
from archon.engine.token_outputs import CollectedRows, output_keys
from archon.engine.weights import hf_full_tensors, init_from_seed, init_unloaded, write_hf_folder
from models import BaseStateDictAdapter, get_model_spec, load_hf_weights
from models.lora import adapters_disabled, apply_lora, is_lora_name
from parallel.errors import ParallelConfigError
from parallel.float8 import (
    convert_to_float8,
    high_precision_linears,
    precompute_float8_scales,
    resolve_emulate,
    uses_float8_all_gather,
)
from pipeline import PipelineConfigError, PipelinedModel

# EngineError lives in archon.engine.errors; importers of this module still find it here.
__all__ = ["ArchonEngine", "EngineError"]

logger = logging.getLogger("archon.engine")
# FSDP x TP gathers over two mesh dims in sequence; DTensor warns about it on every call.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


class ArchonEngine(TrainEngine):
    """``TrainEngine`` over an Archon model (``archon:`` allocations)."""

    backend: ClassVar[str] = "archon"
    """The allocation backend this engine runs."""
    engine_label: ClassVar[str] = "Archon"
    """How the initialization log names the engine."""

    def __init__(
        self,
        config: TrainEngineConfig,
        *,
        name: str = "actor",
        is_critic: bool = False,
        seed: int = 1,
        device: str = "auto",
        temperature: float = 1.0,
        total_steps: int = 1,
        trainable: bool = True,
        allocation: ModelAllocation | None = None,
    ):
        self.config = config
        # ``build_engine`` parsed ``config.backend`` to pick this class and hands the result on.
        self._allocation = allocation
        self.name = name
        self.is_critic = is_critic
        self.seed = seed
        self.device_setting = device
        self.temperature = temperature
        self.total_steps = max(1, total_steps)
        self.trainable = trainable
        # Optimizer steps taken and the random generators: what a checkpoint resumes besides the tensors.
        self.train_state = TrainState()
        self.model: torch.nn.Module | None = None
        # Set under pipeline parallel: this rank's stages; ``model`` is then their weights-only view.
        self.pipeline: PipelinedModel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler = None
        # Set by initialize(): the optimizer side of a step (trainable engines) and the microbatch runner.
        self.stepper: StepRunner | None = None
        self.runner: ArchonModelRunner | None = None
        # Under LoRA (config.lora.enabled): {Archon module name: HF module name} of the adapted layers.
        self.lora_targets: dict[str, str] = {}
        # Under fp8 (config.archon.fp8): names of the linears converted to torchao's Float8Linear.
        self.fp8_linears: list[str] = []

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by ``load``)."""
        return self.train_state.step

    @step.setter
    def step(self, value: int) -> None:
        self.train_state.step = value

    # ------------------------------------------------------------------ build
    def initialize(self) -> ArchonEngine:
        cfg = self.config
        self.layout = init_layout(
            cfg,
            name=self.name,
            device=self.device_setting,
            allocation=self._allocation,
            backend=self.backend,
            engine_class=type(self).__name__,
            engine_label=self.engine_label,
        )
        self.device_type, self.device = self.layout.device_type, self.layout.device
        self.allocation, self.parallel_dims = self.layout.allocation, self.layout.parallel_dims
        self.parallelize_options = self.layout.options
        self.train_state.device_type = self.device_type
        self.hf_config = load_model_config(self.name, cfg, check_spec=True)
        self.spec = get_model_spec(self.hf_config.model_type)
        self.model_args = self.spec.model_args_class.from_hf_config(self.hf_config, is_critic=self.is_critic)
        with torch.device("meta"):
            model = self.spec.model_class(self.model_args)
        if cfg.lora.enabled:
            # Before any parallel technique, so that TP, FSDP, pipeline stages, AC and compile see the adapters.
            self.lora_targets = add_adapters(
                model,
                self.spec.state_dict_adapter_class(self.model_args),
                cfg.lora,
                cfg.dtype,
                f"{self.name}.lora",
                trainable_head=self.is_critic,
            )
        # torchtitan's order: float8 conversion on the meta-device model, then TP (float8 styles), then FSDP.
        self.fp8_linears = self._convert_to_fp8(model) if cfg.archon.fp8 else []
        if self.parallel_dims.pp_enabled:
            self.pipeline = self._split_into_stages(model)
            model, parts = self.pipeline.model, self.pipeline.parts
        else:
            try:
                model = self.spec.parallelize_fn(
                    model, parallel_dims=self.parallel_dims, options=self.parallelize_options
                )
            except ParallelConfigError as exc:  # parallel/ states what the layout cannot do to this model
                raise EngineError(f"{self.name}.backend = '{cfg.backend}': {exc}") from None
            parts = [model]
        # The CPU under offload (FSDP2's rule); _init_weights puts the buffers on the compute device.
        where, fsdp = f"{self.name}.backend = '{cfg.backend}'", self.parallel_dims.fsdp_enabled
        for part in parts:
            part.to_empty(device=parameter_device(self.device, cfg.archon.offload_params, fsdp, where))
        self.model = model
        self._init_weights()
        # Router bookkeeping of MoE models (None for dense ones); see archon/engine/moe_balance.py.
        self.moe = build_moe_balancer(self.model, self.model_args, cfg.archon, self.parallel_dims, self.device)
        # The actor replays the experts the rollout servers chose when the batch carries them.
        self.routing_replay = bool(getattr(cfg, "moe_routing_replay", False))
        if self.routing_replay and self.moe is None:
            raise EngineError(
                f"{self.name}.moe_routing_replay = true, but model type '{self.hf_config.model_type}' "
                "has no MoE layers to replay; turn it off"
            )
        check_prefix_sharing(cfg, self.parallel_dims, self.moe is not None, self.name)
        self.runner = ArchonModelRunner(
            self.model,
            self.layout,
            cfg,
            moe=self.moe,
            routing_replay=self.routing_replay,
            is_critic=self.is_critic,
            temperature=self.temperature,
        )
        if not self.trainable:
            self.model.requires_grad_(False)
        else:
            # Under LoRA only the adapters (and a critic's value head) require grad: the optimizer holds no
            # state for the frozen base (``build_optimizer`` keeps trainable parameters only).
            self.stepper = StepRunner.for_model(self.model, cfg, self.name, self.train_state, self.total_steps)
            self.optimizer, self.lr_scheduler = self.stepper.optimizer, self.stepper.lr_scheduler
            if uses_float8_all_gather(self.model):
                # Scales of the float8 all-gather for the next step, in one all-reduce (torchao's advice); also
                # for the first: without them torchao scales each weight by its amax over the FSDP mesh only,
                # which under FSDP x TP is a different scale per TP shard (measured: d2t2's first loss 0.027
                # off d1's, 1e-5 with them).
                model_ = self.model
                self.stepper.after_step.append(lambda: precompute_float8_scales(model_))
                precompute_float8_scales(model_)
        return self

    def _convert_to_fp8(self, model: torch.nn.Module) -> list[str]:
        """Swap the meta-device model's eligible linears for torchao's float8 ones; returns their names."""
        cfg, where = self.config, f"{self.name}.archon.fp8 = '{self.config.archon.fp8}'"
        if cfg.lora.enabled:
            raise ConfigError(
                f"{where} with {self.name}.lora.enabled: adapters wrap the linears fp8 would convert; turn one off"
            )
        if cfg.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"{where} casts from float32 or bfloat16, not {cfg.dtype}; set {self.name}.dtype")
        try:
            emulate = resolve_emulate(self.device, cfg.archon.fp8_emulate)
            # Float8 all-gather and float8 TP inputs only when every forward runs in fp8 anyway (fp8_forward):
            # otherwise the logprob recomputation would see float8-rounded weights.
            fp8_forward, pd = cfg.archon.fp8_forward, self.parallel_dims
            names = convert_to_float8(
                model,
                cfg.archon.fp8,
                emulate=emulate,
                fsdp_float8_all_gather=fp8_forward and pd.fsdp_enabled,
                float8_tp=fp8_forward and pd.tp_enabled,
            )
        except ParallelConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        logger.info("%s: fp8 (%s%s) on %d linear layers", self.name, cfg.archon.fp8, ", emulated" * emulate, len(names))
        return names

    def _split_into_stages(self, model: torch.nn.Module) -> PipelinedModel:
        """This rank's pipeline stages of the meta-device ``model``, each parallelized."""
        if self.spec.pipelining_fn is None:
            raise EngineError(
                f"{self.name}.backend = '{self.config.backend}' asks for pipeline parallel, but model "
                f"type '{self.hf_config.model_type}' has no pipelining function in its ModelSpec; "
                "use p1 or add one (see models/qwen3/spec.py)"
            )
        try:
            return self.spec.pipelining_fn(
                model,
                parallel_dims=self.parallel_dims,
                options=self.parallelize_options,
                pipeline=pipeline_options(self.config),
                parallelize_fn=self.spec.parallelize_fn,
                device=self.device,
            )
        except (PipelineConfigError, ParallelConfigError) as exc:  # what the layout cannot do to this model
            raise EngineError(f"{self.name}.backend = '{self.config.backend}': {exc}") from None

    def _state_dict_adapter(self) -> BaseStateDictAdapter:
        """The model's HF name map; under LoRA it knows the adapters (optional in HF checkpoints, not HF fields)."""
        adapter = self.spec.state_dict_adapter_class(self.model_args)
        return lora_adapter(adapter) if self.lora_targets else adapter

    def _build_full(self) -> torch.nn.Module:
        """A single-device model with this engine's parameter names (adapters included), for seeded init."""
        model = self.spec.model_class(self.model_args)
        if self.lora_targets:
            lora = self.config.lora
            adapter = self.spec.state_dict_adapter_class(self.model_args)
            apply_lora(model, adapter, list(self.lora_targets), rank=lora.rank, alpha=lora.alpha)
        return model

    @torch.no_grad()
    def _init_weights(self) -> None:
        assert self.model is not None
        # Buffers (RoPE tables) and anything a checkpoint lacks (a critic's value head).
        cast(Any, self.model).init_weights(buffer_device=self.device)  # an Archon model (models/)
        if self.config.path:
            result = load_hf_weights(self.model, self.config.path, self._state_dict_adapter(), strict=True)
            unloaded = [name for name in result.initialised if not is_lora_name(name)]
            init_unloaded(self.model, unloaded, self.seed, std=getattr(self.model_args, "initializer_range", 0.02))
        else:
            # From scratch: initialise the full model identically on every rank from the seed, then
            # shard it, so that the initial weights do not depend on the allocation.
            init_from_seed(self.model, self._build_full, self.seed)
        if self.lora_targets:
            init_adapters(self.model, self.seed, self.config.lora)

    # ------------------------------------------------------------------ helpers
    def _plan(self, batch: Batch) -> list[list[int]]:
        """This rank's microbatches; under pipeline parallel a count the schedule can run."""
        layout = self.layout
        runnable = self.pipeline.microbatch_count if self.pipeline is not None else None
        # Under prefix sharing a prompt's samples stay in one microbatch, where their prompt is packed once.
        groups = prompt_groups(batch) if self.config.archon.prefix_sharing else None
        return plan_rank_microbatches(
            batch, self.config.mb_spec, layout.dp_size, layout.dp_rank, self.name, runnable, groups
        )

    # ------------------------------------------------------------------ train
    def train_batch(
        self, batch: Batch, loss_fn: LossFn, loss_weight_fn: LossWeightFn = token_count_weight
    ) -> dict[str, float]:
        """Forward+backward over every microbatch, then one optimizer step; returns global stats.

        The host waits for the device once: losses and stats stay tensors until the gradient norm
        is read to decide the step, and they come back with it (``StepTotals.read``).
        """
        assert self.model is not None and self.runner is not None and self.stepper is not None, (
            "initialize() a trainable engine first"
        )
        batch, total_weight, started = self.stepper.begin(self.model, batch, loss_weight_fn)
        my_mbs = self._plan(batch)
        grad_scale = float(self.parallel_dims.fsdp_gradient_divide_factor)
        self.stepper.zero_grad()
        totals = StepTotals()
        if self.moe is not None:
            self.moe.begin_step()
            if self.moe.aux_loss_enabled:
                # The global-batch aux loss weighs every token by the step's expert counts, which
                # must be known before the first backward: route the whole step once without grad.
                self._route_without_grad(batch, my_mbs)
                self.moe.use_prepass_counts()
        if self.pipeline is not None:
            self._train_pipelined(
                self.pipeline, batch, my_mbs, loss_fn, loss_weight_fn, total_weight, grad_scale, totals
            )
        else:
            train_microbatches(
                self.runner,
                self.model,
                batch,
                my_mbs,
                loss_fn=loss_fn,
                loss_weight_fn=loss_weight_fn,
                total_weight=total_weight,
                grad_scale=grad_scale,
                totals=totals,
                device=self.device,
            )

        pp_group = self.parallel_dims.get_mesh("pp").get_group() if self.parallel_dims.pp_enabled else None
        outcome = self.stepper.finish(self.model.parameters(), totals, started, pp_group=pp_group)
        moe_stats = self.moe.end_step(optimizer_stepped=outcome.stepped) if self.moe is not None else {}

        keys, reduced = reduce_step_totals(totals, self.layout.dp_group())
        if self.pipeline is not None:
            # The loss and its stats exist on the last stage only; every rank reports them.
            keys, reduced = self.pipeline.broadcast_from_last_stage((keys, reduced))
        result = outcome.stats(keys, reduced)
        if moe_stats:
            # The load-balancing loss is part of what was minimised (it reached the gradients
            # through the MoE layers, see models/common/moe.py).
            result["loss"] += moe_stats.pop("moe/aux_loss_term", 0.0)
            result.update(moe_stats)
        return result

    def _train_pipelined(
        self,
        pipeline: PipelinedModel,
        batch: Batch,
        my_mbs: list[list[int]],
        loss_fn: LossFn,
        loss_weight_fn: LossWeightFn,
        total_weight: float,
        grad_scale: float,
        totals: StepTotals,
    ) -> None:
        """This rank's stages through the schedule's forward and backward; the last stage computes the loss."""
        assert self.runner is not None
        runner = self.runner
        packs, inputs = runner.pipeline_microbatches(batch, my_mbs)
        rows = [microbatch_rows(batch, indices, loss_weight_fn, self.device) for indices in my_mbs]

        def last_stage_loss(out: torch.Tensor, i: int) -> torch.Tensor:
            outputs = runner.token_outputs(out, packs[i])
            return microbatch_loss(outputs, *rows[i], loss_fn, total_weight, totals) * grad_scale

        with self.layout.autocast(self.config.dtype):
            pipeline.train_step(inputs, last_stage_loss)
        totals.tokens = sum(p.n_real_tokens for p in packs)

    @torch.no_grad()
    def _route_without_grad(self, batch: Batch, my_mbs: list[list[int]]) -> None:
        """A forward of this rank's microbatches that only feeds the MoE routers' counters."""
        assert self.runner is not None, "initialize() the engine first"
        if self.pipeline is not None:
            _, inputs = self.runner.pipeline_microbatches(batch, my_mbs)
            with self.layout.autocast(self.config.dtype):
                self.pipeline.forward_step(inputs, lambda out, i: None)
            return
        for indices in my_mbs:
            self.runner.route(to_device(self.runner.pack(batch, indices), self.device))

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-token ``logprobs`` and ``entropy`` (or ``values`` for a critic), ``[B, S]``, global batch order."""
        assert self.model is not None and self.runner is not None, "initialize() first"
        if self.fp8_linears and not self.config.archon.fp8_forward:
            # Logprob recomputation stays in `dtype`: fp8 must not silently widen the train/inference mismatch.
            with high_precision_linears(self.model):
                return self._forward(batch)
        return self._forward(batch)

    def _forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        assert self.model is not None and self.runner is not None, "initialize() first"
        runner = self.runner
        self.model.eval()
        batch = on_host(batch)
        rows = CollectedRows(output_keys(self.is_critic))
        my_mbs = self._plan(batch)
        if self.pipeline is not None:
            packs, inputs = runner.pipeline_microbatches(batch, my_mbs)
            with self.layout.autocast(self.config.dtype):
                self.pipeline.forward_step(
                    inputs, lambda out, i: rows.add(runner.token_outputs(out, packs[i]), my_mbs[i])
                )
        else:
            forward_microbatches(runner, batch, my_mbs, rows, self.device)
        result = rows.assemble(tuple(batch["input_ids"].shape), self.layout.dp_group())
        if self.pipeline is not None:
            # The last stage computed the outputs; every rank returns them.
            result = self.pipeline.broadcast_from_last_stage(result)
        return result

    def adapters_off(self) -> AbstractContextManager[None]:
        """A context in which ``forward`` computes the base model alone (every ``LoRALinear``'s adapter off)."""
        assert self.model is not None, "initialize() the engine first"
        if not self.lora_targets:
            return super().adapters_off()
        return adapters_disabled(self.model)

    def load(self, path: str | Path) -> dict[str, Any]:
        """``TrainEngine.load``; under fp8 all-gather the float8 scales are then recomputed from the loaded weights."""
        extra = super().load(path)
        if self.model is not None:
            precompute_float8_scales(self.model)
        return extra

    # ------------------------------------------------------------------ weights out
    def named_full_tensors(
        self, dtype: torch.dtype | None = None, extras: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) one at a time; a collective: every rank must iterate.

        Parameters are cast to ``dtype``.  ``extras`` adds the persistent buffers HF formats may
        lack (the MoE routing bias, in float32) under the names Archon's own server reads;
        without it only the fields of the model's HF architecture come out.  Under LoRA the
        adapted layers come merged (``W + alpha / r * B @ A``).
        """
        assert self.model is not None, "initialize() the engine first"
        scales = {module: self.config.lora.scale for module in self.lora_targets}
        # Under LoRA the adapters are merged into their layers' weights (what servers without adapters load).
        yield from hf_full_tensors(self.model, self._state_dict_adapter(), self.pipeline, dtype, extras, scales)

    def export_hf(
        self,
        path: str | Path,
        dtype: torch.dtype | None = None,
        max_shard_size: str | int = "5GB",
        extras: bool = False,
    ) -> None:
        """Write an HF folder (config.json + sharded safetensors) from the sharded model; rank 0 writes.

        ``extras`` also writes what the HF architecture has no field for (the MoE routing bias),
        for folders that only Archon's own server reads (disk weight sync).
        """
        write_hf_folder(
            self.named_full_tensors(dtype, extras=extras),
            self.hf_config.to_dict(),
            path,
            source=self.config.path,
            max_shard_size=max_shard_size,
        )

    def export_peft(self, path: str | Path) -> bool:
        """Write the LoRA adapters as a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)
        that ``peft.PeftModel.from_pretrained`` loads onto the transformers model of ``path``'s base; rank 0 writes."""
        assert self.model is not None, "initialize() the engine first"
        if not self.lora_targets:
            raise EngineError(f"{self.name}.lora.enabled is false: there are no adapters to export as a PEFT folder")
        config = peft_config(self.config.lora, self.lora_targets, self.config.path)
        write_peft_folder(peft_tensors(self.model, self.pipeline, self.lora_targets), config, path)
        return True
