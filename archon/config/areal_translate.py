"""Turning AReaL's config keys into Archon's before the config is built (the table is ``archon.config.areal_keys``).

Applied to every config, TOML or YAML, after the overrides: an AReaL key may come from a file or a command line.
AReaL's ``null`` (the key's default there) leaves an Archon key at Archon's default, except
``actor.rejection_sampling: null``, which in AReaL turns the behaviour correction off (``level = 'none'``).
AReaL's allocation strings may name size-1 dimensions a backend does not have (its GRPO example writes
``sglang:d4p1t1`` and ``fsdp:d4p1t1``); those change nothing and are dropped (``drop_unit_dims``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import typing
from dataclasses import dataclass, field
from typing import Any

from archon.alloc import BACKENDS, AllocationError, AllocationMode, ModelAllocation
from archon.config.areal_keys import AReaLKey, find_areal_key
from archon.config.schema import Config, ConfigError, OptimizerConfig

logger = logging.getLogger("archon.config")

_NULL_MEANS = {"actor.rejection_sampling": {"level": "none"}}
"""Archon keys whose AReaL null is a setting of its own, not the default: what it becomes."""

_PLAIN_COMPONENT = re.compile(r"^(\s*([A-Za-z_][A-Za-z0-9_]*)(\[[^\]]*\])?\s*:\s*)((?:[dtpce][0-9]+)+)\s*$")
_DIM = re.compile(r"([dtpce])([0-9]+)")

_TRAINED = ("actor", "critic")
"""Engines with an optimizer that steps (a warmup proportion becomes steps for these)."""


@dataclass
class AReaLTranslation:
    """What translating a tree found that can only be applied to the built config."""

    warmup_proportions: dict[str, float] = field(default_factory=dict)
    """Engine -> AReaL's optimizer.warmup_steps_proportion."""


def translate_areal_keys(tree: dict[str, Any], sources: dict[str, str]) -> AReaLTranslation:
    """Rewrite ``tree`` (in place) from AReaL's keys to Archon's: split ``allocation_mode``, move translated keys,
    drop harmless ones with one warning per table entry, refuse the rest with the entry's sentence.

    Keys that are neither Archon's nor in the table are left for the builder, which names the closest valid key.
    """
    run = _Translator(tree, sources)
    run.split_allocation_mode()
    run.walk(Config, tree, "")
    run.warn()
    return run.result


def apply_warmup_proportions(cfg: Config, translation: AReaLTranslation, explicit: set[str]) -> None:
    """AReaL's ``optimizer.warmup_steps_proportion`` as warmup steps: ``int(proportion x the engine's optimizer
    steps)``, as AReaL rounds it (before critic/ref/teacher inherit the actor's optimizer)."""
    for engine, proportion in translation.warmup_proportions.items():
        key = f"{engine}.optimizer.warmup_steps"
        if key in explicit:
            raise ConfigError(
                f"both {key} and {engine}.optimizer.warmup_steps_proportion (AReaL's name) are set; keep one"
            )
        section = getattr(cfg, engine)
        steps = cfg.total_train_steps * section.ppo_n_minibatches * section.ppo_epochs
        section.optimizer.warmup_steps = int(proportion * steps)
        explicit.add(key)


def drop_unit_dims(text: str) -> str:
    """``text`` without the size-1 dimensions its backends do not take (``sglang:d4p1t1`` -> ``sglang:d4t1``)."""
    parts = []
    for comp in text.split("+"):
        m = _PLAIN_COMPONENT.match(comp)
        if m and m.group(2) in BACKENDS:
            accepted = BACKENDS[m.group(2)]
            dims = "".join(d.group(0) for d in _DIM.finditer(m.group(4)) if d.group(1) in accepted or d.group(2) != "1")
            comp = m.group(1) + (dims or "d1")
        parts.append(comp)
    return "+".join(parts)


