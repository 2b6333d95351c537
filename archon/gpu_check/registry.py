"""Every check, in the order a run makes them: cheap and independent first, servers last.

Budgets are seconds on the device the row runs on (a cold ``torch.compile`` of the tiny models
and a server start dominate); ``--budget-scale`` stretches them on slow machines.
"""

from __future__ import annotations

from archon.gpu_check import environment, kernels, memory, servers, training
from archon.gpu_check.table import Check

CHECKS: list[Check] = [
    Check("environment", environment.check_environment, False, 60, "versions; torch computes on the device"),
    Check("cuda_environment", environment.check_cuda_environment, True, 60, "NCCL, varlen API, grouped GEMM, sm"),
    Check("packed_attention", kernels.check_packed_attention, False, 60, "packed rows vs per-sequence attention"),
    Check("varlen_attention", kernels.check_varlen_attention, True, 60, "bf16 varlen kernel vs reference"),
    Check("experts_loop", kernels.check_experts_loop, False, 60, "per-expert loop vs float64 SwiGLU"),
    Check("grouped_gemm", kernels.check_grouped_gemm, True, 60, "grouped GEMM vs float64 SwiGLU"),
    Check("train_dense", training.check_train_dense, False, 120, "d1 steps vs plain model and CPU fp32"),
    Check("train_moe", training.check_train_moe, False, 120, "d1 MoE steps vs plain model and CPU fp32"),
    Check("activation_checkpointing", training.check_activation_checkpointing, False, 180, "AC modes vs no AC"),
    Check("compile_dense", training.check_compile_dense, True, 240, "torch.compile (+AC budget) vs eager"),
    Check("compile_moe", training.check_compile_moe, True, 240, "torch.compile MoE vs eager"),
    Check("host_syncs", training.check_host_syncs, True, 120, "synchronizing CUDA calls per train step"),
    Check("memory_estimate", memory.check_memory_estimate, True, 180, "plan estimate vs max_memory_reserved"),
    Check("offload", memory.check_offload, True, 180, "FSDP2 CPU offload: host params, less GPU memory"),
    Check("dcp_roundtrip", memory.check_dcp_roundtrip, False, 120, "save, load into a fresh engine, continue"),
    Check("server_local", servers.check_server_local, False, 240, "built-in server: launch, weight sync, logprobs"),
    Check("server_sglang", servers.check_server_sglang, True, 360, "SGLang: launch, disk weight sync, logprobs"),
    Check("server_vllm", servers.check_server_vllm, True, 360, "vLLM: launch, disk weight sync, logprobs"),
]
