"""Activation checkpointing of transformer blocks: none, full, selective (layer or op), memory budget.

* ``full``: every block recomputes its forward in backward.
* ``selective`` with an integer N: every Nth block is checkpointed (layer-level).
* ``selective`` with ``op``: inside every block, outputs of matmuls, attention (SDPA's kernels
  and, on CUDA, the packed varlen op) and context parallel's all-to-alls are saved and
  everything cheap (norms, activations, RoPE, casts) is recomputed.  Keeping all matmul
  outputs costs more memory than torchtitan's "every other mm" rule but never re-runs a
  matmul (or a collective), which matters most on small models and CPUs.
* ``memory_budget``: torch.compile's min-cut partitioner picks what to save so activations
  stay within a fraction of the no-recompute memory; it only exists under compile.

``debug`` logs, per checkpointed block, which ops were saved and which recomputed.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

try:  # registers torch.ops.torch_attn._varlen_attn, the op packed CUDA attention calls
    import torch.nn.attention.varlen  # noqa: F401
except ImportError:  # a torch without varlen attention: nothing to save
    pass

from parallel.errors import ParallelConfigError

logger = logging.getLogger("archon.parallel.ac")

AC_MODES = ("none", "full", "selective", "memory_budget")


def _find_varlen_op() -> Any:
    """``torch.ops.torch_attn._varlen_attn.default`` (registered by importing ``torch.nn.attention.varlen``)."""
    namespace = getattr(torch.ops, "torch_attn", None)
    op = getattr(namespace, "_varlen_attn", None) if namespace is not None else None
    return op.default if op is not None else None


_VARLEN_OP = _find_varlen_op()


def save_list() -> set:
    """Ops whose outputs op-level selective AC saves: matmuls, every attention kernel, CP's all-to-all."""
    ops = {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    for name in (
        "_grouped_mm",
        "_scaled_dot_product_cudnn_attention",
        # The kernels behind packed (varlen) attention when called directly rather than through the op below.
        "_flash_attention_forward",
        "_cudnn_attention_forward",
    ):
        if hasattr(torch.ops.aten, name):
            ops.add(getattr(torch.ops.aten, name).default)
    # Packed CUDA attention (models/common/attention.py) calls torch.nn.attention.varlen.varlen_attn, a
    # custom op: SAC sees it and not the FlashAttention kernel inside, so it is saved by this name
    # (as torchtitan does); otherwise every backward would run the attention forward again.
    if _VARLEN_OP is not None:
        ops.add(_VARLEN_OP)
    # Context parallel's all-to-alls: recomputing them would repeat the communication in backward.
    ops.add(torch.ops._c10d_functional.all_to_all_single.default)
    return ops


class _Recorder:
    """Counts what a checkpoint policy decided, and logs it once per block."""

    def __init__(self, name: str):
        self.name = name
        self.saved: Counter = Counter()
        self.recomputed: Counter = Counter()
        self.logged = False

    def note(self, op, policy: CheckpointPolicy) -> None:
        target = self.saved if policy == CheckpointPolicy.MUST_SAVE else self.recomputed
        target[str(op).split(".")[1] if "." in str(op) else str(op)] += 1

    def log(self) -> None:
        if not self.logged and (self.saved or self.recomputed):
            logger.info("AC %s: saved %s; recomputed %s", self.name, dict(self.saved), dict(self.recomputed))
            self.logged = True


def _ignore_fsdp_unshard_ops() -> None:
    # An FSDP unit nested inside a checkpointed block (the experts under expert parallel)
    # may gather its parameters in recompute but not in forward, or the other way round: under
    # pipeline parallel they stay unsharded between microbatches, so whether the unit gathers
    # depends on what ran before.  SAC matches ops between forward and recompute by count, so
    # skip the ops of a gather (and the profiler ranges around it).  The save list never holds
    # them, so they would be recomputed anyway.
    ops = {
        torch.ops.profiler._record_function_enter_new.default,
        torch.ops.profiler._record_function_exit._RecordFunction,
        torch.ops.aten.copy_.default,
    }
    for name in ("all_gather_copy_in", "split_with_sizes_copy"):
        if hasattr(torch.ops.fsdp, name):
            ops.add(getattr(torch.ops.fsdp, name).default)
    for name in ("_allgather_base_", "allgather_into_tensor_coalesced", "allgather_"):
        if hasattr(torch.ops.c10d, name):
            ops.add(getattr(torch.ops.c10d, name).default)
    SAC_IGNORED_OPS.update(ops)


def _context_fn(save_ops: set, recorder: _Recorder | None):
    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        decision = CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE
        if recorder is not None and not ctx.is_recompute:
            recorder.note(op, decision)
        return decision

    def make():
        if recorder is not None:
            recorder.log()
        return create_selective_checkpoint_contexts(policy)

    return make


def _wrap(block: nn.Module, name: str, save_ops: set | None, preserve_rng_state: bool, debug: bool) -> nn.Module:
    recorder = _Recorder(name) if debug else None
    kwargs: dict[str, Any] = dict(preserve_rng_state=preserve_rng_state)
    if save_ops is not None or debug:
        _ignore_fsdp_unshard_ops()
        kwargs["context_fn"] = _context_fn(save_ops or set(), recorder)
    return checkpoint_wrapper(block, **kwargs)


def apply_ac(
    blocks: nn.ModuleDict,
    ac_mode: str,
    selective_ac_option: str = "op",
    ac_memory_budget: float = 0.5,
    *,
    compile_enabled: bool = False,
    preserve_rng_state: bool = False,
    debug: bool = False,
) -> None:
    """Wrap the blocks of ``blocks`` (a ModuleDict of transformer blocks) in place."""
    if ac_mode not in AC_MODES:
        raise ParallelConfigError(f"ac_mode '{ac_mode}' must be one of {', '.join(AC_MODES)}")
    if ac_mode == "none":
        return
    if ac_mode == "memory_budget":
        if not compile_enabled:
            raise ParallelConfigError(
                "ac_mode = 'memory_budget' needs torch.compile; set archon.enable_compile = true "
                "or choose ac_mode 'selective' or 'full'"
            )
        if not 0.0 <= ac_memory_budget <= 1.0:
            raise ParallelConfigError(f"ac_memory_budget = {ac_memory_budget} must be between 0.0 and 1.0")
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = ac_memory_budget
        if debug:
            logger.info("AC memory_budget=%s: the compile partitioner chooses what to recompute", ac_memory_budget)
        return
    every = 1
    save_ops = None
    if ac_mode == "selective":
        if selective_ac_option == "op":
            save_ops = save_list()
        elif selective_ac_option.isdigit() and int(selective_ac_option) >= 1:
            every = int(selective_ac_option)
        else:
            raise ParallelConfigError(f"selective_ac_option '{selective_ac_option}' must be 'op' or a positive integer")
    for i, (name, block) in enumerate(list(blocks.items())):
        if i % every == 0:
            blocks[name] = _wrap(block, f"block {name}", save_ops, preserve_rng_state, debug)
    if debug:
        wrapped = [n for i, n in enumerate(blocks) if i % every == 0]
        logger.info(
            "AC %s%s: checkpointed blocks %s",
            ac_mode,
            f" ({selective_ac_option})" if ac_mode == "selective" else "",
            wrapped,
        )
