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
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from archon.alloc import ModelAllocation
from archon.config import TrainEngineConfig
from archon.engine.dist import init_distributed, resolve_device_type
from archon.engine.microbatch import (
    Batch,
    PackedMicrobatch,
    pack,
    plan_microbatches,
    rows_of,
    seqlens_of,
    unpack,
)
from archon.engine.optimizer import build_lr_scheduler, build_optimizer
from models.hf_checkpoint import clean_fqn
from parallel.context_parallel import gather_sequence, shard_sequence
from parallel.dims import ParallelDims
from parallel.fsdp import to_dtype
from parallel.grad_clip import clip_grad_norm_
from parallel.loss_parallel import vocab_parallel_logprobs_entropy
from pipeline import Microbatch, PipelineConfigError, PipelinedModel

logger = logging.getLogger("archon.engine")
# FSDP x TP gathers over two mesh dims in sequence; DTensor warns about it on every call.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

LossFn = Callable[[dict[str, torch.Tensor], Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]
LossWeightFn = Callable[[Batch], float]



def _token_count_weight(mb: Batch) -> float:
    return float(mb["loss_mask"].sum()) if "loss_mask" in mb else float(mb["attention_mask"].sum())


class EngineError(ValueError):
    """A user-caused problem with an engine's config, allocation or data."""


@dataclass
class _StepTotals:
    """What one rank's microbatches of a step add up to, before reduction over ranks."""

    loss: float = 0.0
    """Sum of the microbatches' weighted losses."""
    stats: dict[str, float] = field(default_factory=dict)
    """Weighted sums of the loss function's stats."""
    tokens: int = 0
    """Real (unpadded) tokens."""


class ArchonEngine:
    """Builds, trains, evaluates, checkpoints and exports one model (actor, critic or reference)."""

    def __init__(self, config: TrainEngineConfig, *, name: str = "actor", is_critic: bool = False,
                 seed: int = 1, device: str = "auto", temperature: float = 1.0, total_steps: int = 1,
                 trainable: bool = True):
        self.config = config
        self.name = name
        self.is_critic = is_critic
        self.seed = seed
        self.device_setting = device
        self.temperature = temperature
        self.total_steps = max(1, total_steps)
        self.trainable = trainable
        self.step = 0
        self.model: torch.nn.Module | None = None
        # Set under pipeline parallel: this rank's stages; ``model`` is then their weights-only view.
        self.pipeline: PipelinedModel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler = None

    # ------------------------------------------------------------------ build
    def initialize(self) -> "ArchonEngine":
        from models import get_model_spec

        cfg = self.config
        self.device_type = resolve_device_type(self.device_setting)
        if cfg.archon.use_deterministic_algorithms:
            from parallel.determinism import apply_determinism

            # Environment variables must be set before the first kernel/communicator exists.
            apply_determinism(self.device_type)
        init_distributed(self.device_type)
        self.device = torch.device(self.device_type, torch.cuda.current_device() if self.device_type == "cuda" else 0) \
            if self.device_type == "cuda" else torch.device("cpu")
        self.allocation = ModelAllocation.from_str(cfg.backend)
        world = dist.get_world_size()
        if self.allocation.world_size != world:
            raise EngineError(f"{self.name}.backend = '{cfg.backend}' needs {self.allocation.world_size} ranks but "
                              f"the job has {world}; launch with --nproc_per_node={self.allocation.world_size} "
                              f"or change the allocation")
        self.parallel_dims = ParallelDims.from_allocation(self.allocation, world_size=world,
                                                          dp_replicate=cfg.archon.dp_replicate)
        self.parallel_dims.build_meshes(self.device_type)
        if dist.get_rank() == 0:
            logger.info("Initialized Archon engine with parallel dims: %s", self.parallel_dims.describe())

        self.hf_config = self._load_hf_config()
        self.spec = get_model_spec(self.hf_config.model_type)
        self.model_args = self.spec.model_args_class.from_hf_config(self.hf_config, is_critic=self.is_critic)
        with torch.device("meta"):
            model = self.spec.model_class(self.model_args)
        if self.parallel_dims.pp_enabled:
            self.pipeline = self._split_into_stages(model)
            model, parts = self.pipeline.model, self.pipeline.parts
        else:
            model = self.spec.parallelize_fn(model, self.parallel_dims, cfg)
            parts = [model]
        for part in parts:
            part.to_empty(device=self.device)
        self.model = model
        self._init_weights()
        if not self.trainable:
            self.model.requires_grad_(False)
        else:
            self.optimizer = build_optimizer(self.model.parameters(), cfg.optimizer)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.optimizer, self.total_steps)
        return self

    def _split_into_stages(self, model: torch.nn.Module) -> PipelinedModel:
        """This rank's pipeline stages of the meta-device ``model``, each parallelized."""
        if self.spec.pipelining_fn is None:
            raise EngineError(f"{self.name}.backend = '{self.config.backend}' asks for pipeline parallel, but model "
                              f"type '{self.hf_config.model_type}' has no pipelining function in its ModelSpec; "
                              "use p1 or add one (see models/qwen3/spec.py)")
        try:
            return self.spec.pipelining_fn(model, self.parallel_dims, self.config, self.spec.parallelize_fn,
                                           self.device)
        except PipelineConfigError as exc:
            raise EngineError(f"{self.name}.backend = '{self.config.backend}': {exc}") from None

    def _load_hf_config(self):
        from transformers import AutoConfig

        source = self.config.path or self.config.model_config
        if not source:
            raise EngineError(f"{self.name}.path is empty and {self.name}.model_config is empty; set one to an "
                              "HF model folder (path loads its weights, model_config only its architecture)")
        p = Path(source)
        folder = p.parent if p.name == "config.json" else p
        if not (folder / "config.json").is_file():
            raise EngineError(f"{self.name}: no config.json in '{folder}'; point {self.name}.path at a Hugging Face "
                              "model folder (config.json + *.safetensors)")
        return AutoConfig.from_pretrained(str(folder))

    @torch.no_grad()
    def _init_weights(self) -> None:
        from models import load_hf_weights

        assert self.model is not None
        # Buffers (RoPE tables) and anything a checkpoint lacks (a critic's value head).
        self.model.init_weights(buffer_device=self.device)
        if self.config.path:
            result = load_hf_weights(self.model, self.config.path,
                                     self.spec.state_dict_adapter_class(self.model_args), strict=True)
            self._init_unloaded(result.initialised)
            return
        # From scratch: initialise the full model identically on every rank from the seed, then
        # shard it, so that the initial weights do not depend on the allocation.
        torch.manual_seed(self.seed)
        full = self.spec.model_class(self.model_args)
        full.init_weights()
        full_sd = dict(full.named_parameters())
        for name, tensor in _named_state(self.model):
            copy_full_into(tensor, full_sd[name])

    @torch.no_grad()
    def _init_unloaded(self, names: list[str]) -> None:
        """Seeded init of tensors a checkpoint legitimately lacks (a critic's value head).

        Drawn as full tensors from a generator seeded by the run seed and the name, then
        sharded, so the values do not depend on the allocation.
        """
        params = dict(_named_state(self.model))
        std = getattr(self.model_args, "initializer_range", 0.02)
        for name in names:
            target = params[name]
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + sum(map(ord, name)))
            full = torch.empty(target.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            copy_full_into(target, full)

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

    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def _pack(self, batch: Batch, indices: list[int], pad_to: int = 0) -> PackedMicrobatch:
        """Pack ``indices`` into one row: to ``max_tokens_per_mb`` under pad_to_maximum, else to ``pad_to``."""
        if self._pad_to_maximum():
            pad_to = self.config.mb_spec.max_tokens_per_mb
        return pack(batch, indices, multiple_of=self.parallel_dims.seq_len_divisor, pad_to=pad_to)

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
        tokens, positions = self._model_inputs(mb)
        kwargs = {} if keep is None else {"keep": keep}
        with self._autocast():
            out = self.model(tokens, positions=positions, cu_seqlens=mb.cu_seqlens, **kwargs)
        return self._token_outputs(out, mb, keep)

    def _loss_positions(self, batch: Batch, mb: PackedMicrobatch) -> torch.Tensor | None:
        """Packed positions whose logits the loss can read: those predicting a ``loss_mask`` token.

        The LM head and the logprobs then skip the rest (an RL batch's prompts).  None (every
        position) for a critic, without ``loss_mask``, when the layout shards the sequence or
        the vocabulary (TP, CP, PP), or when nearly every position is needed anyway.
        """
        pd = self.parallel_dims
        if self.is_critic or "loss_mask" not in batch or pd.tp_enabled or pd.cp_enabled or pd.pp_enabled:
            return None
        loss_mask = batch["loss_mask"]
        masked = torch.zeros(mb.total_len, dtype=torch.bool, device=loss_mask.device)
        if mb.indices:
            masked[:mb.n_real_tokens] = torch.cat([loss_mask[i, :n] for i, n in zip(mb.indices, mb.seqlens)]) > 0
        masked[mb.seq_starts] = False  # a sequence's first token has no predicting position (its logprob is 0)
        keep = masked.nonzero().squeeze(1) - 1
        return keep if keep.numel() < 0.9 * mb.total_len else None

    def _model_inputs(self, mb: PackedMicrobatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and positions the model (or the first pipeline stage) sees: this CP rank's chunk."""
        cp_mesh = self.parallel_dims.get_optional_mesh("cp")
        if cp_mesh is None:
            return mb.tokens, mb.positions
        return shard_sequence(mb.tokens, cp_mesh), shard_sequence(mb.positions, cp_mesh)

    @property
    def _output_keys(self) -> list[str]:
        """Per-token outputs of ``forward``: a critic's values, or an LM's logprobs and entropy."""
        return ["values"] if self.is_critic else ["logprobs", "entropy"]

    def _token_outputs(self, out: torch.Tensor, mb: PackedMicrobatch,
                       keep: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The model's output for packed ``mb`` (logits or values) as token-aligned per-token rows.

        Next-token targets come from the full row; under context parallel the per-token outputs
        are gathered back to full rows, the same on every CP rank (see ``gather_sequence``).
        ``keep``: the packed positions ``out`` holds (all when None); the others get 0.
        """
        cp_mesh = self.parallel_dims.get_optional_mesh("cp")
        if self.is_critic:
            values = out.full_tensor() if isinstance(out, DTensor) else out
            rows = [values.reshape(-1).float()]
        else:
            targets = torch.roll(mb.tokens[0], -1)
            if cp_mesh is not None:
                targets = shard_sequence(targets, cp_mesh, dim=0)
            if keep is not None:
                targets = targets[keep]
            # Kept apart (not stacked): an output the loss ignores then gets no gradient at all,
            # and its backward is skipped (the entropy's is a tokens x vocab pass).
            # The whole [1, T, V] logits (a view inside), not out[0]: a select's backward would
            # write its gradient into a zero-filled copy of the logits.
            rows = [r[0] for r in vocab_parallel_logprobs_entropy(out, targets.unsqueeze(0), self.temperature)]
        # ``_anchor`` keeps a graph through the model even when the microbatch has no sample.
        anchor = rows[0].sum() * 0.0
        if keep is not None:
            rows = [row.new_zeros(mb.total_len).index_copy(0, keep, row) for row in rows]
        result = {}
        for key, row in zip(self._output_keys, rows):
            if cp_mesh is not None:
                row = gather_sequence(row, cp_mesh, dim=0)
            # Output i is about token i: shift the next-token values right; sequence starts get 0.
            aligned = torch.roll(row, 1, dims=0).index_fill(0, mb.seq_starts, 0.0)
            result[key] = unpack(aligned, mb)
        result["_anchor"] = anchor
        return result

    def _plan(self, batch: Batch):
        mb_spec = self.config.mb_spec
        lens = seqlens_of(batch)
        n_mbs = mb_spec.n_mbs if self.pipeline is None else self.pipeline.microbatch_count(mb_spec.n_mbs)
        try:
            plan = plan_microbatches(lens, self.dp_size, n_mbs, mb_spec.max_tokens_per_mb)
            runnable = plan.n_microbatches if self.pipeline is None else \
                self.pipeline.microbatch_count(plan.n_microbatches)
            if runnable != plan.n_microbatches:
                # max_tokens_per_mb asked for a count the schedule cannot run: take the next one it can.
                plan = plan_microbatches(lens, self.dp_size, runnable, mb_spec.max_tokens_per_mb)
        except ValueError as exc:
            raise EngineError(f"{self.name}: {exc}") from None
        return plan.per_rank[self.dp_rank]

    def _pipeline_microbatches(self, batch: Batch, mbs: list[list[int]]
                               ) -> tuple[list[PackedMicrobatch], list[Microbatch]]:
        """Packed microbatches of one shape (pipeline stages exchange fixed-size buffers) and their stage inputs.

        Every row is padded to the step's longest (a multiple of tp*cp); ``cu_seqlens`` are
        padded to one length with empty trailing sequences, so they split like the rest.  Under
        context parallel the stage inputs are this rank's chunk (``_token_outputs`` gathers).
        """
        from models.common.packing import pad_cu_seqlens

        lens = seqlens_of(batch)
        longest = max(1, max(sum(lens[i] for i in indices) for indices in mbs))
        packs = [self._pack(batch, indices, pad_to=longest) for indices in mbs]
        n_bounds = max(p.cu_seqlens.numel() for p in packs)
        inputs = []
        for p in packs:
            # Every stage gets the positions of this rank's chunk; the boundaries stay global.
            tokens, positions = self._model_inputs(p)
            inputs.append((tokens, {"positions": positions, "cu_seqlens": pad_cu_seqlens(p.cu_seqlens, n_bounds)}))
        return packs, inputs

    # ------------------------------------------------------------------ train
    def train_batch(self, batch: Batch, loss_fn: LossFn, loss_weight_fn: LossWeightFn = _token_count_weight
                    ) -> dict[str, float]:
        """Forward+backward over every microbatch, then one optimizer step; returns global stats."""
        assert self.model is not None and self.optimizer is not None, "initialize() a trainable engine first"
        t0 = time.perf_counter()
        self.model.train()
        batch = self._to_device(batch)
        total_weight = float(loss_weight_fn(batch))
        if total_weight <= 0:
            raise EngineError(f"{self.name}: the batch has no loss weight (e.g. every loss_mask is 0); "
                              "nothing to train on")
        my_mbs = self._plan(batch)
        grad_scale = float(self.parallel_dims.fsdp_gradient_divide_factor)
        self.optimizer.zero_grad(set_to_none=True)
        totals = _StepTotals()
        if self.pipeline is not None:
            packs, inputs = self._pipeline_microbatches(batch, my_mbs)

            def last_stage_loss(out: torch.Tensor, i: int) -> torch.Tensor:
                outputs = self._token_outputs(out, packs[i])
                return self._microbatch_loss(outputs, batch, my_mbs[i], loss_fn, loss_weight_fn, total_weight,
                                             totals) * grad_scale

            with self._autocast():
                self.pipeline.train_step(inputs, last_stage_loss)
            totals.tokens = sum(p.n_real_tokens for p in packs)
        else:
            for i, indices in enumerate(my_mbs):
                self._set_gradient_sync(i == len(my_mbs) - 1)
                packed = self._pack(batch, indices)
                outputs = self._run_model(packed, keep=self._loss_positions(batch, packed))
                scaled = self._microbatch_loss(outputs, batch, indices, loss_fn, loss_weight_fn,
                                               total_weight, totals)
                (scaled * grad_scale).backward()
                totals.tokens += packed.n_real_tokens

        pp_group = self.parallel_dims.get_mesh("pp").get_group() if self.parallel_dims.pp_enabled else None
        grad_norm = clip_grad_norm_(self.model.parameters(), self.config.optimizer.max_grad_norm, pp_group=pp_group)
        finite = bool(torch.isfinite(grad_norm))
        lr = self.optimizer.param_groups[0]["lr"]
        if finite:
            self.optimizer.step()
        else:
            logger.warning("%s: non-finite gradient norm at step %d; the optimizer step is skipped",
                           self.name, self.step)
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        self.step += 1

        keys = sorted(totals.stats)
        reduced = torch.tensor([totals.loss, float(totals.tokens)] + [totals.stats[k] for k in keys],
                               dtype=torch.float64)
        if self.dp_size > 1:
            dist.all_reduce(reduced, group=self._dp_group())
        if self.pipeline is not None:
            # The loss and its stats exist on the last stage only; every rank reports them.
            keys, reduced = self.pipeline.broadcast_from_last_stage((keys, reduced))
        result = {"loss": float(reduced[0]), "grad_norm": float(grad_norm), "lr": lr,
                  "tokens": float(reduced[1]), "update_skipped": float(not finite),
                  "train_time_s": time.perf_counter() - t0}
        result.update({k: float(v) for k, v in zip(keys, reduced[2:].tolist())})
        return result

    def _microbatch_loss(self, outputs: dict[str, torch.Tensor], batch: Batch, indices: list[int], loss_fn: LossFn,
                         loss_weight_fn: LossWeightFn, total_weight: float, totals: "_StepTotals") -> torch.Tensor:
        """This microbatch's share of the global loss (its weight / the batch's); stats are added to ``totals``."""
        anchor = outputs.pop("_anchor")
        if indices:
            mb = rows_of(batch, indices)
            loss, stats = loss_fn(outputs, mb)
            weight = float(loss_weight_fn(mb))
        else:
            # A rank without samples still runs backward so FSDP's collectives line up.
            loss = anchor
            stats, weight = {}, 0.0
        scaled = loss * (weight / total_weight)
        totals.loss += float(scaled.detach())
        for key, value in stats.items():
            value = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
            totals.stats[key] = totals.stats.get(key, 0.0) + value * weight / total_weight
        return scaled

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-token ``logprobs`` and ``entropy`` (or ``values`` for a critic), ``[B, S]``, global batch order."""
        assert self.model is not None, "initialize() first"
        self.model.eval()
        batch = self._to_device(batch)
        B, S = batch["input_ids"].shape
        mine: dict[str, list[torch.Tensor]] = {}
        my_indices: list[int] = []

        def keep(outputs: dict[str, torch.Tensor], indices: list[int]) -> None:
            outputs.pop("_anchor")
            if not indices:
                return
            my_indices.extend(indices)
            for key, value in outputs.items():
                mine.setdefault(key, []).extend(list(value.float().cpu()))

        my_mbs = self._plan(batch)
        if self.pipeline is not None:
            packs, inputs = self._pipeline_microbatches(batch, my_mbs)
            with self._autocast():
                self.pipeline.forward_step(inputs, lambda out, i: keep(self._token_outputs(out, packs[i]), my_mbs[i]))
        else:
            for indices in my_mbs:
                keep(self._run_model(self._pack(batch, indices)), indices)
        gathered: list[Any] = [None] * self.dp_size
        payload = (my_indices, mine)
        if self.dp_size > 1:
            dist.all_gather_object(gathered, payload, group=self._dp_group())
        else:
            gathered = [payload]
        keys = self._output_keys
        result = {k: torch.zeros(B, S, dtype=torch.float32) for k in keys}
        for indices, values in gathered:
            for key in keys:
                for row, idx in enumerate(indices):
                    v = values[key][row]
                    result[key][idx, : v.shape[0]] = v
        if self.pipeline is not None:
            # The last stage computed the outputs; every rank returns them.
            result = self.pipeline.broadcast_from_last_stage(result)
        return result

    # ------------------------------------------------------------------ weights out
    def named_full_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) one parameter at a time; a collective: every rank must iterate."""
        adapter = self.spec.state_dict_adapter_class(self.model_args)
        if self.pipeline is not None:
            # Each tensor comes from the stage holding it, in the full model's order.
            tensors = self.pipeline.named_full_tensors(dict(_named_state(self.model, buffers=False)))
        else:
            tensors = ((name, t.full_tensor() if isinstance(t, DTensor) else t)
                       for name, t in _named_state(self.model, buffers=False))
        for name, full in tensors:
            full = full.detach()
            if dtype is not None:
                full = full.to(dtype)
            yield from adapter.to_hf_tensors(name, full)

    def export_hf(self, path: str | Path, dtype: torch.dtype | None = None, max_shard_size: str | int = "5GB") -> None:
        """Write an HF folder (config.json + sharded safetensors) from the sharded model; rank 0 writes."""
        from models import save_hf_tensors

        tensors = ((n, t.cpu()) for n, t in self.named_full_tensors(dtype))
        if dist.get_rank() == 0:
            save_hf_tensors(tensors, self.hf_config.to_dict(), path, max_shard_size=max_shard_size)
            source = Path(self.config.path) / "generation_config.json" if self.config.path else None
            if source is not None and source.is_file():
                # EOS ids and sampling defaults live here; generate() and servers read them.
                shutil.copyfile(source, Path(path) / "generation_config.json")
        else:
            for _ in tensors:  # join the collectives
                pass
        dist.barrier()

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | Path, extra_state: dict[str, Any] | None = None) -> None:
        from archon.engine.checkpoint import save_checkpoint

        save_checkpoint(self, Path(path), extra_state or {})

    def load(self, path: str | Path) -> dict[str, Any]:
        from archon.engine.checkpoint import load_checkpoint

        return load_checkpoint(self, Path(path))


def _named_state(model: torch.nn.Module, buffers: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (and persistent buffers) with wrapper prefixes (AC, compile) removed."""
    items = list(model.named_parameters())
    if buffers:
        items += list(model.named_buffers())
    for name, tensor in items:
        yield clean_fqn(name), tensor


@torch.no_grad()
def copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter that may be a DTensor shard (no communication)."""
    if isinstance(target, DTensor):
        local = distribute_tensor(full.to(target.device, target.dtype), target.device_mesh, target.placements,
                                  src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full.to(target.device, target.dtype))
