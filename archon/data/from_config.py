"""The datasets a run's ``train_dataset`` config describes, and the sentence that says how prompts are formatted."""

from __future__ import annotations

from typing import Any

from archon.config.dataset import DatasetConfig
from archon.data.encoding import has_chat_template
from archon.data.rl_dataset import RLPromptDataset
from archon.data.sft_dataset import SFTDataset
from archon.errors import DataError


def _check_chat_template(ds: DatasetConfig, tokenizer: Any) -> None:
    if ds.apply_chat_template and not has_chat_template(tokenizer):
        raise DataError(
            "train_dataset.apply_chat_template = true but the tokenizer of actor.path has no chat_template; set it "
            "to false (text prompts as written) or use a model folder whose tokenizer_config.json defines one"
        )


def describe_chat_template(ds: DatasetConfig, tokenizer: Any) -> str:
    """What happens to text prompts and chat rows, for the log at start."""
    if ds.apply_chat_template:
        text = "text prompts are wrapped in the tokenizer's chat template (a user message and the generation prompt)"
    elif has_chat_template(tokenizer):
        text = (
            "text prompts are tokenised as written, without the tokenizer's chat template (set it to true for a "
            "chat or instruct model)"
        )
    else:
        text = "text prompts are tokenised as written (the tokenizer has no chat template)"
    return (
        f"train_dataset.apply_chat_template = {str(ds.apply_chat_template).lower()}: {text}; chat rows (messages) "
        "are always rendered by the chat template"
    )


def build_rl_dataset(ds: DatasetConfig, tokenizer: Any) -> RLPromptDataset:
    """The RL prompts of ``ds`` (path, split, field names, chat template option, ``max_length``)."""
    _check_chat_template(ds, tokenizer)
    return RLPromptDataset(
        ds.path,
        tokenizer,
        use_chat_template=ds.apply_chat_template,
        max_prompt_length=ds.max_length,
        prompt_key=ds.prompt_key,
        answer_key=ds.answer_key,
        messages_key=ds.messages_key,
        split=ds.split,
        subset=ds.subset or None,
    )


def build_sft_dataset(ds: DatasetConfig, tokenizer: Any) -> SFTDataset:
    """The SFT samples of ``ds`` (path, split, field names, chat template option, ``max_length``)."""
    _check_chat_template(ds, tokenizer)
    return SFTDataset(
        ds.path,
        tokenizer,
        max_length=ds.max_length,
        use_chat_template=ds.apply_chat_template,
        prompt_key=ds.prompt_key,
        completion_key=ds.completion_key,
        messages_key=ds.messages_key,
        split=ds.split,
        subset=ds.subset or None,
    )
