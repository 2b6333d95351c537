"""Config rules of vLLM rollouts: new weights from disk, and a logprob mode the trainer can match.

vLLM reports ``raw_logprobs`` (``log_softmax`` of the raw logits, before temperature and every
filter) or ``processed_logprobs`` (after temperature and the filters); the trainer recomputes
``log_softmax(logits / T)`` before filtering, so only some sampling settings have a matching mode.
"""

from __future__ import annotations

from archon.config.schema import Config, ConfigError, GenerationConfig

RAW_LOGPROBS = "raw_logprobs"
PROCESSED_LOGPROBS = "processed_logprobs"


def vllm_logprobs_mode(g: GenerationConfig) -> str:
    """The ``--logprobs-mode`` under which vLLM reports what the trainer recomputes for ``g``."""
    if g.temperature == 0 or g.temperature == 1.0 or g.top_k == 1:
        return RAW_LOGPROBS  # T = 1 for the trainer: the raw logprobs are exactly log_softmax(logits)
    filters = [
        f"{name} = {value}"
        for name, value, on in (
            ("gconfig.top_k", g.top_k, g.top_k not in (-1, 0)),
            ("gconfig.top_p", g.top_p, g.top_p < 1.0),
            ("gconfig.min_p", g.min_p, g.min_p > 0.0),
            ("gconfig.min_new_tokens", g.min_new_tokens, g.min_new_tokens > 0),
        )
        if on
    ]
    if filters:
        raise ConfigError(
            f"gconfig.temperature = {g.temperature} with {', '.join(filters)} cannot be trained on with vLLM rollouts: "
            "vLLM reports logprobs either before temperature (raw_logprobs) or after filtering (processed_logprobs), "
            "never log_softmax(logits / T) before filtering as the trainer recomputes them; use temperature 1, drop "
            "the filters, or use sglang rollouts"
        )
    return PROCESSED_LOGPROBS


def check_vllm_config(cfg: Config) -> None:
    """Config check for vllm rollouts: weights from disk (or, colocated on GPUs, from the trainer's tensors), and a
    logprob mode the trainer can match."""
    sync = cfg.rollout.weight_sync
    if sync != "disk" and not (sync == "tensor" and cfg.rollout.colocate):
        raise ConfigError(
            f"rollout.backend = '{cfg.rollout.backend}' gets new weights from disk, or from the trainer's tensors "
            f"when colocated, but rollout.weight_sync = '{sync}'; set rollout.weight_sync = 'disk' "
            "(the run directory must be visible to the servers)"
        )
    if sync == "tensor" and cfg.device == "cpu":
        raise ConfigError(
            "rollout.weight_sync = 'tensor' with vllm rollouts goes through vLLM's CUDA IPC weight transfer, but "
            "device = 'cpu'; set rollout.weight_sync = 'disk'"
        )
    if cfg.actor.moe_routing_replay:
        raise ConfigError(
            f"actor.moe_routing_replay needs the experts each token was routed to, which "
            f"rollout.backend = '{cfg.rollout.backend}' does not report; use an sglang or local "
            "rollout backend, or set actor.moe_routing_replay = false"
        )
    r = cfg.rollout
    if r.max_head_offpolicyness > 0 and r.partial_rollout and r.pause_generation_mode != "abort":
        raise ConfigError(
            f"rollout.pause_generation_mode = '{r.pause_generation_mode}' is SGLang's; vLLM servers pause "
            "by aborting, so set rollout.pause_generation_mode = 'abort' (interrupted requests are sent "
            "again with their tokens so far)"
        )
    vllm_logprobs_mode(cfg.gconfig)
