"""The memory of a colocated GPU (``rollout.colocate``): a server and a training rank take turns on it.

A colocated GPU peaks in one of two phases, and both must fit the card:

* **generating**: the server's weights and KV cache (its static fraction, ``sglang.mem_fraction_static``), its CUDA
  context, and what the trainer keeps on the GPU meanwhile: its CUDA context, cuBLAS workspaces and NCCL buffers,
  and its parameters and optimizer state unless ``actor.offload`` moved them to CPU (gradients, activations and the
  gathered parameters are gone between steps);
* **training**: the training rank's own peak (``archon.plan.fit.estimate_train_gpu``), plus what the server keeps
  after releasing its memory: its CUDA context only (SGLang's ``release_memory_occupation`` frees weights and KV).

Only what the separate estimates model is counted; SGLang servers only (as ``estimate_server_gpu``).
"""

from __future__ import annotations

import dataclasses

from archon.placement import TRAINING_ENGINES
from archon.plan.memory import CUDA_CONTEXT_BYTES, HELD_TERMS, Estimate, Term

OFFLOADED_TERMS = ("parameters", "optimizer state")
"""Names of the actor's terms ``actor.offload`` moves to CPU while the servers generate."""
PROCESS_RESIDENT_TERMS = ("CUDA context", "cuBLAS workspaces")
"""Names of the per-process terms a process keeps as long as it lives."""


def _split_engine(name: str) -> tuple[str, str]:
    """('actor', 'parameters (...)') from 'actor parameters (...)'; ('', name) for a single engine's term."""
    head, _, rest = name.partition(" ")
    return (head, rest) if head in TRAINING_ENGINES and rest else ("", name)


def trainer_resident_terms(train: Estimate, offload: bool) -> list[Term]:
    """What a training rank keeps on its GPU between steps: states, NCCL buffers, CUDA context, cuBLAS."""
    kept = []
    for term in train.terms:
        engine, base = _split_engine(term.name)
        if not base.startswith(HELD_TERMS + PROCESS_RESIDENT_TERMS):
            continue
        if offload and engine in ("", "actor") and base.startswith(OFFLOADED_TERMS):
            continue  # on the CPU while the servers generate
        kept.append(dataclasses.replace(term, name=f"trainer {term.name}"))
    return kept


def server_context_terms(device_type: str) -> list[Term]:
    """The server process's CUDA context: on the GPU in both phases, outside its static fraction."""
    if device_type != "cuda":
        return []
    return [Term("server CUDA context and kernels", CUDA_CONTEXT_BYTES, "")]


def generating_phase(train: Estimate, server: Estimate, offload: bool, device_type: str) -> Estimate:
    """A colocated GPU while its server generates: the server's static fraction beside the trainer's resident state."""
    resident = trainer_resident_terms(train, offload)
    fix = (
        "set actor.offload = true" if not offload else "lower sglang.mem_fraction_static or raise the t of the servers"
    )
    # The KV cache takes whatever the weights leave of the static fraction: lowering that fraction shrinks it.
    kv_fix = "lower sglang.mem_fraction_static" + ("" if offload else " or set actor.offload = true")
    server_terms = [dataclasses.replace(t, name=f"server {t.name}", fix=t.fix or kv_fix) for t in server.terms]
    terms = server_terms + server_context_terms(device_type) + [dataclasses.replace(t, fix=fix) for t in resident]
    return Estimate(f"colocated GPU, generating ({server.what})", terms)


def training_phase(train: Estimate, device_type: str) -> Estimate:
    """A colocated GPU while its training rank trains: its peak, beside the released server's context."""
    released = Term("server weights and KV cache (released while training)", 0, "")
    return Estimate(
        f"colocated GPU, training ({train.what})", train.terms + server_context_terms(device_type) + [released]
    )
