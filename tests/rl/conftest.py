"""Fixtures of the RL tests: a tiny model and prompts the trainer runs on."""

from __future__ import annotations

import json

import pytest
from hf_fixtures import make_tiny_tokenizer, save_tiny_hf


@pytest.fixture(scope="module")
def rl_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    model = root / "model"
    tok = make_tiny_tokenizer(model)
    save_tiny_hf(model, "qwen3", seed=4, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    rows = [{"prompt": f"what is {a} + {b} ?", "answer": str(a + b)} for a in range(6) for b in range(4)]
    data = root / "rl.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data, root
