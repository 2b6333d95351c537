"""Checks and defaults of the colocated layouts: ``rollout.colocate`` and the ``inprocess`` rollout backend.

Colocation (AReaL's word; verl's hybrid engine) lets rollout servers and training ranks take turns on the same GPUs:
server i runs on the GPUs of training ranks ``i*size .. (i+1)*size - 1`` (``archon.placement``), so the rollout
allocation must cover exactly the actor's GPUs.  The ``inprocess`` backend needs no server at all: the built-in
generator runs inside every data-parallel rank of a plain ``archon:dN`` actor, on the weights being trained.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from archon.alloc import ModelAllocation
from archon.config.schema import Config, ConfigError

COLOCATED_MEMORY_FRACTION = 0.5
"""Default of sglang.mem_fraction_static and vllm.gpu_memory_utilization with rollout.colocate: the rest of the GPU
stays for what the trainer keeps there while the servers generate."""


def apply_colocate_defaults(cfg: Config, explicit: set[str]) -> None:
    """Lower the servers' share of the GPU to ``COLOCATED_MEMORY_FRACTION`` when colocated, unless the user set it."""
    if not cfg.rollout.colocate:
        return
    if "sglang.mem_fraction_static" not in explicit:
        cfg.sglang.mem_fraction_static = COLOCATED_MEMORY_FRACTION
    if "vllm.gpu_memory_utilization" not in explicit:
        cfg.vllm.gpu_memory_utilization = COLOCATED_MEMORY_FRACTION
    if "rollout.weight_sync" not in explicit:
        # Servers on the trainer's GPUs take its tensors by reference (vLLM: from disk, its only way in); NCCL puts
        # no two ranks on one GPU, so the broadcast group is never the default here.
        cfg.rollout.weight_sync = "disk" if cfg.rollout.backend.startswith("vllm") else "tensor"


def check_colocation(cfg: Config, allocs: dict[str, ModelAllocation], sources: dict[str, str], job: str) -> None:
    """Refuse a colocated or in-process layout that cannot run, in one sentence naming the keys to change."""

    def where(key: str) -> str:
        return sources.get(key, "the defaults")

    rollout, actor = allocs["rollout"], allocs["actor"]
    if rollout.backend == "inprocess" and job == "rl":
        _check_inprocess(cfg, rollout, actor, where)
    if cfg.actor.offload and not cfg.rollout.colocate:
        raise ConfigError(
            f"actor.offload = true (from {where('actor.offload')}) moves the trainer's parameters and optimizer state "
            "to CPU while colocated servers generate, which only helps with rollout.colocate = true; set "
            "rollout.colocate = true or actor.offload = false"
        )
    if cfg.rollout.weight_sync == "tensor" and not cfg.rollout.colocate and job == "rl":
        raise ConfigError(
            f"rollout.weight_sync = 'tensor' (from {where('rollout.weight_sync')}) hands the trainer's tensors to "
            "servers on its own GPUs, which only colocated servers are; set rollout.colocate = true, or use "
            "'distributed' or 'disk'"
        )
    if cfg.actor.offload and cfg.actor.archon.offload_params:
        raise ConfigError(
            "actor.offload = true moves the trainer's state to CPU while the servers generate, but "
            "actor.archon.offload_params = true keeps it there all the time already; turn one of them off"
        )
    if not cfg.rollout.colocate or job != "rl":
        return
    if cfg.rollout.max_head_offpolicyness > 0:
        raise ConfigError(
            f"rollout.colocate = true makes servers and trainer take turns on the same GPUs, so the servers cannot "
            f"generate while the trainer trains as rollout.max_head_offpolicyness = "
            f"{cfg.rollout.max_head_offpolicyness} (from {where('rollout.max_head_offpolicyness')}) asks; set it "
            "to 0, or give the servers GPUs of their own (rollout.colocate = false)"
        )
    if rollout.world_size != actor.world_size:
        size = rollout.parallel.tp_size * rollout.parallel.pp_size
        fit = dataclasses.replace(
            rollout, parallel=dataclasses.replace(rollout.parallel, dp_size=actor.world_size // size)
        )
        hint = f", e.g. '{fit}'" if actor.world_size % size == 0 else " (and t*p to a divisor of the actor's)"
        raise ConfigError(
            f"rollout.colocate = true puts every server on training ranks' GPUs, so rollout.backend = '{rollout}' "
            f"(from {where('rollout.backend')}, {rollout.world_size} GPUs) must use as many GPUs as actor.backend = "
            f"'{actor}' ({actor.world_size}); change the d of rollout.backend{hint}"
        )

    if cfg.rollout.weight_sync == "distributed":
        raise ConfigError(
            f"rollout.weight_sync = 'distributed' (from {where('rollout.weight_sync')}) forms a broadcast group of "
            "the trainer and the servers, which cannot share a GPU under NCCL; colocated servers take 'tensor' (the "
            "default with rollout.colocate) or 'disk'"
        )
    if cfg.rollout.server_addrs:
        raise ConfigError(
            f"rollout.colocate = true places the servers the run launches on the training GPUs, but "
            f"rollout.server_addrs (from {where('rollout.server_addrs')}) lists servers started elsewhere, which "
            "cannot be placed; leave rollout.server_addrs empty or set rollout.colocate = false"
        )


def _check_inprocess(
    cfg: Config, rollout: ModelAllocation, actor: ModelAllocation, where: Callable[[str], str]
) -> None:
    """``inprocess:dN``: a plain ``archon:dN`` actor, synchronous, not colocated (it has no server to place)."""
    key = f"rollout.backend = '{rollout}' (from {where('rollout.backend')})"
    if actor.backend != "archon":
        raise ConfigError(
            f"{key} runs Archon's built-in generator on the actor's weights, which only Archon's models have, but "
            f"actor.backend = '{actor}'; write 'archon:{str(actor).split(':', 1)[1]}' or use a 'local:' rollout server"
        )
    p = actor.parallel
    if actor.is_hybrid or p.tp_size * p.pp_size * p.cp_size * p.ep_size > 1:
        raise ConfigError(
            f"{key} generates with each data-parallel rank's whole model, but actor.backend = '{actor}' splits it "
            "(t, p, c or e); use a plain 'archon:dN' actor or a 'local:' or 'sglang:' rollout server"
        )
    if rollout.parallel.dp_size != p.dp_size:
        raise ConfigError(
            f"{key} runs one engine in each of the actor's ranks, so its d must equal the actor's: write "
            f"'inprocess:d{p.dp_size}' for actor.backend = '{actor}'"
        )
    if cfg.rollout.colocate:
        raise ConfigError(
            f"rollout.colocate = true places rollout servers on the training GPUs, but {key} starts no server (it "
            "already generates on the training GPUs); set rollout.colocate = false"
        )
    if cfg.rollout.server_addrs:
        raise ConfigError(
            f"rollout.server_addrs lists servers, but {key} generates inside the trainer and uses none; leave "
            "rollout.server_addrs empty or choose a server backend"
        )
    if cfg.rollout.max_head_offpolicyness > 0:
        raise ConfigError(
            f"rollout.max_head_offpolicyness = {cfg.rollout.max_head_offpolicyness} (from "
            f"{where('rollout.max_head_offpolicyness')}) asks rollouts to run ahead of training, but {key} generates "
            "on the weights being trained, between steps; set rollout.max_head_offpolicyness = 0 or use a server "
            "backend"
        )
