"""Rollout servers and strangers: loopback by default, a per-run key otherwise, never an open
weight-update endpoint.

A launched run's servers (real built-in servers, ``local:d1``) require the run's key on every
endpoint but ``/health``; a request without it, or with a wrong one, gets HTTP 401 with one
sentence and changes nothing (the served weights are checked against an independent model),
while the trainer's client, given the key, is served as usual.  The key reaches the servers
through their environment, never their command line, log or ``/get_server_info``, and lives in
an owner-only file under the run directory while they run.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_fixtures import random_tokens, save_tiny_hf
from paths import REPO

import models
from archon.config import load_config
from archon.launch.servers import RolloutLauncher, build_launch_specs
from archon.rollout.client import RolloutClient, RolloutRequestError
from archon.wire.auth import API_KEY_ENV, check_bind, is_loopback

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth")
    save_tiny_hf(root / "served", "qwen3", seed=51)
    save_tiny_hf(root / "other", "qwen3", seed=52)
    return root


def _call(url: str, path: str, body: Any = None, key: str | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode()


@torch.no_grad()
def _greedy(folder: Path, prompt: list[int], n: int) -> list[int]:
    model = models.load_hf_model(folder)
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_launched_servers_require_the_runs_key(folders, tmp_path):
    cfg = load_config(
        None,
        [
            f"actor.path={folders / 'served'}",
            "actor.dtype=float32",
            "rollout.backend=local:d1",
            f"output_dir={tmp_path}",
            "cluster.n_gpus_per_node=2",
            "rollout.setup_timeout=120",
        ],
    )
    prompt = random_tokens(5, 3)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    expected = _greedy(folders / "served", prompt, 4)
    with RolloutLauncher.from_config(cfg, tmp_path) as launcher:
        key = launcher.api_key
        url = f"http://{launcher.addrs[0]}"
        assert key and len(key) >= 32
        key_file = tmp_path / "rollout" / "api_key"
        assert key_file.read_text().strip() == key and stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert key not in " ".join(launcher.specs[0].cmd) and launcher.specs[0].env[API_KEY_ENV] == key

        assert _call(url, "/health") == (200, "ok")  # liveness probes stay open, as in SGLang
        attempts = {
            "/generate": body,
            "/update_weights_from_disk": {"model_path": str(folders / "other"), "weight_version": "evil"},
            "/init_weights_update_group": {
                "master_address": "127.0.0.1",
                "master_port": 1,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": "evil",
            },
            "/pause_generation": {},
        }
        for path, payload in attempts.items():
            for wrong in (None, "not-the-key", key + "x"):
                status, answer = _call(url, path, payload, key=wrong)
                assert status == 401, (path, wrong, answer)
                message = answer["error"]["message"]
                assert "Authorization: Bearer" in message and "\n" not in message, message
        status, info = _call(url, "/get_server_info", key=key)
        assert status == 200 and "api_key" not in info and key not in json.dumps(info)
        assert info["weight_version"] == "default"  # the refused update changed nothing
        assert key not in (tmp_path / "rollout" / "server_0.log").read_text()

        # The trainer's client carries the key; without it the 401 surfaces as one clear error.
        with RolloutClient(launcher.addrs, api_key=key, setup_timeout=30) as client:
            result = client.generate(prompt, body["sampling_params"])
            assert result.output_ids == expected
        with RolloutClient(launcher.addrs, setup_timeout=30, retries=0) as client:
            with pytest.raises(RolloutRequestError, match="HTTP 401.*requires an API key"):
                client.generate(prompt, body["sampling_params"])
    assert not key_file.exists()  # gone with the servers


def test_routable_addresses_need_a_key(folders, tmp_path):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("node-7")
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", "secret")
    with pytest.raises(ValueError, match="ARCHON_API_KEY"):
        check_bind("0.0.0.0", None)

    # The CLI refuses before loading anything.
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "archon.server.app",
            "--model-path",
            str(folders / "served"),
            "--host",
            "0.0.0.0",
            "--port",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "reachable from other machines" in out.stderr and "ARCHON_API_KEY" in out.stderr

    # Multi-node runs bind every interface, and every server gets the run's key (node 0's: the plan puts them there).
    cfg = load_config(
        None,
        [
            f"actor.path={folders / 'served'}",
            "rollout.backend=local:d2",
            "cluster.n_nodes=2",
            "cluster.n_gpus_per_node=2",
            "actor.backend=archon:d2",
        ],
    )
    specs = build_launch_specs(cfg, tmp_path, node=0)
    assert {s.host for s in specs} == {"0.0.0.0"} and len({s.api_key for s in specs}) == 1
    assert all(s.env[API_KEY_ENV] == s.api_key for s in specs)
    sg = load_config(
        None,
        [
            f"actor.path={folders / 'served'}",
            "rollout.backend=sglang:d2t1",
            "cluster.n_nodes=2",
            "cluster.n_gpus_per_node=2",
            "actor.backend=archon:d2",
        ],
    )
    for spec in build_launch_specs(sg, tmp_path, node=0, api_key="k123"):
        assert spec.cmd[spec.cmd.index("--api-key") + 1] == "k123"
