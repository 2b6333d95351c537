"""The ``train_dataset`` config section: where a run's data is, which fields hold what, and whether text prompts go
through the tokenizer's chat template (``archon.data.from_config`` builds the datasets from it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DatasetConfig:
    path: str = ""
    """A .jsonl, .json or .parquet file, a `save_to_disk` folder or a downloaded Hugging Face dataset folder (RL:
    prompt/answer rows, GSM8K's question/answer, chat messages, verl's prompt/reward_model; SFT: prompt/completion
    or chat messages)."""
    split: str = "train"
    """Split of a dataset folder with several (a single file is one split)."""
    subset: str = ""
    """Configuration of a hub dataset folder with several (GSM8K: 'main' or 'socratic'); empty: its only one."""
    prompt_key: str = ""
    """Field holding the prompt (dotted for a nested one); empty: 'prompt', else GSM8K's 'question'."""
    answer_key: str = ""
    """RL: field holding the reference answer; empty: 'answer', else verl's 'reward_model.ground_truth'."""
    completion_key: str = ""
    """SFT: field holding the completion; empty: 'completion'."""
    messages_key: str = ""
    """Field holding a chat (a list of role/content messages); empty: 'messages' (RL also takes a prompt field
    holding a list of messages, as verl's layout has)."""
    apply_chat_template: bool = False
    """Wrap text prompts in the tokenizer's chat template as a user message (chat or instruct models); false
    tokenises them as written (base models). Chat rows are always rendered by the template."""
    batch_size: int = 8
    """Prompts (RL) or sequences (SFT) per step, over all ranks."""
    shuffle: bool = True
    """Shuffle every epoch with a seed that depends only on `seed` and the epoch."""
    max_length: int = 1024
    """RL: longest prompt kept (longer ones are dropped and counted); SFT: longest sequence."""
    drop_last: bool = True
    """Drop the incomplete last batch of an epoch."""
