"""Prompts for RL: jsonl rows of ``{"prompt", "answer"}``, GSM8K's ``{"question", "answer"}``, or chat rows
``{"messages", "tools" (optional), "answer"}`` (multi-turn agents start from the messages and tools)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archon.data.encoding import PROMPT_PLACEHOLDER, apply_prompt_template, encode_messages, encode_prompt
from archon.data.jsonl import load_jsonl
from archon.data.sampler import EpochSampler, repeat_for_group
from archon.errors import DataError

logger = logging.getLogger(__name__)

COMPLETION_IDS = "completion_ids"
"""The keyword under which reward functions get a completion's token ids (TRL's name); no data field may use it."""


@dataclass(frozen=True)
class PromptSample:
    """One prompt, tokenised, with its reference answer."""

    index: int
    """Row of the data file (0-based, counting kept and dropped rows)."""
    input_ids: list[int]
    """Prompt token ids (after template and chat template)."""
    prompt: str
    """Prompt text after the prompt template (before the chat template)."""
    answer: str
    """Reference answer: GSM8K's final number after '####', otherwise the row's answer."""
    solution: str
    """The row's full answer text (GSM8K: the worked solution)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other fields of the row, passed to reward functions as keywords."""


def gsm8k_reference(answer: str) -> str:
    """The final answer of a GSM8K solution: the text after the last '####', without commas or '$'."""
    if "####" not in answer:
        return answer.strip()
    return answer.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "").strip()


def _row_fields(row: dict[str, Any], where: str) -> tuple[str, str, dict[str, Any]]:
    if "prompt" in row:
        text_key = "prompt"
    elif "question" in row:
        text_key = "question"
    else:
        raise DataError(
            f"{where} has neither 'prompt' nor 'question' (keys: {sorted(row)}); RL data rows look "
            'like {"prompt": ..., "answer": ...} or GSM8K\'s {"question": ..., "answer": ...}'
        )
    if "answer" not in row:
        raise DataError(f"{where} has no 'answer'; every RL prompt needs a reference answer for the reward")
    text, answer = row[text_key], row["answer"]
    if not isinstance(text, str):
        raise DataError(f"{where}: '{text_key}' must be a string, got {type(text).__name__}")
    extra = {k: v for k, v in row.items() if k not in (text_key, "answer")}
    if COMPLETION_IDS in extra:
        raise DataError(
            f"{where} has a '{COMPLETION_IDS}' field, a name the trainer passes to reward functions (the "
            "generated token ids); rename the field"
        )
    return text, str(answer), extra


def _chat_row(row: dict[str, Any], where: str) -> tuple[str, str, dict[str, Any]]:
    """A chat row's last user text (the sample's ``prompt``), answer, and other fields (``messages`` and ``tools``
    among them, for agents and reward functions)."""
    messages, tools = row["messages"], row.get("tools")
    if not messages or not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DataError(f'{where}: \'messages\' must be a non-empty list of {{"role": ..., "content": ...}} objects')
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: 'tools' must be a list of JSON schema objects (the chat template's tools)")
    if "answer" not in row:
        raise DataError(f"{where} has no 'answer'; every RL prompt needs a reference answer for the reward")
    extra = {k: v for k, v in row.items() if k != "answer"}
    if COMPLETION_IDS in extra:
        raise DataError(f"{where} has a '{COMPLETION_IDS}' field, a name the trainer passes to reward functions")
    users = [m.get("content") for m in messages if m["role"] == "user"]
    return (users[-1] if users and isinstance(users[-1], str) else ""), str(row["answer"]), extra


class RLPromptDataset:
    """Tokenised RL prompts; rows whose prompt is longer than ``max_prompt_length`` are dropped."""

    def __init__(
        self,
        rows: list[dict[str, Any]] | str | Path,
        tokenizer: Any,
        *,
        prompt_template: str = PROMPT_PLACEHOLDER,
        system_prompt: str | None = None,
        use_chat_template: bool | None = None,
        max_prompt_length: int | None = None,
    ):
        source = str(rows) if isinstance(rows, (str, Path)) else "the given rows"
        if isinstance(rows, (str, Path)):
            rows = load_jsonl(rows)
        if not rows:
            raise DataError(
                f'{source} has no rows; write one JSON object per line, e.g. {{"prompt": "1 + 1 =", "answer": "2"}}'
            )
        self.samples: list[PromptSample] = []
        self.n_dropped = 0
        for i, row in enumerate(rows):
            where = f"{source} row {i + 1}"
            if "messages" in row:
                if prompt_template != PROMPT_PLACEHOLDER or system_prompt or use_chat_template is False:
                    raise DataError(
                        f"{where} is a chat row (messages), which is rendered as is by the chat template; unset "
                        "prompt_template, system_prompt and use_chat_template = false, or write prompt rows"
                    )
                prompt, answer, extra = _chat_row(row, where)
                ids = encode_messages(tokenizer, row["messages"], tools=row.get("tools"))
            else:
                text, answer, extra = _row_fields(row, where)
                prompt = apply_prompt_template(text, prompt_template)
                ids = encode_prompt(tokenizer, prompt, system_prompt=system_prompt, use_chat_template=use_chat_template)
            if max_prompt_length is not None and len(ids) > max_prompt_length:
                self.n_dropped += 1
                continue
            self.samples.append(PromptSample(i, ids, prompt, gsm8k_reference(answer), answer, extra))
        if self.n_dropped:
            logger.warning(
                "dropped %d of %d prompts from %s longer than max_prompt_length=%d tokens",
                self.n_dropped,
                len(rows),
                source,
                max_prompt_length,
            )
        if not self.samples:
            raise DataError(
                f"no prompts left from {source} (read {len(rows)} rows, dropped {self.n_dropped} "
                f"longer than max_prompt_length={max_prompt_length}); raise train_dataset.max_length"
            )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> PromptSample:
        return self.samples[i]


class PromptLoader:
    """Global batches of prompts in a seeded order that is resumable and independent of ranks."""

    def __init__(
        self,
        dataset: RLPromptDataset,
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
        group_size: int = 1,
    ):
        self.dataset = dataset
        self.group_size = group_size
        self.sampler = EpochSampler(len(dataset), batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def next_batch(self) -> list[PromptSample]:
        """The next ``batch_size`` prompts (one of each)."""
        return [self.dataset[i] for i in self.sampler.next_batch()]

    def next_rollout_batch(self) -> list[PromptSample]:
        """The next prompts, each repeated ``group_size`` times in a row (one entry per rollout)."""
        return repeat_for_group(self.next_batch(), self.group_size)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
