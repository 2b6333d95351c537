"""Fixtures of the evaluation tests: a tiny model, training prompts and held-out prompts."""

from __future__ import annotations

import json

import pytest
from hf_fixtures import make_tiny_tokenizer, save_tiny_hf


@pytest.fixture(scope="module")
def eval_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model = root / "model"
    tok = make_tiny_tokenizer(model)
    save_tiny_hf(model, "qwen3", seed=4, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    train = root / "train.jsonl"
    train.write_text(
        "".join(
            json.dumps({"prompt": f"what is {a} + {b} ?", "answer": str(a + b)}) + "\n"
            for a in range(4)
            for b in range(2)
        )
    )
    valid = root / "valid.jsonl"
    valid.write_text(
        "".join(json.dumps({"prompt": f"what is {a} + {a} ?", "answer": str(2 * a)}) + "\n" for a in range(10, 16))
    )
    return model, train, valid, root
