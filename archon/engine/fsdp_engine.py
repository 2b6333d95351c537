"""FSDPEngine: any transformers causal LM, laid over ``fsdp:dN[tM][cK]`` with FSDP2, TP and Ulysses CP.

The model is transformers' own ``AutoModelForCausalLM`` (a critic: ``...ForTokenClassification``
with one output); no Archon model code is involved.  Everything else is ``ArchonEngine``'s:
the same microbatch plan, loss normalisation over the global batch, per-token outputs,
checkpoints (DCP, resharding across allocations), HF export and weight sync, so actor,
critic, reference, teacher, SFT and RL run on it unchanged.

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
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from archon.engine.engine import ArchonEngine, EngineError
from archon.engine.microbatch import Batch, pack, rows_of
from archon.engine.optimizer import build_lr_scheduler, build_optimizer
from archon.engine.options import parameter_device
from archon.engine.token_outputs import output_keys
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
from archon.engine.weights import named_state
from parallel.activation_checkpoint import apply_ac
from parallel.context_parallel import check_heads_divisible
from parallel.errors import ParallelConfigError
from parallel.fsdp import apply_fsdp
from parallel.loss_parallel import vocab_parallel_logprobs_entropy

logger = logging.getLogger("archon.engine")


@dataclass
class PaddedMicrobatch:
    """Right-padded rows (for models whose attention cannot take packed rows)."""

    indices: list[int]
    """Sample indices (into the global batch), one row each."""
    seqlens: list[int]
    """Length of each row's sequence."""
    tokens: torch.Tensor
    """[rows, width] token ids (one padding row when ``indices`` is empty)."""
    attention_mask: torch.Tensor
    """[rows, width] 1 on real tokens."""
    n_real_tokens: int
    """Tokens that belong to real sequences."""


class FSDPEngine(ArchonEngine):
    """``ArchonEngine``'s interface over a transformers model (``fsdp:`` allocations)."""

    backend: ClassVar[str] = "fsdp"
    engine_label: ClassVar[str] = "FSDP"

    # ------------------------------------------------------------------ build
    def initialize(self) -> FSDPEngine:
        cfg = self.config
        self._init_parallel()
        # No MoE router bookkeeping or routing replay: those hook into Archon's own MoE layers.
        self.moe = None
        self.routing_replay = False
        pd = self.parallel_dims
        # The grammar refuses p and e for fsdp:, so these hold by construction.
        assert not pd.pp_enabled and not pd.ep_enabled
        self.hf_config = self._load_hf_config()
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
        if not self.trainable:
            self.model.requires_grad_(False)
        else:
            self.optimizer = build_optimizer(self.model.parameters(), cfg.optimizer)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.optimizer, self.total_steps)
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
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

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
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.model, FSDPModule):
            self.model.reshard()

    @staticmethod
    def _logits(out) -> torch.Tensor:
        logits = out.logits
        return (logits.full_tensor() if isinstance(logits, DTensor) else logits).float()

    def _pack(self, batch: Batch, indices: list[int], pad_to: int = 0):
        if not self.packed:
            return _pad_rows(batch, indices)
        if self._pad_to_maximum():
            pad_to = self.config.mb_spec.max_tokens_per_mb
        # Sequence parallel is not used, so only Ulysses needs lengths divisible by c.
        return pack(batch, indices, multiple_of=self.parallel_dims.cp, pad_to=pad_to)

    # ------------------------------------------------------------------ running the model
    def _loss_positions(self, batch, mb) -> None:
        """Every position: transformers models compute their head over the whole sequence."""
        return None

    def _run_model(self, mb, keep: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        assert keep is None, "the fsdp engine computes every position"
        if isinstance(mb, PaddedMicrobatch):
            return self._run_padded(mb)
        tokens, inputs = self._model_inputs(mb)
        positions = inputs["positions"]
        kwargs = {}
        cp_mesh = self.parallel_dims.get_optional_mesh("cp")
        if cp_mesh is not None:
            kwargs = dict(
                archon_cp_group=cp_mesh.get_group(), archon_cp_size=cp_mesh.size(), archon_cu_seqlens=mb.cu_seqlens
            )
        assert self.model is not None, "initialize() the engine first"
        with self._autocast():
            out = self.model(input_ids=tokens, position_ids=positions, use_cache=False, **kwargs)
        return self._token_outputs(self._head_output(out), mb)

    def _head_output(self, out) -> torch.Tensor:
        """Logits ``[b, s, V]`` (maybe a vocab-sharded DTensor), or a critic's values ``[b, s]``."""
        logits = out.logits
        if self.is_critic:
            values = logits.full_tensor() if isinstance(logits, DTensor) else logits
            return values.squeeze(-1)
        return logits

    def _run_padded(self, mb: PaddedMicrobatch) -> dict[str, torch.Tensor]:
        """Right-padded rows through the model; the same token-aligned outputs as the packed path."""
        assert self.model is not None, "initialize() the engine first"
        with self._autocast():
            out = self.model(input_ids=mb.tokens, attention_mask=mb.attention_mask, use_cache=False)
        head = self._head_output(out)
        if self.is_critic:
            per_token = head.float().unsqueeze(0)
        else:
            targets = torch.roll(mb.tokens, -1, dims=1)
            per_token = torch.stack(vocab_parallel_logprobs_entropy(head, targets, self.temperature))
        anchor = per_token.sum() * 0.0
        # Output i is about token i: shift right; each row's first token (and its padding) get 0.
        aligned = torch.roll(per_token, 1, dims=2)
        aligned[:, :, 0] = 0.0
        aligned = aligned * mb.attention_mask.to(aligned.dtype)
        width = max(mb.seqlens, default=0)
        result = {key: rows[: len(mb.indices), :width] for key, rows in zip(output_keys(self.is_critic), aligned)}
        result["_anchor"] = anchor
        return result

    # ------------------------------------------------------------------ weights out
    def named_full_tensors(
        self, dtype: torch.dtype | None = None, extras: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(transformers name, full tensor) one parameter at a time; a collective: every rank must iterate.

        ``extras`` is accepted for the weight-sync interface; a transformers model has nothing beyond its HF fields.
        """
        assert self.model is not None, "initialize() the engine first"
        for name, tensor in named_state(self.model, buffers=False):
            full = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()
            yield name, full.to(dtype) if dtype is not None else full

    def _export_hf_config(self) -> dict:
        return self.export_config.to_dict()


def _pad_rows(batch: Batch, indices: list[int]) -> PaddedMicrobatch:
    """Rows ``indices`` right-padded to their longest; an empty microbatch is one padding token."""
    if not indices:
        tokens = batch["input_ids"].new_zeros(1, 1)
        return PaddedMicrobatch([], [], tokens, torch.ones_like(tokens), 0)
    rows = rows_of(batch, indices)
    mask = rows["attention_mask"]
    seqlens = [int(n) for n in mask.sum(dim=1)]
    return PaddedMicrobatch(list(indices), seqlens, rows["input_ids"], mask, sum(seqlens))
