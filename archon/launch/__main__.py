"""``python -m archon.launch slurm|ray|serve-node|prepare ...`` (see ``archon.launch.cli``)."""

import sys

from archon.launch.cli import main

sys.exit(main())
