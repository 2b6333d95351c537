"""Guard rails: imports only go down the layer table of the design, and files stay small.

The table lives here as data (it is DESIGN.md's "The layers, bottom to top").  Every module of
the library is parsed with ``ast`` (no import runs), and every import counts: top-level,
inside functions, and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

THIRD_PARTY = "<third-party>"
"""Stands for any installed package that is neither the standard library nor Archon's own."""

LAYERS: dict[str, set[str]] = {
    "parallel": {"torch"},
    "pipeline": {"torch", "parallel"},
    "models": {"torch", "safetensors", "transformers", "parallel", "pipeline"},
    "scaffold": {"torch", "models", THIRD_PARTY},
    "archon": {"parallel", "pipeline", "models", THIRD_PARTY},
    "scripts": {"archon", "scaffold", THIRD_PARTY},
}
"""Each top-level folder and what it may import besides the standard library and itself."""

MODEL_CODE_MAY_IMPORT = {"torch", "models"}
"""What single-device model code (``models/common/`` but its ``infra/``, ``models/*/model/``) may import."""

FORBIDDEN_INSIDE_ARCHON: dict[str, tuple[str, ...]] = {
    "archon.engine": ("archon.rl", "archon.rollout", "archon.server", "archon.launch"),
    "archon.checkpoint": ("archon.rl", "archon.engine", "archon.rollout", "archon.server", "archon.launch"),
    "archon.rollout": ("archon.rl", "archon.engine", "archon.server", "archon.launch"),
    "archon.server": ("archon.rl", "archon.engine", "archon.rollout", "archon.launch"),
    "archon.wire": ("archon.rl", "archon.engine", "archon.rollout", "archon.server", "archon.launch"),
}
"""Packages of ``archon`` and the ones they never import (the client and the built-in server share ``archon.wire``)."""

CLUSTER_ENTRY_POINTS = ("archon.launch.cli", "archon.launch.slurm", "archon.launch.ray_cluster", "archon.launch.serve")
"""``python -m archon.launch``'s modules: nothing outside ``archon.launch`` imports them."""

ALLOWED_BY_DESIGN: dict[str, set[str]] = {
    # DESIGN.md: "add_model.py (its logic lives in models/, next to the packages it writes)".
    "scripts/add_model.py": {"models"}
}
"""Single files the design itself lets import more than their layer."""

PENDING: dict[str, str] = {}
"""Known violations, each with its fix; the test fails when one is gone, so this list only shrinks."""

LIBRARY = ("parallel", "pipeline", "models", "scaffold", "archon", "scripts")
LONG_FILE_LINES = 600
"""A library file past this is reported as a warning: a hint to look for a second job in it, not a rule."""
MAX_LINES = 1000
"""Longest library file (any top-level package, scripts): past this it surely holds several jobs."""
MAX_TEST_LINES = 800
"""Longest file under tests/ (test files hold many small cases; splitting them duplicates fixtures)."""


@dataclass(frozen=True)
class Import:
    source: str
    """Importing file, relative to the repository."""
    line: int
    """Line of the import statement."""
    targets: tuple[str, ...]
    """Dotted names it may import: the module, and ``module.name`` for each ``from`` name (maybe a submodule)."""


def _module_name(rel: str) -> str:
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(rel: str, text: str) -> list[Import]:
    """Every import of the module at ``rel`` (relative to the repository) whose source is ``text``."""
    tree = ast.parse(text, filename=rel)
    package = _module_name(rel) if rel.endswith("/__init__.py") else _module_name(rel).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(Import(rel, node.lineno, (alias.name,)) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([module] if module else []))
            names = tuple(f"{module}.{alias.name}" for alias in node.names if alias.name != "*")
            found.append(Import(rel, node.lineno, (module, *names)))
    return found


def _library_files() -> list[Path]:
    return sorted(p for top in LIBRARY for p in (REPO / top).rglob("*.py"))


def _kind(name: str) -> str:
    top = name.split(".")[0]
    if top in LAYERS:
        return top
    if top in sys.stdlib_module_names:
        return "<stdlib>"
    return top


def _is_model_code(rel: str) -> bool:
    """``models/common/`` (but its ``infra/``, the decoder's parallel plan) and ``models/<package>/model/``."""
    if rel.startswith("models/common/infra/"):
        return False
    parts = rel.split("/")
    return rel.startswith("models/common/") or (len(parts) > 3 and parts[0] == "models" and parts[2] == "model")


