"""Tiny reward functions for tests/test_rewards.py, loaded by 'reward_fns:<name>' in worker processes."""

import os
import time


def length_reward(prompt, completion, answer, **kw):
    return float(len(completion)) + float(kw.get("bonus", 0.0))


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
