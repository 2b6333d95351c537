"""RL with LoRA: the KL reference is the actor's base model with the adapters off, not a second engine.

The adapters-off actor's logprobs equal those of a separate frozen engine on the base model (on archon:d1, d2
and t2, and fsdp:d1 with PEFT's adapters), after the adapters trained a few steps (so adapters on differ);
the trainer builds no reference engine under LoRA + KL, and a 2-step RL run gives the same metrics as the
same run with a reference engine of its own on the base model (the path without LoRA sharing).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from engine_utils import engine_config, make_batch, sft_loss, sft_weight
from hf_fixtures import save_tiny_hf
from rl_runs import overrides

LORA: dict[str, Any] = {"enabled": True, "rank": 4, "alpha": 8}


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("qwen3")
    save_tiny_hf(folder, "qwen3", seed=3)
    return str(folder)


def _reference_logprobs(path: str, backend: str) -> dict[str, Any] | None:
    """Adapters-off and adapters-on logprobs of a LoRA actor after 3 steps, and a base-model engine's logprobs."""
    import torch.distributed as dist

    from archon.config.lora import LoRAConfig
    from archon.engine import build_engine

    archon = {"pp_schedule": "1F1B"} if "p2" in backend else {}
    actor = build_engine(engine_config(path, backend, lora=LoRAConfig(**LORA), archon=archon), total_steps=3)
    actor.initialize()
    for step in range(3):
        actor.train_batch(make_batch(step), sft_loss, sft_weight)
    batch = make_batch(7)
    with actor.adapters_off():
        off = actor.forward(batch)["logprobs"]
    on = actor.forward(batch)["logprobs"]  # the switch is back on after the context
    base = build_engine(engine_config(path, backend, archon=archon), name="ref", trainable=False).initialize()
    ref = base.forward(batch)["logprobs"]
    refused = ""
    try:
        base.adapters_off()
    except ValueError as exc:
        refused = str(exc)
    return {"off": off, "on": on, "ref": ref, "refused": refused} if dist.get_rank() == 0 else None


@pytest.mark.parametrize(("backend", "world"), [("archon:d1", 1), ("archon:d2", 2), ("archon:t2", 2), ("fsdp:d1", 1)])
def test_adapters_off_actor_is_the_base_model(qwen3_path, backend, world):
    got = run_distributed(_reference_logprobs, world, qwen3_path, backend, timeout=600)[0]
    # The trained adapters move the policy, so the comparison below is not trivially met.
    assert (got["on"] - got["ref"]).abs().max() > 1e-3
    torch.testing.assert_close(got["off"], got["ref"], atol=1e-5, rtol=0)
    assert "no LoRA adapters" in got["refused"]


def _train_recording_ref(args: list[str]) -> dict[str, Any] | None:
    import torch.distributed as dist

    from archon.config import load_config
    from archon.rl.trainer import RLTrainer

    trainer = RLTrainer(load_config(None, args))
    history = trainer.run()
    assert trainer.ref is not None
    shared = trainer.ref.engine is trainer.actor_engine
    return {"history": history, "shared": shared} if dist.get_rank() == 0 else None


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    skip = ("time", "perf", "mem", "_s", "tokens_per")
    return {
        k: float(v)
        for k, v in row.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and not any(s in k for s in skip)
    }


@pytest.mark.slow
def test_rl_with_lora_and_kl_uses_the_actor_base_as_reference(rl_setup, tmp_path):
    model, data, _ = rl_setup
    # PEFT's init (B = 0): the servers start from the base model, which is the actor's policy before step 1.
    lora = ["actor.lora.enabled=true", "actor.lora.rank=4", "actor.lora.alpha=8"]

    def run(name: str, extra: list[str]) -> dict[str, Any]:
        kl: dict[str, Any] = {"actor.kl_loss_coef": 0.1}
        args = overrides(model, data, tmp_path / name, "archon:d1", total_train_steps=2, **kl)
        return run_distributed(_train_recording_ref, 1, args + lora + extra, timeout=600)[0]

    shared = run("shared", [])
    separate = run("separate", ["ref.lora.enabled=false"])  # a reference engine of its own on the base model
    assert shared["shared"] and not separate["shared"]
    assert len(shared["history"]) == len(separate["history"]) == 2
    # Step 2's policy has trained adapters: a reference that followed them would give kl_ref = 0 (k1 is signed).
    assert abs(shared["history"][1]["kl_ref"]) > 1e-4, shared["history"][1]
    for a, b in zip(shared["history"], separate["history"], strict=True):
        got, want = _numbers(a), _numbers(b)
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert math.isclose(got[key], value, abs_tol=1e-5), (key, got[key], value)