def _violation(imp: Import) -> str | None:
    """Why ``imp`` runs against the table, as ``"<file> -> <what>"``, or None."""
    layer = imp.source.split("/")[0]
    target = imp.targets[0]
    kind = _kind(target)
    if kind in ("<stdlib>", layer):
        pass
    elif kind in LAYERS:
        if kind not in LAYERS[layer] and kind not in ALLOWED_BY_DESIGN.get(imp.source, set()):
            return f"{imp.source} -> {kind}"
    elif kind not in LAYERS[layer] and THIRD_PARTY not in LAYERS[layer]:
        return f"{imp.source} -> {kind}"
    if _is_model_code(imp.source) and kind not in ("<stdlib>", *MODEL_CODE_MAY_IMPORT):
        return f"{imp.source} -> {kind} (model code)"
    if layer == "archon":
        module = _module_name(imp.source)
        for name in imp.targets:
            if not module.startswith("archon.launch") and any(
                name == e or name.startswith(e + ".") for e in CLUSTER_ENTRY_POINTS
            ):
                return f"{imp.source} -> archon.launch"
            for package, forbidden in FORBIDDEN_INSIDE_ARCHON.items():
                for f in forbidden:
                    if module.startswith(package) and (name == f or name.startswith(f + ".")):
                        return f"{imp.source} -> {f}"
    return None


def _violations_of(rel: str, text: str) -> set[str]:
    return {why for imp in _imports(rel, text) if (why := _violation(imp)) is not None}


def test_the_scan_sees_every_kind_of_import():
    # Guards the guard: TYPE_CHECKING, function-level, relative and `from package import module` imports count.
    text = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from archon.rl import trainer\n"
        "def f():\n    from ..engine import engine\n    import archon.launch.cli\n    from archon import rl\n"
    )
    assert _violations_of("archon/rollout/probe.py", text) == {
        "archon/rollout/probe.py -> archon.rl",
        "archon/rollout/probe.py -> archon.engine",
        "archon/rollout/probe.py -> archon.launch",
    }
    assert _violations_of("parallel/probe.py", "import numpy\nfrom pipeline import split\n") == {
        "parallel/probe.py -> numpy",
        "parallel/probe.py -> pipeline",
    }
    assert _violations_of("models/common/probe.py", "from parallel.dims import ParallelDims\n") == {
        "models/common/probe.py -> parallel (model code)"
    }
    assert _violations_of("models/common/infra/probe.py", "from parallel.dims import ParallelDims\n") == set()
    assert _violations_of("pipeline/probe.py", "import os, torch\nfrom parallel import dims\n") == set()
    assert _violations_of("scripts/probe.py", "import models\n") == {"scripts/probe.py -> models"}


def test_imports_only_go_down_the_layer_table():
    files = _library_files()
    assert len(files) > 150  # the walk really covered the library
    violations: dict[str, int] = {}
    for path in files:
        for imp in _imports(path.relative_to(REPO).as_posix(), path.read_text()):
            why = _violation(imp)
            if why is not None:
                violations.setdefault(why, imp.line)
    unexpected = sorted(f"{why} (line {line})" for why, line in violations.items() if why not in PENDING)
    fixed = sorted(set(PENDING) - set(violations))
    assert not unexpected, "imports against the layer table in DESIGN.md:\n" + "\n".join(unexpected)
    assert not fixed, f"no longer violated, remove from PENDING: {fixed}"


def test_model_code_is_single_device():
    # models/common/ and models/*/model/ never mention meshes, ranks or parallel techniques.
    checked = [p for p in _library_files() if _is_model_code(p.relative_to(REPO).as_posix())]
    assert len(checked) >= 20
    for path in checked:
        text = path.read_text()
        assert "DeviceMesh" not in text and "torch.distributed" not in text, path


def _line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_library_file_grows_past_the_limit():
    lengths = {p.relative_to(REPO).as_posix(): _line_count(p) for p in _library_files()}
    over = {f: n for f, n in lengths.items() if n > MAX_LINES}
    assert not over, f"library files over {MAX_LINES} lines (split them by job): {over}"
    long = {f: n for f, n in lengths.items() if n > LONG_FILE_LINES}
    if long:
        warnings.warn(f"library files over {LONG_FILE_LINES} lines (do they hold two jobs?): {long}", stacklevel=1)


def test_no_test_file_grows_past_its_limit():
    over = {p.name: _line_count(p) for p in (REPO / "tests").rglob("*.py") if _line_count(p) > MAX_TEST_LINES}
    assert not over, f"test files over {MAX_TEST_LINES} lines: {over}"
