"""ArchonEngine: one model laid over the ranks by its allocation string, and how it trains.

Every rank calls every method with the same global batch (a dict of right-padded ``[B, S]``
tensors with ``attention_mask``).  The engine cuts it into data-parallel shares and packed
microbatches the same way on every rank, and normalises the loss by the global batch, so a
step's loss and gradients do not depend on the allocation or on microbatching.  Under context
parallel, the ``cp`` ranks of one data-parallel share get the same microbatches: each runs the
model on one chunk of every packed row, and the loss sees the full rows.  Under pipeline
parallel a step's microbatches are padded to one length and run through this rank's stages by
the schedule (``pipeline/``); what the last stage computes reaches every rank.

Per-token outputs are token-aligned: ``logprobs[b, i] = log p(input_ids[b, i] | input_ids[b, :i])``
(0 at each sequence's first token); a critic's ``values[b, i]`` is the value of the state
before token ``i``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from archon.alloc import ModelAllocation
from archon.checkpoint.dcp import load_checkpoint, save_checkpoint
from archon.checkpoint.state import TrainState, engine_states
from archon.config import ConfigError, TrainEngineConfig
from archon.engine.dist import current_device, init_distributed, resolve_device_type
from archon.engine.microbatch import (
    ROUTED_EXPERTS,
    Batch,
    PackedMicrobatch,
    on_host,
    pack,
    pack_token_values,
    plan_microbatches,
    rows_of,
    seqlens_of,
    to_device,
)
from archon.engine.optimizer import build_lr_scheduler, build_optimizer
from archon.engine.options import parallelize_options, parameter_device, pipeline_options
from archon.engine.step_loss import (
    LossFn,
    LossWeightFn,
    StepTotals,
    microbatch_loss,
    reduce_step_totals,
    token_count_weight,
)
from archon.engine.token_outputs import CollectedRows, loss_positions, output_keys, token_outputs
from archon.engine.torch_floor import check_torch_version
from archon.engine.weights import hf_full_tensors, init_from_seed, init_unloaded, load_hf_config, write_hf_folder
from archon.errors import ArchonError
from archon.runtime.drill import drill_point
from parallel.context_parallel import shard_sequence
from parallel.dims import ParallelDims
from parallel.dtypes import to_dtype
from parallel.errors import ParallelConfigError
from parallel.grad_clip import clip_grad_norm_
from pipeline import Microbatch, PipelineConfigError, PipelinedModel

logger = logging.getLogger("archon.engine")
# FSDP x TP gathers over two mesh dims in sequence; DTensor warns about it on every call.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


class EngineError(ArchonError, ValueError):
    """A user-caused problem with an engine's config, allocation or data."""


