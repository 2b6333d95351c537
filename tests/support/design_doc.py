"""The rules DESIGN.md states, read from its tables: the layer table and the table of ``archon``'s packages.

The guard tests take their rules from here, so the document and the checks cannot drift apart.
"""

from __future__ import annotations

import re

from paths import REPO

DESIGN = REPO / "DESIGN.md"
THIRD_PARTY = "<third-party>"
"""Stands for any installed package that is neither the standard library nor Archon's own."""


def _table_rows(title: str) -> list[list[str]]:
    """The body rows of the first table under the ``## title`` section, as lists of cell texts."""
    text = DESIGN.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    rows = []
    for line in text[start : end if end > 0 else None].splitlines():
        if line.startswith("|") and not set(line) <= set("|- "):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows[1:]  # the header row


def _names(cell: str) -> list[str]:
    """Backticked names of a cell, or its comma-separated words when none are backticked."""
    ticked = re.findall(r"`([^`]+)`", cell)
    return ticked or [w.strip() for w in cell.split(",") if w.strip() and w.strip() != "—"]


def layers() -> dict[str, set[str]]:
    """Top-level folder -> what it may import besides the standard library and itself."""
    out = {}
    for folder, _, may in _table_rows("The layers, bottom to top"):
        name = _names(folder)[0].rstrip("/")
        out[name] = {THIRD_PARTY if w == "third-party" else w for w in _names(may)}
    return out


def archon_packages() -> dict[str, tuple[str, ...]]:
    """Package of ``archon`` (dotted) -> the packages of ``archon`` it never imports."""
    out = {}
    for package, _, never in _table_rows("Inside `archon/`"):
        name = _names(package)[0].rstrip("/").replace("/", ".")
        out[name] = tuple(_names(never))
    return out
