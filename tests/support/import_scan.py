"""Every import of the library, read with ``ast`` (nothing is imported): for the layer and import-graph tests.

Every import counts: top-level, inside functions, and under ``TYPE_CHECKING``; each says whether it
sits inside a function.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from paths import REPO

LIBRARY = ("parallel", "pipeline", "models", "scaffold", "archon", "scripts")
"""The top-level folders the guards read (``scripts`` holds files, not a package)."""


@dataclass(frozen=True)
class Import:
    source: str
    """Importing file, relative to the repository."""
    line: int
    """Line of the import statement."""
    targets: tuple[str, ...]
    """Dotted names it may import: the module, and ``module.name`` for each ``from`` name (maybe a submodule)."""
    in_function: bool = False
    """The statement runs when a function is called, not when its module is imported."""


def module_name(rel: str) -> str:
    """``archon/rl/trainer.py`` -> ``archon.rl.trainer``; a package's ``__init__.py`` -> the package."""
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _function_nodes(tree: ast.AST) -> set[ast.AST]:
    """Every node that sits inside a function body."""
    inside: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(n for child in ast.iter_child_nodes(node) for n in ast.walk(child))
    return inside


def scan_imports(rel: str, text: str) -> list[Import]:
    """Every import of the module at ``rel`` (relative to the repository) whose source is ``text``."""
    tree = ast.parse(text, filename=rel)
    package = module_name(rel) if rel.endswith("/__init__.py") else module_name(rel).rpartition(".")[0]
    inside = _function_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(Import(rel, node.lineno, (alias.name,), node in inside) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([module] if module else []))
            names = tuple(f"{module}.{alias.name}" for alias in node.names if alias.name != "*")
            found.append(Import(rel, node.lineno, (module, *names), node in inside))
    return found


def library_files() -> list[Path]:
    """Every Python file of the library folders."""
    return sorted(p for top in LIBRARY for p in (REPO / top).rglob("*.py"))


def library_modules() -> dict[str, Path]:
    """Dotted name -> file of every importable library module (``scripts`` are files, not modules)."""
    return {
        module_name(p.relative_to(REPO).as_posix()): p
        for p in library_files()
        if not p.is_relative_to(REPO / "scripts")
    }


def resolve(name: str, modules: dict[str, Path] | set[str]) -> str | None:
    """The library module a dotted import name lands in (``archon.config.Config`` -> ``archon.config``), or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None
