"""``reward.fn``: importing a named reward function and telling how Archon can call it (no torch).

Two calling conventions are accepted:

- Archon's: ``fn(prompt, completion, answer, **kw) -> float``, one sample per call;
- TRL's: ``fn(completions, **kwargs) -> list[float]`` (also ``fn(prompts, completions, **kwargs)``), a batch
  of keyword lists per call, as TRL's GRPOTrainer calls its reward functions.  Archon calls it with
  one-element lists: ``prompts``, ``completions``, ``answer``, ``completion_ids`` and the dataset's
  other fields, each under its own name (only the names it takes when it has no ``**kwargs``).

``archon.rl.rewards`` runs the function in its worker pool; ``archon.config.preflight`` checks it before
any process starts.  Both use the functions here, so a function the check accepts is one the pool calls.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from archon.config.schema import ConfigError

BUILTIN_REWARDS = ("math", "exact_match")
"""Reward functions named by a word (``archon.rl.rewards.BUILTIN_REWARD_FNS`` holds them)."""

TRL_NAMES = ("prompts", "completions", "answer", "completion_ids")
"""Keyword lists Archon always passes to a TRL-style reward function (besides the dataset's other fields)."""

USAGE = (
    f"use a built-in ({', '.join(BUILTIN_REWARDS)}) or 'package.module:function' naming an importable function "
    "fn(prompt, completion, answer, **kw) -> float, or TRL's fn(completions, **kwargs) -> list[float]"
)


@dataclass(frozen=True)
class RewardStyle:
    """How a reward function is called."""

    trl: bool
    """True: TRL's batched keyword convention; False: Archon's ``fn(prompt, completion, answer, **kw)``."""
    accepts: tuple[str, ...] | None = None
    """TRL style without ``**kwargs``: the keyword names it takes; None: it takes any."""


def import_reward_fn(name: str) -> Callable[..., Any]:
    """The function ``'package.module:function'`` names (``ConfigError`` saying what is wrong otherwise)."""
    if ":" not in name:
        raise ConfigError(f"unknown reward function '{name}'; {USAGE}")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"reward function '{name}': cannot import module '{module_name}' ({exc}); "
            f"make it importable (installed or on PYTHONPATH); {USAGE}"
        ) from None
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"reward function '{name}': module '{module_name}' has no attribute '{attr}'; {USAGE}")
    if not callable(fn):
        raise ConfigError(f"reward function '{name}' is not callable; {USAGE}")
    return fn


def reward_style(fn: Callable[..., Any], name: str) -> RewardStyle:
    """Archon's or TRL's convention for ``fn`` from its signature; ``ConfigError`` when it fits neither."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return RewardStyle(trl=False)  # a builtin or C callable without a signature: trust it
    params = sig.parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    shown = f"reward function '{name}' has the signature {sig}"
    if "completions" in params:
        if params["completions"].kind is inspect.Parameter.POSITIONAL_ONLY:
            raise ConfigError(f"{shown}, whose 'completions' is positional-only; TRL passes it by name; {USAGE}")
        required = [
            p.name
            for p in params.values()
            if p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        unknown = [n for n in required if n not in TRL_NAMES]
        if unknown and not var_kw:
            raise ConfigError(
                f"{shown}; Archon passes {', '.join(TRL_NAMES)} and the dataset's other fields by name, so "
                f"{', '.join(unknown)} would be missing unless it takes **kwargs; {USAGE}"
            )
        accepts = None if var_kw else tuple(n for n in params if n in TRL_NAMES or n not in ("self",))
        return RewardStyle(trl=True, accepts=accepts)
    try:
        sig.bind("prompt", "completion", "answer", completion_ids=[])
    except TypeError:
        raise ConfigError(
            f"{shown}, which cannot be called as fn(prompt, completion, answer, completion_ids=..., **fields) "
            f"(Archon passes the completion's token ids and the dataset's other fields by name: take **kw); {USAGE}"
        ) from None
    return RewardStyle(trl=False)


def check_reward_fn(name: str) -> str:
    """What ``reward.fn = name`` is, after importing it and checking its signature (for the preflight report)."""
    if name in BUILTIN_REWARDS:
        return f"reward.fn = '{name}' is a built-in"
    style = reward_style(import_reward_fn(name), name)
    kind = "TRL's fn(completions, **kwargs) -> list[float]" if style.trl else "fn(prompt, completion, answer, **kw)"
    return f"reward.fn = '{name}' imports and is called as {kind}"
