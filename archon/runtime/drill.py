"""Kill-and-resume drills: stop a training process at a named moment so a test can kill the run there.

Killing a run at a random time rarely lands inside a short phase such as a weight sync.  For
the drill tests, ``ARCHON_DRILL_PAUSE="<phase>:<n>"`` makes the process that reaches
``drill_point("<phase>")`` for the n-th time write ``ARCHON_DRILL_FILE`` (a JSON object with
the phase, n and its pid) and then wait forever, in the middle of that phase, until the test
kills the run.  Phases:

- ``rollout``: rank 0, generation requests in flight at the servers;
- ``optimizer_step``: gradients reduced, the optimizer step not taken (every rank);
- ``weight_sync``: rank 0, a bucket of weights half broadcast to the servers;
- ``checkpoint``: the first engine's shards written, the checkpoint not complete (every rank).

Without ``ARCHON_DRILL_PAUSE`` (every real run) ``drill_point`` does nothing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

PAUSE_ENV = "ARCHON_DRILL_PAUSE"
FILE_ENV = "ARCHON_DRILL_FILE"
PHASES = ("rollout", "optimizer_step", "weight_sync", "checkpoint")

_reached: dict[str, int] = {}


def drill_point(phase: str) -> None:
    """Mark that this process reached ``phase``; pause here forever if the drill asks for it."""
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    _reached[phase] = _reached.get(phase, 0) + 1
    wanted, _, count = spec.partition(":")
    if wanted != phase or _reached[phase] != int(count or 1):
        return
    marker = os.environ.get(FILE_ENV)
    if marker:
        tmp = Path(f"{marker}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"phase": phase, "n": _reached[phase], "pid": os.getpid()}))
        tmp.replace(marker)
    while True:  # until killed: the drill test's SIGKILL, or the parent-death signal after it
        time.sleep(3600)
