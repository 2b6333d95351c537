"""RL post-training (PPO / GRPO) with rollouts from SGLang or Archon's built-in servers.

    torchrun --nproc_per_node=N scripts/train_rl.py --config x.toml [dotted.key=value ...]

Rerunning the same command with the same output_dir resumes from the last checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import sys

from archon.config import ConfigError, load_config
from archon.engine.dist import shutdown_distributed
from archon.rl.trainer import RankZeroError, RLTrainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ok = False
    try:
        cfg = load_config(args.config, args.overrides)
        RLTrainer(cfg).run()
        ok = True
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RankZeroError as exc:
        # Rank 0 logged the traceback; every rank ends with the same one-line reason.
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown_distributed(barrier=ok)
    return 0


if __name__ == "__main__":
    sys.exit(main())
