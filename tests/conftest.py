"""Fixtures shared by several test modules."""

from __future__ import annotations

import json

import pytest
import torch
from hf_fixtures import make_tiny_tokenizer, save_tiny_hf

from models.common.linear import cpu_linear_kernel


def pytest_sessionstart(session: pytest.Session) -> None:
    """Choose the float32 CPU linear kernel once, before any test starts a process: every rollout server, rank and
    subprocess of the session inherits the choice (``$ARCHON_CPU_LINEAR``) and computes alike, as the tests that
    compare two runs need."""
    cpu_linear_kernel()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for the module: a generation thread and the test's own reference
    forwards would otherwise fight over the machine's cores and slow each other down badly."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def rl_setup(tmp_path_factory):
    """A tiny Qwen3 with its tokenizer and addition prompts the RL trainer runs on: (model, data, root)."""
    root = tmp_path_factory.mktemp("rl")
    model = root / "model"
    tok = make_tiny_tokenizer(model)
    save_tiny_hf(model, "qwen3", seed=4, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    rows = [{"prompt": f"what is {a} + {b} ?", "answer": str(a + b)} for a in range(6) for b in range(4)]
    data = root / "rl.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data, root
