"""Does a run fit in GPU memory: the per-GPU estimate of training ranks and rollout servers.

The Archon document's rule of thumb (appendix A.7), made concrete for Archon's engine.  For one
training rank, from the model's config.json (no weights), the allocation and the engine config:

* **states**, held all the time: sharded float32 master parameters, AdamW's two float32 moments,
  and the sharded float32 gradients between backward and the optimizer step.  A parameter is
  split by TP (or, an expert weight, by EP x ETP) and then by FSDP over ``dp_shard x cp``;
  expert weights end up split ``dp_shard x cp x tp`` ways whatever the folding.
* **unsharded parameters** in the compute dtype: the two FSDP units being gathered when FSDP
  reshards after forward, every unit of the rank when it does not (pipeline parallel by
  default, ``reshard_after_forward_policy``); without FSDP, autocast's low-precision copies.
* **unsharded gradients**: with several microbatches (or pipeline parallel) FSDP accumulates
  them unsharded in float32 until the last microbatch (appendix A.4).
* **activations** of the microbatches in flight: one without pipeline parallel; under a
  pipeline schedule, the stage forwards that have not finished their backward (their weight
  backward for zero-bubble schedules, which retain the graph) found by walking torch's own
  action list for the rank.  Per layer and token the tensors autograd saves in Archon's block
  (norms, q/k/v, attention, SwiGLU or routed experts), less with activation checkpointing
  (``full``: the block input; ``selective``: matmul and attention outputs, or every Nth block);
  the last stage adds the float32 softmax of the loss over the (vocab-parallel) logits.

On CUDA (``device_type = "cuda"``) each engine also holds its NCCL communicators' buffers, and
``fit`` adds what a process holds once (CUDA context, cuBLAS workspaces, the default NCCL group, a
fragmentation margin) and compares with what CUDA lets a process allocate of the card, not its
nominal size (see "beyond tensors" below for the figures and their sources).

Microbatch tokens assume every sequence is as long as it may be (RL: ``train_dataset.max_length
+ gconfig.max_new_tokens``; SFT: ``train_dataset.max_length``).  torch.compile usually saves
less than eager; the estimate is eager's.  For one rollout server GPU: the weights (split t*p
ways) and the KV cache SGLang fits into ``sglang.mem_fraction_static`` of the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from archon.alloc import ModelAllocation
from archon.plan.optimizer_memory import OPTIMIZER_LABELS, adamw_state_bytes
from archon.plan.params import lora_param_groups, model_args_of, param_groups

if TYPE_CHECKING:
    from archon.config import Config, TrainEngineConfig

GiB = 1 << 30
MiB = 1 << 20
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Term:
    """One named contribution to a GPU's memory."""

    name: str
    """What it is, e.g. 'optimizer state'."""
    bytes: int
    """Bytes on one GPU."""
    fix: str = ""
    """What reduces it (shown when it dominates a misfit)."""


@dataclass
class Estimate:
    """The peak memory of one GPU of one kind of process."""

    what: str
    """Which process, e.g. 'training rank, pipeline stage 3 of 4'."""
    terms: list[Term]
    """The contributions at the peak."""
    limit: int = 0
    """Bytes this process may use (a rollout server: its static fraction); 0 means the whole GPU."""

    @property
    def total(self) -> int:
        return sum(t.bytes for t in self.terms)

    @property
    def dominant(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)


# ---------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    """What one optimizer step of an engine trains on."""

    sequences: int
    """Sequences per optimizer step, over all data-parallel ranks."""
    seq_len: int
    """Tokens of the longest sequence (every sequence is assumed this long)."""


