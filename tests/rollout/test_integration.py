"""The client, the launcher and weight sync against real built-in servers over loopback.

Two ``local`` servers are launched as the trainer would launch them; a sharded engine
(``archon:d2``, FSDP over 2 forked ranks) trains a step and pushes its weights to them, and
the servers' outputs must then be exactly the new policy's (logprobs equal the engine's own
recomputation of the same tokens).
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import pytest
import torch
from dist_utils import run_distributed, wait_until
from engine_utils import engine_config, make_batch, sft_loss, sft_weight
from hf_fixtures import save_tiny_hf

from archon.gpu_check.servers import engine_logprobs
from archon.wire.auth import auth_headers

if TYPE_CHECKING:
    from archon.rollout.weight_sync import WeightSyncEngine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    save_tiny_hf(folder, "qwen3", seed=8, eos_token_id=1)
    return folder


def _config(model: Path, run_dir: Path, servers: int):
    from archon.config import load_config

    return load_config(
        None,
        [
            f"actor.path={model}",
            "actor.dtype=float32",
            "actor.backend=archon:d2",
            f"rollout.backend=local:d{servers}",
            f"output_dir={run_dir}",
            "cluster.n_gpus_per_node=8",
            "rollout.setup_timeout=300",
        ],
    )


def _server_info(addr: str, api_key: str | None) -> dict:
    request = urllib.request.Request(f"http://{addr}/get_server_info", headers=auth_headers(api_key))
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [
        torch.randint(2, 128, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def test_client_spreads_load_and_survives_a_killed_server(model_dir, tmp_path):
    from archon.launch.servers import RolloutLauncher
    from archon.rollout.client import RolloutClient, RolloutError

    cfg = _config(model_dir, tmp_path, servers=2)
    with RolloutLauncher.from_config(cfg, tmp_path) as launcher:  # starts the servers
        addrs = launcher.addrs
        pids = launcher.pids
        with RolloutClient(addrs, request_timeout=300, retries=3, backoff_s=0.05, api_key=launcher.api_key) as client:
            client.wait_healthy(300)
            prompts = _prompts(24)
            params = [
                {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 100 + i, "ignore_eos": True}
                for i in range(24)
            ]
            first = client.generate_many(prompts, params)
            assert {r.server for r in first} == {f"http://{a}" for a in addrs}
            # Seeded sampling is a function of the request, whichever server answers it.
            again = client.generate_many(prompts[::-1], params[::-1])[::-1]
            assert [r.output_ids for r in again] == [r.output_ids for r in first]
            assert all(len(r.output_logprobs) == 6 for r in first)

            # Kill server 0 while a long batch is in flight: every request still completes.
            long_params = [{**p, "max_new_tokens": 200} for p in params]
            future = client.submit(client.agenerate_many(prompts, long_params))
            # Once server 0 is decoding, its requests have ~200 steps to go: the kill lands mid-generation.
            wait_until(
                lambda: _server_info(addrs[0], launcher.api_key)["num_running_reqs"] > 0, "server 0 to start generating"
            )
            os.kill(pids[0], signal.SIGKILL)
            results = future.result(timeout=120)
            assert all(len(r.output_ids) == 200 for r in results)
            assert client.up_addrs == [f"http://{addrs[1]}"]

            os.kill(pids[1], signal.SIGKILL)
            with pytest.raises(RolloutError, match=addrs[1].split(":")[-1]):
                client.generate_many(prompts[:2], params[:2])


def _sync_and_compare(model: str, run_dir: str, mode: Literal["distributed", "disk"]):
    import torch.distributed as dist

    from archon.engine.engine import ArchonEngine
    from archon.launch.servers import RolloutLauncher
    from archon.rollout.client import RolloutClient
    from archon.rollout.weight_sync import build_weight_sync

    cfg = _config(Path(model), Path(run_dir), servers=2)
    rank0 = dist.get_rank() == 0
    launcher = client = None
    try:
        if rank0:
            launcher = RolloutLauncher.from_config(cfg, run_dir)
            client = RolloutClient(launcher.start(), request_timeout=300, api_key=launcher.api_key)
            client.wait_healthy(300)
        engine = ArchonEngine(engine_config(model, "archon:d2"), total_steps=2).initialize()
        # ArchonEngine's methods take ``extras`` where the protocol says ``**kw``: cast.
        sync = build_weight_sync(
            mode, cast("WeightSyncEngine", engine), client, folder=Path(run_dir) / "weights", chunk_mb=0.05
        )
        sync.setup()
        engine.train_batch(make_batch(0), sft_loss, sft_weight)  # the policy moves away from the folder's
        stats = sync.sync("1")
        prompts = _prompts(6)
        payload: list[Any] = [None]
        if rank0:
            assert client is not None
            results = client.generate_many(prompts, {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
            payload = [[(r.output_ids, r.output_logprobs, r.weight_version, r.server) for r in results]]
        dist.broadcast_object_list(payload, src=0)
        results = payload[0]
        trainer_logprobs = engine_logprobs(engine, [p + out for p, (out, *_) in zip(prompts, results)])
        sync.close()
        if not rank0:
            return None
        out = []
        for b, (p, (ids, lps, version, server)) in enumerate(zip(prompts, results)):
            mine = trainer_logprobs[b][len(p) : len(p) + len(ids)]
            out.append((p + list(ids), lps, mine, version, server))
        return out, stats
    finally:
        if client is not None:
            client.close()
        if launcher is not None:
            launcher.stop()


@pytest.mark.parametrize("mode", ["distributed", "disk"])
def test_weight_sync_from_a_sharded_engine_gives_the_servers_the_new_policy(model_dir, tmp_path, mode):
    import models

    results, stats = run_distributed(_sync_and_compare, 2, str(model_dir), str(tmp_path), mode, timeout=300)[0]
    assert stats["weight_sync_bytes"] > 0 and stats["weight_sync_time_s"] > 0
    if mode == "distributed":
        assert stats["weight_sync_buckets"] > 1  # 0.05 MiB buckets: several broadcast rounds
    assert len({server for *_, server in results}) == 2  # both servers were updated and answered
    old = models.load_hf_model(model_dir)
    moved = 0.0
    for tokens, server_lps, trainer_lps, version, _ in results:
        assert version == "1"
        assert max(abs(a - b) for a, b in zip(server_lps, trainer_lps)) < 1e-5, (server_lps, trainer_lps)
        # The folder's (old) weights give other logprobs for the same tokens: the check above can fail.
        with torch.no_grad():
            logp = torch.log_softmax(old(torch.tensor([tokens]))[0].float(), -1)
        n = len(server_lps)
        old_lps = logp[-n - 1 : -1].gather(-1, torch.tensor(tokens[-n:])[:, None])[:, 0]
        moved = max(moved, max(abs(a - b) for a, b in zip(server_lps, old_lps.tolist())))
    assert moved > 1e-3
