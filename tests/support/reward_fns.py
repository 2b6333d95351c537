"""Tiny reward functions for tests/rl/test_rewards.py, loaded by 'reward_fns:<name>' in worker processes."""

import os
import time


def length_reward(prompt, completion, answer, **kw):
    return float(len(completion)) + float(kw.get("bonus", 0.0))


def token_count(prompt, completion, answer, *, completion_ids, **kw):
    """The completion's length in tokens, from the ids the trainer passes (stop token included)."""
    return float(len(completion_ids))


def is_yes(prompt, completion, answer, **kw):
    return completion.strip() == "yes"


def raises(prompt, completion, answer, **kw):
    if completion == "boom":
        raise RuntimeError("reward function blew up")
    return 1.0


def exits(prompt, completion, answer, **kw):
    if completion == "exit":
        os._exit(3)
    return 1.0


def sleeps(prompt, completion, answer, **kw):
    if completion == "slow":
        time.sleep(60)
    return 1.0


def returns_none(prompt, completion, answer, **kw):
    return None


def segfaults(prompt, completion, answer, **kw):
    if completion == "segv":
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV in this worker
    return 1.0


def one(prompt, completion, answer, **kw):
    return 1.0


def slow_length(prompt, completion, answer, **kw):
    """length_reward that takes a while, so a test can kill a run between two steps."""
    time.sleep(0.05)
    return length_reward(prompt, completion, answer, **kw)


def crc_quarter(prompt, completion, answer, **kw):
    """1 for about a quarter of completions (a hash of the text): many groups of 4 get equal rewards."""
    import zlib

    return float(zlib.crc32(completion.encode()) % 4 == 0)


def misbehaves(prompt, completion, answer, **kw):
    """Fails in every way a reward function can, chosen by the completion."""
    if completion == "raise":
        raise KeyError("no such field")
    if completion == "hang":
        time.sleep(60)
    if completion == "text":
        return "1.0"
    if completion == "nan":
        return float("nan")
    return 1.0


def always_raises(prompt, completion, answer, **kw):
    raise RuntimeError("the reward service is down")
