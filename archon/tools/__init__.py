"""Tools a user runs on a run's outputs: ``python -m archon.tools.plot OUTPUT_DIR``."""
