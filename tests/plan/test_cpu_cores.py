"""cluster.pin_cpu_cores: each CPU process of a run gets its own share of the node's cores."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hf_fixtures import save_tiny_hf
from paths import REPO
from server_utils import start_server

from archon.config import load_config
from archon.launch.servers import build_launch_specs
from archon.runtime import cpu_pinning
from archon.runtime.cpu_pinning import parse_core_list, slot_cores


@pytest.mark.parametrize(
    ("n_slots", "cores", "expected"),
    [
        (2, [0, 1], [(0,), (1,)]),
        (3, list(range(8)), [(0, 1, 2), (3, 4, 5), (6, 7)]),
        (4, list(range(8)), [(0, 1), (2, 3), (4, 5), (6, 7)]),
        # A cpuset that is not 0..n-1 (Slurm, cgroups): shares are by position in it.
        (2, [2, 3, 6, 7, 9], [(2, 3, 6), (7, 9)]),
        (3, [0, 1], [None, None, None]),
    ],
)
def test_slot_shares_are_contiguous_near_equal_and_cover_every_core_once(n_slots, cores, expected):
    shares = [slot_cores(s, n_slots, cores) for s in range(n_slots)]
    assert shares == expected
    if None not in shares:
        assert [c for share in shares for c in share or ()] == cores


def test_a_slot_outside_the_node_is_refused():
    with pytest.raises(ValueError, match="slot 2 is outside the node's 2 slots"):
        slot_cores(2, 2, [0, 1, 2, 3])


def test_core_lists_parse_or_say_what_is_expected():
    assert parse_core_list("0,2, 5") == (0, 2, 5)
    for bad in ("", "a,b", "-1"):
        with pytest.raises(ValueError, match="--cpu-cores"):
            parse_core_list(bad)


def _local_cfg(tmp_path: Path, *extra: str):
    return load_config(
        None,
        [
            "actor.path=/models/tiny",
            "rollout.backend=local:d2",
            "actor.backend=archon:d2",
            "cluster.n_gpus_per_node=4",
            f"output_dir='{tmp_path}'",
            *extra,
        ],
    )


def test_launched_servers_get_their_slots_share(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cpu_pinning, "_START_CORES", tuple(range(8)))
    specs = build_launch_specs(_local_cfg(tmp_path, "cluster.pin_cpu_cores=true"), ports=[4100, 4101])
    # The plan puts the servers on slots 0 and 1 of the node's 4 (the training ranks on 2 and 3).
    assert [s.cmd[s.cmd.index("--cpu-cores") + 1] for s in specs] == ["0,1", "2,3"]
    # Off by default, and off with fewer cores than slots (a warning says why).
    assert all("--cpu-cores" not in s.cmd for s in build_launch_specs(_local_cfg(tmp_path), ports=[4100, 4101]))
    monkeypatch.setattr(cpu_pinning, "_START_CORES", (0, 1))
    with caplog.at_level(logging.WARNING, logger="archon.runtime"):
        specs = build_launch_specs(_local_cfg(tmp_path, "cluster.pin_cpu_cores=true"), ports=[4100, 4101])
    assert all("--cpu-cores" not in s.cmd for s in specs)
    assert "rollout server 0 is not pinned, because this node's 2 allowed cores" in caplog.text


def _allowed(pid: int) -> dict[int, str]:
    """Cpus_allowed_list of every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        out[int(tid)] = next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
    return out


def test_a_training_rank_pins_itself_and_its_later_threads():
    """``init_run`` with pin_cpu_cores in a fresh process: its last core (the one training slot of
    a node of 2 processes), and a thread started afterwards has it too."""
    code = textwrap.dedent(
        """
        import json, os, sys, threading, torch
        from archon.cli import init_run
        from archon.config import load_config
        from archon.runtime.cpu_pinning import slot_cores
        start = sorted(os.sched_getaffinity(0))
        cfg = load_config(None, ["actor.path=/models/tiny", "rollout.backend=local:d1", "actor.backend=archon:d1",
                                 "cluster.n_gpus_per_node=2", "cluster.pin_cpu_cores=true", "device=cpu"])
        init_run(cfg, "rl")
        seen = {}
        t = threading.Thread(target=lambda: seen.update(cores=sorted(os.sched_getaffinity(0))))
        t.start(); t.join()
        print(json.dumps({"start": start, "expected": slot_cores(1, 2, start), "main": sorted(os.sched_getaffinity(0)),
                          "thread": seen["cores"], "threads": torch.get_num_threads()}))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "4"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    got = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = got["expected"]
    if expected is None:  # a 1-core machine: nothing to pin
        assert got["main"] == got["start"]
        return
    assert got["main"] == got["thread"] == list(expected)
    assert got["threads"] == min(4, len(expected))


def test_the_built_in_server_runs_every_thread_on_its_cores(tmp_path):
    save_tiny_hf(tmp_path / "model", "qwen3", seed=3)
    core = max(os.sched_getaffinity(0))
    server = start_server(tmp_path / "model", "--cpu-cores", str(core))
    try:
        threads = _allowed(server.proc.pid)
        # The HTTP loop, the generation thread and any helper threads alike.
        assert len(threads) >= 2 and set(threads.values()) == {str(core)}
    finally:
        server.stop()


def test_a_server_pinned_to_a_core_it_may_not_use_says_so(tmp_path):
    save_tiny_hf(tmp_path / "model", "qwen3", seed=3)
    bad = os.cpu_count() or 1  # one past the last core
    proc = subprocess.run(
        [sys.executable, "-m", "archon.server.app", "--model-path", str(tmp_path / "model"), "--cpu-cores", str(bad)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert f"cannot pin to CPU cores {bad}" in proc.stderr