def workload_of(cfg: Config, job: str) -> Workload:
    """RL: a minibatch of the rollout batch (prompt + completion); SFT: a batch of max_length sequences."""
    if job == "sft":
        return Workload(cfg.train_dataset.batch_size, cfg.train_dataset.max_length)
    rows = cfg.train_dataset.batch_size * cfg.gconfig.n_samples
    return Workload(
        max(1, rows // max(1, cfg.actor.ppo_n_minibatches)), cfg.train_dataset.max_length + cfg.gconfig.max_new_tokens
    )


# ---------------------------------------------------------------------------------- training rank


@dataclass(frozen=True)
class _Layout:
    dp_shard: int
    dp_replicate: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int

    @classmethod
    def of(cls, alloc: ModelAllocation, dp_replicate: int) -> _Layout:
        p = alloc.parallel
        return cls(p.dp_size // dp_replicate, dp_replicate, p.tp_size, p.pp_size, p.cp_size, p.ep_size, p.etp_size)

    @property
    def fsdp(self) -> bool:
        return self.dp_shard * self.cp > 1 or self.dp_replicate > 1

    def split(self, kind: str, numel: int, fsdp: bool) -> float:
        """Elements of a parameter group on one rank: after TP/EP, and after FSDP when ``fsdp``."""
        if kind == "tp":
            n = numel / self.tp
        elif kind == "expert":
            n = numel / (self.ep * self.etp if self.ep > 1 else self.tp)
        else:
            n = float(numel)
        if fsdp and kind == "expert" and self.ep > 1:
            # Expert weights have their own FSDP units over the ranks EP left (efsdp), always.
            n /= self.dp_shard * self.cp * self.tp // (self.ep * self.etp)
        elif fsdp and self.fsdp:
            n /= self.dp_shard * self.cp
        return n


def _rank_layers(
    n_layers: int, lay: _Layout, engine: TrainEngineConfig, pp_rank: int
) -> tuple[list[int], list[int], int]:
    """(this pp rank's stage ids, its layer ids, stage count)."""
    if lay.pp == 1:
        return [0], list(range(n_layers)), 1
    from pipeline.placement import stages_of_rank
    from pipeline.schedules import placement_style, required_stages_per_rank
    from pipeline.split import count_stages

    schedule = engine.archon.pp_schedule
    n_stages = count_stages(n_layers, lay.pp, required_stages_per_rank(schedule), engine.archon.pp_layers_per_stage)
    stages = stages_of_rank(pp_rank, lay.pp, n_stages, placement_style(schedule))
    per = n_layers // n_stages
    return stages, [i for s in stages for i in range(s * per, (s + 1) * per)], n_stages


def _layer_activations(
    args: Any, layer: int, tokens: int, b: int, lay: _Layout, engine: TrainEngineConfig, device_type: str
) -> tuple[float, float]:
    """(bytes autograd keeps for one block over a microbatch of ``tokens``, bytes of one full block).

    The second is what activation checkpointing rebuilds, one block at a time, in backward.
    """
    t, cp = lay.tp, lay.cp
    tc = tokens / cp  # tokens this rank sees (Ulysses splits the sequence)
    tsp = tc / t  # sequence-parallel region (norms, residual)
    h, hd = args.dim, args.head_dim
    q, kv = args.n_heads * hd / t, args.n_kv_heads * hd / t
    heads, kvheads = args.n_heads / t, args.n_kv_heads / t
    norm = 4 * h + 4 + b * h  # float32 input, rsqrt, normalised (the norm computes in float32)
    full = 2 * tsp * norm + tc * b * h  # both norms; the attention input (all-gathered under TP)
    if args.qk_norm:
        full += tc * ((4 + b) * (q + kv) + 4 * (heads + kvheads))
    full += tc * (b * (q + 2 * kv) + b * q + 4 * heads)  # q, k, v after RoPE; attention output, logsumexp
    if device_type != "cuda" or cp > 1:
        full += tc * b * q  # the output re-laid out for wo (CPU SDPA layout, or CP's all-to-all)
    if device_type != "cuda":
        full += tokens * tokens * b  # CPU SDPA keeps the packed causal mask as a float matrix
    moe = args.is_moe_layer(layer)
    moe_saved = 0.0  # what op-level AC keeps of an MoE block (added below)
    if moe:
        k, experts = args.top_k, args.num_experts
        n = tsp if (lay.ep > 1 and lay.etp == 1 and t > 1) else tc
        fm = args.moe_hidden_dim / (lay.etp if lay.ep > 1 else t)
        full += n * (b * h + 4 * experts + 28 * k)  # input, router softmax, top-k, sort order
        full += n * k * (2 * b * h + 4 * b * fm + b)  # routed copies in and out, SwiGLU of each expert
        moe_saved = n * b * experts + n * k * (2 * b * fm + b * h)
    else:
        full += tc * (b * h + 4 * b * args.hidden_dim / t)  # input; gate, up, silu, product
    if not engine.gradient_checkpointing or engine.archon.ac_mode == "none":
        return full, full
    block_input = tsp * b * h
    mode = engine.archon.ac_mode
    if mode == "full":
        return block_input, full
    if mode == "memory_budget":
        return block_input + engine.archon.ac_memory_budget * full, full
    option = engine.archon.selective_ac_option
    if option != "op":
        return (block_input if layer % int(option) == 0 else full), full
    saved = block_input + tc * (b * (q + 2 * kv) + b * q + 4 * heads + b * h)  # q/k/v, attention, wo out
    if moe:
        saved += moe_saved
    else:
        saved += tc * (2 * b * args.hidden_dim / t + b * h)
    if cp > 1:
        saved += tc * b * (2 * q + 2 * kv)  # CP's all-to-all outputs are kept, not re-sent
    return saved, full


def _in_flight(
    engine: TrainEngineConfig, lay: _Layout, n_stages: int, n_mbs: int, pp_rank: int, unit_bytes: dict[int, float]
) -> float:
    """Peak bytes of the stage forwards whose backward has not finished, walking torch's schedule."""
    from pipeline.schedules import microbatch_count

    schedule = engine.archon.pp_schedule
    n = microbatch_count(schedule, n_mbs, n_stages, lay.pp)
    actions = _rank_actions(schedule, lay.pp, n_stages, n, pp_rank)
    live: set[tuple[int, int]] = set()
    peak = 0.0
    for stage, kind, mb in actions:
        if kind == "F":
            live.add((stage, mb))
            peak = max(peak, sum(unit_bytes[s] for s, _ in live))
        elif kind in ("B", "W"):
            live.discard((stage, mb))
    return peak


def _rank_actions(schedule: str, pp: int, n_stages: int, n_mbs: int, rank: int) -> list[tuple[int, str, int]]:
    """(stage, 'F'|'B'|'I'|'W', microbatch) in the order torch's schedule runs them on ``rank``."""
    per_rank = n_stages // pp
    if schedule in ("1F1B", "GPipe"):
        warm = n_mbs if schedule == "GPipe" else min(n_mbs, pp - rank)
        out = [(rank, "F", i) for i in range(warm)]
        for i in range(n_mbs):
            out.append((rank, "B", i))
            if warm + i < n_mbs:
                out.append((rank, "F", warm + i))
        return out
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = {
        "Interleaved1F1B": torch_schedules.ScheduleInterleaved1F1B,
        "InterleavedZeroBubble": torch_schedules.ScheduleInterleavedZeroBubble,
        "ZBVZeroBubble": torch_schedules.ScheduleZBVZeroBubble,
        "DualPipeV": torch_schedules.ScheduleDualPipeV,
    }[schedule]
    # The action lists are computed from these attributes only; no stage or process group is needed.
    sched = cls.__new__(cls)
    rounds = max(1, n_mbs // pp)
    sched.__dict__.update(
        pp_group_size=pp,
        n_local_stages=per_rank,
        _n_microbatches=n_mbs,
        rank=rank,
        number_of_rounds=rounds,
        microbatches_per_round=n_mbs // rounds,
        num_stages=n_stages,
        _num_stages=n_stages,
    )
    out = []
    for action in sched._calculate_single_rank_operations(rank):
        if action is None:
            continue
        kind = action.computation_type.value
        if kind == "OVERLAP_F_B":  # DualPipeV: a forward and a backward of two chunks at once
            out.extend(
                (sub.stage_index, sub.computation_type.value, sub.microbatch_index) for sub in action.sub_actions or ()
            )
        elif kind in ("F", "B", "I", "W"):
            out.append((action.stage_index, kind, action.microbatch_index))
    return out


# ---------------------------------------------------------------------------------- beyond tensors (CUDA)
# What a training process holds on a GPU besides the tensors counted below, and how much of a
# card a process may use at all.  Figures are documented or measured elsewhere (sources beside
# each); they are deliberately round, so "fits" keeps a margin rather than promising the last MiB.

USABLE_FRACTION = 79.11 / 80
"""Share of a card's nominal memory CUDA lets processes allocate: an "80 GB" H100 (80 GiB of HBM) reports
79.11 GiB total to torch.cuda.mem_get_info, the capacity in torch's out-of-memory message
(vllm-project/vllm#27508; A100 80GB: 79.15-79.35 GiB); the driver keeps the rest."""
CUDA_CONTEXT_BYTES = 512 * MiB
"""The CUDA context of one process with its kernels: ~300 MB at initialisation since CUDA 11.7 loads
kernels lazily, >1 GB before (pytorch/pytorch#107667), growing as a step loads torch's, NCCL's and Triton's."""
CUBLAS_WORKSPACE_BYTES = 2 * 32 * MiB
"""torch's default cuBLAS workspace, shared with cuBLASLt, is 32 MiB per (handle, stream) on Hopper and 8.1 MiB
before (``:4096:8``, aten/src/ATen/cuda/CublasHandlePool.cpp; cuBLAS's cublasSetWorkspace recommends 32 MiB on
Hopper); forward and backward matmuls share one stream, two allow for one side stream."""
NCCL_COLLECTIVE_BYTES = GiB
"""One NCCL communicator that runs collectives (all-gather, reduce-scatter, all-reduce): its buffers are
NCCL_BUFFSIZE (4 MiB, Simple protocol) plus the LL and LL128 buffers per channel and ring peer, with up to
32 channels on H100 NVLink; one communicator after an all-reduce held ~1.6 GB with the context (NVIDIA/nccl#864)."""
NCCL_PEER_BYTES = 450 * MiB
"""Each peer of an all-to-all or point-to-point communicator: on 8 H100s the first all_to_all_single took a
rank's NCCL memory from 1.06 to 4.34 GB, 32 channels to each of 7 peers (NVIDIA/nccl#1685)."""
FRAGMENTATION_MARGIN = 0.10
"""Caching-allocator blocks reserved but not usable for the next request, as a share of the tensors' peak: a
margin, not a law; it reached 21% (16 of 77 GiB) in a torchrec study (meta-pytorch/torchrec#4584) and shrinks with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."""


HELD_TERMS = ("parameters", "optimizer state", "NCCL buffers")
"""Names of the terms an engine holds all the time (beside another engine's peak, or in its optimizer step)."""


def usable_gpu_bytes(gpu_memory_gb: float) -> int:
    """Bytes a process can allocate on a card of ``gpu_memory_gb`` nominal GiB (``cluster.gpu_memory_gb``)."""
    return int(gpu_memory_gb * GiB * USABLE_FRACTION)


def process_terms(tensor_bytes: int) -> list[Term]:
    """What one training process adds once, whatever its engines: CUDA context, cuBLAS, the default NCCL
    group (barriers, object broadcasts), and the fragmentation margin on ``tensor_bytes`` (its tensors' peak)."""
    return [
        Term("CUDA context and kernels", CUDA_CONTEXT_BYTES, ""),
        Term("cuBLAS workspaces", CUBLAS_WORKSPACE_BYTES, ""),
        Term("NCCL buffers of the default group", NCCL_COLLECTIVE_BYTES, ""),
        Term(
            f"allocator fragmentation ({FRAGMENTATION_MARGIN:.0%} margin)",
            int(FRAGMENTATION_MARGIN * tensor_bytes),
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True wastes less",
        ),
    ]


def nccl_communicators(lay: _Layout) -> tuple[int, int]:
    """(communicators running collectives, all-to-all and point-to-point peers) of one engine's meshes."""
    collectives = int(lay.fsdp) + int(lay.dp_replicate > 1) + int(lay.tp > 1)
    peers = 0
    if lay.cp > 1:
        peers += lay.cp - 1  # Ulysses all-to-all
    if lay.ep > 1:
        peers += lay.ep - 1  # token dispatch all-to-all
        collectives += int(lay.dp_shard * lay.cp * lay.tp // (lay.ep * lay.etp) > 1)  # expert FSDP (efsdp)
    if lay.pp > 1:
        peers += 1 if lay.pp == 2 else 2  # the previous and the next pipeline rank
    return collectives, peers


def nccl_term(lay: _Layout) -> Term:
    """NCCL buffers of one engine's communicators (held as long as the engine lives)."""
    collectives, peers = nccl_communicators(lay)
    return Term(
        f"NCCL buffers ({collectives} collective communicators, {peers} all-to-all/p2p peers)",
        collectives * NCCL_COLLECTIVE_BYTES + peers * NCCL_PEER_BYTES,
        "fewer parallel dimensions, or NCCL_BUFFSIZE / NCCL_MAX_NCHANNELS",
    )


def estimate_training_rank(
    engine: TrainEngineConfig,
    hf: dict[str, Any],
    workload: Workload,
    *,
    device_type: str = "cuda",
    is_critic: bool = False,
    trainable: bool = True,
    pp_rank: int | None = None,
) -> Estimate:
    """Peak memory of one training rank of ``engine`` (the largest over its pipeline ranks unless ``pp_rank``)."""
    alloc = ModelAllocation.from_str(engine.backend)
    lay = _Layout.of(alloc, engine.archon.dp_replicate)
    if pp_rank is None:
        return max(
            (
                estimate_training_rank(
                    engine, hf, workload, device_type=device_type, is_critic=is_critic, trainable=trainable, pp_rank=r
                )
                for r in range(lay.pp)
            ),
            key=lambda e: e.total,
        )
    spec, args = model_args_of(hf, is_critic)
    groups = param_groups(spec, args)
    stages, layers, n_stages = _rank_layers(args.n_layers, lay, engine, pp_rank)
    first, last = 0 in stages, n_stages - 1 in stages
    held = {f"layers.{i}" for i in layers} | ({"tok_embeddings"} if first else set()) | ({"head"} if last else set())
    mine = [g for g in groups if g.unit.split(".experts")[0] in held]
    lora = engine.lora
    # Under LoRA the adapters are float32 master weights with gradients and AdamW state; the frozen base has neither.
    adapters = [g for g in lora_param_groups(spec, args, lora) if g.unit in held] if lora.enabled else []
    mine += adapters
    n_local = sum(lay.split(g.kind, g.numel, fsdp=True) for g in mine)
    n_tp = sum(lay.split(g.kind, g.numel, fsdp=False) for g in mine)
    units: dict[str, float] = {}
    for g in mine:
        units[g.unit] = units.get(g.unit, 0.0) + lay.split(g.kind, g.numel, fsdp=False)
    pb = _DTYPE_BYTES[engine.dtype]
    b = pb  # activations are in the compute dtype (FSDP mixed precision or autocast)
    offload = engine.archon.offload_params
    terms = []
    if lora.enabled:
        n_train = sum(lay.split(g.kind, g.numel, fsdp=True) for g in adapters)
        n_train_tp = sum(lay.split(g.kind, g.numel, fsdp=False) for g in adapters)
        n_frozen = n_local - n_train
        if not offload:
            terms.append(
                Term(f"parameters (frozen base in {engine.dtype}, sharded)", int(pb * n_frozen), "raise t, e or p")
            )
    else:
        n_train, n_train_tp = n_local, n_tp
    if not offload:
        terms.append(Term("parameters (float32, sharded)", int(4 * n_train), "raise t, e or p (or d, under FSDP)"))
        if trainable:
            # Per parameter group (a group's local share taken as one tensor for torchao's size rule).
            trained = adapters if lora.enabled else mine
            kind = engine.optimizer.type
            state = adamw_state_bytes(kind, (lay.split(g.kind, g.numel, fsdp=True) for g in trained))
            terms.append(Term(f"optimizer state ({OPTIMIZER_LABELS[kind]})", state, "raise t, e or p (or d)"))
    if device_type == "cuda" and any(nccl_communicators(lay)):
        terms.append(nccl_term(lay))  # held for the engine's life, like its states
    # Unsharded parameters while a unit computes.
    reshard = engine.archon.reshard_after_forward_policy == "always" or (
        engine.archon.reshard_after_forward_policy == "default" and lay.pp == 1
    )
    if lay.fsdp:
        biggest = sorted(units.values(), reverse=True)[:2]
        gathered = sum(biggest) if reshard else n_tp
        terms.append(
            Term(
                "unsharded parameters (FSDP all-gather)",
                int(gathered * pb),
                "reshard_after_forward_policy = 'always'" if not reshard else "raise t, e or p",
            )
        )
    elif pb != 4:
        terms.append(Term("low-precision weight copies (autocast)", int(n_tp * pb), "raise t, e or p"))
    # Gradients: float32, unsharded while FSDP accumulates over microbatches (A.4), else sharded.
    n_mbs = engine.mb_spec.n_mbs
    dp = lay.dp_shard * lay.dp_replicate
    seqs_per_rank = math.ceil(workload.sequences / dp)
    # With several microbatches the gradients of the first ones live through the later ones' forward.
    accumulate = trainable and (n_mbs > 1 or lay.pp > 1)
    if accumulate:
        unsharded = lay.fsdp
        terms.append(
            Term(
                "gradients (float32" + (", unsharded until the last microbatch)" if unsharded else ")"),
                int(4 * (n_train_tp if unsharded else n_train)),
                "raise t, e or p",
            )
        )
    # Activations of the microbatches in flight.
    mbs = n_mbs
    if lay.pp > 1:
        from pipeline.schedules import microbatch_count

        mbs = microbatch_count(engine.archon.pp_schedule, n_mbs, n_stages, lay.pp)
    per_mb = max(1, math.ceil(seqs_per_rank / mbs))
    tokens = per_mb * workload.seq_len
    if engine.mb_spec.max_tokens_per_mb > 0:
        cap = max(workload.seq_len, engine.mb_spec.max_tokens_per_mb)
        tokens = cap if (engine.pad_to_maximum or engine.archon.enable_compile) else min(tokens, cap)
    tokens = math.ceil(tokens / (lay.tp * lay.cp)) * lay.tp * lay.cp
    per_layer = {i: _layer_activations(args, i, tokens, b, lay, engine, device_type) for i in layers}
    vocab = 1 if is_critic else args.vocab_size / lay.tp
    tc = tokens / lay.cp
    # The loss keeps float32 probabilities and the logits (unsharded) or its float32 shifted logits
    # (vocab-parallel); its peak beyond them is two float32 [tokens, vocab] buffers (log-softmax and
    # the float copy in forward, the gradient and its product in backward; an entropy term in the loss
    # adds about two more).  Measured on an H200 (gpu_check memory_estimate, 8 x 1024 tokens, 32k vocab).
    kept = (b + 4) * vocab if lay.tp == 1 else 8 * vocab
    head_saved = (tc / lay.tp) * (4 * args.dim + 4 + b * args.dim) + tc * (b * args.dim + kept)
    loss_peak = tc * (8 if lay.tp == 1 else b + 12) * vocab
    per_stage_layers = len(layers) // len(stages)
    unit_bytes = {}
    for k, s in enumerate(stages):
        own = layers[k * per_stage_layers : (k + 1) * per_stage_layers]
        unit_bytes[s] = (
            sum(per_layer[i][0] for i in own)
            + (head_saved if s == n_stages - 1 else 0.0)
            + (tc / lay.tp) * b * args.dim
        )  # the stage input kept for backward
    if not trainable:
        # Forward only (no_grad): one block's tensors at a time, and the last stage's logits.
        acts = max(full for _, full in per_layer.values()) + (tc * (b + 12) * vocab if last else 0.0)
    elif lay.pp > 1:
        acts = _in_flight(engine, lay, n_stages, n_mbs, pp_rank, unit_bytes)
    else:
        acts = sum(unit_bytes.values())
    recompute = max(full for _, full in per_layer.values()) - max(saved for saved, _ in per_layer.values())
    terms.append(
        Term(
            f"activations ({tokens} tokens per microbatch)",
            int(acts),
            "raise mb_spec.n_mbs, turn on gradient_checkpointing, or raise t, c or p",
        )
    )
    if trainable:
        # The loss's float32 softmax temporaries come first, then one recomputed block at a time.
        terms.append(
            Term(
                "backward transients (loss softmax, recomputed block)",
                int(max(recompute, loss_peak if last else 0)),
                "raise t or n_mbs",
            )
        )
    where = f"training rank, pipeline rank {pp_rank} of {lay.pp}" if lay.pp > 1 else "training rank"
    compute = Estimate(where, terms)
    if not trainable or offload:
        return compute
    # The optimizer step: sharded gradients, and foreach AdamW's float32 temporaries (fused on CUDA: none).
    states = [t for t in terms if t.name.startswith(HELD_TERMS)]
    step = states + [Term("gradients (float32, sharded)", int(4 * n_train), "raise t, e, p or d")]
    if device_type != "cuda":
        step.append(Term("optimizer step temporaries (foreach AdamW)", int(4 * n_train), "raise t, e, p or d"))
    step_estimate = Estimate(where + ", optimizer step", step)
    return compute if compute.total >= step_estimate.total else step_estimate
