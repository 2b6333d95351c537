"""``scripts/train_sft.py`` end to end under torchrun on a tiny HF folder (CPU, gloo).

The script's per-step losses must equal an independent single-process computation of the
same run (same seed, same data order) made with ``ArchonEngine`` directly, so the entry
point adds nothing to the numbers; and a rerun with the same output_dir resumes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import run_distributed
from hf_fixtures import make_tiny_tokenizer, save_tiny_hf
from paths import REPO

STEPS = 3


@pytest.fixture(scope="module")
def sft_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    model = root / "model"
    tok = make_tiny_tokenizer(model)
    save_tiny_hf(model, "qwen3", seed=4, vocab_size=len(tok))
    rows = [{"prompt": f"what is {a} + {b} ?", "completion": f"{a + b}"} for a in range(6) for b in range(4)]
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data, root


def _overrides(model: Path, data: Path, out: Path, backend: str) -> list[str]:
    return [
        f"actor.backend={backend}",
        f"actor.path={model}",
        "actor.dtype=float32",
        "actor.archon.enable_compile=false",
        "actor.optimizer.lr=1e-2",
        f"train_dataset.path={data}",
        "train_dataset.batch_size=8",
        f"total_train_steps={STEPS}",
        f"output_dir={out}",
        "cluster.n_gpus_per_node=4",
        "saver.export_hf=false",
        "seed=7",
    ]


def _torchrun(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--standalone",  # torchrun binds a free port itself: no window for another process to take it
        str(REPO / "scripts" / "train_sft.py"),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)


def _reference(model: str, data: str, out: str) -> list[float] | None:
    import torch.distributed as dist

    from archon.config import load_config
    from archon.sft import run_sft

    cfg = load_config(None, _overrides(Path(model), Path(data), Path(out), "archon:d1"))
    history = run_sft(cfg)
    return [h["loss"] for h in history] if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_train_sft_under_torchrun_matches_single_process(sft_setup):
    model, data, root = sft_setup
    out = root / "run_d2"
    proc = _torchrun(2, _overrides(model, data, out, "archon:d2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for key in ("step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "step_time_s", "peak_mem_gb"):
        assert all(r.get(key) is not None for r in records), key
    ref = run_distributed(_reference, 1, str(model), str(data), str(root / "run_ref"))[0]
    assert max(abs(r["loss"] - x) for r, x in zip(records, ref)) < 1e-4, (records, ref)
    assert (out / "checkpoints" / "latest").is_file()

    # Same command, more steps: resumes from the checkpoint at step 3 and continues.
    proc = _torchrun(2, _overrides(model, data, out, "archon:d2") + [f"total_train_steps={STEPS + 1}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 2))


def test_train_sft_reports_config_errors_in_one_line(sft_setup):
    model, data, root = sft_setup
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train_sft.py"), "actor.optimiser.lr=1"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2
    assert "unknown config key 'actor.optimiser'" in proc.stderr and "did you mean 'actor.optimizer'" in proc.stderr
    assert "Traceback" not in proc.stderr
