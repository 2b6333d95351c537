"""``python -m archon.eval --config x.toml [overrides] --model PATH`` (see ``archon.eval.cli``)."""

import sys

from archon.eval.cli import main

sys.exit(main())
