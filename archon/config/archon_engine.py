"""``<engine>.archon``: the options of Archon's own engine (pipeline schedule, compile, activation checkpointing,
FSDP, MoE balancing, FP8); the ``fsdp:`` engine reads the activation checkpointing, compile, FSDP and determinism
ones too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ArchonEngineConfig:
    pp_schedule: Literal["1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", "GPipe"] = (
        "Interleaved1F1B"
    )
    """Pipeline schedule used when the allocation has p > 1 (the short names I1F1B, IZB and ZBV are accepted)."""
    pp_layers_per_stage: int = 0
    """Transformer blocks per pipeline stage; 0 derives it from the layer count and schedule."""
    enable_compile: bool = True
    """torch.compile each block (after activation checkpointing, before FSDP); unset: on for CUDA, off for CPU."""
    ac_mode: Literal["none", "full", "selective", "memory_budget"] = "selective"
    """Activation checkpointing mode, applied only when `gradient_checkpointing` is true."""
    selective_ac_option: str = "op"
    """For ac_mode=selective: 'op' (save matmul/attention outputs) or an integer N (checkpoint every Nth block)."""
    ac_memory_budget: float = 0.5
    """For ac_mode=memory_budget (needs compile): 0.0 recomputes everything, 1.0 nothing."""
    offload_params: bool = False
    """Keep FSDP-sharded parameters, gradients and optimizer state on the CPU (CPUOffloadPolicy)."""
    reshard_after_forward_policy: Literal["default", "always", "never"] = "default"
    """FSDP resharding after forward: default reshards except with pipeline parallel."""
    use_deterministic_algorithms: bool = False
    """Deterministic kernels, cuBLAS workspace, NCCL Ring and compile; slower, for debugging."""
    ac_debug: bool = False
    """Log which activations are saved and which are recomputed (slow)."""
    dp_replicate: int = 1
    """HSDP: split the allocation's d into dp_replicate replica groups x d/dp_replicate shards."""
    moe_load_balance: Literal["none", "aux_loss", "aux_free"] = "none"
    """MoE load balancing: 'aux_loss' (Switch loss over the global batch) or 'aux_free' (DeepSeek-V3 routing bias)."""
    moe_aux_loss_coef: float = 1e-3
    """aux_loss: weight of each MoE layer's load-balancing loss in the training loss (Megatron's moe_aux_loss_coeff)."""
    moe_bias_update_rate: float = 1e-3
    """aux_free: bias step per optimizer step, +rate for experts below the mean load, -rate above it."""
    moe_router_dtype: Literal["auto", "float32"] = "auto"
    """dtype of the MoE router's gate matmul: 'auto' follows `dtype`; 'float32' keeps it fp32 under bf16."""
    fp8: Literal["", "tensorwise", "rowwise", "rowwise_with_gw_hp"] = ""
    """FP8 training of the linear layers with torchao (fp8 extra): '' off, or a torchao float8 recipe name."""
    fp8_emulate: bool = False
    """Emulate fp8 on a CUDA GPU without FP8 matmuls (SM < 8.9; slow) instead of refusing; CPU always emulates."""
    fp8_forward: bool = False
    """`forward` (logprob recompute, ref and critic values) in fp8 too, with fp8 all-gather/TP; false: in `dtype`."""
    prefix_sharing: bool = False
    """Pack a prompt that several sequences of a microbatch share once (GRPO's samples): same loss and gradients,
    fewer tokens through the model; layouts of d (and dp_replicate) and t, no compile, dense models."""
