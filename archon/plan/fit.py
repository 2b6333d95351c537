"""Does a run fit its GPUs: every engine of a training rank, every rollout server, and fixes that were checked.

``check_fit(cfg, job)`` estimates one training GPU (actor, and critic/reference when the run
has them, colocated on the same ranks) and one rollout server GPU against
``cluster.gpu_memory_gb``.  When the training rank does not fit it tries, in this order,
changes that leave the cluster plan alone: activation checkpointing, ZBV instead of IZB,
more microbatches, resharding after forward, then moving a factor of 2 of the allocation from
``d`` into ``t``, ``p`` or ``e``; it reports the first ones whose estimate fits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from archon.alloc import AllocationError, ModelAllocation
from archon.config.reference import reference_is_actor_base
from archon.plan.colocated_fit import generating_phase, training_phase
from archon.plan.memory import (
    HELD_TERMS,
    Estimate,
    GiB,
    Term,
    Workload,
    estimate_training_rank,
    process_terms,
    usable_gpu_bytes,
    workload_of,
)
from archon.plan.params import model_args_of, param_groups, read_model_config

if TYPE_CHECKING:
    from archon.config import Config, TrainEngineConfig

_KV_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


@dataclass
class FitReport:
    """The memory check of a run against one GPU's memory."""

    gpu_bytes: int
    """Memory one process can allocate on a GPU (cluster.gpu_memory_gb, less the driver's share on CUDA)."""
    train: Estimate | None = None
    """The fullest training GPU (None for a run without training ranks)."""
    rollout: Estimate | None = None
    """One rollout server GPU (None without SGLang servers)."""
    generating: Estimate | None = None
    """Colocated runs: a shared GPU while its server generates (``train`` is then the same GPU while training)."""
    fixes: list[str] = field(default_factory=list)
    """Changes (as overrides) checked to make the training rank fit, each with its estimate."""
    notes: list[str] = field(default_factory=list)
    """Assumptions worth saying next to the numbers."""

    def fits_train(self) -> bool:
        return self.train is None or self.train.total <= self.gpu_bytes

    def fits_rollout(self) -> bool:
        return self.rollout is None or self.rollout.total <= (self.rollout.limit or self.gpu_bytes)

    def fits_generating(self) -> bool:
        return self.generating is None or self.generating.total <= self.gpu_bytes

    @property
    def fits(self) -> bool:
        return self.fits_train() and self.fits_rollout() and self.fits_generating()

    @property
    def estimates(self) -> list[Estimate]:
        """Every estimate made, in the order the plan prints them."""
        return [e for e in (self.train, self.generating, self.rollout) if e is not None]

    def verdict(self, est: Estimate) -> str:
        limit = est.limit or self.gpu_bytes
        if est.total <= limit and est.limit:
            kv = est.terms[-1]
            return f"fits: the weights leave {kv.bytes / GiB:.1f} GiB of the static fraction for the {kv.name}"
        if est.total <= limit:
            return f"fits, {(limit - est.total) / GiB:.1f} GiB headroom"
        dom = est.dominant
        return (
            f"does not fit: {est.total / GiB:.1f} GiB > {limit / GiB:.1f} GiB; the largest term is "
            f"{dom.name} ({dom.bytes / GiB:.1f} GiB){'; ' + dom.fix if dom.fix else ''}"
        )


# ---------------------------------------------------------------------------------- training


def _engines(cfg: Config, job: str) -> list[tuple[str, TrainEngineConfig, bool, bool]]:
    """(name, engine config, is_critic, trainable) of every engine a training rank holds."""
    engines: list[tuple[str, TrainEngineConfig, bool, bool]] = [("actor", cfg.actor, False, True)]
    if job == "rl" and (cfg.actor.kl_ctl or cfg.actor.kl_loss_coef) and not reference_is_actor_base(cfg):
        engines.append(("ref", cfg.ref, False, False))  # a LoRA actor's reference is its own base: no engine
    if job == "rl" and cfg.actor.adv_estimator == "gae":
        engines.append(("critic", cfg.critic, True, True))
    if job == "rl" and cfg.actor.kd_coef:
        # Counted with the actor's architecture: a teacher of another size is estimated as the actor's.
        engines.append(("teacher", cfg.teacher, False, False))
    return engines


def _states(est: Estimate) -> list[Term]:
    return [t for t in est.terms if t.name.startswith(HELD_TERMS)]


def estimate_train_gpu(
    cfg: Config, job: str, hf: dict[str, Any], device_type: str = "cuda", actor: TrainEngineConfig | None = None
) -> Estimate:
    """One training GPU: each engine's peak while the others hold their parameters and optimizer state."""
    workload = workload_of(cfg, job)
    engines = _engines(cfg, job)
    if actor is not None:
        engines[0] = ("actor", actor, False, True)
    ests = {
        name: estimate_training_rank(eng, hf, workload, device_type=device_type, is_critic=critic, trainable=trainable)
        for name, eng, critic, trainable in engines
    }
    if len(ests) == 1:
        return _with_process_terms(ests["actor"], device_type)
    best: Estimate | None = None
    for name, est in ests.items():
        terms = [dataclasses.replace(t, name=f"{name} {t.name}") for t in est.terms]
        for other, o in ests.items():
            if other != name:
                terms += [dataclasses.replace(t, name=f"{other} {t.name}") for t in _states(o)]
        combined = Estimate(f"{est.what} ({name} computing)", terms)
        if best is None or combined.total > best.total:
            best = combined
    assert best is not None  # ests has two engines or more here
    return _with_process_terms(best, device_type)


