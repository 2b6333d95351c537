"""Datasets, samplers and batching for RL prompts and SFT."""

from archon.data.collate import collate
from archon.data.encoding import apply_prompt_template, encode_messages, encode_prompt, encode_text, has_chat_template
from archon.data.jsonl import load_jsonl
from archon.data.rl_dataset import PromptLoader, PromptSample, RLPromptDataset, gsm8k_reference
from archon.data.sampler import EpochSampler, epoch_order, repeat_for_group
from archon.data.sft_dataset import SFTDataset, build_chat_sft_sample, build_sft_sample
from archon.data.sources import load_rows

__all__ = [
    "EpochSampler",
    "PromptLoader",
    "PromptSample",
    "RLPromptDataset",
    "SFTDataset",
    "apply_prompt_template",
    "build_chat_sft_sample",
    "build_sft_sample",
    "collate",
    "encode_messages",
    "encode_prompt",
    "encode_text",
    "epoch_order",
    "gsm8k_reference",
    "has_chat_template",
    "load_jsonl",
    "load_rows",
    "repeat_for_group",
]