class ArchonEngine:
    """Builds, trains, evaluates, checkpoints and exports one model (actor, critic or reference)."""

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

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by ``load``)."""
        return self.train_state.step

    @step.setter
    def step(self, value: int) -> None:
        self.train_state.step = value

    # ------------------------------------------------------------------ build
    def initialize(self) -> ArchonEngine:
        from models import get_model_spec

        cfg = self.config
        self._init_parallel()
        self.hf_config = self._load_hf_config()
        self.spec = get_model_spec(self.hf_config.model_type)
        self.model_args = self.spec.model_args_class.from_hf_config(self.hf_config, is_critic=self.is_critic)
        with torch.device("meta"):
            model = self.spec.model_class(self.model_args)
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
        from archon.engine.moe_balance import build_moe_balancer

        # Router bookkeeping of MoE models (None for dense ones); see archon/engine/moe_balance.py.
        self.moe = build_moe_balancer(self.model, self.model_args, cfg.archon, self.parallel_dims, self.device)
        # The actor replays the experts the rollout servers chose when the batch carries them.
        self.routing_replay = bool(getattr(cfg, "moe_routing_replay", False))
        if self.routing_replay and self.moe is None:
            raise EngineError(
                f"{self.name}.moe_routing_replay = true, but model type '{self.hf_config.model_type}' "
                "has no MoE layers to replay; turn it off"
            )
        if not self.trainable:
            self.model.requires_grad_(False)
        else:
            self.optimizer = build_optimizer(self.model.parameters(), cfg.optimizer)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.optimizer, self.total_steps)
        return self

    def _init_parallel(self) -> None:
        """Device, process group, allocation and device meshes: what every engine sets up first."""
        cfg = self.config
        check_torch_version()
        self.device_type = resolve_device_type(self.device_setting)
        if cfg.archon.use_deterministic_algorithms:
            from parallel.determinism import apply_determinism

            # Environment variables must be set before the first kernel/communicator exists.
            apply_determinism(self.device_type)
        # The entry points already joined with the GPU the cluster plan gives this rank (init_run).
        init_distributed(self.device_type)
        self.device = current_device(self.device_type)
        self.train_state.device_type = self.device_type
        self.allocation = self._allocation or ModelAllocation.from_str(cfg.backend)
        # What parallel/ and pipeline/ are told besides the sizes (dtypes, AC, compile, offload).
        self.parallelize_options = parallelize_options(cfg)
        if self.allocation.backend != self.backend:
            raise EngineError(
                f"{self.name}.backend = '{cfg.backend}' is a '{self.allocation.backend}:' allocation, "
                f"but {type(self).__name__} runs '{self.backend}:' ones; build engines with "
                "archon.engine.build_engine(config, ...), which picks the engine by backend"
            )
        world = dist.get_world_size()
        if self.allocation.world_size != world:
            raise EngineError(
                f"{self.name}.backend = '{cfg.backend}' needs {self.allocation.world_size} ranks but "
                f"the job has {world}; launch with --nproc_per_node={self.allocation.world_size} "
                f"or change the allocation"
            )
        try:
            self.parallel_dims = ParallelDims.from_allocation(self.allocation, dp_replicate=cfg.archon.dp_replicate)
        except ParallelConfigError as exc:  # parallel/ cannot raise Archon's errors
            raise EngineError(f"{self.name}.backend = '{cfg.backend}': {exc}") from None
        self.parallel_dims.build_meshes(self.device_type)
        if dist.get_rank() == 0:
            logger.info(
                "Initialized %s engine with parallel dims: %s", self.engine_label, self.parallel_dims.describe()
            )

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

    def _load_hf_config(self):
        try:
            return load_hf_config(self.name, self.config.path or self.config.model_config, self.backend == "archon")
        except ConfigError as exc:
            raise EngineError(str(exc)) from None

    @torch.no_grad()
    def _init_weights(self) -> None:
        from models import load_hf_weights

        assert self.model is not None
        # Buffers (RoPE tables) and anything a checkpoint lacks (a critic's value head).
        cast(Any, self.model).init_weights(buffer_device=self.device)  # an Archon model (models/)
        if self.config.path:
            result = load_hf_weights(
                self.model, self.config.path, self.spec.state_dict_adapter_class(self.model_args), strict=True
            )
            init_unloaded(
                self.model, result.initialised, self.seed, std=getattr(self.model_args, "initializer_range", 0.02)
            )
            return
        # From scratch: initialise the full model identically on every rank from the seed, then
        # shard it, so that the initial weights do not depend on the allocation.
        init_from_seed(self.model, lambda: self.spec.model_class(self.model_args), self.seed)

    # ------------------------------------------------------------------ helpers
    @property
    def dp_size(self) -> int:
        pd = self.parallel_dims
        return pd.dp_replicate * pd.dp_shard

    @property
    def dp_rank(self) -> int:
        if self.dp_size == 1:
            return 0
        return self.parallel_dims.get_mesh("dp").get_local_rank()

    def _dp_group(self):
        return self.parallel_dims.get_mesh("dp").get_group() if self.dp_size > 1 else None

    def _rows(self, batch: Batch, indices: list[int], weight_fn: LossWeightFn) -> tuple[Batch | None, float]:
        """A microbatch's rows of the host ``batch`` on the device (None without samples), and their loss weight."""
        if not indices:
            return None, 0.0
        rows = rows_of(batch, indices)
        rows.pop(ROUTED_EXPERTS, None)  # replayed routing reaches the model packed, never the loss
        return to_device(rows, self.device), float(weight_fn(rows))

    def _pack(self, batch: Batch, indices: list[int], pad_to: int = 0) -> PackedMicrobatch:
        """Pack ``indices`` into one row: to ``max_tokens_per_mb`` under pad_to_maximum, else to ``pad_to``."""
        if self._pad_to_maximum():
            pad_to = self.config.mb_spec.max_tokens_per_mb
        packed = pack(batch, indices, multiple_of=self.parallel_dims.seq_len_divisor, pad_to=pad_to)
        if self.routing_replay and ROUTED_EXPERTS in batch:
            # Positions without a server choice (padding, a completion's last token) route freely.
            packed.routed_experts = pack_token_values(batch[ROUTED_EXPERTS], packed, fill=-1)
        return packed

    def _pad_to_maximum(self) -> bool:
        cfg = self.config
        if (cfg.pad_to_maximum or cfg.archon.enable_compile) and cfg.mb_spec.max_tokens_per_mb <= 0:
            return False
        return cfg.pad_to_maximum or cfg.archon.enable_compile

    def _set_gradient_sync(self, enabled: bool) -> None:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(enabled)

    def _autocast(self):
        """Mixed precision where FSDP's policy does not apply (one data-parallel rank, TP only).

        FSDP casts parameters to ``dtype`` for compute; without FSDP the same ``dtype`` setting
        must still mean low-precision matmuls, so autocast provides them (as torchtitan does).
        """
        dtype = to_dtype(self.config.dtype)
        if dtype == torch.float32 or self.parallel_dims.fsdp_enabled:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=dtype)

    def _run_model(self, mb: PackedMicrobatch, keep: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Packed forward; token-aligned per-token outputs, unpacked to ``[b, s]`` rows.

        Under context parallel the model sees this rank's chunk of the row (``cu_seqlens``
        stays global); ``_token_outputs`` gathers the outputs back to full rows.  With
        ``keep`` (packed positions) only those positions get logits; the others' outputs are 0.
        """
        tokens, kwargs = self._model_inputs(mb)
        if keep is not None:
            kwargs["keep"] = keep
        assert self.model is not None, "initialize() the engine first"
        with self._autocast():
            out = self.model(tokens, cu_seqlens=mb.cu_seqlens, **kwargs)
        return self._token_outputs(out, mb, keep)

    def _loss_positions(self, batch: Batch, mb: PackedMicrobatch) -> torch.Tensor | None:
        """Packed positions the loss reads (``loss_positions``); None (every position) for a critic
        or when the layout shards the sequence or the vocabulary (TP, CP, PP)."""
        pd = self.parallel_dims
        if self.is_critic or pd.tp_enabled or pd.cp_enabled or pd.pp_enabled:
            return None
        return loss_positions(batch, mb)

    def _model_inputs(self, mb: PackedMicrobatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Tokens and the per-token keyword inputs the model (or every pipeline stage) sees: this CP rank's chunk.

        MoE models also get the real-token mask (padding stays out of router statistics) and,
        under routing replay, the packed expert choices.
        """
        kwargs = {"positions": mb.positions}
        if self.moe is not None:
            kwargs["token_mask"] = (torch.arange(mb.total_len, device=self.device) < mb.n_real_tokens)[None]
            if mb.routed_experts is not None:
                kwargs["routed_experts"] = mb.routed_experts.to(self.device, torch.int64)
        cp_mesh = self.parallel_dims.get_optional_mesh("cp")
        if cp_mesh is None:
            return mb.tokens, kwargs
        return shard_sequence(mb.tokens, cp_mesh), {k: shard_sequence(v, cp_mesh) for k, v in kwargs.items()}

    def _token_outputs(
        self, out: torch.Tensor, mb: PackedMicrobatch, keep: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """The model's output for packed ``mb`` as token-aligned per-token rows (``token_outputs``)."""
        cp_mesh = self.parallel_dims.get_optional_mesh("cp")
        return token_outputs(out, mb, keep, is_critic=self.is_critic, temperature=self.temperature, cp_mesh=cp_mesh)

    def _plan(self, batch: Batch):
        mb_spec = self.config.mb_spec
        lens = seqlens_of(batch)
        n_mbs = mb_spec.n_mbs if self.pipeline is None else self.pipeline.microbatch_count(mb_spec.n_mbs)
        try:
            plan = plan_microbatches(lens, self.dp_size, n_mbs, mb_spec.max_tokens_per_mb)
            runnable = (
                plan.n_microbatches if self.pipeline is None else self.pipeline.microbatch_count(plan.n_microbatches)
            )
            if runnable != plan.n_microbatches:
                # max_tokens_per_mb asked for a count the schedule cannot run: take the next one it can.
                plan = plan_microbatches(lens, self.dp_size, runnable, mb_spec.max_tokens_per_mb)
        except ConfigError as exc:  # a sample longer than mb_spec.max_tokens_per_mb
            raise EngineError(f"{self.name}: {exc}") from None
        return plan.per_rank[self.dp_rank]

    def _pipeline_microbatches(
        self, batch: Batch, mbs: list[list[int]]
    ) -> tuple[list[PackedMicrobatch], list[Microbatch]]:
        """Packed microbatches of one shape (pipeline stages exchange fixed-size buffers) and their stage inputs.

        Every row is padded to the step's longest (a multiple of tp*cp); ``cu_seqlens`` are
        padded to one length with empty trailing sequences, so they split like the rest.  Under
        context parallel the stage inputs are this rank's chunk (``_token_outputs`` gathers).
        """
        from models.common.packing import pad_cu_seqlens

        lens = seqlens_of(batch)
        longest = max(1, max(sum(lens[i] for i in indices) for indices in mbs))
        packs = [to_device(self._pack(batch, indices, pad_to=longest), self.device) for indices in mbs]
        n_bounds = max(p.cu_seqlens.numel() for p in packs)
        inputs = []
        for p in packs:
            # Every stage gets the positions (and MoE inputs) of this rank's chunk; the boundaries stay global.
            tokens, kwargs = self._model_inputs(p)
            inputs.append((tokens, {**kwargs, "cu_seqlens": pad_cu_seqlens(p.cu_seqlens, n_bounds)}))
        return packs, inputs

    # ------------------------------------------------------------------ train
    def train_batch(
        self, batch: Batch, loss_fn: LossFn, loss_weight_fn: LossWeightFn = token_count_weight
    ) -> dict[str, float]:
        """Forward+backward over every microbatch, then one optimizer step; returns global stats.

        The host waits for the device once: losses and stats stay tensors until the gradient norm
        is read to decide the step, and they come back with it (``StepTotals.read``).
        """
        assert self.model is not None and self.optimizer is not None and self.lr_scheduler is not None, (
            "initialize() a trainable engine first"
        )
        t0 = time.perf_counter()
        self.model.train()
        # Planned, packed and weighed on the host; microbatches go to the device one by one.
        batch = on_host(batch)
        total_weight = float(loss_weight_fn(batch))
        if total_weight <= 0:
            raise EngineError(
                f"{self.name}: the batch has no loss weight (e.g. every loss_mask is 0); nothing to train on"
            )
        my_mbs = self._plan(batch)
        grad_scale = float(self.parallel_dims.fsdp_gradient_divide_factor)
        self.optimizer.zero_grad(set_to_none=True)
        totals = StepTotals()
        if self.moe is not None:
            self.moe.begin_step()
            if self.moe.aux_loss_enabled:
                # The global-batch aux loss weighs every token by the step's expert counts, which
                # must be known before the first backward: route the whole step once without grad.
                self._route_without_grad(batch, my_mbs)
                self.moe.use_prepass_counts()
        if self.pipeline is not None:
            packs, inputs = self._pipeline_microbatches(batch, my_mbs)
            rows = [self._rows(batch, indices, loss_weight_fn) for indices in my_mbs]

            def last_stage_loss(out: torch.Tensor, i: int) -> torch.Tensor:
                outputs = self._token_outputs(out, packs[i])
                return microbatch_loss(outputs, *rows[i], loss_fn, total_weight, totals) * grad_scale

            with self._autocast():
                self.pipeline.train_step(inputs, last_stage_loss)
            totals.tokens = sum(p.n_real_tokens for p in packs)
        else:
            for i, indices in enumerate(my_mbs):
                self._set_gradient_sync(i == len(my_mbs) - 1)
                packed = self._pack(batch, indices)
                keep = to_device(self._loss_positions(batch, packed), self.device)
                outputs = self._run_model(to_device(packed, self.device), keep=keep)
                scaled = microbatch_loss(
                    outputs, *self._rows(batch, indices, loss_weight_fn), loss_fn, total_weight, totals
                )
                (scaled * grad_scale).backward()
                totals.tokens += packed.n_real_tokens

        pp_group = self.parallel_dims.get_mesh("pp").get_group() if self.parallel_dims.pp_enabled else None
        grad_norm = clip_grad_norm_(self.model.parameters(), self.config.optimizer.max_grad_norm, pp_group=pp_group)
        # The step's one host read: the norm decides the step, and the losses and stats come along.
        (norm,) = totals.read(grad_norm)
        finite = math.isfinite(norm)
        lr = self.optimizer.param_groups[0]["lr"]
        drill_point("optimizer_step")
        if finite:
            self.optimizer.step()
        else:
            logger.warning(
                "%s: non-finite gradient norm at step %d; the optimizer step is skipped", self.name, self.step
            )
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        self.step += 1
        moe_stats = self.moe.end_step(optimizer_stepped=finite) if self.moe is not None else {}

        keys, reduced = reduce_step_totals(totals, self._dp_group() if self.dp_size > 1 else None)
        if self.pipeline is not None:
            # The loss and its stats exist on the last stage only; every rank reports them.
            keys, reduced = self.pipeline.broadcast_from_last_stage((keys, reduced))
        result = {
            "loss": float(reduced[0]),
            "grad_norm": norm,
            "lr": lr,
            "tokens": float(reduced[1]),
            "update_skipped": float(not finite),
            "train_time_s": time.perf_counter() - t0,
        }
        result.update({k: float(v) for k, v in zip(keys, reduced[2:].tolist())})
        if moe_stats:
            # The load-balancing loss is part of what was minimised (it reached the gradients
            # through the MoE layers, see models/common/moe.py).
            result["loss"] += moe_stats.pop("moe/aux_loss_term", 0.0)
            result.update(moe_stats)
        return result

    @torch.no_grad()
    def _route_without_grad(self, batch: Batch, my_mbs: list[list[int]]) -> None:
        """A forward of this rank's microbatches that only feeds the MoE routers' counters."""
        if self.pipeline is not None:
            _, inputs = self._pipeline_microbatches(batch, my_mbs)
            with self._autocast():
                self.pipeline.forward_step(inputs, lambda out, i: None)
            return
        assert self.model is not None, "initialize() the engine first"
        for indices in my_mbs:
            packed = to_device(self._pack(batch, indices), self.device)
            tokens, kwargs = self._model_inputs(packed)
            with self._autocast():
                self.model(tokens, cu_seqlens=packed.cu_seqlens, **kwargs)

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-token ``logprobs`` and ``entropy`` (or ``values`` for a critic), ``[B, S]``, global batch order."""
        assert self.model is not None, "initialize() first"
        self.model.eval()
        batch = on_host(batch)
        rows = CollectedRows(output_keys(self.is_critic))
        my_mbs = self._plan(batch)
        if self.pipeline is not None:
            packs, inputs = self._pipeline_microbatches(batch, my_mbs)
            with self._autocast():
                self.pipeline.forward_step(
                    inputs, lambda out, i: rows.add(self._token_outputs(out, packs[i]), my_mbs[i])
                )
        else:
            for indices in my_mbs:
                rows.add(self._run_model(to_device(self._pack(batch, indices), self.device)), indices)
        result = rows.assemble(tuple(batch["input_ids"].shape), self._dp_group())
        if self.pipeline is not None:
            # The last stage computed the outputs; every rank returns them.
            result = self.pipeline.broadcast_from_last_stage(result)
        return result

    # ------------------------------------------------------------------ weights out
    def named_full_tensors(
        self, dtype: torch.dtype | None = None, extras: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) one at a time; a collective: every rank must iterate.

        Parameters are cast to ``dtype``.  ``extras`` adds the persistent buffers HF formats may
        lack (the MoE routing bias, in float32) under the names Archon's own server reads;
        without it only the fields of the model's HF architecture come out.
        """
        assert self.model is not None, "initialize() the engine first"
        adapter = self.spec.state_dict_adapter_class(self.model_args)
        yield from hf_full_tensors(self.model, adapter, self.pipeline, dtype, extras)

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
            self._export_hf_config(),
            path,
            source=self.config.path,
            max_shard_size=max_shard_size,
        )

    def _export_hf_config(self) -> dict[str, Any]:
        """The config.json ``export_hf`` writes."""
        return self.hf_config.to_dict()

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_states(self) -> dict[str, Stateful]:
        """What a checkpoint of this engine holds: the model, the optimizer and LR scheduler (when trainable),
        and the train state (step, random generators)."""
        assert self.model is not None, "initialize() first"
        return engine_states(self.model, self.optimizer, self.lr_scheduler, self.train_state)

    def save(self, path: str | Path, extra_state: dict[str, Any] | None = None) -> None:
        """Write a resumable checkpoint to ``path`` (collective); ``extra_state`` is the caller's JSON data."""
        save_checkpoint(
            self.checkpoint_states(), Path(path), extra_state or {}, name=self.name, allocation=str(self.allocation)
        )

    def load(self, path: str | Path) -> dict[str, Any]:
        """Resume from a checkpoint written by ``save`` (any allocation; collective); returns its extra state."""
        return load_checkpoint(self.checkpoint_states(), Path(path), name=self.name)

    def checkpoint_nbytes(self) -> float:
        """This rank's share of one checkpoint's bytes: parameters, and AdamW's two moments with an optimizer.

        A parameter's global size counts once however it is sharded: each rank of a pipeline stage
        counts its stage's global sizes divided by the ranks that hold that stage.
        """
        ranks_per_stage = dist.get_world_size() / self.allocation.parallel.pp_size
        assert self.model is not None, "initialize() the engine first"
        per_param = 3 if self.optimizer is not None else 1
        stage = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return per_param * stage / ranks_per_stage
