"""Supervised fine-tuning data: rows of ``{"prompt", "completion"}`` (or fields named in the config), or chat rows
``{"messages"}`` trained on their assistant turns only."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from archon.data.encoding import PROMPT_PLACEHOLDER, apply_prompt_template, encode_messages, encode_prompt, encode_text
from archon.data.fields import COMPLETION_KEYS, MESSAGES_KEYS, PROMPT_KEYS, find_field, keys_for, missing_field
from archon.data.sources import load_rows
from archon.errors import DataError

logger = logging.getLogger(__name__)


def build_sft_sample(prompt_ids: list[int], completion_ids: list[int], eos_token_id: int) -> dict[str, list[int]]:
    """``input_ids = prompt + completion + [eos]`` with ``loss_mask`` 1 on completion and EOS only.

    Token-aligned: ``loss_mask[i] = 1`` means token ``i`` is predicted from tokens ``< i``,
    so the first token is never trained on, even with an empty prompt.
    """
    ids = list(prompt_ids) + list(completion_ids) + [eos_token_id]
    mask = [0] * len(prompt_ids) + [1] * (len(completion_ids) + 1)
    mask[0] = 0
    return {"input_ids": ids, "loss_mask": mask}


def _turn_span(tokenizer: Any, messages: list[dict[str, Any]], k: int, tools: Any, full: list[int]) -> range:
    """The positions in ``full`` (the whole chat's ids) of assistant message ``k``: from where the template's
    generation prompt ends to where the template ends that turn, each found by rendering the chat up to it."""
    before = encode_messages(tokenizer, messages[:k], tools=tools, add_generation_prompt=True)
    through = encode_messages(tokenizer, messages[: k + 1], tools=tools, add_generation_prompt=False)
    if through[: len(before)] != before or full[: len(through)] != through:
        raise DataError(
            f"the chat template renders message {k + 1} (assistant) differently once more messages follow it (it "
            "edits earlier turns, e.g. drops their reasoning), so the tokens it trained on cannot be found; "
            "split the conversation into one row per assistant turn"
        )
    return range(len(before), len(through))


def build_chat_sft_sample(
    tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None
) -> dict[str, list[int]]:
    """A chat rendered by the tokenizer's chat template, ``loss_mask`` 1 exactly on the assistant turns.

    A turn is what the template writes after its generation prompt up to the end of that message, cut after
    the tokenizer's EOS when the turn holds one (the text a template puts after the end-of-turn token, e.g. a
    newline, is never generated).  As in ``build_sft_sample`` the first token is never trained on.
    """
    full = encode_messages(tokenizer, messages, tools=tools, add_generation_prompt=False)
    mask = [0] * len(full)
    eos = getattr(tokenizer, "eos_token_id", None)
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        span = _turn_span(tokenizer, messages, k, tools, full)
        ends = [i for i in span if full[i] == eos]
        for i in range(span.start, ends[-1] + 1 if ends else span.stop):
            mask[i] = 1
    mask[0] = 0
    return {"input_ids": full, "loss_mask": mask}


def _read_sft_row(
    row: dict[str, Any], where: str, prompt_key: str, completion_key: str, messages_key: str
) -> tuple[str, str] | tuple[list[dict[str, Any]], None]:
    """A row's (prompt, completion) texts, or its chat messages and None."""
    chat = find_field(row, keys_for(messages_key, MESSAGES_KEYS))
    if chat is not None:
        messages = chat[1]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise DataError(f'{where}: \'{chat[0]}\' must be a list of {{"role": ..., "content": ...}} objects')
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: '{chat[0]}' has no assistant message, so nothing to train on")
        return messages, None
    prompt = find_field(row, keys_for(prompt_key, PROMPT_KEYS))
    completion = find_field(row, keys_for(completion_key, COMPLETION_KEYS))
    for found, key, defaults, config_key in (
        (prompt, prompt_key, "'prompt' (nor 'question')", "prompt_key"),
        (completion, completion_key, "'completion'", "completion_key"),
    ):
        if found is None:
            missing = f"no '{key}'" if key else f"no {defaults}"
            raise missing_field(
                where,
                missing,
                row,
                config_key,
                '; SFT rows look like {"prompt": ..., "completion": ...} or chat rows {"messages": [...]}',
            )
        if not isinstance(found[1], str):
            raise DataError(f"{where}: '{found[0]}' must be a string, got {type(found[1]).__name__}")
    assert prompt is not None and completion is not None
    return prompt[1], completion[1]


