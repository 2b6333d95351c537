"""Prompts for RL: rows of ``{"prompt", "answer"}``, GSM8K's ``{"question", "answer"}``, chat rows
``{"messages", "tools" (optional), "answer"}`` (multi-turn agents start from the messages and tools), verl's
``{"prompt": [messages], "reward_model": {"ground_truth"}}`` (DAPO-Math-17k), or any fields named in the config."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archon.data.encoding import PROMPT_PLACEHOLDER, apply_prompt_template, encode_messages, encode_prompt
from archon.data.fields import ANSWER_KEYS, MESSAGES_KEYS, PROMPT_KEYS, find_field, keys_for, missing_field
from archon.data.sampler import EpochSampler, repeat_for_group
from archon.data.sources import load_rows
from archon.errors import DataError

logger = logging.getLogger(__name__)

COMPLETION_IDS = "completion_ids"
"""The keyword under which reward functions get a completion's token ids (TRL's name); no data field may use it."""
RESERVED_FIELDS = ("prompt", "completion", "answer", COMPLETION_IDS)
"""Names reward functions get as arguments; a row may hold them only as the fields its prompt and answer come from."""


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


def _check_extra(extra: dict[str, Any], where: str) -> None:
    for name in RESERVED_FIELDS:
        if name in extra:
            raise DataError(
                f"{where} has a '{name}' field besides the fields it was read from, a name the trainer passes to "
                "reward functions (the prompt, the generated text or token ids, the reference answer); rename the "
                "field or name it in train_dataset.prompt_key / answer_key"
            )


def _answer(row: dict[str, Any], where: str, answer_key: str) -> tuple[str, str]:
    """The row's reference answer (as text) and the field it came from."""
    found = find_field(row, keys_for(answer_key, ANSWER_KEYS))
    if found is None:
        missing = f"no '{answer_key}'" if answer_key else "no 'answer' (nor verl's 'reward_model.ground_truth')"
        raise missing_field(
            where, missing, row, "answer_key", "; every RL prompt needs a reference answer for the reward"
        )
    return str(found[1]), found[0]


