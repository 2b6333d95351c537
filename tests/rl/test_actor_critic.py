"""PPOActor's and PPOCritic's own logic: which rows and passes reach the engine, and the critic's
values, aligned like the engine's, plus the value after each row's last token (GAE bootstrap)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import pytest
import torch
from dist_utils import run_distributed
from engine_utils import engine_config, make_batch
from hf_fixtures import save_tiny_hf

if TYPE_CHECKING:
    from archon.engine.engine import ArchonEngine


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("critic") / "model"
    save_tiny_hf(path, "qwen3", seed=2)
    return str(path)


def _values(path: str):
    import torch.distributed as dist

    from archon.config import CriticConfig
    from archon.engine.engine import ArchonEngine
    from archon.rl.critic import PPOCritic

    engine = ArchonEngine(engine_config(path), is_critic=True, total_steps=1).initialize()
    critic = PPOCritic(engine, CriticConfig(), agg_mode="token-mean", max_new_tokens=8)
    batch = make_batch(3, n=4)
    values, after = critic.compute_values(batch)
    plain = engine.forward(batch)["values"]
    # Reference for values_after: append a real next token to every row and read the value
    # before it, which by definition is the value of the state after the row's last token.
    lengths = batch["attention_mask"].sum(1)
    rows, width = batch["input_ids"].shape
    longer = {
        "input_ids": torch.cat([batch["input_ids"], torch.zeros(rows, 1, dtype=torch.long)], 1),
        "attention_mask": torch.cat([batch["attention_mask"], torch.zeros(rows, 1, dtype=torch.long)], 1),
    }
    for b in range(rows):
        longer["input_ids"][b, lengths[b]] = 17 + b
        longer["attention_mask"][b, lengths[b]] = 1
    reference = engine.forward(longer)["values"][torch.arange(rows), lengths]
    out = (values, after, plain, reference, batch["attention_mask"])
    return out if dist.get_rank() == 0 else None


def test_values_after_is_the_value_of_the_state_after_the_last_token(tiny_model):
    values, after, plain, reference, attn = run_distributed(_values, 1, tiny_model)[0]
    torch.testing.assert_close(values, plain, atol=1e-5, rtol=1e-5)  # unchanged by the appended token
    torch.testing.assert_close(after, reference, atol=1e-5, rtol=1e-5)
    # Not the value before the last token: a one-position shift would show.
    last = values[torch.arange(values.shape[0]), attn.sum(1) - 1]
    assert (after - last).abs().max() > 1e-3


class RecordingEngine:
    """Stands in for an ArchonEngine: records the minibatches it is asked to step on."""

    def __init__(self):
        self.seed, self.step, self.batches = 5, 0, []

    def train_batch(self, mb, loss_fn, loss_weight_fn):
        self.batches.append(mb)
        self.step += 1
        return {"loss": 0.0}


def _rl_batch(rows: int = 4) -> dict:
    return {
        "input_ids": torch.arange(rows * 3).view(rows, 3) + 1,
        "attention_mask": torch.ones(rows, 3),
        "loss_mask": torch.tensor([[0.0, 1.0, 1.0]] * rows),
        "logprobs": torch.zeros(rows, 3),
        "advantages": torch.ones(rows, 3),
        "rewards": torch.arange(rows, dtype=torch.float32),
        "seq_no_eos_mask": torch.tensor([False, True, False, True][:rows]),
    }


def test_actor_overlong_filtering_and_epochs_reach_the_engine():
    from archon.config import ActorConfig
    from archon.rl.actor import PPOActor

    engine = RecordingEngine()
    actor = PPOActor(
        cast("ArchonEngine", engine),
        ActorConfig(ppo_n_minibatches=2, ppo_epochs=3, overlong_filtering=True),
        max_new_tokens=4,
    )
    actor.ppo_update(_rl_batch())
    assert len(engine.batches) == 6  # ppo_epochs x ppo_n_minibatches optimizer steps
    for mb in engine.batches:
        # The truncated rows (1 and 3) are still in the batch but without a loss token.
        no_eos = mb["seq_no_eos_mask"].bool()
        assert mb["loss_mask"][no_eos].sum() == 0 and (mb["loss_mask"][~no_eos].sum(1) == 2).all()
    engine = RecordingEngine()
    actor = PPOActor(cast("ArchonEngine", engine), ActorConfig(overlong_filtering=True), max_new_tokens=4)
    batch = _rl_batch()
    batch["seq_no_eos_mask"] = torch.ones(4, dtype=torch.bool)
    assert actor.ppo_update(batch) == {} and engine.batches == []  # everything filtered: no step


def test_critic_epochs_and_shuffle_use_the_engine_step_as_seed():
    from archon.config import CriticConfig
    from archon.rl.critic import PPOCritic

    def rows_seen(start_step):
        engine = RecordingEngine()
        engine.step = start_step
        critic = PPOCritic(
            cast("ArchonEngine", engine),
            CriticConfig(ppo_n_minibatches=2, ppo_epochs=2, shuffle=True),
            agg_mode="token-mean",
            max_new_tokens=4,
        )
        batch = {**_rl_batch(), "old_values": torch.zeros(4, 3), "returns": torch.ones(4, 3)}
        critic.ppo_update(batch)
        return [mb["rewards"].long().tolist() for mb in engine.batches]

    first = rows_seen(0)
    assert len(first) == 4 and rows_seen(0) == first
    assert rows_seen(4) != first  # the next RL step shuffles differently
