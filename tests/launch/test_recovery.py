"""Rollout servers killed during an RL run (real built-in servers, ``local:dN``, SIGKILL).

The kill lands at the start of a step's rollout (the server is up and idle, then dies before
the batch is sent), so which recovery path runs is deterministic:

* with another server up, the dead one's requests go to it and the step completes; before the
  step's weight sync the launcher restarts the dead server (``rollout.max_server_restarts``) or,
  with no restarts left, the run drops it and goes on with the rest;
* with no server up, the launcher restarts it, the trainer re-forms the weight-update group and
  sends the current policy, and the rollout is repeated;
* with no server up and no restarts left, the run stops with an error naming the server and
  the last lines of its log, and saves nothing of the failed step.

Sampling seeds depend only on the step and the sample, so a recovered run must report exactly
the metrics of an uninterrupted one; and the trainer/server logprob difference stays ~0 on the
restarted servers, which is only possible if they serve the current policy, not the model folder.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from dist_utils import run_distributed

KEYS = ("actor/loss", "reward_mean", "response_len_mean", "actor/grad_norm", "actor/entropy")


def _overrides(model: Path, data: Path, out: Path, backend: str, servers: int, **extra) -> list[str]:
    base = {
        "actor.backend": backend,
        "actor.path": model,
        "actor.dtype": "float32",
        "actor.archon.enable_compile": "false",
        "actor.optimizer.lr": 1e-2,
        "train_dataset.path": data,
        "train_dataset.batch_size": 4,
        "gconfig.n_samples": 4,
        "gconfig.max_new_tokens": 5,
        "total_train_steps": 4,
        "output_dir": out,
        "reward.fn": "reward_fns:length_reward",
        "reward.n_workers": 0,
        "cluster.n_gpus_per_node": 8,
        "saver.export_hf": "false",
        "seed": 3,
        "rollout.backend": f"local:d{servers}",
        "rollout.setup_timeout": 120,
        "rollout.request_retries": 2,
        "saver.freq_steps": 1,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _install_killer(kills: dict[int, list[int]]) -> None:
    """In this (forked) rank: at the start of rollout call k, SIGKILL servers ``kills[k]`` and wait for their death."""
    from archon.launch.servers import RolloutLauncher
    from archon.rollout.client import RolloutClient

    launchers: list[RolloutLauncher] = []
    start = RolloutLauncher.start

    def recording_start(self):
        launchers.append(self)
        return start(self)

    generate_many = RolloutClient.agenerate_many
    calls = [0]

    async def killing_generate_many(self, *args, **kwargs):
        calls[0] += 1
        for index in kills.get(calls[0], []):
            run = next(r for r in launchers[0]._running if r.spec.index == index)
            os.kill(run.proc.pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while run.proc.poll() is None:  # dead (and reaped) before the batch is sent
                assert time.monotonic() < deadline
                time.sleep(0.01)
        return await generate_many(self, *args, **kwargs)

    RolloutLauncher.start = recording_start
    RolloutClient.agenerate_many = killing_generate_many


def _train(args: list[str], kills: dict[int, list[int]]):
    import torch.distributed as dist

    from archon.config import load_config
    from archon.rl.trainer import RLTrainer

    if dist.get_rank() == 0:
        _install_killer(kills)
    try:
        history = RLTrainer(load_config(None, args)).run()
    except Exception as exc:  # noqa: BLE001 - the test inspects what every rank saw
        return f"{type(exc).__name__}: {exc}"
    return history if dist.get_rank() == 0 else None


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(rl_setup):
    model, data, root = rl_setup
    return run_distributed(_train, 1, _overrides(model, data, root / "reference", "archon:d1", 1), {}, timeout=600)[0]


def _assert_same_run(history: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in history] == [r["step"] for r in reference]
    for key in KEYS:
        assert [r[key] for r in history] == pytest.approx([r[key] for r in reference], abs=1e-4), key
    for r in history:  # every server answered with the policy the trainer had
        assert r["behav_prox_logprob_diff"] < 1e-5, r


def test_lost_server_among_others_is_restarted_then_dropped(rl_setup, reference):
    model, data, root = rl_setup
    out = root / "two_servers"
    # Rollout 2: server 0 dies (restarted before the sync); rollout 3: server 1 dies (no restart left: dropped).
    history = run_distributed(
        _train,
        2,
        _overrides(model, data, out, "archon:d2", 2, **{"rollout.max_server_restarts": 1}),
        {2: [0], 3: [1]},
        timeout=600,
    )[0]
    assert isinstance(history, list), history
    _assert_same_run(history, reference)
    assert [(r["rollout/server_restarts"], r["rollout/servers_dropped"]) for r in history] == [
        (0, 0),
        (1, 0),
        (1, 1),
        (1, 1),
    ]


def test_last_server_is_restarted_with_the_current_policy_then_the_run_stops_clearly(rl_setup, reference):
    model, data, root = rl_setup
    out = root / "one_server"
    # Rollout 2: the only server dies (restarted, given policy v1, rollout repeated: call 3);
    # rollout 4 (step 3): it dies again with no restart left.
    errors = run_distributed(
        _train,
        1,
        _overrides(model, data, out, "archon:d1", 1, **{"rollout.max_server_restarts": 1}),
        {2: [0], 4: [0]},
        timeout=600,
    )
    error = errors[0]
    assert isinstance(error, str) and error.startswith("RankZeroError: rollout of step 3 failed on rank 0: "), error
    assert "no rollout server is left" in error and "its process exited with code -9" in error
    assert "server_0.log" in error and "restarted rollout server" not in error
    assert "starting the HTTP server" in error  # a line of the server's own log
    assert "rollout.max_server_restarts" in error and "rerun the same command" in error
    records = _records(out)
    _assert_same_run(records, reference[:2])
    assert [r["rollout/server_restarts"] for r in records] == [0, 1]
    saved = sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())
    assert not any("3" in name for name in saved), saved  # nothing of the failed step


def test_servers_archon_did_not_start_are_dropped_and_named_when_none_is_left():
    from fake_sglang import FakeSGLang

    from archon.launch.recovery import ServerSupervisor
    from archon.rollout.client import RolloutClient, RolloutError

    servers = [FakeSGLang().start() for _ in range(2)]
    try:
        with RolloutClient([s.addr for s in servers], backoff_s=0.01, setup_timeout=10) as client:
            supervisor = ServerSupervisor(client, launcher=None, max_restarts=3)
            assert supervisor.recover().changed is False  # all healthy: nothing to do
            servers[0].kill()  # silent death between steps: only /health finds it
            result = supervisor.recover()
            assert result.dropped == [f"http://{servers[0].addr}"] and result.restarted == []
            assert client.up_addrs == [f"http://{servers[1].addr}"] and supervisor.restarts == 0
            servers[1].kill()
            with pytest.raises(RolloutError) as info:
                supervisor.recover()
    finally:
        for s in servers:
            s.stop()
    msg = str(info.value)
    assert msg.startswith("no rollout server is left") and servers[0].addr in msg and servers[1].addr in msg
    assert "/health failed" in msg and "Archon did not start them (rollout.server_addrs)" in msg
    assert supervisor.stats() == {"rollout/server_restarts": 0.0, "rollout/servers_dropped": 2.0}
