"""The CPU demo's assets: deterministic, loadable by transformers and Archon, and a task at chance before RL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import models
from archon.data import RLPromptDataset, SFTDataset, has_chat_template, load_jsonl
from archon.demos.first_letter import (
    EOS_TOKEN,
    PAD_TOKEN,
    REWARD_FN,
    SEPARATOR,
    DemoTask,
    TinyQwen3,
    first_letter,
    main,
    make_assets,
    make_prompt,
    make_rows,
    sample_prompts,
    uniform_policy_reward,
    vocabulary,
)
from archon.rl.rewards import get_reward_fn

# Small data files keep the module fast; the model has the demo's real shape.
TASK = DemoTask(n_train=96, n_test=24, n_sft=40)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("demo") / "assets", TASK)


@pytest.fixture(scope="module")
def tok(assets):
    return AutoTokenizer.from_pretrained(assets.model)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_assets_are_deterministic_and_depend_on_the_seed(assets, tmp_path):
    again = make_assets(tmp_path / "again", TASK)
    first, second = _files(assets.root), _files(again.root)
    assert set(first) >= {
        "model/config.json",
        "model/model.safetensors",
        "model/tokenizer.json",
        "tokenizer/tokenizer.json",
        "data/train.jsonl",
        "data/test.jsonl",
        "data/sft.jsonl",
    }
    assert first == second
    other = make_assets(tmp_path / "other", DemoTask(n_train=96, n_test=24, n_sft=40, seed=1), TinyQwen3(seed=1))
    third = _files(other.root)
    for name in ("model/model.safetensors", "data/train.jsonl", "data/sft.jsonl"):
        assert third[name] != first[name], name


def test_tokenizer_round_trips_the_task_strings(assets, tok):
    standalone = AutoTokenizer.from_pretrained(assets.tokenizer)
    assert standalone.get_vocab() == tok.get_vocab()
    vocab = vocabulary(TASK)
    assert len(tok) == len(vocab)
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id == vocab.index(EOS_TOKEN)
    assert tok.pad_token == PAD_TOKEN and tok.pad_token_id == vocab.index(PAD_TOKEN)
    assert tok.bos_token_id is None
    assert not has_chat_template(tok)  # prompts are plain text
    for row in load_jsonl(assets.train) + load_jsonl(assets.test):
        ids = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        assert len(ids) == TASK.prompt_letters + 1
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == row["prompt"]
        answer_ids = tok(row["answer"], add_special_tokens=False)["input_ids"]
        assert len(answer_ids) == 1
        # What the trainer's decode of "answer, EOS" gives is the answer itself.
        assert tok.decode(answer_ids + [tok.eos_token_id], skip_special_tokens=True) == row["answer"]


def test_model_loads_in_transformers_and_archon_with_equal_logits(assets, tok):
    hf = AutoModelForCausalLM.from_pretrained(assets.model).eval()
    config = json.loads((assets.model / "config.json").read_text())
    generation = json.loads((assets.model / "generation_config.json").read_text())
    assert config["model_type"] == "qwen3" and config["vocab_size"] == len(tok)
    assert config["eos_token_id"] == generation["eos_token_id"] == tok.eos_token_id
    assert config["pad_token_id"] == tok.pad_token_id
    ours = models.load_hf_model(assets.model)
    prompts = [r["prompt"] for r in load_jsonl(assets.test)[:4]]
    tokens = torch.tensor([tok(p, add_special_tokens=False)["input_ids"] for p in prompts])
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens)
    assert got.shape == ref.shape == (4, TASK.prompt_letters + 1, len(tok))
    assert ref.std() > 0.05  # not a comparison of constants
    assert (got - ref).abs().max().item() < 1e-5


def test_reward_on_hand_written_cases():
    reward = get_reward_fn(REWARD_FN)
    prompt = make_prompt(["c", "a", "f", "b", "e", "d"])
    assert prompt == f"c a f b e d {SEPARATOR}"
    assert first_letter(prompt) == "c"
    assert reward(prompt, "c", "c") == 1.0
    assert reward(prompt, " c ", "c") == 1.0  # decoding may leave spaces around a word
    for wrong in ("a", "d", "", "c a", "c c", SEPARATOR):
        assert reward(prompt, wrong, "c") == 0.0, wrong
    with pytest.raises(ValueError, match="not a demo prompt"):
        first_letter("c a f")


def test_rows_parse_with_the_archon_datasets(assets, tok):
    rl = RLPromptDataset(assets.train, tok)
    assert len(rl) == TASK.n_train and rl.n_dropped == 0
    for sample in rl.samples:
        assert sample.answer == first_letter(sample.prompt) == sample.prompt.split()[0]
        assert len(set(sample.prompt.split()[:-1])) == TASK.prompt_letters  # distinct letters
    test_prompts = {r["prompt"] for r in load_jsonl(assets.test)}
    assert len(test_prompts) == TASK.n_test
    assert not test_prompts & {s.prompt for s in rl.samples}
    sft_rows = load_jsonl(assets.sft)
    sft = SFTDataset(sft_rows, tok, max_length=64)
    assert len(sft) == TASK.n_sft
    for row, sample in zip(sft_rows, sft.samples):
        assert row["completion"] in TASK.letters
        assert sample["input_ids"][-2:] == [tok.convert_tokens_to_ids(row["completion"]), tok.eos_token_id]
        assert sum(sample["loss_mask"]) == 2  # the letter and EOS
    # Format-only: the SFT answers are not the task's answers more often than chance.
    hits = sum(r["completion"] == first_letter(r["prompt"]) for r in make_rows(DemoTask(n_sft=1000))["sft"])
    assert hits < 1000 * 2 / len(TASK.letters)


def test_chance_level_of_uniform_policies(assets, tok):
    rows = load_jsonl(assets.test)
    # Exactly one of the candidates is each prompt's answer, so a uniform choice scores 1/n.
    assert uniform_policy_reward(rows, vocabulary(TASK)) == pytest.approx(1 / len(vocabulary(TASK)))
    assert uniform_policy_reward(rows, list(TASK.letters)) == pytest.approx(1 / len(TASK.letters))
    # The same through the trainer's decoding of every token id.
    decoded = [tok.decode([i], skip_special_tokens=True) for i in range(len(tok))]
    assert uniform_policy_reward(rows, decoded) == pytest.approx(1 / len(tok))


def test_untrained_model_answers_near_chance(assets, tok):
    """The expected reward of the random model, sampling one token at temperature 1."""
    model = models.load_hf_model(assets.model)
    rows = load_jsonl(assets.test)
    tokens = torch.tensor([tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows])
    answers = torch.tensor([tok.convert_tokens_to_ids(r["answer"]) for r in rows])
    with torch.no_grad():
        probs = torch.softmax(model(tokens)[:, -1].float(), dim=-1)
    expected = probs.gather(1, answers[:, None]).mean().item()
    chance = 1 / len(tok)
    assert chance / 2 < expected < 2 * chance


def test_bad_task_settings_are_one_sentence_errors():
    with pytest.raises(ValueError, match="distinct letters"):
        DemoTask(letters="aab")
    with pytest.raises(ValueError, match="between 1 and 3"):
        DemoTask(letters="abc", prompt_letters=4)
    import random

    with pytest.raises(ValueError, match="only 6 exist"):
        sample_prompts(DemoTask(letters="abc", prompt_letters=2), 7, random.Random(0))


def test_cli_writes_the_assets(tmp_path, capsys):
    assert main(["make-assets", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "first letter" in out and f"{1 / len(vocabulary()):.3f}" in out
    assert len(load_jsonl(tmp_path / "out" / "data" / "train.jsonl")) == DemoTask().n_train
    (tmp_path / "file").write_text("")
    assert main(["make-assets", str(tmp_path / "file")]) == 2
    assert "is not a directory" in capsys.readouterr().err
