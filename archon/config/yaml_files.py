"""YAML config files (AReaL's format): reading them, and resolving their ``${a.b}`` references.

AReaL's YAML files go through OmegaConf, which (1) reads ``1e-8`` as a number where PyYAML's YAML 1.1 rules read
a string, and (2) resolves ``${a.b}`` references to other keys of the config (``ref.path: ${actor.path}``).  Both
are reproduced here for the plain form that AReaL's example files use; a resolver call (``${oc.env:HOME}``) or a
relative reference (``${.path}``) is refused with a sentence that says to write the value.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from archon.config.schema import Config, ConfigError

YAML_SUFFIXES = (".yaml", ".yml")
"""File name endings read as YAML; every other config file is TOML."""

_REFERENCE = re.compile(r"\$\{([^{}]*)\}")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
# YAML 1.2 floats: PyYAML (YAML 1.1) wants a '.' in the mantissa and a sign in the exponent, so '1e-8' is a string.
_FLOAT = re.compile(
    r"^[-+]?(([0-9]+\.[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+)$"
    r"|^[-+]?\.(inf|Inf|INF)$|^\.(nan|NaN|NAN)$"
)
_FLOAT_TAG = "tag:yaml.org,2002:float"


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 floats (as OmegaConf reads them)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag != _FLOAT_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+0123456789."))


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping a YAML config file holds (``ConfigError`` when it is not valid YAML or not a mapping)."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            data = yaml.load(fh, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file '{path}' is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file '{path}' holds a {type(data).__name__}, not a mapping of keys to values; "
            "write one 'key: value' per line"
        )
    return data


def resolve_references(tree: dict[str, Any], origin: str) -> dict[str, Any]:
    """``tree`` with every ``${a.b}`` string resolved against the tree itself (after the overrides), as OmegaConf does.

    A string that is one reference takes the referenced value with its type (``${actor.scheduling_spec}`` a list);
    a reference inside longer text is replaced by the value's text.  A key the tree does not set resolves to
    Archon's default when Archon has that key.  ``origin`` names the file for error messages.
    """
    return _Resolver(tree, origin).resolve_tree()


class _Resolver:
    def __init__(self, tree: dict[str, Any], origin: str):
        self.tree = tree
        self.origin = origin
        self.done: dict[str, Any] = {}

    def resolve_tree(self) -> dict[str, Any]:
        return self._resolve(self.tree, "", ())

    def _resolve(self, value: Any, key: str, chain: tuple[str, ...]) -> Any:
        if isinstance(value, dict):
            return {k: self._resolve(v, f"{key}.{k}" if key else str(k), chain) for k, v in value.items()}
        if isinstance(value, list):
            return [self._resolve(v, key, chain) for v in value]
        if not isinstance(value, str) or "${" not in value:
            return value
        whole = _REFERENCE.fullmatch(value.strip())
        if whole:
            return copy.deepcopy(self._lookup(whole.group(1), key, chain))
        return _REFERENCE.sub(lambda m: str(self._lookup(m.group(1), key, chain)), value)

    def _lookup(self, ref: str, key: str, chain: tuple[str, ...]) -> Any:
        ref = ref.strip()
        if not _DOTTED.fullmatch(ref):
            raise ConfigError(
                f"config key '{key}' (from {self.origin}) uses '${{{ref}}}', an OmegaConf form Archon's YAML loader "
                "does not resolve (only plain references to other keys, such as ${actor.path}); write the value itself"
            )
        if ref in chain:
            loop = " -> ".join((*chain, ref))
            raise ConfigError(
                f"config key '{key}' (from {self.origin}) refers to itself through {loop}; break the loop"
            )
        if ref in self.done:
            return self.done[ref]
        node: Any = self.tree
        for part in ref.split("."):
            if not isinstance(node, dict) or part not in node:
                node = _archon_default(ref)
                if node is _MISSING:
                    raise ConfigError(
                        f"config key '{key}' (from {self.origin}) refers to '${{{ref}}}', which the config does "
                        "not set and Archon has no default for; set that key or write the value itself"
                    )
                break
            node = node[part]
        value = self._resolve(node, ref, (*chain, ref))
        self.done[ref] = value
        return value


_MISSING = object()


def _archon_default(dotted: str) -> Any:
    """The default of an Archon config key, as YAML would write it; ``_MISSING`` when Archon has no such key."""
    node: Any = Config()
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return _MISSING
        node = getattr(node, part)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.asdict(node)
    return list(node) if isinstance(node, tuple) else node
