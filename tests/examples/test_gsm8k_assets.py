"""The examples' tiny GSM8K (``archon.demos.gsm8k``): rows with GSM8K's shape whose arithmetic is right, scored by
the math reward as they come, a tokenizer that round-trips them, and chat rows read back from the hub layout."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from archon.config.dataset import DatasetConfig
from archon.data.from_config import build_rl_dataset
from archon.demos.gsm8k import IM_END, TinyGsm8k, build_tokenizer, chat_rows, main, make_rows, write_gsm8k_folder
from archon.rl.rewards import math_reward

CALCULATOR = re.compile(r"<<([0-9+\-*/ ]+)=(\d+)>>")


@pytest.fixture(scope="module")
def rows() -> dict[str, list[dict[str, str]]]:
    return make_rows(TinyGsm8k())


def test_rows_have_gsm8k_shape_and_right_arithmetic(rows) -> None:
    assert len(rows["train"]) == 64 and len(rows["test"]) == 16
    assert not {r["question"] for r in rows["train"]} & {r["question"] for r in rows["test"]}
    for row in rows["train"] + rows["test"]:
        assert set(row) == {"question", "answer"}
        notes = CALCULATOR.findall(row["answer"])
        assert notes, row
        for expression, value in notes:
            assert eval(expression) == int(value), row  # noqa: S307 - digits and + - * / only (the regex)
        final = row["answer"].rsplit("\n#### ", 1)[1]
        assert final == notes[-1][1] and int(final) >= 0, row
    assert make_rows(TinyGsm8k()) == rows  # a function of the seed
    assert make_rows(TinyGsm8k(seed=1)) != rows


def test_the_math_reward_scores_the_rows_as_they_come(rows) -> None:
    for row in rows["test"]:
        final = int(row["answer"].rsplit("#### ", 1)[1])
        assert math_reward(row["question"], row["answer"], row["answer"]) == 1.0
        assert math_reward(row["question"], f"so it is {final}", row["answer"]) == 1.0
        assert math_reward(row["question"], f"#### {final + 1}", row["answer"]) == 0.0


def test_the_tokenizer_round_trips_the_rows_and_renders_chatml(rows) -> None:
    tok = build_tokenizer()
    for row in rows["train"]:
        for text in row.values():
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert len(ids) == len(text) and tok.unk_token_id not in ids  # one token per character
            assert tok.decode(ids) == text
    chat = chat_rows(rows["train"][:1])[0]["messages"]
    rendered = tok.apply_chat_template(chat, tokenize=False)
    assert (
        rendered
        == f"<|im_start|>user\n{chat[0]['content']}{IM_END}\n<|im_start|>assistant\n{chat[1]['content']}{IM_END}\n"
    )
    assert tok.eos_token == IM_END and tok.bos_token is None


def test_the_hub_layout_reads_back_by_subset_and_split_and_becomes_chat_rows(rows, tmp_path: Path) -> None:
    folder = tmp_path / "gsm8k"
    write_gsm8k_folder(folder, rows)
    tok = build_tokenizer()
    for split in ("train", "test"):
        ds = build_rl_dataset(DatasetConfig(path=str(folder), subset="main", split=split, max_length=512), tok)
        assert [s.prompt for s in ds.samples] == [r["question"] for r in rows[split]]
        assert [s.answer for s in ds.samples] == [r["answer"].rsplit("#### ", 1)[1] for r in rows[split]]
    out = tmp_path / "chat.jsonl"
    assert main(["chat-rows", str(folder), str(out), "--split", "test"]) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == chat_rows(rows["test"])
