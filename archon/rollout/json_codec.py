"""JSON for the rollout client's requests and answers: orjson, with the standard library behind it.

A rollout round is one batched request of a few hundred prompts and an answer of ~100 KB; the
client encodes and decodes them on the trainer's side, where the standard library's ``json``
took ~3 ms of CPU a round of the digits demo (~3% of an asynchronous step) and orjson takes
under a third of that.  What orjson refuses (integers beyond 64 bits, ``NaN`` literals in an answer,
objects it cannot serialise) goes through ``json`` as before, so nothing a server or a caller
could send stops working.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

JSON_HEADERS = {"Content-Type": "application/json"}
"""Headers of a request whose body comes from ``dumps``."""


def dumps(obj: Any) -> bytes:
    """``obj`` as a JSON body (non-string dict keys become strings, as ``json.dumps`` makes them)."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return json.dumps(obj).encode()


def loads(data: bytes) -> Any:
    """A decoded JSON body; ``ValueError`` if it is not JSON (``NaN`` and ``Infinity`` are accepted, as by ``json``)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)
