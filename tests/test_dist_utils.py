"""The fork harness (``archon.runtime.fork_ranks``) and the tests' wrapper around it (``run_distributed``)."""

import multiprocessing
import multiprocessing.connection
import os
import threading

import pytest
import torch
import torch.distributed as dist
from dist_utils import DistributedTestError, run_distributed

from archon.runtime.fork_ranks import RankError, run_ranks


def _all_reduce_rank() -> tuple[int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


def test_results_in_rank_order():
    assert run_distributed(_all_reduce_rank, 3) == [(0, 6.0), (1, 6.0), (2, 6.0)]


def test_failure_reports_rank_traceback():
    with pytest.raises(DistributedTestError, match="rank 1 failed(.|\n)*boom on rank one"):
        run_distributed(_fail_on_rank_one, 2, timeout=300)


def test_the_first_failure_is_named_even_when_its_peers_report_is_read_first(monkeypatch):
    # After rank 0's store port (the first message), the parent reads only once every rank has
    # reported: rank 0's "Connection reset by peer" from the barrier and rank 1's own error wait
    # side by side, rank 0's first in the list.
    real_wait = multiprocessing.connection.wait
    calls_with_messages = []

    def wait_for_all(conns, timeout=None):
        ready = real_wait(conns, timeout=timeout)
        if not timeout or not ready or not calls_with_messages:
            calls_with_messages.extend(ready[:1] if timeout else [])
            return ready
        while len(ready) < len(conns):
            ready = real_wait(conns, timeout=timeout)
        return sorted(ready, key=conns.index)

    monkeypatch.setattr(multiprocessing.connection, "wait", wait_for_all)
    with pytest.raises(DistributedTestError, match="rank 1 failed(.|\n)*boom on rank one"):
        run_distributed(_fail_on_rank_one, 2, timeout=120)
    assert calls_with_messages  # the port message passed through; the reports were read together


def _environment(tag: str) -> tuple[str, str, str, int]:
    return os.environ["ARCHON_TEST_TAG"], tag, os.environ["RANK"], torch.get_num_threads()


def _exit_without_reporting() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


def _raise_on_rank_one() -> None:
    # No collective on rank 0: a peer blocked in one fails too when rank 1 exits, and its report
    # may reach the parent first (see test_failure_reports_rank_traceback).
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")


def _hang() -> None:
    threading.Event().wait()


def test_env_kwargs_and_threads_reach_every_rank():
    results = run_distributed(_environment, 2, env={"ARCHON_TEST_TAG": "x", "RANK": "7"}, threads=2, tag="y")
    assert results == [("x", "y", "0", 2), ("x", "y", "1", 2)]  # the harness's RANK wins over env's


def test_rank_that_dies_is_named_with_its_exit_code():
    with pytest.raises(DistributedTestError, match=r"rank 1 died without reporting \(exit code 3\)"):
        run_distributed(_exit_without_reporting, 2)
    assert multiprocessing.active_children() == []


def test_ranks_past_the_deadline_are_named_and_killed():
    with pytest.raises(RankError, match=r"ranks \[0, 1\] did not finish within 2 s") as info:
        run_ranks(_hang, 2, timeout_s=2)
    assert info.value.ranks == [0, 1] and info.value.details == ""
    assert multiprocessing.active_children() == []


def test_library_error_is_one_line_with_the_traceback_apart():
    with pytest.raises(RankError, match=r"^rank 1 failed: ValueError: boom on rank one$") as info:
        run_ranks(_raise_on_rank_one, 2)
    assert info.value.ranks == [1] and "Traceback" in info.value.details
