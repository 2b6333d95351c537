"""Supervised fine-tuning data: jsonl rows of ``{"prompt", "completion"}``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from archon.data.encoding import PROMPT_PLACEHOLDER, apply_prompt_template, encode_prompt, encode_text
from archon.data.jsonl import load_jsonl
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


class SFTDataset:
    """Tokenised prompt/completion pairs with a loss mask on the completion.

    Sequences longer than ``max_length`` are dropped (``truncation='drop'``) or cut to
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
            rows = load_jsonl(rows)
        if not rows:
            raise DataError(
                f'{source} has no rows; write one JSON object per line, e.g. {{"prompt": "1 + 1 =", "completion": "2"}}'
            )
        self.samples: list[dict[str, list[int]]] = []
        self.n_dropped = 0
        self.n_truncated = 0
        for i, row in enumerate(rows):
            where = f"{source} row {i + 1}"
            if not isinstance(row.get("prompt"), str) or not isinstance(row.get("completion"), str):
                raise DataError(f"{where} needs string fields 'prompt' and 'completion' (keys: {sorted(row)})")
            prompt = apply_prompt_template(row["prompt"], prompt_template)
            prompt_ids = encode_prompt(
                tokenizer, prompt, system_prompt=system_prompt, use_chat_template=use_chat_template
            )
            sample = build_sft_sample(prompt_ids, encode_text(tokenizer, row["completion"]), eos)
            if max_length is not None and len(sample["input_ids"]) > max_length:
                if truncation == "drop" or len(prompt_ids) >= max_length:
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