class _Translator:
    def __init__(self, tree: dict[str, Any], sources: dict[str, str]):
        self.tree = tree
        self.sources = sources
        self.result = AReaLTranslation()
        self.dropped: dict[AReaLKey, list[str]] = {}

    def where(self, key: str) -> str:
        return self.sources.get(key, "the config")

    def split_allocation_mode(self) -> None:
        """AReaL's deprecated ``allocation_mode = 'sglang:d4t2+archon:d4p2t2'`` as rollout.backend and actor.backend."""
        text = self.tree.pop("allocation_mode", None)
        if text in (None, ""):
            return
        where = self.where("allocation_mode")
        try:
            mode = AllocationMode.from_str(drop_unit_dims(text) if isinstance(text, str) else text)
        except AllocationError as exc:
            raise ConfigError(f"allocation_mode (from {where}): {exc}") from None
        split: dict[str, ModelAllocation] = {}
        for comp in mode:
            section = comp.name or ("rollout" if comp.is_inference else "actor")
            if section not in ("rollout", "actor", "critic", "ref", "teacher") or section in split:
                raise ConfigError(
                    f"allocation_mode = '{text}' (from {where}) has a component '{comp}' that no single engine takes; "
                    "give one inference and one training component, or name them (sglang[rollout]:d4+archon[actor]:d4)"
                )
            split[section] = dataclasses.replace(comp, name=None)
        for section, alloc in split.items():
            key = f"{section}.backend"
            node = self.tree.setdefault(section, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key '{section}' (from {self.where(section)}) must be a table")
            own = node.get("backend")
            if own not in (None, "") and not _same_allocation(own, alloc):
                raise ConfigError(
                    f"allocation_mode = '{text}' (from {where}) gives {key} = '{alloc}', but {key} = '{own}' (from "
                    f"{self.where(key)}); remove allocation_mode (deprecated) and keep {key}"
                )
            node["backend"] = str(alloc)
            self.sources.setdefault(key, where)
        logger.warning(
            "allocation_mode (from %s) is deprecated, as in AReaL: write %s instead",
            where,
            " and ".join(f"{s}.backend = '{a}'" for s, a in split.items()),
        )

    def walk(self, cls: type, node: dict[str, Any], prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        for key in list(node):
            dotted = prefix + key
            value = node[key]
            if key in names:
                if value is None:
                    if dotted in _NULL_MEANS:
                        node[key] = dict(_NULL_MEANS[dotted])
                    else:
                        del node[key]  # AReaL's null: the key's default
                elif dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
                    self.walk(typing.cast(type, hints[key]), value, dotted + ".")
                elif key == "backend" and not prefix.count(".") > 1 and isinstance(value, str):
                    node[key] = drop_unit_dims(value)
                    if node[key] != value:
                        logger.info("%s = '%s' read as '%s' (size-1 dimensions only)", dotted, value, node[key])
                else:
                    found = find_areal_key(dotted)
                    if found and found[0].kind == "translated" and found[0].values and found[1] == dotted:
                        node[key] = found[0].values.get(value, value) if _hashable(value) else value
                continue
            found = find_areal_key(dotted)
            if found is None:
                if isinstance(value, dict):
                    self.walk_unknown(value, dotted + ".")
                    if not value:
                        del node[key]  # a section of AReaL keys only, each dropped or moved
                continue  # what is left, the builder names with the closest valid key
            entry, target = found
            if entry.kind == "translated":
                del node[key]
                self.translate(entry, dotted, target, value, node)
            else:
                self.drop(entry, dotted, value)
                del node[key]

    def walk_unknown(self, node: dict[str, Any], prefix: str) -> None:
        """The keys of a section Archon does not have, each by the table (what is left stays for the builder)."""
        for key in list(node):
            dotted = prefix + key
            found = find_areal_key(dotted)
            if found is None:
                if isinstance(node[key], dict):
                    self.walk_unknown(node[key], dotted + ".")
                    if not node[key]:
                        del node[key]
            elif found[0].kind == "translated":
                self.translate(found[0], dotted, found[1], node.pop(key), node)
            else:
                self.drop(found[0], dotted, node.pop(key))

    def drop(self, entry: AReaLKey, dotted: str, value: Any) -> None:
        """Drop an ignored key, or a refused one with a value that changes nothing; refuse the rest."""
        if entry.kind == "ignored":
            self.dropped.setdefault(entry, []).append(dotted)
        elif entry.harmless is not None and entry.harmless(value, self.tree):
            self.dropped.setdefault(entry, []).append(f"{dotted} = {value!r}")
        else:
            raise ConfigError(f"config key '{dotted}' = {value!r} (from {self.where(dotted)}): {entry.note}")

    def translate(self, entry: AReaLKey, dotted: str, target: str, value: Any, node: dict[str, Any]) -> None:
        where = self.where(dotted)
        if value is None:
            return  # AReaL's default, which Archon's default already is
        leaf = dotted.rsplit(".", 1)[-1]
        if leaf == "warmup_steps_proportion":
            engine = dotted.split(".", 1)[0]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
                raise ConfigError(f"config key '{dotted}' (from {where}) must be a fraction in [0, 1], got {value!r}")
            if engine in _TRAINED:
                self.result.warmup_proportions[engine] = float(value)
            return
        if leaf in ("beta1", "beta2"):
            # Both betas form Archon's one pair; the other keeps its own value or the default (AReaL's too).
            betas = node.get("betas") or list(OptimizerConfig().betas)
            if not isinstance(betas, (list, tuple)) or len(betas) != 2:
                raise ConfigError(f"config key '{target}' (from {self.where(target)}) must be [beta1, beta2]")
            betas = list(betas)
            betas[0 if leaf == "beta1" else 1] = value
            node["betas"] = betas
            self.sources.setdefault(target, where)
            return
        if entry.values and _hashable(value):
            value = entry.values.get(value, value)
        parts = target.split(".")
        parent = self.tree
        for part in parts[:-1]:
            parent = parent.setdefault(part, {})
        own = parent.get(parts[-1])
        if own is not None and own != value:
            raise ConfigError(
                f"config key '{dotted}' (from {where}) is AReaL's name for {target}, which is set to {own!r} "
                f"(from {self.where(target)}); keep one of them"
            )
        parent[parts[-1]] = value
        self.sources.setdefault(target, where)

    def warn(self) -> None:
        for entry, keys in self.dropped.items():
            origins = sorted({self.where(k.split(" = ", 1)[0]) for k in keys})
            logger.warning(
                "AReaL config key%s %s (from %s) ignored: %s",
                "s" if len(keys) > 1 else "",
                ", ".join(keys),
                ", ".join(origins),
                entry.note,
            )


def _same_allocation(text: Any, alloc: ModelAllocation) -> bool:
    try:
        return dataclasses.replace(ModelAllocation.from_str(text), name=None) == alloc
    except AllocationError:
        return False


def _hashable(value: Any) -> bool:
    return not isinstance(value, (dict, list))