def _with_process_terms(est: Estimate, device_type: str) -> Estimate:
    """``est`` plus what the process holds once on a GPU (context, cuBLAS, default NCCL group, fragmentation)."""
    if device_type != "cuda":
        return est
    tensors = sum(t.bytes for t in est.terms if "NCCL" not in t.name)  # NCCL's buffers bypass torch's allocator
    return Estimate(est.what, est.terms + process_terms(tensors), est.limit)


def _replace_engine(engine: TrainEngineConfig, **changes: Any) -> TrainEngineConfig:
    archon = {k.split(".", 1)[1]: changes.pop(k) for k in list(changes) if k.startswith("archon.")}
    mb = {k.split(".", 1)[1]: changes.pop(k) for k in list(changes) if k.startswith("mb_spec.")}
    return dataclasses.replace(
        engine,
        archon=dataclasses.replace(engine.archon, **archon),
        mb_spec=dataclasses.replace(engine.mb_spec, **mb),
        **changes,
    )


def _allocation_variants(alloc: ModelAllocation, args: Any) -> list[str]:
    """Plain allocations of the same world size with a factor 2 moved from d into t or p, or e doubled."""
    if alloc.is_hybrid:
        return []
    p = alloc.parallel
    out = []

    def text(d: int, t: int, pp: int, c: int, e: int) -> str:
        dims = "".join(f"{k}{v}" for k, v in (("d", d), ("p", pp), ("t", t), ("c", c), ("e", e)) if v > 1 or k == "d")
        return f"archon:{dims}"

    if p.dp_size % 2 == 0:
        t = p.tp_size * 2
        moe_hidden = getattr(args, "moe_hidden_dim", 0) if p.ep_size == 1 else 0
        if all(x % t == 0 for x in (args.n_heads, args.n_kv_heads, args.hidden_dim, moe_hidden or t)):
            out.append(text(p.dp_size // 2, t, p.pp_size, p.cp_size, p.ep_size))
        out.append(text(p.dp_size // 2, p.tp_size, p.pp_size * 2, p.cp_size, p.ep_size))
    experts = getattr(args, "num_experts", 0)
    e = p.ep_size * 2
    if experts and experts % e == 0 and (p.dp_size * p.cp_size * p.tp_size) % e == 0:
        out.append(text(p.dp_size, p.tp_size, p.pp_size, p.cp_size, e))
    return out


def _candidate_fixes(engine: TrainEngineConfig, args: Any, workload: Workload) -> list[tuple[str, dict[str, Any]]]:
    arch = engine.archon
    alloc = ModelAllocation.from_str(engine.backend)
    fixes: list[tuple[str, dict[str, Any]]] = []
    if not engine.gradient_checkpointing or arch.ac_mode == "none":
        changes: dict[str, Any] = {"gradient_checkpointing": True}
        text = "actor.gradient_checkpointing=true"
        if arch.ac_mode == "none":
            changes["archon.ac_mode"] = "full"
            text += " actor.archon.ac_mode=full"
        fixes.append((text, changes))
    elif arch.ac_mode == "selective":
        fixes.append(("actor.archon.ac_mode=full", {"archon.ac_mode": "full"}))
    if alloc.parallel.pp_size > 1 and arch.pp_schedule == "InterleavedZeroBubble":
        fixes.append(
            (
                "actor.archon.pp_schedule=ZBVZeroBubble",
                {"archon.pp_schedule": "ZBVZeroBubble", "archon.pp_layers_per_stage": 0},
            )
        )
    per_rank = math.ceil(workload.sequences / alloc.parallel.dp_size)
    for factor in (2, 4):
        n = engine.mb_spec.n_mbs * factor
        if n <= per_rank:
            fixes.append((f"actor.mb_spec.n_mbs={n}", {"mb_spec.n_mbs": n}))
    if alloc.parallel.pp_size > 1 and arch.reshard_after_forward_policy != "always":
        fixes.append(
            ("actor.archon.reshard_after_forward_policy=always", {"archon.reshard_after_forward_policy": "always"})
        )
    for variant in _allocation_variants(alloc, args):
        fixes.append((f"actor.backend={variant}", {"backend": variant}))
    return fixes


def _checked_fixes(cfg: Config, job: str, hf: dict[str, Any], gpu: int, device_type: str, limit: int = 2) -> list[str]:
    """Up to ``limit`` single changes whose estimate fits, with that estimate."""
    from pipeline.split import PipelineConfigError

    _, args = model_args_of(hf)
    found = []
    for text, changes in _candidate_fixes(cfg.actor, args, workload_of(cfg, job)):
        try:
            engine = _replace_engine(cfg.actor, **changes)
            est = estimate_train_gpu(cfg, job, hf, device_type, actor=engine)
        except (PipelineConfigError, AllocationError, ValueError):
            continue  # not a valid layout for this model (layers, heads or experts do not divide)
        if est.total <= gpu:
            found.append(f"{text} ({est.total / GiB:.1f} GiB, {(gpu - est.total) / GiB:.1f} GiB headroom)")
            if len(found) == limit:
                break
    return found


# ---------------------------------------------------------------------------------- rollout


def estimate_server_gpu(cfg: Config, hf: dict[str, Any], gpu: int) -> Estimate | None:
    """One GPU of an SGLang server: its share of the weights and the KV cache in mem_fraction_static."""
    rollout = cfg.allocations()["rollout"]
    if rollout.backend != "sglang":
        return None
    spec, args = model_args_of(hf)
    t, p = rollout.parallel.tp_size, rollout.parallel.pp_size
    weight_bytes = _KV_BYTES.get(cfg.sglang.dtype, 2)
    weights = sum(g.numel for g in param_groups(spec, args)) * weight_bytes / (t * p)
    static = cfg.sglang.mem_fraction_static * gpu
    kv_heads = math.ceil(args.n_kv_heads / t)  # SGLang replicates KV heads when t exceeds them
    per_token = 2 * (args.n_layers / p) * kv_heads * args.head_dim * weight_bytes
    seq = cfg.train_dataset.max_length + cfg.gconfig.max_new_tokens
    kv = max(0.0, static - weights)
    terms = [
        Term(
            f"weights ({cfg.sglang.dtype}, split t{t}" + (f" x p{p}" if p > 1 else "") + ")",
            int(weights),
            "raise the t of rollout.backend (fewer, larger servers)",
        ),
        Term(
            f"KV cache ({int(kv // per_token)} tokens, {int(kv // (per_token * seq))} sequences of {seq})", int(kv), ""
        ),
    ]
    est = Estimate(
        f"rollout server GPU (sglang.mem_fraction_static = {cfg.sglang.mem_fraction_static})", terms, limit=int(static)
    )
    if kv < per_token * seq:
        # Not even one sequence's KV cache fits beside the weights: report the shortfall.
        est.terms[1] = Term(
            f"KV cache for one sequence of {seq} tokens",
            int(per_token * seq),
            "raise sglang.mem_fraction_static or the t of rollout.backend",
        )
    return est


# ---------------------------------------------------------------------------------- the check


def check_fit(cfg: Config, job: str = "rl", device_type: str = "cuda") -> FitReport:
    """Estimate a training GPU and a rollout GPU of ``cfg`` against ``cluster.gpu_memory_gb``."""
    # On CUDA a card's nominal size is more than a process can allocate (memory.USABLE_FRACTION).
    gpu = usable_gpu_bytes(cfg.cluster.gpu_memory_gb) if device_type == "cuda" else int(cfg.cluster.gpu_memory_gb * GiB)
    hf = read_model_config(cfg.actor)
    report = FitReport(gpu)
    report.train = estimate_train_gpu(cfg, job, hf, device_type)
    if not report.fits_train():
        report.fixes = _checked_fixes(cfg, job, hf, gpu, device_type)
    if job == "rl" and not cfg.rollout.server_addrs:
        report.rollout = estimate_server_gpu(cfg, hf, gpu)
    if job == "rl" and cfg.rollout.colocate and report.rollout is not None:
        # A GPU holds a server and a training rank: each phase's peak, with what the other keeps meanwhile.
        report.generating = generating_phase(report.train, report.rollout, cfg.actor.offload, device_type)
        report.train = training_phase(report.train, device_type)
        report.notes.append(
            "colocated: the servers release their weights and KV cache before training, and the trainer keeps only "
            "its states and buffers on the GPU while they generate"
            + (" (its parameters and optimizer state go to CPU: actor.offload)" if cfg.actor.offload else "")
        )
    elif job == "rl" and cfg.allocations()["rollout"].backend == "inprocess":
        report.notes.append("inprocess: the generator's KV cache beside the training rank is not estimated")
    elif job == "rl" and cfg.rollout.colocate:
        report.notes.append(
            f"colocated {cfg.allocations()['rollout'].backend} servers are not estimated (SGLang's are): leave room "
            "beside the training rank's peak for them"
        )
    if device_type == "cuda":
        report.notes.append(
            f"cluster.gpu_memory_gb = {cfg.cluster.gpu_memory_gb:g}: processes can allocate {gpu / GiB:.1f} GiB "
            "of such a card (torch.cuda.mem_get_info's total on an 80 GB H100: 79.1 GiB)"
        )
    w = workload_of(cfg, job)
    report.notes.append(
        f"every sequence assumed {w.seq_len} tokens long, {w.sequences} per optimizer step"
        + (" (a ppo minibatch)" if job == "rl" else "")
    )
    if cfg.actor.archon.enable_compile:
        report.notes.append("estimated for eager mode; torch.compile usually keeps fewer activations")
    return report
