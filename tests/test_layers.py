"""Guard rails: imports only go down the layer table of the design, and files stay small.

The rules are DESIGN.md's tables (read by ``design_doc``), so the document and the checks agree.
Every module of the library is parsed with ``ast`` (no import runs), and every import counts:
top-level, inside functions, and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from design_doc import THIRD_PARTY, archon_packages, layers
from import_scan import Import, library_files, module_name, scan_imports
from paths import REPO

LAYERS = layers()
"""Each top-level folder and what it may import besides the standard library and itself (DESIGN.md's table)."""

MODEL_CODE_MAY_IMPORT = {"torch", "models"}
"""What single-device model code (``models/common/`` but its ``infra/``, ``models/*/model/``) may import."""

FORBIDDEN_INSIDE_ARCHON = archon_packages()
"""Packages of ``archon`` and the ones they never import (DESIGN.md's table "Inside archon/")."""

CLUSTER_ENTRY_POINTS = ("archon.launch.cli", "archon.launch.slurm", "archon.launch.ray_cluster", "archon.launch.serve")
"""``python -m archon.launch``'s modules: nothing outside ``archon.launch`` imports them."""

PENDING: dict[str, str] = {}
"""Known violations, each with its fix; the test fails when one is gone, so this list only shrinks."""

LONG_FILE_LINES = 600
"""A library file past this is reported as a warning: a hint to look for a second job in it, not a rule."""
MAX_LINES = 1000
"""Longest library file (any top-level package, scripts): past this it surely holds several jobs."""
MAX_TEST_LINES = 800
"""Longest file under tests/ (test files hold many small cases; splitting them duplicates fixtures)."""


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
        if kind not in LAYERS[layer]:
            return f"{imp.source} -> {kind}"
    elif kind not in LAYERS[layer] and THIRD_PARTY not in LAYERS[layer]:
        return f"{imp.source} -> {kind}"
    if _is_model_code(imp.source) and kind not in ("<stdlib>", *MODEL_CODE_MAY_IMPORT):
        return f"{imp.source} -> {kind} (model code)"
    if layer == "archon":
        module = module_name(imp.source)
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
    return {why for imp in scan_imports(rel, text) if (why := _violation(imp)) is not None}


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
    files = library_files()
    assert len(files) > 150  # the walk really covered the library
    violations: dict[str, int] = {}
    for path in files:
        for imp in scan_imports(path.relative_to(REPO).as_posix(), path.read_text()):
            why = _violation(imp)
            if why is not None:
                violations.setdefault(why, imp.line)
    unexpected = sorted(f"{why} (line {line})" for why, line in violations.items() if why not in PENDING)
    fixed = sorted(set(PENDING) - set(violations))
    assert not unexpected, "imports against the layer table in DESIGN.md:\n" + "\n".join(unexpected)
    assert not fixed, f"no longer violated, remove from PENDING: {fixed}"


def test_model_code_is_single_device():
    # models/common/ and models/*/model/ never mention meshes, ranks or parallel techniques.
    checked = [p for p in library_files() if _is_model_code(p.relative_to(REPO).as_posix())]
    assert len(checked) >= 20
    for path in checked:
        text = path.read_text()
        assert "DeviceMesh" not in text and "torch.distributed" not in text, path


def _line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_library_file_grows_past_the_limit():
    lengths = {p.relative_to(REPO).as_posix(): _line_count(p) for p in library_files()}
    over = {f: n for f, n in lengths.items() if n > MAX_LINES}
    assert not over, f"library files over {MAX_LINES} lines (split them by job): {over}"
    long = {f: n for f, n in lengths.items() if n > LONG_FILE_LINES}
    if long:
        warnings.warn(f"library files over {LONG_FILE_LINES} lines (do they hold two jobs?): {long}", stacklevel=1)


def test_no_test_file_grows_past_its_limit():
    over = {p.name: _line_count(p) for p in (REPO / "tests").rglob("*.py") if _line_count(p) > MAX_TEST_LINES}
    assert not over, f"test files over {MAX_TEST_LINES} lines: {over}"


def test_the_design_document_names_every_package_and_only_real_ones():
    assert {"parallel", "pipeline", "models", "archon", "scripts"} <= set(LAYERS)
    assert all((REPO / folder).is_dir() for folder in LAYERS)
    named = set(FORBIDDEN_INSIDE_ARCHON)
    real = {f"archon.{p.name}" for p in (REPO / "archon").iterdir() if (p / "__init__.py").is_file()}
    assert named == real, (
        f"DESIGN.md's package table lists {sorted(named - real)} (not in archon/) and misses {sorted(real - named)}"
    )
    for never in FORBIDDEN_INSIDE_ARCHON.values():
        assert set(never) <= real, never
    design = (REPO / "DESIGN.md").read_text()
    roots = sorted(p.name for p in (REPO / "archon").glob("*.py") if p.name != "__init__.py")
    missing = [name for name in roots if f"`{name}`" not in design]
    assert not missing, f"modules at archon/'s root that DESIGN.md does not describe: {missing}"
