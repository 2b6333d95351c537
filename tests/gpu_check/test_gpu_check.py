"""``scripts/gpu_check.py``: its CPU rows pass here, its CUDA rows are skipped (never passed), and each
check catches the mistake it exists for (the code under check is broken on purpose and the row fails)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from paths import REPO

import models.common.moe as moe
from archon.gpu_check import CHECKS, Check, Outcome, kernels, run_checks
from archon.gpu_check.cli import main
from archon.gpu_check.table import NEEDS_CUDA, Context, failed
from models.common.attention import CoreAttention

CPU = torch.device("cpu")


def whole_row_attention(self, q, k, v, cu_seqlens, gqa):
    """A packed-attention bug: causal over the whole row, so a sequence sees the ones before it."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.scale, enable_gqa=gqa
    )
    return out.transpose(1, 2)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "table.json"
    # Without CUDA the default (--device cuda) must fall back by itself; with CUDA ask for the CPU run.
    device = ["--device", "cpu"] if torch.cuda.is_available() else []
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", *device, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, out


@pytest.mark.slow  # the whole CPU run: ~10 tiny engines and a built-in server (~20 s on an idle 2-core machine)
def test_cpu_run_passes_its_rows_and_skips_the_cuda_ones(cpu_run):
    proc, out = cpu_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if not torch.cuda.is_available():
        assert "CUDA is not available here; running the CPU checks" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["environment"]["device"] == "cpu"
    rows = {r["name"]: r for r in doc["rows"]}
    assert list(rows) == [c.name for c in CHECKS]
    for check in CHECKS:
        row = rows[check.name]
        assert set(row) == {"name", "status", "measured", "tolerance", "seconds", "note"}
        if check.needs_cuda:
            assert (row["status"], row["note"]) == ("skip", NEEDS_CUDA), row
        else:
            assert row["status"] == "pass", row
            assert row["measured"] and row["tolerance"], row
    # The table is printed too, with its totals.
    assert "train_moe" in proc.stdout and f"{sum(not c.needs_cuda for c in CHECKS)} pass, 0 fail" in proc.stdout


def test_attention_row_fails_when_sequences_see_each_other(monkeypatch, tmp_path):
    assert kernels.check_packed_attention(Context(CPU, tmp_path)).status == "pass"
    monkeypatch.setattr(CoreAttention, "_per_sequence", whole_row_attention)
    out = kernels.check_packed_attention(Context(CPU, tmp_path))
    assert out.status == "fail" and out.measured["out_err"] > 0.01 and out.measured["grad_err"] > 0.01


def test_experts_row_fails_when_an_empty_group_shifts_the_others(monkeypatch, tmp_path):
    real = moe._run_experts_loop

    def skips_empty_groups(w1, w2, w3, x, counts):
        # Empty experts dropped from the counts but not from the weights: later groups meet the wrong expert.
        nonempty = counts[counts > 0]
        n = nonempty.numel()
        return real(w1[:n], w2[:n], w3[:n], x, nonempty)

    monkeypatch.setattr(moe, "_run_experts_loop", skips_empty_groups)
    out = kernels.check_experts_loop(Context(CPU, tmp_path))
    assert out.status == "fail" and out.measured["out_err"] > 0.1


def test_a_raising_or_hanging_check_is_an_error_row_and_the_others_still_run(tmp_path):
    def raises(ctx: Context) -> Outcome:
        raise RuntimeError("kaput\nsecond line of the message")

    def hangs(ctx: Context) -> Outcome:
        time.sleep(30)
        return Outcome("pass")

    def passes(ctx: Context) -> Outcome:
        return Outcome("pass", {"x": 1}, "x == 1")

    checks = [
        Check("raises", raises, False, 10, ""),
        Check("hangs", hangs, False, 0.3, ""),
        Check("cuda_only", passes, True, 10, ""),
        Check("passes", passes, False, 10, ""),
    ]
    t0 = time.monotonic()
    rows = run_checks(checks, Context(CPU, tmp_path))
    assert time.monotonic() - t0 < 10  # the hanging check was cut at its budget
    assert [(r.name, r.status) for r in rows] == [
        ("raises", "error"),
        ("hangs", "error"),
        ("cuda_only", "skip"),
        ("passes", "pass"),
    ]
    assert rows[0].note.startswith("RuntimeError: kaput (at test_gpu_check.py:") and "\n" not in rows[0].note
    assert "over its time budget" in rows[1].note
    assert rows[2].note == NEEDS_CUDA
    assert failed(rows) and not failed(rows[2:])


def _run_with_broken_engine_code(out: str) -> tuple[int, dict[str, str]]:
    """In a forked rank: break packed attention and checkpoint loading, run the CLI on some rows."""
    from archon.engine import ArchonEngine

    CoreAttention._per_sequence = whole_row_attention  # pyright: ignore[reportAttributeAccessIssue]
    ArchonEngine.load = lambda self, path: {"data_position": 2}  # pretends, loads nothing
    code = main(["--device", "cpu", "--only", "train_dense,dcp_roundtrip,experts_loop", "--out", out])
    rows = json.loads(Path(out).read_text())["rows"]
    return code, {r["name"]: r["status"] for r in rows}


def test_engine_rows_catch_broken_packing_and_loading_and_the_exit_code_says_so(tmp_path):
    code, statuses = run_distributed(_run_with_broken_engine_code, 1, str(tmp_path / "t.json"))[0]
    assert statuses == {"train_dense": "fail", "dcp_roundtrip": "fail", "experts_loop": "pass"}
    assert code == 1


def test_unknown_check_names_are_refused(capsys):
    assert main(["--only", "train_dense,no_such_check"]) == 2
    assert "unknown check(s) no_such_check" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernel_rows_pass_on_a_gpu(tmp_path):
    ctx = Context(torch.device("cuda", 0), tmp_path)
    by_name = {c.name: c for c in CHECKS}
    rows = run_checks([by_name[n] for n in ("cuda_environment", "varlen_attention", "grouped_gemm")], ctx)
    assert all(r.status in ("pass", "skip") for r in rows), rows
