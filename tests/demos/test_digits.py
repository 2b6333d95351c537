"""The multi-token CPU demo's assets: a character-level tokenizer, disjoint data, the reward, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import models
from archon.data import RLPromptDataset, load_jsonl
from archon.demos.digits import (
    REWARD_FN,
    DigitsTask,
    answer_of,
    digits_reward,
    main,
    make_assets,
    make_rows,
    vocabulary,
)
from archon.demos.first_letter import EOS_TOKEN, PAD_TOKEN, UNK_TOKEN
from archon.rl.rewards import get_reward_fn

TASK = DigitsTask(n_train=64, n_test=16)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("digits") / "assets", TASK)


@pytest.fixture(scope="module")
def tok(assets):
    return AutoTokenizer.from_pretrained(assets.model)


def test_tokenizer_is_one_token_per_character_and_round_trips(assets, tok):
    assert len(tok) == len(vocabulary()) and tok.eos_token_id == vocabulary().index("<eos>")
    for row in load_jsonl(assets.train) + load_jsonl(assets.test):
        ids = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        assert len(ids) == TASK.digits + 1 and tok.unk_token_id not in ids
        assert tok.decode(ids) == row["prompt"]
        answer_ids = tok(row["answer"], add_special_tokens=False)["input_ids"]
        # What the trainer decodes from "answer, EOS" is the answer: several tokens, then EOS.
        assert len(answer_ids) == TASK.digits
        assert tok.decode(answer_ids + [tok.eos_token_id], skip_special_tokens=True) == row["answer"]


def test_rows_are_deterministic_disjoint_and_parse(assets, tok):
    assert make_rows(TASK) == make_rows(TASK) != make_rows(DigitsTask(n_train=64, n_test=16, seed=1))
    train = RLPromptDataset(assets.train, tok)
    assert len(train) == TASK.n_train
    assert all(s.answer == answer_of(s.prompt) for s in train.samples)
    assert not {r["prompt"] for r in load_jsonl(assets.test)} & {s.prompt for s in train.samples}
    with pytest.raises(ValueError, match="not a digits-demo prompt"):
        answer_of("12+3=")
    with pytest.raises(ValueError, match="between 1 and 8"):
        DigitsTask(digits=0)


def test_reward_on_hand_written_cases(tok):
    reward = get_reward_fn(REWARD_FN)
    assert reward is digits_reward

    def score(*tokens: str) -> float:
        ids = tok.convert_tokens_to_ids(list(tokens))
        return reward("471=", tok.decode(ids, skip_special_tokens=True), "471", completion_ids=ids)

    assert score("4", "7", "1", EOS_TOKEN) == 1.0
    assert score("4", "7", EOS_TOKEN) == pytest.approx(0.5 * 2 / 3)  # stopped too early
    assert score("4", "7", "1", "0") == 0.5  # all digits, but did not stop (cut one token later)
    assert score("1", "7", "0", EOS_TOKEN) == pytest.approx(1 / 3)  # only the 7 is in place
    assert score(EOS_TOKEN) == 0.0
    # Special tokens other than EOS vanish from the text ("471"), not from the ids: no credit for them.
    assert score("4", "7", "1", PAD_TOKEN) == 0.5
    assert score("4", "7", UNK_TOKEN, "1") == pytest.approx(0.5 * 2 / 3)


def test_model_loads_in_transformers_and_archon_with_equal_logits(assets, tok):
    hf = AutoModelForCausalLM.from_pretrained(assets.model).eval()
    config = json.loads((assets.model / "config.json").read_text())
    assert config["vocab_size"] == len(tok) and config["eos_token_id"] == tok.eos_token_id
    ours = models.load_hf_model(assets.model)
    tokens = torch.tensor([tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in load_jsonl(assets.test)])
    with torch.no_grad():
        ref, got = hf(tokens).logits, ours(tokens)
    assert ref.std() > 0.05 and (got - ref).abs().max().item() < 1e-5


def test_cli_writes_the_assets(tmp_path, capsys):
    assert main(["make-assets", str(tmp_path / "out"), "--digits", "2"]) == 0
    assert "repeat the number" in capsys.readouterr().out
    rows = load_jsonl(tmp_path / "out" / "data" / "train.jsonl")
    assert len(rows) == DigitsTask().n_train and all(len(r["answer"]) == 2 for r in rows)
    (tmp_path / "file").write_text("")
    assert main(["make-assets", str(tmp_path / "file")]) == 2
    assert "is not a directory" in capsys.readouterr().err
