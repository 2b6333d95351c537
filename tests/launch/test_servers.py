"""Launch specs for sglang/local allocations, and real launches of fake servers (startup, logs, stopping)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
from dist_utils import pid_alive, wait_until
from fake_sglang import fake_command, fake_completion
from paths import REPO, SUPPORT

import archon.launch.servers as launch_servers
from archon.alloc import ModelAllocation
from archon.config import Config, ConfigError, load_config
from archon.launch.servers import LaunchSpec, RolloutLauncher, RolloutLaunchError, build_launch_specs
from archon.rollout.client import RolloutClient
from archon.server.app import parse_args
from archon.wire.weight_group import ranks_per_server


def _cfg(*overrides: str) -> Config:
    return load_config(None, ["actor.path=/models/tiny", *overrides])


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


# ---------------------------------------------------------------------------------- specs


def test_sglang_d4t2_on_three_nodes_with_a_pipelined_actor(tmp_path):
    cfg = _cfg(
        "rollout.backend=sglang:d4t2",
        "actor.backend=archon:d4p2t2",
        "cluster.n_nodes=3",
        "cluster.n_gpus_per_node=8",
        "sglang.random_seed=5",
    )
    # The plan gives node 0 to rollout and nodes 1-2 to training: the trainer (rank 0 on node 1)
    # must not start them on its own node; a cluster launcher starts node 0's.
    with pytest.raises(ConfigError, match=r"server 0 on node 0 \(GPUs 0,1\).*its own node 1"):
        build_launch_specs(cfg, tmp_path)
    specs = build_launch_specs(cfg, tmp_path, ports=[30000, 30001, 30002, 30003], node=0)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3", "4,5", "6,7"]
    assert build_launch_specs(cfg, tmp_path, node=1) == []
    for i, s in enumerate(specs):
        assert s.cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
        assert _flag(s.cmd, "--model-path") == "/models/tiny"
        assert _flag(s.cmd, "--tp-size") == "2"
        assert _flag(s.cmd, "--port") == str(30000 + i)
        assert _flag(s.cmd, "--random-seed") == str(5 + i)
        assert _flag(s.cmd, "--dtype") == "bfloat16"
        assert _flag(s.cmd, "--mem-fraction-static") == "0.8"
        assert _flag(s.cmd, "--log-level") == "warning"
        assert "--skip-tokenizer-init" in s.cmd
        # No context length unless the user sets one: SGLang derives the model's own.
        for absent in (
            "--dp-size",
            "--ep-size",
            "--enable-dp-attention",
            "--disable-cuda-graph",
            "--max-running-requests",
            "--attention-backend",
            "--context-length",
            "--enable-deterministic-inference",
        ):
            assert absent not in s.cmd
        # Trainer ranks on the other nodes must reach the servers: bind every interface.
        assert _flag(s.cmd, "--host") == "0.0.0.0" and s.host == "0.0.0.0"
        assert not s.addr.startswith("0.0.0.0") and s.addr.endswith(f":{30000 + i}")
        assert s.log_path == tmp_path / "rollout" / f"server_{i}.log"
    assert ranks_per_server(ModelAllocation.from_str("sglang:d4t2")) == 2


def test_sglang_d2t4_with_extra_options(tmp_path):
    cfg = _cfg(
        "rollout.backend=sglang:d2t4",
        "actor.backend=archon:d8",
        "cluster.n_nodes=2",
        "sglang.disable_cuda_graph=true",
        "sglang.max_running_requests=64",
        "sglang.attention_backend=fa3",
        "sglang.mem_fraction_static=0.6",
        "sglang.dtype=float16",
        "sglang.extra_args=['--chunked-prefill-size', '4096']",
    )
    specs = build_launch_specs(cfg, tmp_path, node=0)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1,2,3", "4,5,6,7"]
    ports = [s.port for s in specs]
    assert len(set(ports)) == 2 and all(p > 0 for p in ports)
    for s in specs:
        assert _flag(s.cmd, "--tp-size") == "4"
        assert "--disable-cuda-graph" in s.cmd
        assert _flag(s.cmd, "--max-running-requests") == "64"
        assert _flag(s.cmd, "--attention-backend") == "fa3"
        assert _flag(s.cmd, "--mem-fraction-static") == "0.6"
        assert _flag(s.cmd, "--dtype") == "float16"
        assert s.cmd[-2:] == ["--chunked-prefill-size", "4096"]


def test_sglang_d4t4_with_dp_attention_and_expert_parallel(tmp_path):
    moe = [
        "rollout.backend=sglang:d4t4",
        "actor.backend='archon:(attn:d1p4t2c2|ffn:d1p4t1e4)'",
        "sglang.dp_size=4",
        "sglang.ep_size=4",
        "sglang.enable_dp_attention=true",
    ]
    # Internal DP/EP never changes GPU counts: still 4 servers x 4 GPUs.
    specs = build_launch_specs(_cfg(*moe, "cluster.n_nodes=2", "cluster.n_gpus_per_node=16"), tmp_path, node=0)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1,2,3", "4,5,6,7", "8,9,10,11", "12,13,14,15"]
    for s in specs:
        assert _flag(s.cmd, "--tp-size") == "4"
        assert _flag(s.cmd, "--dp-size") == "4"
        assert _flag(s.cmd, "--ep-size") == "4"
        assert "--enable-dp-attention" in s.cmd
        assert "--enable-return-routed-experts" not in s.cmd
    replay = build_launch_specs(
        _cfg(*moe, "cluster.n_nodes=2", "cluster.n_gpus_per_node=16", "actor.moe_routing_replay=true"), tmp_path, node=0
    )
    assert all(s.cmd.count("--enable-return-routed-experts") == 1 for s in replay)  # routing replay asks SGLang
    # On 8-GPU nodes servers 2 and 3 land on node 1 and training on nodes 2-3: the trainer reaches
    # none of them, a cluster launcher starts each node's own.
    four_nodes = _cfg(*moe, "cluster.n_nodes=4", "cluster.n_gpus_per_node=8")
    with pytest.raises(ConfigError, match=r"server 2 on node 1 .*server 3 on node 1.*rollout.server_addrs"):
        build_launch_specs(four_nodes, tmp_path)
    on_node1 = build_launch_specs(four_nodes, tmp_path, node=1)
    assert [(s.index, s.env["CUDA_VISIBLE_DEVICES"]) for s in on_node1] == [(2, "0,1,2,3"), (3, "4,5,6,7")]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["sglang.dp_size=2"], "without sglang.enable_dp_attention would make SGLang start 2 replicas"),
        (["sglang.dp_size=3", "sglang.enable_dp_attention=true"], "dp_size = 3 must divide the server's tp size"),
        (["sglang.ep_size=8"], "ep_size = 8 must divide the server's tp size.*t4"),
    ],
)
def test_sglang_options_that_would_change_gpu_counts_are_rejected(tmp_path, overrides, message):
    cfg = _cfg("rollout.backend=sglang:d2t4", "actor.backend=archon:d8", "cluster.n_nodes=2", *overrides)
    with pytest.raises(ConfigError, match=message):
        build_launch_specs(cfg, tmp_path)


def test_local_d2_specs(tmp_path):
    cfg = _cfg(
        "rollout.backend=local:d2",
        "actor.backend=archon:d2",
        "cluster.n_gpus_per_node=4",
        "actor.dtype=float32",
        "sglang.random_seed=7",
        "sglang.context_length=2048",
        f"output_dir='{tmp_path}'",
    )
    specs = build_launch_specs(cfg, ports=[4100, 4101])
    assert [s.cmd for s in specs] == [
        [
            sys.executable,
            "-m",
            "archon.server.app",
            "--model-path",
            "/models/tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(4100 + i),
            "--dtype",
            "float32",
            "--random-seed",
            str(7 + i),
            "--context-length",
            "2048",
        ]
        for i in range(2)
    ]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["", ""]
    assert [s.addr for s in specs] == ["127.0.0.1:4100", "127.0.0.1:4101"]
    assert [s.log_path for s in specs] == [tmp_path / "rollout" / "server_0.log", tmp_path / "rollout" / "server_1.log"]
    assert ranks_per_server(ModelAllocation.from_str("local:d2")) == 1


def test_local_servers_take_the_deterministic_inference_flag(tmp_path):
    cfg = _cfg("rollout.backend=local:d1", "sglang.enable_deterministic_inference=true", f"output_dir='{tmp_path}'")
    (spec,) = build_launch_specs(cfg, ports=[4100])
    assert spec.cmd[-1] == "--enable-deterministic-inference"
    assert parse_args(spec.cmd[3:]).enable_deterministic_inference  # the built-in server's own parser takes it


def test_missing_model_path_is_a_clear_error(tmp_path):
    cfg = load_config(None, ["rollout.backend=local:d1"])
    with pytest.raises(ConfigError, match="set sglang.model_path or actor.path"):
        build_launch_specs(cfg, tmp_path)


def test_server_addrs_bypass_launching(tmp_path):
    cfg = load_config(
        None,
        [
            "rollout.backend=sglang:d2t4",
            "actor.backend=archon:d8",
            "cluster.n_nodes=2",
            "rollout.server_addrs=['10.0.0.5:30000', '10.0.0.6:30000']",
        ],
    )
    assert build_launch_specs(cfg, tmp_path) == []
    with RolloutLauncher.from_config(cfg, tmp_path) as launcher:
        assert launcher.addrs == ["10.0.0.5:30000", "10.0.0.6:30000"]
        assert launcher.pids == []
    assert not (tmp_path / "rollout").exists()


# ---------------------------------------------------------------------------------- real launches


def _fake_specs(tmp_path: Path, n: int = 2, extra: dict[int, list[str]] | None = None) -> list[LaunchSpec]:
    """The launcher's own local:dN specs, with the command swapped for the fake server script.

    Its /health answers at once: SGLang's one-second /health (the fake's default) only slows these
    tests of starting and stopping, and the launcher probes the servers one after the other.
    """
    cfg = _cfg(f"rollout.backend=local:d{n}", f"actor.backend=archon:d{n}", "cluster.n_gpus_per_node=4")
    specs = build_launch_specs(cfg, tmp_path)
    for s in specs:
        s.cmd = fake_command(s.port, "--host", s.host, "--health-delay-s", "0", *(extra or {}).get(s.index, []))
    return specs


def test_launch_two_fake_servers_wait_log_and_stop(tmp_path):
    specs = _fake_specs(tmp_path)
    with RolloutLauncher(specs, setup_timeout=300) as launcher:
        pids = launcher.pids
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        for addr in launcher.addrs:
            with urllib.request.urlopen(f"http://{addr}/health", timeout=5) as resp:
                assert resp.status == 200
        with RolloutClient(launcher.addrs, setup_timeout=300) as client:
            results = client.generate_many([[1, 2], [3, 4], [5, 6], [7]], {"max_new_tokens": 3, "temperature": 0})
        assert [r.output_ids for r in results] == [
            fake_completion(p, {"max_new_tokens": 3, "temperature": 0})[0] for p in ([1, 2], [3, 4], [5, 6], [7])
        ]
        assert {r.server for r in results} == {f"http://{a}" for a in launcher.addrs}
    assert not any(pid_alive(p) for p in pids)
    for i, s in enumerate(specs):
        log = (tmp_path / "rollout" / f"server_{i}.log").read_text()
        assert f"fake sglang starting on 127.0.0.1:{s.port}" in log


def test_servers_stop_when_the_body_raises(tmp_path):
    before = signal.getsignal(signal.SIGTERM)  # not always SIG_DFL: an earlier test may have started Ray here
    with pytest.raises(RuntimeError, match="trainer crashed"):
        with RolloutLauncher(_fake_specs(tmp_path), setup_timeout=300) as launcher:
            pids = launcher.pids
            raise RuntimeError("trainer crashed")
    assert pids and not any(pid_alive(p) for p in pids)
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored


def test_server_exiting_during_startup_reports_its_log_tail(tmp_path):
    specs = _fake_specs(tmp_path, extra={1: ["--crash-on-start", "model weights are corrupt"]})
    launcher = RolloutLauncher(specs, setup_timeout=300)
    with pytest.raises(
        RolloutLaunchError,
        match=r"server 1 .* exited with code 3 during startup(.|\n)*"
        r"model weights are corrupt",
    ):
        launcher.start()
    assert launcher.pids == []  # the healthy one was stopped too


def test_a_server_whose_port_was_taken_meanwhile_starts_on_another(tmp_path, monkeypatch):
    """Ports are picked before the servers bind them; another process may take one in between."""
    # The squatter accepts connections but never answers, so a /health probe of its port lasts the whole
    # probe timeout (30 s, for a busy SGLang) before the launcher sees the server's exit; the fakes answer
    # in about a second, so a short probe tests the same path without the wait.
    monkeypatch.setattr(launch_servers, "HEALTH_PROBE_TIMEOUT_S", 3.0)
    specs = _fake_specs(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", specs[0].port))
        taken.listen()
        with RolloutLauncher(specs, setup_timeout=300) as launcher:
            first = launcher.addrs[0]
            assert first != f"127.0.0.1:{specs[0].port}" and launcher.addrs[1] == specs[1].addr
            with urllib.request.urlopen(f"http://{first}/health", timeout=5) as resp:
                assert resp.status == 200
    log = (tmp_path / "rollout" / "server_0.log").read_text()
    assert "address already in use" in log.lower() and f"starting on {first}" in log


def test_startup_timeout_is_a_clear_error(tmp_path):
    specs = _fake_specs(tmp_path, n=1, extra={0: ["--startup-delay-s", "60"]})
    launcher = RolloutLauncher(specs, setup_timeout=1.0, stop_grace_s=2.0)
    # The log tail always holds the command line the launcher wrote first (the server may not have printed yet).
    with pytest.raises(
        RolloutLaunchError,
        match=r"server\(s\) 0 \(127.0.0.1:\d+\) not healthy after 1 s; raise "
        r"rollout.setup_timeout(.|\n)*--startup-delay-s 60",
    ):
        launcher.start()
    assert launcher.pids == []


_SELF_SIGNAL_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path
    sys.path[:0] = [{tests!r}, {repo!r}]
    from archon.launch.servers import LaunchSpec, RolloutLauncher, free_ports
    from fake_sglang import fake_command
    # As in a terminal: a shell's background job (a CI runner, a soak loop) inherits SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ports = free_ports(2)
    specs = [LaunchSpec(i, fake_command(p, "--health-delay-s", "0"), {{}}, "127.0.0.1", p,
                        Path({logs!r}) / f"server_{{i}}.log")
             for i, p in enumerate(ports)]
    launcher = RolloutLauncher(specs, setup_timeout=300)
    launcher.start()
    print(json.dumps(launcher.pids), flush=True)
    if {sig!r} == "exit":
        sys.exit(0)  # no stop(): atexit must clean up
    os.kill(os.getpid(), getattr(signal, {sig!r}))
    time.sleep(30)
    print("signal did not end the trainer", flush=True)
""")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "exit", "SIGKILL"])
def test_signal_or_exit_of_the_trainer_stops_the_servers(tmp_path, sig):
    script = _SELF_SIGNAL_SCRIPT.format(tests=str(SUPPORT), repo=str(REPO), logs=str(tmp_path), sig=sig)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    pids = json.loads(proc.stdout.splitlines()[0])
    assert len(pids) == 2
    assert "did not end" not in proc.stdout
    if sig == "exit":
        assert proc.returncode == 0
    elif sig == "SIGTERM":
        assert proc.returncode == -signal.SIGTERM  # it still dies of the signal, as without the launcher
    elif sig == "SIGINT":
        # KeyboardInterrupt was raised; uncaught, Python then exits by SIGINT.
        assert "KeyboardInterrupt" in proc.stderr and proc.returncode == -signal.SIGINT
    else:
        # No handler runs on SIGKILL: the servers learn of it from the kernel (parent-death signal).
        assert proc.returncode == -signal.SIGKILL
        wait_until(lambda: not any(pid_alive(p) for p in pids), "the servers to exit")
    assert not any(pid_alive(p) for p in pids)


