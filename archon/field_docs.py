"""The one-line docstrings written under dataclass fields, read from the source.

Archon documents every config and command-line field with a string under it (as torchtitan
does); ``archon.config`` prints them (``--describe``) and the built-in server turns them into
``--help``.  Pure Python with no Archon imports, so either side can use it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (and its dataclass bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
