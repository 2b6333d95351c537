"""Add a model type to Archon from transformers' own implementation of it.

    python scripts/add_model.py llama                       # a transformers model_type
    python scripts/add_model.py /path/to/hf_folder --name my_llama

writes ``models/<name>/`` (spec, args, model, state-dict adapter, parallelize) and
``tests/models/test_<name>_parity.py``, registers the package, and prints what differs from
Archon's shared blocks (also written at the top of the generated ``model.py``).  The logic
lives in ``scaffold``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaffold import ScaffoldError, scaffold_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", help="a transformers model_type (e.g. llama) or a Hugging Face model folder")
    parser.add_argument("--name", help="package name under models/ (default: the model type)")
    parser.add_argument(
        "--models-dir",
        help="where to write the package (default: models/); other folders must be on $ARCHON_MODELS_PATH",
    )
    parser.add_argument("--tests-dir", help="where to write the parity test (default: tests/models/)")
    args = parser.parse_args(argv)
    try:
        result = scaffold_model(args.source, name=args.name, models_dir=args.models_dir, tests_dir=args.tests_dir)
    except ScaffoldError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
