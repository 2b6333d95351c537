"""``python -m archon.config --config x.toml [overrides]``: the resolved config, the allocation table, and the
start checks of ``archon.config.preflight`` (hub ids are looked up in the local cache, not downloaded)."""

import functools
import sys

from archon.config.preflight import preflight
from archon.config.show import main

sys.exit(main(check=functools.partial(preflight, download=False)))