# ---------------------------------------------------------------------------------- real SGLang


def _sglang_and_cuda() -> bool:
    try:
        import sglang  # noqa: F401  # pyright: ignore[reportMissingImports]
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _sglang_and_cuda(), reason="needs sglang and a CUDA device")
def test_launch_real_sglang(tmp_path):
    from hf_fixtures import save_tiny_hf

    save_tiny_hf(tmp_path / "model", "qwen3", max_shard_size="1GB")
    cfg = load_config(
        None,
        [
            "rollout.backend=sglang:d1t1",
            "actor.backend=archon:d1",
            "cluster.n_gpus_per_node=2",
            f"actor.path='{tmp_path / 'model'}'",
            "sglang.dtype=float32",
            "sglang.mem_fraction_static=0.3",
            "sglang.context_length=512",
            "sglang.disable_cuda_graph=true",
            "rollout.setup_timeout=600",
        ],
    )
    with RolloutLauncher.from_config(cfg, tmp_path) as launcher:
        with RolloutClient(launcher.addrs, setup_timeout=60, api_key=launcher.api_key) as client:
            results = client.generate_many(
                [[1, 2, 3], [4, 5]], {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
            )
            assert [len(r.output_ids) for r in results] == [4, 4]
            assert all(len(r.output_logprobs) == 4 and all(lp <= 0 for lp in r.output_logprobs) for r in results)
            client.update_weights_from_disk(str(tmp_path / "model"), "v1")
            assert client.generate([1, 2, 3], {"max_new_tokens": 1}).weight_version == "v1"
