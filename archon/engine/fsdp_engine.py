"""FSDPEngine: any transformers causal LM, laid over ``fsdp:dN[tM][cK]`` with FSDP2, TP and Ulysses CP.

The model is transformers' own ``AutoModelForCausalLM`` (a critic: ``...ForTokenClassification``
with one output); no Archon model code is involved.  It is a ``TrainEngine`` beside
``ArchonEngine`` and shares with it, by composition, the layout (``layout``), the microbatch
plan and loop with loss normalisation over the global batch (``microbatch_loop``), the
optimizer step (``step_runner``), per-token outputs (``token_outputs``) and checkpoints (DCP,
resharding across allocations; ``checkpointing``), so actor, critic, reference, teacher, SFT
and RL run on it unchanged.  This module builds the model; running it on microbatches is
``fsdp_runner``.

Parallel dims, applied in torchtitan's order:

* ``t``: transformers' tensor-parallel plan for the model (``apply_tp_plan``), on the TP mesh;
  the LM head's logits stay vocab-sharded for the vocab-parallel loss;
* ``c``: Ulysses context parallel through an attention function registered with transformers
  (``ulysses_attention``): each rank runs the model on one chunk of the packed row;
* activation checkpointing and compile per block (``_no_split_modules``);
* ``d``: FSDP2, one unit per block, the root holding embeddings, final norm and head.

Packing.  Microbatches are one packed row with ``position_ids`` restarting at every sequence,
which transformers turns into a block-diagonal causal mask, when the model computes exactly
that: ``initialize`` checks it on a two-sequence probe and falls back to right-padded rows
(with an attention mask) for a model whose attention ignores packing.  Under context
parallel the Ulysses attention builds the packed mask itself, so rows are always packed.

Weights.  Rank 0 loads the checkpoint with ``from_pretrained`` on the CPU (transformers does
any key conversion the model needs), and every rank receives its shards by broadcast
(``set_model_state_dict(broadcast_from_rank0=True)``); without a checkpoint rank 0 draws the
initialisation from the run seed the same way, so the initial weights do not depend on the
allocation.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from archon.alloc import ModelAllocation
from archon.checkpoint.state import TrainState
from archon.config import TrainEngineConfig
from archon.engine.errors import EngineError
from archon.engine.fsdp_lora import (
    adapted_modules,
    inject_lora,
    merge_peft_tensors,
    peft_adapter_tensors,
    peft_adapters_disabled,
)
from archon.engine.fsdp_runner import TransformersRunner
from archon.engine.interface import TrainEngine
from archon.engine.layout import init_layout, load_model_config
from archon.engine.lora import peft_config, write_peft_folder
from archon.engine.microbatch import Batch, on_host
from archon.engine.microbatch_loop import forward_microbatches, plan_rank_microbatches, train_microbatches
from archon.engine.options import parameter_device
from archon.engine.step_loss import LossFn, LossWeightFn, StepTotals, reduce_step_totals, token_count_weight
from archon.engine.step_runner import StepRunner
from archon.engine.token_outputs import CollectedRows, output_keys
from archon.engine.transformers_model import (
    TransformersModelError,
    apply_tp_plan,
    build_meta_model,
    critic_config,
    embeddings_tied,
    fsdp_units,
    model_class_for,
    register_ulysses_attention,
    restore_buffers,
    retie_embeddings,
    wrap_blocks,
    zero_dropout,
)
from archon.engine.weights import named_state, write_hf_folder
from parallel.activation_checkpoint import apply_ac
from parallel.context_parallel import check_heads_divisible
from parallel.errors import ParallelConfigError
from parallel.fsdp import apply_fsdp

logger = logging.getLogger("archon.engine")


class FSDPEngine(TrainEngine):
    """``TrainEngine`` over a transformers model (``fsdp:`` allocations).

    No MoE router bookkeeping or routing replay: those hook into Archon's own MoE layers.
    """

    backend: ClassVar[str] = "fsdp"
    """The allocation backend this engine runs."""
    engine_label: ClassVar[str] = "FSDP"
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
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler = None
        # Set by initialize(): the optimizer side of a step (trainable engines) and the microbatch runner.
        self.stepper: StepRunner | None = None
        self.runner: TransformersRunner | None = None

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by ``load``)."""
        return self.train_state.step

    @step.setter
    def step(self, value: int) -> None:
        self.train_state.step = value

    # ------------------------------------------------------------------ build
    def initialize(self) -> FSDPEngine:
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
        pd = self.parallel_dims
        if cfg.archon.fp8:
            raise EngineError(
                f"{self.name}.archon.fp8 = '{cfg.archon.fp8}' converts Archon's own models only; use an archon: "
                f"backend for {self.name} or turn fp8 off"
            )
        if cfg.archon.prefix_sharing:
            raise EngineError(
                f"{self.name}.archon.prefix_sharing = true packs shared prompts for Archon's own models only; use an "
                f"archon: backend for {self.name} or turn prefix_sharing off"
            )
        # The grammar refuses p and e for fsdp:, so these hold by construction.
        assert not pd.pp_enabled and not pd.ep_enabled
        self.hf_config = load_model_config(self.name, cfg, check_spec=False)
        build_config = copy.deepcopy(self.hf_config)
        dropped = zero_dropout(build_config)
        if dropped and dist.get_rank() == 0:
            logger.info(
                "%s: dropout turned off (%s) so that training does not depend on the allocation",
                self.name,
                ", ".join(dropped),
            )
        if self.is_critic:
            build_config = critic_config(build_config)
        attn = register_ulysses_attention() if pd.cp_enabled else None
        try:
            model, buffers = build_meta_model(build_config, self.is_critic, attn)
            if cfg.lora.enabled:
                # PEFT's adapters before FSDP wraps the blocks (frozen base and adapters share a unit).
                inject_lora(model, cfg.lora, trainable_head="score" if self.is_critic else None)
            self._parallelize(model)
        except (TransformersModelError, ParallelConfigError) as exc:
            raise EngineError(f"{self.name}.backend = '{cfg.backend}': {exc}") from None
        # The CPU under offload (FSDP2's rule); the buffers go to the compute device.
        model.to_empty(
            device=parameter_device(
                self.device, cfg.archon.offload_params, pd.fsdp_enabled, f"{self.name}.backend = '{cfg.backend}'"
            )
        )
        restore_buffers(model, buffers, self.device)
        if self._tied and not embeddings_tied(model):
            retie_embeddings(model)
        self.model = model
        self.export_config = self._export_config()
        self._load_weights(build_config)
        self.packed = pd.cp_enabled or self._packing_works()
        self._reshard()
        if dist.get_rank() == 0:
            logger.info(
                "%s: %s (%s) with %s",
                self.name,
                type(model).__name__,
                self.hf_config.model_type,
                "packed sequences (position_ids)"
                if self.packed
                else "right-padded rows: this model's attention does not take packed sequences",
            )
        self.runner = TransformersRunner(
            self.model, self.layout, cfg, packed=self.packed, is_critic=self.is_critic, temperature=self.temperature
        )
        if not self.trainable:
            self.model.requires_grad_(False)
        else:
            self.stepper = StepRunner.for_model(self.model, cfg, self.name, self.train_state, self.total_steps)
            self.optimizer, self.lr_scheduler = self.stepper.optimizer, self.stepper.lr_scheduler
        return self

    def _parallelize(self, model: torch.nn.Module) -> None:
        """TP -> CP -> AC -> compile -> FSDP on the meta-device model, as ``self.parallelize_options`` say."""
        pd, options = self.parallel_dims, self.parallelize_options
        self._tied = embeddings_tied(model)
        if pd.tp_enabled:
            apply_tp_plan(model, pd.get_mesh("tp"), loss_parallel=not self.is_critic)
        if pd.cp_enabled:
            heads = getattr(model.config, "num_attention_heads", None)
            if isinstance(heads, int):
                check_heads_divisible(heads, pd.tp, pd.cp, type(model).__name__)
        if options.ac_enabled:
            self._apply_ac(model)
        if options.enable_compile:
            for block in fsdp_units(model):
                # transformers' blocks may break the graph (data-dependent control flow).
                block.compile(fullgraph=False)
        if pd.fsdp_enabled:
            mesh = pd.get_mesh("hsdp") if pd.dp_replicate_enabled else pd.get_mesh("dp_shard_cp")
            apply_fsdp(
                model,
                mesh,
                fsdp_units(model),
                param_dtype=options.param_dtype,
                reduce_dtype=options.reduce_dtype,
                cpu_offload=options.cpu_offload,
                reshard_after_forward_policy=options.reshard_after_forward_policy,
            )

    def _apply_ac(self, model: torch.nn.Module) -> None:
        """Activation checkpointing of every block with ``options.ac_mode`` (the blocks of a ModuleDict view)."""
        options = self.parallelize_options
        blocks = fsdp_units(model)
        view = torch.nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        apply_ac(
            view,
            options.ac_mode,
            options.selective_ac_option,
            options.ac_memory_budget,
            compile_enabled=options.enable_compile,
            preserve_rng_state=options.deterministic,
            debug=options.ac_debug,
        )
        wrapped = {id(block): view[str(i)] for i, block in enumerate(blocks)}
        wrap_blocks(model, lambda block: wrapped[id(block)])

    def _export_config(self):
        """The config.json ``export_hf`` writes: the source config with this model's class as architecture."""
        config = copy.deepcopy(critic_config(self.hf_config) if self.is_critic else self.hf_config)
        config.architectures = [type(self.model).__name__]
        return config

    @torch.no_grad()
    def _load_weights(self, build_config) -> None:
        """Rank 0 reads (or seeds) the full weights on the CPU; every rank receives its shards."""
        assert self.model is not None  # initialize() built it
        full: dict[str, Any] = {}
        if dist.get_rank() == 0:
            full = self._full_state_dict_on_cpu(build_config)
        set_model_state_dict(
            self.model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
        )

    def _full_state_dict_on_cpu(self, build_config) -> dict[str, torch.Tensor]:
        cls = model_class_for(build_config, self.is_critic)
        torch_state = torch.get_rng_state()
        torch.manual_seed(self.seed)
        try:
            if self.config.path:
                model, info = cls.from_pretrained(
                    self.config.path, config=build_config, dtype=torch.float32, output_loading_info=True
                )
                missing = sorted(info["missing_keys"])
                if missing and not self.is_critic:
                    raise EngineError(
                        f"{self.name}.path = '{self.config.path}' lacks weights {missing[:5]}; point "
                        "it at a complete Hugging Face checkpoint"
                    )
            else:
                model, missing = cls._from_config(build_config, dtype=torch.float32), []
            if self.config.lora.enabled:
                # The same adapters as the engine's model; PEFT's init drawn from the seeded generator.
                inject_lora(model, self.config.lora)
        finally:
            torch.set_rng_state(torch_state)
        state = model.state_dict()
        std = float(getattr(build_config, "initializer_range", 0.02) or 0.02)
        for name in missing:
            # A critic's value head from a causal-LM checkpoint: seeded by the run seed and the name.
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + sum(map(ord, name)))
            state[name] = (
                torch.empty(state[name].shape).normal_(0.0, std, generator=gen)
                if not name.endswith("bias")
                else torch.zeros(state[name].shape)
            )
        return state

    # ------------------------------------------------------------------ packing
    @torch.no_grad()
    def _packing_works(self) -> bool:
        """Does one packed row (position_ids restarting at 0) give the logits of its sequences run alone?"""
        assert self.model is not None  # initialize() built it
        vocab = int(getattr(self.model.config, "vocab_size", 2))
        ids = (torch.arange(7, device=self.device) * 5 + 3) % vocab
        first, second = ids[:3], ids[3:]
        positions = torch.cat([torch.arange(3), torch.arange(4)]).to(self.device)
        self.model.eval()
        packed = self._logits(self.model(input_ids=ids[None], position_ids=positions[None], use_cache=False))[0]
        alone = torch.cat(
            [self._logits(self.model(input_ids=part[None], use_cache=False))[0] for part in (first, second)]
        )
        scale = float(alone.abs().max()) + 1.0
        return float((packed - alone).abs().max()) <= 1e-3 * scale

    def _reshard(self) -> None:
        """Put FSDP's root back in sharded form: its parameters stay unsharded after a forward
        (``reshard_after_forward=False``), and the optimizer must see the sharded ones."""
        if isinstance(self.model, FSDPModule):
            self.model.reshard()

    @staticmethod
    def _logits(out) -> torch.Tensor:
        logits = out.logits
        return (logits.full_tensor() if isinstance(logits, DTensor) else logits).float()

    # ------------------------------------------------------------------ train
    def _plan(self, batch: Batch) -> list[list[int]]:
        return plan_rank_microbatches(batch, self.config.mb_spec, self.layout.dp_size, self.layout.dp_rank, self.name)

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
        outcome = self.stepper.finish(self.model.parameters(), totals, started)
        keys, reduced = reduce_step_totals(totals, self.layout.dp_group())
        return outcome.stats(keys, reduced)

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-token ``logprobs`` and ``entropy`` (or ``values`` for a critic), ``[B, S]``, global batch order."""
        assert self.model is not None and self.runner is not None, "initialize() first"
        self.model.eval()
        batch = on_host(batch)
        rows = CollectedRows(output_keys(self.is_critic))
        forward_microbatches(self.runner, batch, self._plan(batch), rows, self.device)
        return rows.assemble(tuple(batch["input_ids"].shape), self.layout.dp_group())

    def adapters_off(self) -> AbstractContextManager[None]:
        """A context in which ``forward`` computes the base model alone (PEFT's adapters disabled)."""
        assert self.model is not None, "initialize() the engine first"
        if not self.config.lora.enabled:
            return super().adapters_off()
        return peft_adapters_disabled(self.model)

    # ------------------------------------------------------------------ weights out
    def named_full_tensors(
        self, dtype: torch.dtype | None = None, extras: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(transformers name, full tensor) one parameter at a time; a collective: every rank must iterate.

        ``extras`` is accepted for the weight-sync interface; a transformers model has nothing beyond its HF fields.
        """
        assert self.model is not None, "initialize() the engine first"
        tensors = (
            (name, (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach())
            for name, tensor in named_state(self.model, buffers=False)
        )
        if self.config.lora.enabled:
            # PEFT's adapters merged into their layers, under the base model's names.
            tensors = merge_peft_tensors(tensors, self.config.lora.scale)
        for name, full in tensors:
            yield name, full.to(dtype) if dtype is not None else full

    def export_peft(self, path: str | Path) -> bool:
        """Write PEFT's adapters as a PEFT adapter folder that ``peft.PeftModel.from_pretrained`` loads onto the
        transformers model of ``path``'s base; a collective (every rank gathers), rank 0 writes."""
        assert self.model is not None, "initialize() the engine first"
        if not self.config.lora.enabled:
            raise EngineError(f"{self.name}.lora.enabled is false: there are no adapters to export as a PEFT folder")
        tensors = (
            (name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor)
            for name, tensor in named_state(self.model, buffers=False)
        )
        config = peft_config(self.config.lora, adapted_modules(self.model), self.config.path)
        write_peft_folder(peft_adapter_tensors(tensors), config, path)
        return True

    def export_hf(
        self,
        path: str | Path,
        dtype: torch.dtype | None = None,
        max_shard_size: str | int = "5GB",
        extras: bool = False,
    ) -> None:
        """Write an HF folder (config.json + sharded safetensors) from the sharded model; rank 0 writes.

        The config is the source's with this model's class as architecture (``_export_config``).
        """
        write_hf_folder(
            self.named_full_tensors(dtype, extras=extras),
            self.export_config.to_dict(),
            path,
            source=self.config.path,
            max_shard_size=max_shard_size,
        )