class SFTDataset:
    """Tokenised prompt/completion pairs with a loss mask on the completion, or chats with a loss mask on their
    assistant turns (``build_chat_sft_sample``).

    ``rows`` is a list of dicts or a path ``load_rows`` reads (``split`` and ``subset`` pick the part of a
    dataset folder); ``prompt_key``, ``completion_key`` and ``messages_key`` name the fields (empty: the usual
    names).  Sequences longer than ``max_length`` are dropped (``truncation='drop'``) or cut to
    ``max_length`` (``'truncate'``: the end of the completion and its EOS are lost; a row
    whose prompt leaves no room for a completion token is still dropped).
    """

    def __init__(
        self,
        rows: list[dict[str, Any]] | str | Path,
        tokenizer: Any,
        *,
        max_length: int | None = None,
        truncation: str = "drop",
        prompt_template: str = PROMPT_PLACEHOLDER,
        system_prompt: str | None = None,
        use_chat_template: bool | None = None,
        prompt_key: str = "",
        completion_key: str = "",
        messages_key: str = "",
        split: str = "train",
        subset: str | None = None,
    ):
        if truncation not in ("drop", "truncate"):
            raise DataError(f"truncation = '{truncation}' must be 'drop' or 'truncate'")
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise DataError(
                "the tokenizer has no eos_token; SFT appends EOS to every completion, so set "
                "eos_token in the tokenizer config"
            )
        source = str(rows) if isinstance(rows, (str, Path)) else "the given rows"
        if isinstance(rows, (str, Path)):
            rows = load_rows(rows, split=split, subset=subset)
        if not rows:
            raise DataError(
                f'{source} has no rows; write one JSON object per line, e.g. {{"prompt": "1 + 1 =", "completion": "2"}}'
            )
        self.samples: list[dict[str, list[int]]] = []
        self.n_dropped = 0
        self.n_truncated = 0
        for i, row in enumerate(rows):
            where = f"{source} row {i + 1}"
            text, completion = _read_sft_row(row, where, prompt_key, completion_key, messages_key)
            if completion is None:
                assert isinstance(text, list)
                if prompt_template != PROMPT_PLACEHOLDER or system_prompt:
                    raise DataError(
                        f"{where} is a chat row (messages), which is rendered as is by the chat template; unset "
                        "prompt_template and system_prompt, or write prompt/completion rows"
                    )
                sample = build_chat_sft_sample(tokenizer, text, tools=row.get("tools"))
            else:
                assert isinstance(text, str)
                prompt = apply_prompt_template(text, prompt_template)
                prompt_ids = encode_prompt(
                    tokenizer, prompt, system_prompt=system_prompt, use_chat_template=use_chat_template
                )
                sample = build_sft_sample(prompt_ids, encode_text(tokenizer, completion), eos)
            if max_length is not None and len(sample["input_ids"]) > max_length:
                # Truncation keeps a row only if a trained token is left.
                if truncation == "drop" or not any(sample["loss_mask"][:max_length]):
                    self.n_dropped += 1
                    continue
                sample = {k: v[:max_length] for k, v in sample.items()}
                self.n_truncated += 1
            self.samples.append(sample)
        if self.n_dropped or self.n_truncated:
            logger.warning(
                "SFT data %s: dropped %d and truncated %d of %d rows longer than max_length=%s tokens",
                source,
                self.n_dropped,
                self.n_truncated,
                len(rows),
                max_length,
            )
        if not self.samples:
            raise DataError(
                f"no SFT samples left from {source} (read {len(rows)} rows, dropped {self.n_dropped}); raise max_length"
            )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.samples[i]
