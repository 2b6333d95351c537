"""Reward functions written as TRL users write them, ``fn(completions, **kwargs) -> list[float]`` (for tests)."""

from __future__ import annotations


def trl_length(completions, **kwargs):
    """Length of each completion, plus 100 when the dataset's answer is in it (reads the ``answer`` column)."""
    return [float(len(c)) + (100.0 if a in c else 0.0) for c, a in zip(completions, kwargs["answer"])]


def trl_prompt_aware(prompts, completions, **kwargs):
    """1.0 when a completion repeats its prompt, else 0.0 (TRL's second shape: prompts first)."""
    return [1.0 if p in c else 0.0 for p, c in zip(prompts, completions)]


def trl_no_kwargs(completions):
    """Takes only the completions, without **kwargs: Archon passes nothing else."""
    return [float(c.count("a")) for c in completions]


def needs_reference(completions, reference):
    """A required argument Archon never passes: refused before start."""
    return [0.0 for _ in completions]


def two_args(prompt, completion):
    """Neither Archon's fn(prompt, completion, answer, **kw) nor TRL's: refused before start."""
    return 0.0


NOT_CALLABLE = 3
"""Not a function at all."""
