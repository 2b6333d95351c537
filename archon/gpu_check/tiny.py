"""Tiny models, batches and ``archon:d1`` engines shared by the engine-level checks.

Models are built from a config.json alone (``model_config``, no weights): an engine then
initialises them from its seed the same way on every device, so a CUDA run and a CPU run of
one config start from the same weights.  Dense is Qwen3 with 2 layers and hidden 64; MoE is
Qwen3-MoE of the same shape with 8 experts, top-2; ``serve`` is a small Qwen3 that SGLang and
vLLM accept; ``mid`` is a 170M Qwen3 for memory checks.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from archon.config import ArchonEngineConfig, MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from archon.engine import TrainEngine, build_engine
from archon.engine.dist import init_distributed
from archon.gpu_check.table import Context

VOCAB = 128
_SMALL: dict[str, Any] = dict(
    model_type="qwen3",
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
MODELS: dict[str, dict[str, Any]] = {
    "dense": _SMALL,
    "moe": dict(
        _SMALL,
        model_type="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    # For SGLang and vLLM servers: head_dim 64, which every attention backend of theirs takes.
    "serve": dict(_SMALL, vocab_size=512, hidden_size=256, intermediate_size=512, head_dim=64),
    # ~170M parameters (2 GiB of float32 states with AdamW): large enough that the memory
    # estimate's terms, not allocator slack, decide the peak.  CUDA checks only.
    "mid": dict(
        _SMALL,
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
    ),
}


def write_model_config(folder: str | Path, fields: dict[str, Any]) -> Path:
    """Write ``config.json`` of a transformers config with ``fields`` (``model_type`` among them) into ``folder``."""
    from transformers import AutoConfig

    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    folder = Path(folder)
    config.save_pretrained(folder)
    return folder


def model_folder(ctx: Context, kind: str) -> str:
    """A folder holding the config.json of ``MODELS[kind]`` (written once per run)."""
    key = f"model_config:{kind}"
    if key not in ctx.cache:
        ctx.cache[key] = str(write_model_config(ctx.workdir / "models" / kind, MODELS[kind]))
    return ctx.cache[key]


def make_batch(
    step: int, n: int = 6, vocab: int = VOCAB, min_len: int = 5, max_len: int = 17
) -> dict[str, torch.Tensor]:
    """``n`` right-padded random sequences (deterministic in ``step``); the loss covers each one's second half.
    The engine tests train on the same batches."""
    g = torch.Generator().manual_seed(1000 + step)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    width = max(lens)
    ids = torch.zeros(n, width, dtype=torch.long)
    attn = torch.zeros(n, width, dtype=torch.long)
    loss_mask = torch.zeros(n, width, dtype=torch.float32)
    for b, length in enumerate(lens):
        ids[b, :length] = torch.randint(1, vocab, (length,), generator=g)
        attn[b, :length] = 1
        loss_mask[b, length // 2 : length] = 1.0
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}


def sft_loss(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]):
    """Token-mean negative log-likelihood of the microbatch's loss tokens."""
    mask = mb["loss_mask"]
    return -(outputs["logprobs"] * mask).sum() / mask.sum(), {}


def sft_weight(mb: dict[str, torch.Tensor]) -> float:
    return float(mb["loss_mask"].sum())


def engine_config(folder: str, dtype: str = "float32", **overrides: Any) -> TrainEngineConfig:
    """An ``archon:d1`` engine config for the model at ``folder``; ``archon`` / ``mb_spec`` / ``optimizer``
    overrides are dicts of fields, the rest are ``TrainEngineConfig`` fields."""
    archon = replace(ArchonEngineConfig(enable_compile=False), **overrides.pop("archon", {}))
    # A small learning rate keeps low-precision runs near the float32 one for a few steps.
    optimizer = replace(
        OptimizerConfig(lr=1e-3, warmup_steps=1, weight_decay=0.0, max_grad_norm=1.0), **overrides.pop("optimizer", {})
    )
    mb_spec = replace(MicroBatchSpec(n_mbs=1), **overrides.pop("mb_spec", {}))
    return TrainEngineConfig(
        backend="archon:d1",
        model_config=folder,
        dtype=dtype,  # pyright: ignore[reportArgumentType]  (a Literal of dtype names)
        archon=archon,
        optimizer=optimizer,
        mb_spec=mb_spec,
        **overrides,
    )


def new_engine(
    ctx: Context, config: TrainEngineConfig, device: str, total_steps: int = 3, seed: int = 1
) -> TrainEngine:
    """An initialised engine on ``device`` ('cpu' or 'cuda'); the process group matches the run's device."""
    # Joined once with the run's device (NCCL next to gloo on a GPU run), so CPU engines work there too.
    init_distributed(ctx.device.type)
    return build_engine(config, device=device, total_steps=total_steps, seed=seed).initialize()


def train(engine: TrainEngine, steps: int, first: int = 0) -> list[dict[str, float]]:
    """Stats of ``steps`` SFT steps on ``make_batch(first), make_batch(first + 1), ...``."""
    return [engine.train_batch(make_batch(first + s), sft_loss, sft_weight) for s in range(steps)]


def relative_gap(got: list[float], ref: list[float]) -> float:
    """``max_i |got_i - ref_i| / |ref_i|``."""
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref))