def _check_messages(messages: Any, tools: Any, where: str, key: str) -> list[dict[str, Any]]:
    if not messages or not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DataError(f'{where}: \'{key}\' must be a non-empty list of {{"role": ..., "content": ...}} objects')
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: 'tools' must be a list of JSON schema objects (the chat template's tools)")
    return messages


@dataclass(frozen=True)
class PromptRow:
    """What one data row holds for RL, whichever fields it was read from."""

    text: str
    """The prompt text (a chat row: its last user message's text)."""
    answer: str
    """The reference answer as written."""
    extra: dict[str, Any]
    """The other fields (a chat row's messages under 'messages', whatever field they came from)."""
    messages: list[dict[str, Any]] | None = None
    """The chat to render with the chat template; None for a text prompt."""
    tools: list[dict[str, Any]] | None = None
    """The tools the chat template shows (a chat row's 'tools' field)."""


def _prompt_or_chat(row: dict[str, Any], where: str, prompt_key: str, messages_key: str) -> tuple[str, Any, bool]:
    """The field the prompt is read from, its value, and whether it is a chat (a list of messages)."""
    chat = find_field(row, keys_for(messages_key, MESSAGES_KEYS))
    if chat is not None:
        return chat[0], chat[1], True
    prompt = find_field(row, keys_for(prompt_key, PROMPT_KEYS))
    if prompt is None:
        missing = f"no '{prompt_key}'" if prompt_key else "neither 'prompt' nor 'question'"
        raise missing_field(
            where,
            missing,
            row,
            "prompt_key",
            '; RL rows look like {"prompt": ..., "answer": ...}, GSM8K\'s {"question": ..., "answer": ...} or '
            'chat rows {"messages": [...], "answer": ...}',
        )
    # verl's RL layout (DAPO-Math-17k) keeps the chat messages in 'prompt'.
    return prompt[0], prompt[1], isinstance(prompt[1], list)


def read_prompt_row(
    row: dict[str, Any], where: str, *, prompt_key: str = "", answer_key: str = "", messages_key: str = ""
) -> PromptRow:
    """A row's prompt (text, or chat messages: a ``messages`` field, or a prompt field holding a list of messages
    as verl's layout has), its answer and other fields; ``DataError`` naming the row's fields if one is missing."""
    key, value, is_chat = _prompt_or_chat(row, where, prompt_key, messages_key)
    answer, answer_field = _answer(row, where, answer_key)
    extra = {k: v for k, v in row.items() if k not in (key, answer_field)}
    _check_extra(extra, where)
    if not is_chat:
        if not isinstance(value, str):
            raise DataError(f"{where}: '{key}' must be a string, got {type(value).__name__}")
        return PromptRow(value, answer, extra)
    tools = row.get("tools")
    messages = _check_messages(value, tools, where, key)
    extra["messages"] = messages  # agents start their episodes from it (archon.rl.agent sample_fields)
    users = [m.get("content") for m in messages if m["role"] == "user"]
    text = users[-1] if users and isinstance(users[-1], str) else ""
    return PromptRow(text, answer, extra, messages, tools)


class RLPromptDataset:
    """Tokenised RL prompts; rows whose prompt is longer than ``max_prompt_length`` are dropped.

    ``rows`` is a list of dicts or a path ``load_rows`` reads (``split`` and ``subset`` pick the part of a
    dataset folder).  ``prompt_key``, ``answer_key`` and ``messages_key`` name the fields (dotted for nested
    ones); empty means the usual names (``fields.PROMPT_KEYS`` ...).  A text prompt is wrapped in the chat
    template when ``use_chat_template`` is true (None: when the tokenizer has one); chat rows are always
    rendered by the template, with the generation prompt.
    """

    def __init__(
        self,
        rows: list[dict[str, Any]] | str | Path,
        tokenizer: Any,
        *,
        prompt_template: str = PROMPT_PLACEHOLDER,
        system_prompt: str | None = None,
        use_chat_template: bool | None = None,
        max_prompt_length: int | None = None,
        prompt_key: str = "",
        answer_key: str = "",
        messages_key: str = "",
        split: str = "train",
        subset: str | None = None,
    ):
        source = str(rows) if isinstance(rows, (str, Path)) else "the given rows"
        if isinstance(rows, (str, Path)):
            rows = load_rows(rows, split=split, subset=subset)
        if not rows:
            raise DataError(
                f'{source} has no rows; write one JSON object per line, e.g. {{"prompt": "1 + 1 =", "answer": "2"}}'
            )
        self.samples: list[PromptSample] = []
        self.n_dropped = 0
        keys = dict(prompt_key=prompt_key, answer_key=answer_key, messages_key=messages_key)
        for i, row in enumerate(rows):
            where = f"{source} row {i + 1}"
            parsed = read_prompt_row(row, where, **keys)
            if parsed.messages is not None:
                if prompt_template != PROMPT_PLACEHOLDER or system_prompt:
                    raise DataError(
                        f"{where} is a chat row (messages), which is rendered as is by the chat template; unset "
                        "prompt_template and system_prompt, or write prompt rows"
                    )
                prompt = parsed.text
                ids = encode_messages(tokenizer, parsed.messages, tools=parsed.tools)
            else:
                prompt = apply_prompt_template(parsed.text, prompt_template)
                ids = encode_prompt(tokenizer, prompt, system_prompt=system_prompt, use_chat_template=use_chat_template)
            if max_prompt_length is not None and len(ids) > max_prompt_length:
                self.n_dropped += 1
                continue
            self.samples.append(
                PromptSample(i, ids, prompt, gsm8k_reference(parsed.answer), parsed.answer, parsed.extra)
            )
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
