"""RL runs for the trainer tests: config overrides, and runs on forked ranks."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dist_utils import run_distributed


def overrides(model: Path, data: Path, out: Path, backend: str = "archon:d1", **extra) -> list[str]:
    base = {
        "actor.backend": backend,
        "actor.path": str(model),
        "actor.dtype": "float32",
        "actor.archon.enable_compile": False,
        "actor.optimizer.lr": 1e-2,
        "actor.optimizer.max_grad_norm": 1.0,
        "train_dataset.path": str(data),
        "train_dataset.batch_size": 4,
        "gconfig.n_samples": 4,
        "gconfig.max_new_tokens": 5,
        "total_train_steps": 3,
        "output_dir": str(out),
        # Characters of the completion: random completions of a tiny model get varied rewards.
        "reward.fn": "reward_fns:length_reward",
        "reward.n_workers": 0,
        "cluster.n_gpus_per_node": 8,
        "saver.export_hf": False,
        "seed": 3,
    }
    base.update(extra)
    return [
        f"{k}={json.dumps(v) if isinstance(v, str) else v if not isinstance(v, bool) else str(v).lower()}"
        for k, v in base.items()
    ]


def _train(args: list[str]) -> list[dict] | None:
    import torch.distributed as dist

    from archon.config import load_config
    from archon.rl.trainer import RLTrainer

    history = RLTrainer(load_config(None, args)).run()
    return history if dist.get_rank() == 0 else None


def _run(world: int, args: list[str]) -> list[dict]:
    return run_distributed(_train, world, args, timeout=600)[0]


def train_forced_async(args: list[str], slow_s: float = 0.0) -> list[dict] | None:
    """A run through the asynchronous loop whatever k is; ``slow_s`` makes each training step slower."""
    import torch.distributed as dist

    from archon.config import load_config
    from archon.rl.trainer import RLTrainer

    class Async(RLTrainer):
        def _asynchronous(self) -> bool:
            return True

        def _prepare(self, batch):
            time.sleep(slow_s)
            return super()._prepare(batch)

    history = Async(load_config(None, args)).run()
    return history if dist.get_rank() == 0 else None


def _train_expecting_failure(args: list[str]) -> str:
    from archon.config import load_config
    from archon.rl.trainer import RLTrainer

    try:
        RLTrainer(load_config(None, args)).run()
    except Exception as exc:  # noqa: BLE001 - the test inspects what every rank saw
        return f"{type(exc).__name__}: {exc}"
    return "no error"
