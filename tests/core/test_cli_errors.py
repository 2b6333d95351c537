"""A user error under torchrun is one sentence on stderr, printed once, with a non-zero exit and no
traceback from Archon: whether every rank fails before the process group exists (a config key),
every rank fails on its own after it (a missing data file), or rank 0's failure is broadcast (a
reward function that always raises, which must also stop the run before anything is saved)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import run_distributed
from hf_fixtures import make_tiny_tokenizer, save_tiny_hf
from paths import REPO, helpers_pythonpath


@pytest.fixture(scope="module")
def rl_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = root / "model"
    tok = make_tiny_tokenizer(model)
    save_tiny_hf(model, "qwen3", seed=4, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    data = root / "rl.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is {a} ?", "answer": str(a)}) + "\n" for a in range(8)))
    return model, data, root


def _torchrun(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--standalone",  # torchrun binds a free port itself: no window for another process to take it
        str(REPO / "scripts" / "train_rl.py"),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": helpers_pythonpath()}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)


def _args(model: Path, data: Path, out: Path, **extra: object) -> list[str]:
    base = {
        "actor.backend": "archon:d2",
        "actor.path": model,
        "actor.dtype": "float32",
        "actor.archon.enable_compile": "false",
        "train_dataset.path": data,
        "train_dataset.batch_size": 2,
        "gconfig.n_samples": 2,
        "gconfig.max_new_tokens": 3,
        "total_train_steps": 2,
        "output_dir": out,
        "reward.n_workers": 0,
        "cluster.n_gpus_per_node": 4,
        "saver.freq_steps": 1,
        "saver.export_hf": "false",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _archon_frames(stderr: str) -> list[str]:
    """Traceback frames in Archon's own files (torchrun's summary of a failed worker is not Archon's)."""
    return [
        line
        for line in stderr.splitlines()
        if re.match(r'\s*File ".*/(archon|models|parallel|pipeline|scripts)/', line)
    ]


# One torchrun drill (every rank fails after the process group exists) stays in the default suite; the
# other two are end-to-end drills of paths the fast in-process test below covers (the rank that reports
# with and without a process group, the exit codes), and still run in CI.
@pytest.mark.parametrize(
    "case", [pytest.param("config", marks=pytest.mark.slow), "data", pytest.param("reward", marks=pytest.mark.slow)]
)
def test_user_error_under_torchrun_is_printed_once_without_traceback(rl_assets, case):
    model, data, root = rl_assets
    out = root / f"run_{case}"
    if case == "config":
        extra, needle, code = {"actor.optimizer.lrr": 0.1}, "unknown config key 'actor.optimizer.lrr'", 2
    elif case == "data":
        extra, needle, code = {"train_dataset.path": root / "missing.jsonl"}, "missing.jsonl' does not exist", 2
    else:
        extra, needle, code = {"reward.fn": "reward_fns:always_raises"}, "4 of 4 reward calls failed", 1
    result = _torchrun(_args(model, data, out, **extra))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-4000:]
    assert needle in errors[0], errors
    assert not _archon_frames(result.stderr), result.stderr[-4000:]
    # torchrun reports the worker's exit code as its own failure.
    assert result.returncode != 0 and f"exitcode  : {code}" in result.stderr, result.stderr[-3000:]
    if case == "reward":
        assert "did you mean 'actor.optimizer.lr'" not in errors[0]
        assert "reward_fns:always_raises" in errors[0] and "the reward service is down" in errors[0]
        # The failed step saved nothing: no checkpoint and no metrics line.
        assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
        assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()
    if case == "config":
        assert "did you mean 'actor.optimizer.lr'" in errors[0]


def _run_job_on_a_rank(argv: list[str], failure: str, with_group: bool) -> tuple[int, str]:
    """``run_job`` on this forked rank, whose job fails with ``failure``; its exit code and what it printed."""
    import contextlib
    import io

    import torch.distributed as dist

    from archon.cli import run_job
    from archon.errors import JobError

    def job(cfg: object) -> None:
        raise JobError(failure) if failure else AssertionError("the config error comes first")

    if not with_group:
        dist.destroy_process_group()  # as when the config fails, before any rank joins the group
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = run_job(job, None, argv)
    return code, stderr.getvalue()


@pytest.mark.parametrize("with_group", [True, False])
def test_one_rank_prints_the_error_all_ranks_share(with_group):
    """The in-process counterpart of the torchrun drills: exit codes 2 (bad input) and 1 (a failed run), and
    the error printed by exactly one rank, without a traceback: the first through the group's store, else rank 0."""
    cases = [
        (["actor.optimizer.lrr=0.1"], "", 2, "unknown config key 'actor.optimizer.lrr'"),
        (["actor.path=/models/tiny"], "the reward service is down", 1, "the reward service is down"),
    ]
    for argv, failure, code, needle in cases:
        ranks = run_distributed(_run_job_on_a_rank, 2, argv, failure, with_group, timeout=120)
        assert [c for c, _ in ranks] == [code, code], ranks
        printed = [(rank, out) for rank, (_, out) in enumerate(ranks) if out]
        assert len(printed) == 1, ranks
        rank, out = printed[0]
        assert out.startswith("error: ") and out.count("\n") == 1 and needle in out, out
        assert "Traceback" not in out
        if not with_group:
            assert rank == 0
