"""``python -m archon.config --config x.toml [overrides]``: the resolved config and allocation table."""

import sys

from archon.config.show import main

sys.exit(main())
