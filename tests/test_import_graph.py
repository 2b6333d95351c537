"""The library's import graph: no cycles, and imports inside functions only where they buy something.

Every import counts (top-level, inside functions, under ``TYPE_CHECKING``): a cycle hidden in a
function or behind ``TYPE_CHECKING`` is still two modules that cannot be read, tested or moved
apart.  An import of the library's own modules inside a function is allowed only for the
reasons listed in ``LAZY_IMPORTS`` (a heavy or optional dependency behind it, or a command-line
entry point that must start fast); third-party imports inside functions are the modules' own
choice (heavy optional packages: ray, vllm, matplotlib, ...).
"""

from __future__ import annotations

import sys

from import_scan import library_modules, resolve, scan_imports
from paths import REPO

_TORCH_FREE = "archon.errors is imported by torch-free modules (reward workers, the config and launch CLIs)"
_PLAN_TORCH_FREE = "python -m archon.plan (the plan and memory tables) runs without torch, on a login node too"
LAZY_IMPORTS: dict[tuple[str, str], str] = {
    ("archon.errors", "models"): _TORCH_FREE + "; the layers below archon, whose errors it lists, import torch",
    ("archon.errors", "parallel.errors"): _TORCH_FREE,
    ("archon.errors", "pipeline.split"): _TORCH_FREE,
    ("archon.plan.fit", "pipeline.split"): _PLAN_TORCH_FREE,
    ("archon.plan.params", "models"): _PLAN_TORCH_FREE,
    ("archon.plan.params", "models.lora"): _PLAN_TORCH_FREE,
    ("archon.plan.memory", "pipeline.placement"): _PLAN_TORCH_FREE,
    ("archon.plan.memory", "pipeline.schedules"): _PLAN_TORCH_FREE,
    ("archon.plan.memory", "pipeline.split"): _PLAN_TORCH_FREE,
    ("archon.plan.show", "archon.plan.rehearse"): _PLAN_TORCH_FREE + "; only `rehearse` runs the engine",
    ("archon.demos.first_letter", "archon.data.jsonl"): (
        "reward workers import the demo's reward by name and must not import torch, which archon.data's package does"
    ),
}
"""(importing module, imported library module) pairs allowed inside functions, each with its reason."""

PENDING_CYCLES: list[set[str]] = []
"""Known cycles (strongly connected modules), each removed by a named change; the test fails when one is gone."""

PENDING_LAZY: set[tuple[str, str]] = set()
"""Known function-level imports without a reason; the test fails when one is gone, so this set only shrinks."""


def _graph() -> tuple[dict[str, dict[str, int]], set[tuple[str, str, int]]]:
    """Module -> {imported module: line}, and the function-level (module, imported module, line) imports."""
    modules = library_modules()
    edges: dict[str, dict[str, int]] = {m: {} for m in modules}
    lazy: set[tuple[str, str, int]] = set()
    for name, path in modules.items():
        for imp in scan_imports(path.relative_to(REPO).as_posix(), path.read_text()):
            # ``from pkg import mod`` depends on pkg.mod, ``from pkg import name`` on pkg (its __init__).
            named = imp.targets[1:] or imp.targets[:1]
            for target in named:
                hit = resolve(target, modules)
                if hit is None or hit == name:
                    continue
                edges[name].setdefault(hit, imp.line)
                if imp.in_function:
                    lazy.add((name, hit, imp.line))
    return edges, lazy


def strongly_connected(edges: dict[str, dict[str, int]]) -> list[set[str]]:
    """Tarjan's algorithm: every set of two or more modules that import each other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges)))
    try:
        for v in edges:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_the_cycle_finder_finds_cycles_and_only_cycles():
    edges = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}, "e": {}, "f": {"g": 1}, "g": {"f": 1}}
    assert sorted(map(sorted, strongly_connected(edges))) == [["a", "b", "c"], ["f", "g"]]
    assert strongly_connected({"a": {"b": 1}, "b": {}, "c": {"a": 1, "b": 1}}) == []


def test_the_library_has_no_import_cycles():
    edges, _ = _graph()
    assert len(edges) > 150  # the walk really covered the library
    cycles = strongly_connected(edges)
    unexpected = [sorted(c) for c in cycles if c not in PENDING_CYCLES]
    assert not unexpected, "import cycles (break them by moving what both need below both):\n" + "\n".join(
        " <-> ".join(c) for c in unexpected
    )
    gone = [sorted(c) for c in PENDING_CYCLES if c not in cycles]
    assert not gone, f"no longer cycles, remove from PENDING_CYCLES: {gone}"


def test_library_modules_are_imported_inside_functions_only_for_a_reason():
    _, lazy = _graph()
    found = {(m, t) for m, t, _ in lazy}
    unexplained = sorted(
        f"{m} -> {t} (line {line})" for m, t, line in lazy if (m, t) not in LAZY_IMPORTS | dict.fromkeys(PENDING_LAZY)
    )
    assert not unexplained, (
        "library imports inside functions without a reason in LAZY_IMPORTS (import at the top, or say why not):\n"
        + "\n".join(unexplained)
    )
    stale = sorted(set(LAZY_IMPORTS) - found) + sorted(PENDING_LAZY - found)
    assert not stale, f"no longer imported inside a function, remove: {stale}"
