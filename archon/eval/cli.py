"""``python -m archon.eval --config x.toml [dotted.key=value ...] --model PATH``: evaluate a saved model as a run does.

``PATH`` is a Hugging Face folder (a run's ``hf`` export, or any model folder) or a checkpoint: a run's
``checkpoints/step_<N>`` folder, or a run directory (its newest complete checkpoint).  A checkpoint's actor is first
exported as a Hugging Face folder under the output folder (one process; the config's ``actor.path`` gives the
architecture).  Rollout servers come from the config as for training (``archon.launch.discovery.server_source``):
built-in ``local:dN`` or SGLang/vLLM servers launched on this machine from the model, or ``rollout.server_addrs``
already serving it.  The evaluation is the one the run makes on ``valid_dataset`` with ``evaluator``
(``archon.eval.evaluation``); it prints a table of the ``eval/*`` metrics and writes ``<name>.jsonl`` (one line per
completion) and ``<name>.metrics.json`` under ``--out`` (default ``<run_dir>/eval``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from archon.checkpoint.manager import CheckpointManager
from archon.config import Config, ConfigError, load_config
from archon.data.encoding import load_tokenizer
from archon.engine import build_engine
from archon.engine.dist import init_distributed, resolve_device_type, shutdown_distributed
from archon.errors import user_error_types
from archon.eval.evaluation import EvalSample, write_results
from archon.eval.periodic import build_evaluation
from archon.launch.discovery import server_source
from archon.rl.rewards import RewardComputer
from archon.rl.scoring import CompletionScorer
from archon.rollout.client import RolloutClient
from archon.rollout.server_api import sampling_params

logger = logging.getLogger("archon.eval")


def run_sampling(cfg: Config, tokenizer: Any) -> dict[str, Any]:
    """The run's sampling parameters, stopping on the tokenizer's EOS too (as the trainer's requests do)."""
    eos = tokenizer.eos_token_id
    stop = sorted(set(cfg.gconfig.stop_token_ids) | ({eos} if eos is not None else set()))
    return sampling_params(cfg.gconfig, stop_token_ids=stop)


def find_checkpoint(path: Path) -> Path | None:
    """The checkpoint step folder ``path`` names (a step folder, or a run directory's newest), or None."""
    if (path / "actor").is_dir():
        return path
    if (path / "checkpoints").is_dir():
        return CheckpointManager(path).latest()
    return None


def export_checkpoint(cfg: Config, step_dir: Path, dest: Path) -> Path:
    """The actor of checkpoint ``step_dir`` as a Hugging Face folder ``dest``, on one process (any allocation)."""
    if not cfg.actor.path:
        raise ConfigError(
            f"{step_dir} is a checkpoint; set actor.path to the run's starting model folder (its architecture and "
            "tokenizer) so that its weights can be loaded"
        )
    init_distributed(resolve_device_type(cfg.device))
    try:
        backend = cfg.actor.backend.split(":", 1)[0]
        cfg.actor.backend = f"{backend}:d1"  # the checkpoint reshards onto one process
        engine = build_engine(cfg.actor, name="actor", trainable=False, seed=cfg.seed, device=cfg.device)
        engine.initialize()
        engine.load(step_dir / "actor")
        engine.export_hf(dest)
        load_tokenizer(cfg.actor.path).save_pretrained(dest)
    finally:
        shutdown_distributed()
    logger.info("exported the actor of %s to %s", step_dir, dest)
    return dest


def evaluate_model(cfg: Config, out: Path, name: str) -> tuple[list[EvalSample], dict[str, float]]:
    """Start (or reach) the servers of ``cfg`` on its ``actor.path``, evaluate, write ``out/<name>.*``."""
    if not cfg.valid_dataset.path:
        raise ConfigError(
            "valid_dataset.path is empty; set it to the prompts to evaluate on (a jsonl, json or parquet)"
        )
    if cfg.allocations()["rollout"].backend == "inprocess":
        raise ConfigError(
            "python -m archon.eval needs rollout servers, not rollout.backend = 'inprocess:...'; set it to 'local:d1' "
            "(built-in CPU server), 'sglang:...' or 'vllm:...'"
        )
    tokenizer = load_tokenizer(cfg.actor.path)
    evaluation = build_evaluation(cfg, tokenizer, run_sampling(cfg, tokenizer))
    r = cfg.reward
    launcher = server_source(cfg)
    client: RolloutClient | None = None
    rewards: RewardComputer | None = None
    try:
        addrs = launcher.start()
        client = RolloutClient.from_config(cfg.rollout, addrs, api_key=launcher.api_key)
        client.wait_healthy(cfg.rollout.setup_timeout)
        rewards = RewardComputer(
            r.fn, n_workers=r.n_workers, timeout_s=r.timeout_s, max_failure_frac=r.max_failure_frac
        )
        samples, metrics = evaluation.run(client, CompletionScorer(rewards, tokenizer))
    finally:
        if rewards is not None:
            rewards.close()
        if client is not None:
            client.close()
        launcher.stop()
    write_results(out, name, samples, metrics)
    return samples, metrics


def print_metrics(metrics: dict[str, float], title: str, console: Console | None = None) -> None:
    """The ``eval/*`` metrics as a two-column table."""
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) and not value.is_integer() else f"{value:g}")
    (console or Console()).print(table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m archon.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="TOML config file (valid_dataset, evaluator, reward, gconfig, rollout)")
    parser.add_argument(
        "--model",
        default="",
        help="Hugging Face folder, checkpoint step folder or run directory; empty: actor.path (e.g. with "
        "rollout.server_addrs already serving it)",
    )
    parser.add_argument("--out", default="", help="folder of the results; default <run_dir>/eval")
    parser.add_argument("--name", default="", help="file name of the results; default eval_<model folder name>")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides (a leading + is accepted)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        out = Path(args.out) if args.out else cfg.run_dir / "eval"
        model = Path(args.model or cfg.actor.path)
        name = args.name or f"eval_{model.resolve().name}"
        if args.model:
            step_dir = None if (model / "config.json").is_file() else find_checkpoint(model)
            if step_dir is not None:
                model = export_checkpoint(cfg, step_dir, out / f"hf_{step_dir.name}")
            elif not (model / "config.json").is_file():
                raise ConfigError(
                    f"--model {args.model} is neither a Hugging Face folder (config.json) nor a checkpoint (a "
                    "checkpoints/step_<N> folder or a run directory with complete checkpoints)"
                )
            # The servers start from the model evaluated, whatever the config's server model says.
            cfg.actor.path = cfg.sglang.model_path = cfg.vllm.model = str(model)
        _, metrics = evaluate_model(cfg, out, name)
    except user_error_types() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    print_metrics(metrics, f"evaluation of {model} on {cfg.valid_dataset.path}")
    print(f"per-completion results: {out / (name + '.jsonl')}")
    return 0
