"""Datasets, sampling and collation with a tiny local tokenizer."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from hf_fixtures import make_tiny_tokenizer

from archon.data import (
    EpochSampler,
    PromptLoader,
    RLPromptDataset,
    SFTDataset,
    collate,
    epoch_order,
    load_jsonl,
    repeat_for_group,
)
from archon.errors import DataError

GSM8K_ROWS = [
    {"question": "what is 2 + 2 ?", "answer": "2 + 2 = 4\n#### 4"},
    {"question": "what is 10 + 8 ?", "answer": "10 + 8 = 18 , so the answer is\n#### 18"},
    {"question": "what is 3 + 3 + 3 + 3 + 3 + 3 ?", "answer": "#### 18"},
]


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def plain_tok():
    t = make_tiny_tokenizer()
    t.chat_template = None
    return t


def ids(tok, tokens):
    return tok.convert_tokens_to_ids(tokens)


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


# ---------------------------------------------------------------------------------------
# jsonl
# ---------------------------------------------------------------------------------------


def test_load_jsonl_and_errors(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", GSM8K_ROWS)
    assert load_jsonl(p) == GSM8K_ROWS
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(ValueError, match="bad.jsonl:2 is not valid JSON"):
        load_jsonl(bad)
    bad.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match="bad.jsonl:2 holds a list"):
        load_jsonl(bad)
    with pytest.raises(DataError, match="train_dataset.path"):
        load_jsonl(tmp_path / "missing.jsonl")


# ---------------------------------------------------------------------------------------
# RL prompts
# ---------------------------------------------------------------------------------------


def test_gsm8k_rows_with_chat_template(tmp_path, tok):
    ds = RLPromptDataset(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS), tok)
    assert len(ds) == 3 and ds.n_dropped == 0
    s = ds[1]
    assert s.answer == "18" and s.solution == GSM8K_ROWS[1]["answer"] and s.index == 1
    expected = ["<|im_start|>", "user", "what", "is", "10", "+", "8", "?", "<|im_end|>", "<|im_start|>", "assistant"]
    assert s.input_ids == ids(tok, expected)


def test_a_field_named_like_the_rewards_token_ids_is_refused(plain_tok):
    rows = [{"prompt": "2 + 2", "answer": "4"}, {"prompt": "1 + 1", "answer": "2", "completion_ids": [1]}]
    with pytest.raises(DataError, match="row 2 has a 'completion_ids' field.*rename the field"):
        RLPromptDataset(rows, plain_tok)


def test_prompt_template_system_prompt_and_plain_tokenisation(tok, plain_tok):
    rows = [{"prompt": "2 + 2", "answer": "4", "level": 3}]
    ds = RLPromptDataset(rows, plain_tok, prompt_template="what is {prompt} ?")
    assert ds[0].prompt == "what is 2 + 2 ?"
    assert ds[0].input_ids == ids(plain_tok, ["what", "is", "2", "+", "2", "?"])
    assert ds[0].answer == "4" and ds[0].extra == {"level": 3}
    chat = RLPromptDataset(rows, tok, prompt_template="{prompt} =", system_prompt="the answer")
    assert chat[0].input_ids == ids(
        tok,
        [
            "<|im_start|>",
            "system",
            "the",
            "answer",
            "<|im_end|>",
            "<|im_start|>",
            "user",
            "2",
            "+",
            "2",
            "=",
            "<|im_end|>",
            "<|im_start|>",
            "assistant",
        ],
    )
    with pytest.raises(ValueError, match="placeholder"):
        RLPromptDataset(rows, tok, prompt_template="no placeholder")


def test_max_prompt_length_drops_and_counts(tok, caplog):
    caplog.set_level(logging.WARNING, logger="archon.data")
    # Chat-templated lengths: 11, 11, 19 tokens.
    ds = RLPromptDataset(GSM8K_ROWS, tok, max_prompt_length=11)
    assert len(ds) == 2 and ds.n_dropped == 1
    assert [s.index for s in ds.samples] == [0, 1]
    assert any("dropped 1 of 3 prompts" in r.message for r in caplog.records)
    with pytest.raises(ValueError, match="no prompts left"):
        RLPromptDataset(GSM8K_ROWS, tok, max_prompt_length=3)


def test_bad_rows_are_reported(tok):
    with pytest.raises(ValueError, match="row 2 has neither 'prompt' nor 'question'"):
        RLPromptDataset([{"prompt": "2", "answer": "2"}, {"text": "x", "answer": "1"}], tok)
    with pytest.raises(ValueError, match="row 1 has no 'answer'"):
        RLPromptDataset([{"prompt": "2"}], tok)


# ---------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------


def test_epoch_order_is_a_seeded_permutation():
    a0, a1 = epoch_order(50, seed=7, epoch=0), epoch_order(50, seed=7, epoch=1)
    assert sorted(a0) == list(range(50)) and sorted(a1) == list(range(50))
    assert a0 != a1 and a0 != list(range(50))
    assert epoch_order(50, seed=7, epoch=0) == a0
    assert epoch_order(50, seed=8, epoch=0) != a0
    assert epoch_order(5, seed=7, epoch=3, shuffle=False) == [0, 1, 2, 3, 4]


def test_epoch_order_is_the_same_in_another_process():
    # Nothing but (seed, epoch) may decide the order: not the hash seed of the process,
    # nor its rank or world size.
    code = "from archon.data import epoch_order; print(epoch_order(30, seed=3, epoch=2))"
    env = {**os.environ, "PYTHONHASHSEED": "123", "RANK": "3", "WORLD_SIZE": "8"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(epoch_order(30, seed=3, epoch=2))


def test_sampler_batches_epochs_and_drop_last():
    s = EpochSampler(10, 4, seed=1, drop_last=True)
    assert s.batches_per_epoch == 2
    e0 = epoch_order(10, seed=1, epoch=0)
    assert s.next_batch() == e0[:4] and s.next_batch() == e0[4:8]
    assert s.next_batch() == epoch_order(10, seed=1, epoch=1)[:4] and s.epoch == 1
    keep = EpochSampler(10, 4, seed=1, drop_last=False)
    assert keep.batches_per_epoch == 3
    assert [len(keep.next_batch()) for _ in range(4)] == [4, 4, 2, 4]
    with pytest.raises(ValueError, match="larger than the dataset"):
        EpochSampler(3, 4, seed=1)


def test_sampler_resume_continues_exactly():
    full = EpochSampler(10, 3, seed=5)
    reference = [full.next_batch() for _ in range(8)]  # crosses two epoch boundaries
    first = EpochSampler(10, 3, seed=5)
    head = [first.next_batch() for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as JSON
    assert state["epoch"] == 1 and state["position"] == 3
    resumed = EpochSampler(10, 3, seed=5)
    resumed.load_state_dict(state)
    assert head + [resumed.next_batch() for _ in range(4)] == reference
    with pytest.raises(ValueError, match="same seed"):
        EpochSampler(10, 3, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="same data file"):
        EpochSampler(11, 3, seed=5).load_state_dict(state)


def test_prompt_loader_repeats_groups_consecutively(tok):
    ds = RLPromptDataset(GSM8K_ROWS, tok)
    loader = PromptLoader(ds, 2, seed=0, group_size=3)
    state = loader.state_dict()
    batch = loader.next_rollout_batch()
    assert len(batch) == 6
    assert [s.index for s in batch[:3]] == [batch[0].index] * 3
    assert [s.index for s in batch[3:]] == [batch[3].index] * 3 and batch[0].index != batch[3].index
    loader.load_state_dict(state)
    assert [s.index for s in loader.next_batch()] == [batch[0].index, batch[3].index]
    assert repeat_for_group(["a", "b"], 2) == ["a", "a", "b", "b"]


# ---------------------------------------------------------------------------------------
# SFT
# ---------------------------------------------------------------------------------------


def test_sft_sample_masks_completion_and_eos(tok):
    ds = SFTDataset([{"prompt": "what is 2 + 2 ?", "completion": "the answer is 4"}], tok)
    prompt = ["<|im_start|>", "user", "what", "is", "2", "+", "2", "?", "<|im_end|>", "<|im_start|>", "assistant"]
    completion = ["the", "answer", "is", "4", "<|im_end|>"]
    assert ds[0]["input_ids"] == ids(tok, prompt + completion)
    assert ds[0]["loss_mask"] == [0] * len(prompt) + [1] * len(completion)


def test_sft_first_token_never_trained(plain_tok):
    ds = SFTDataset([{"prompt": "", "completion": "4 + 4"}], plain_tok)
    assert ds[0]["input_ids"] == ids(plain_tok, ["4", "+", "4", "<|im_end|>"])
    assert ds[0]["loss_mask"] == [0, 1, 1, 1]


def test_sft_max_length_drop_and_truncate(plain_tok, caplog):
    caplog.set_level(logging.WARNING, logger="archon.data")
    rows = [
        {"prompt": "what is", "completion": "4"},  # 2 + 1 + eos = 4 tokens
        {"prompt": "what is 2 + 2", "completion": "is 4 4"},  # 5 + 3 + 1 = 9 tokens
        {"prompt": "1 2 3 4 5 6", "completion": "7"},
    ]  # prompt alone fills max_length
    dropped = SFTDataset(rows, plain_tok, max_length=6)
    assert len(dropped) == 1 and dropped.n_dropped == 2 and dropped.n_truncated == 0
    cut = SFTDataset(rows, plain_tok, max_length=6, truncation="truncate")
    assert len(cut) == 2 and cut.n_dropped == 1 and cut.n_truncated == 1
    assert cut[1]["input_ids"] == ids(plain_tok, ["what", "is", "2", "+", "2", "is"])
    assert cut[1]["loss_mask"] == [0, 0, 0, 0, 0, 1]
    assert any("dropped 1 and truncated 1" in r.message for r in caplog.records)


# ---------------------------------------------------------------------------------------
# collate
# ---------------------------------------------------------------------------------------


def test_collate_pads_per_token_fields_and_stacks_scalars():
    samples = [
        {
            "input_ids": [5, 6, 7],
            "loss_mask": [0, 1, 1],
            "logprobs": [0.0, -0.5, -1.5],
            "rewards": 1.0,
            "seq_no_eos_mask": False,
            "prompt": "ignored",
        },
        {
            "input_ids": [8, 9],
            "loss_mask": [0, 1],
            "logprobs": [0.0, -2.0],
            "rewards": 0,
            "seq_no_eos_mask": True,
            "prompt": "ignored",
        },
    ]
    b = collate(samples, pad_token_id=1, pad_to_multiple_of=4)
    assert set(b) == {"input_ids", "loss_mask", "logprobs", "rewards", "seq_no_eos_mask", "attention_mask"}
    assert torch.equal(b["input_ids"], torch.tensor([[5, 6, 7, 1], [8, 9, 1, 1]]))
    assert torch.equal(b["attention_mask"], torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
    assert torch.equal(b["loss_mask"], torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]]))
    assert b["logprobs"].dtype == torch.float32
    torch.testing.assert_close(b["logprobs"], torch.tensor([[0.0, -0.5, -1.5, 0.0], [0.0, -2.0, 0.0, 0.0]]))
    assert b["rewards"].tolist() == [1.0, 0.0] and b["rewards"].dtype == torch.float32
    assert b["seq_no_eos_mask"].tolist() == [False, True] and b["seq_no_eos_mask"].dtype == torch.bool
    assert b["input_ids"].dtype == torch.long


def test_collate_rejects_misaligned_fields(tok):
    with pytest.raises(ValueError, match="per-token field 'loss_mask'"):
        collate([{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}])
    # An SFT dataset collates straight into the engine's batch layout.
    ds = SFTDataset([{"prompt": "what is 2 + 2 ?", "completion": "4"}, {"prompt": "2", "completion": "2 + 2"}], tok)
    b = collate([ds[0], ds[1]], pad_token_id=tok.pad_token_id)
    assert b["input_ids"].shape == b["loss_mask"].shape == b["attention_mask"].shape
    assert int(b["loss_mask"].sum()) == 2 + 4
