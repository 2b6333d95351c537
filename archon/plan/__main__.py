"""``python -m archon.plan [rehearse] --config x.toml [overrides]`` (see ``archon.plan.show``)."""

import sys

from archon.plan.show import main

sys.exit(main())
