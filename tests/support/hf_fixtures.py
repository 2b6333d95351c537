"""Tiny Hugging Face models and tokenizers built locally (no hub access), for tests.

    hf_model, config = make_tiny_hf_model("qwen3_moe", tie=True)
    save_tiny_hf(tmp_path / "m", "qwen3", seed=1)          # sharded folder + tokenizer-free
    tok = make_tiny_tokenizer(tmp_path / "m")                # transformers-loadable tokenizer

Every parameter is perturbed (norm weights around 1, biases non-zero, matrices scaled by
1/sqrt(fan_in)) so that a mistake in any of them shows in the logits.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from models.common.decoder import Decoder, TransformerBlock

TINY: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
TINY_PER_TYPE: dict[str, dict[str, Any]] = {
    "qwen2": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # head_dim deliberately != hidden_size / num_attention_heads
    "qwen3": dict(head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3_moe": dict(
        head_dim=24,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
}
MODEL_TYPES = tuple(TINY_PER_TYPE)
"""Archon's built-in model types; any other transformers model type works too (``TINY`` plus overrides)."""


def make_tiny_hf_config(model_type: str, tie: bool = False, **overrides: Any):
    """A tiny transformers config of ``model_type`` (hidden 64, 2 layers, 4 heads, 2 kv heads)."""
    from transformers import AutoConfig

    kwargs = {**TINY, **TINY_PER_TYPE.get(model_type, {}), "tie_word_embeddings": tie, **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


@torch.no_grad()
def perturb_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every parameter random, non-trivial values (in place, deterministic in ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight") or "layernorm" in name:
            value = 1.0 + 0.2 * noise
        elif name.endswith(".bias"):
            value = 0.2 * noise
        elif "embed_tokens" in name:
            value = 0.5 * noise
        else:
            value = noise / math.sqrt(p.shape[-1])
        p.copy_(value.to(p.dtype))
    return model


def make_tiny_hf_model(model_type: str, tie: bool = False, seed: int = 0, **overrides: Any):
    """``(hf_model, config)``: a tiny perturbed ``AutoModelForCausalLM`` in float32, eval mode."""
    from transformers import AutoModelForCausalLM

    config = make_tiny_hf_config(model_type, tie=tie, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_(model, seed)
    return model.eval(), config


def save_tiny_hf(
    folder: str | os.PathLike,
    model_type: str,
    tie: bool = False,
    seed: int = 0,
    max_shard_size: str | int = "40KB",
    **overrides: Any,
):
    """Build a tiny HF model and ``save_pretrained`` it sharded into ``folder``; return ``(hf_model, config)``."""
    model, config = make_tiny_hf_model(model_type, tie=tie, seed=seed, **overrides)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return model, config


def make_tiny_tokenizer(folder: str | os.PathLike | None = None, vocab: list[str] | None = None):
    """A word-level ``PreTrainedTokenizerFast`` with special tokens and a chat template.

    Special tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos).  Unknown
    words map to ``<unk>``.  Saved with ``save_pretrained`` into ``folder`` when given, so
    ``AutoTokenizer.from_pretrained(folder)`` loads it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if vocab is None:
        words = ["user", "assistant", "system", "\n", "+", "=", "?", "what", "is", "the", "answer"]
        words += [str(i) for i in range(100)]
        vocab = words
    tokens = specials + [w for w in vocab if w not in specials]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=chat_template,
    )
    if folder is not None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        hf_tok.save_pretrained(folder)
    return hf_tok


def random_tokens(n: int, seed: int, vocab: int = TINY["vocab_size"]) -> list[int]:
    """``n`` token ids drawn uniformly from the tiny vocabulary (deterministic in ``seed``)."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decoder(model: Any) -> Decoder:
    """``model`` typed as Archon's ``Decoder`` (``load_hf_model``/``build_model`` return a plain ``nn.Module``)."""
    return cast("Decoder", model)


def block_of(model: Any, i: int) -> TransformerBlock:
    """Block ``i`` of an Archon model, typed (``model.layers`` is an ``nn.ModuleDict`` keyed by ``str(i)``)."""
    return cast("TransformerBlock", model.layers[str(i)])
