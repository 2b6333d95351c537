"""Reward functions and a crash-proof pool of processes that runs them.

A reward function is called as ``fn(prompt, completion, answer, **kw)`` and returns a
number (a bool counts as 1.0 / 0.0; a string, None or NaN is a failure).  Built-ins:
``math`` (answer equivalence with ``math-verify``) and ``exact_match``; any other
importable function is named ``"package.module:function"``.  A function written for TRL,
``fn(completions, **kwargs) -> list[float]``, is called with one-element lists
(``archon.config.reward_check`` tells the two apart).

``RewardComputer`` runs the calls in worker processes, one call per worker at a time, so
that whatever a reward function does (raise, hang, ``os._exit``, segfault) costs only that
sample: it gets reward 0.0, a warning naming the sample's index is logged, the failure is
counted, and a dead or hung worker is replaced.  A reward function that is broken rather
than unlucky must not train a policy on zeros: when more than ``max_failure_frac`` of one
``compute()`` call's samples fail, it raises ``RewardError``.  Workers are started with
the ``spawn`` method (no inherited locks or CUDA state) and receive ``sys.path`` from the
parent, so modules importable in the trainer are importable there.
"""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing as mp
import os
import re
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from archon.config import ConfigError
from archon.config.reward_check import BUILTIN_REWARDS, import_reward_fn, reward_style
from archon.errors import ArchonError

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Any]


class RewardError(ArchonError, RuntimeError):
    """The reward function cannot be loaded, its workers do not start, or too many of its calls fail."""


# ----------------------------------------------------------------------------------------
# Answer extraction and the built-in reward functions
# ----------------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def gsm8k_final_answer(text: str) -> str | None:
    """The answer after GSM8K's ``####`` marker (commas and ``$`` removed), if any."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    return tail.replace(",", "").replace("$", "").strip() or None


def last_number(text: str) -> str | None:
    """The last number in ``text`` (integers, decimals, ``a/b`` fractions; thousands commas removed)."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    return found[-1].replace(",", "").rstrip(".")


def extract_final_answer(text: str) -> str | None:
    """A completion's final answer: the last ``\\boxed{}``, else after ``####``, else the last number."""
    for extract in (last_boxed, gsm8k_final_answer, last_number):
        found = extract(text)
        if found:
            return found
    return None


def reference_answer(answer: str) -> str:
    """The reference answer to compare with: GSM8K's ``#### x`` or a ``\\boxed{x}`` if present, else the text."""
    return gsm8k_final_answer(answer) or last_boxed(answer) or answer.strip()


def _normalize_text(text: str) -> str:
    return " ".join(text.split()).lower()


def _math_verify_timeout(timeout_s: float) -> int | None:
    # math-verify's own timeout uses SIGALRM, which works only in a main thread; elsewhere
    # the process pool's timeout is the only guard.
    if threading.current_thread() is not threading.main_thread():
        return None
    return max(1, math.ceil(timeout_s))


def math_reward(prompt: str, completion: str, answer: str, *, timeout_s: float = 5.0, **_: Any) -> float:
    """1.0 if the completion's final answer is mathematically equal to the reference, else 0.0."""
    pred = extract_final_answer(completion)
    if pred is None:
        return 0.0
    gold = reference_answer(answer)
    if _normalize_text(pred) == _normalize_text(gold):
        return 1.0
    from math_verify import parse, verify

    limit = _math_verify_timeout(timeout_s)
    # math-verify takes None (no timeout) though its annotation says int.
    parsed_gold = parse(f"\\boxed{{{gold}}}", parsing_timeout=limit)  # pyright: ignore[reportArgumentType]
    parsed_pred = parse(f"\\boxed{{{pred}}}", parsing_timeout=limit)  # pyright: ignore[reportArgumentType]
    if not parsed_gold or not parsed_pred:
        return 0.0
    return 1.0 if verify(parsed_gold, parsed_pred, timeout_seconds=limit) else 0.0


def exact_match_reward(prompt: str, completion: str, answer: str, **_: Any) -> float:
    """1.0 if completion and answer are equal up to case and runs of whitespace."""
    return 1.0 if _normalize_text(completion) == _normalize_text(answer) else 0.0


BUILTIN_REWARD_FNS: dict[str, RewardFn] = {"math": math_reward, "exact_match": exact_match_reward}
assert tuple(BUILTIN_REWARD_FNS) == BUILTIN_REWARDS  # the names the config check accepts without importing


def get_reward_fn(name: str | RewardFn) -> RewardFn:
    """A built-in by name, a ``"package.module:function"`` import, or a callable, called as
    ``fn(prompt, completion, answer, **kw) -> float`` (a TRL-style function is adapted to that)."""
    if not callable(name) and name in BUILTIN_REWARD_FNS:
        return BUILTIN_REWARD_FNS[name]
    fn = name if callable(name) else import_reward_fn(name)
    style = reward_style(fn, getattr(fn, "__qualname__", str(fn)) if callable(name) else name)
    if not style.trl:
        return fn
    return functools.partial(call_trl_style, fn, style.accepts)


def call_trl_style(
    fn: RewardFn, accepts: tuple[str, ...] | None, prompt: str, completion: str, answer: str, **kw: Any
) -> Any:
    """One sample through a TRL-style ``fn(completions, **kwargs) -> list[float]``: every argument as a list of
    one, by name (only the names ``accepts`` lists when it is not None); its one reward."""
    batch = {"prompts": [prompt], "completions": [completion], "answer": [answer], **{k: [v] for k, v in kw.items()}}
    if accepts is not None:
        batch = {k: v for k, v in batch.items() if k in accepts}
    result = fn(**batch)
    if isinstance(result, (str, bytes)) or not isinstance(result, Sequence) or len(result) != 1:
        raise TypeError(
            f"the TRL-style reward function returned {result!r} for one completion; it must return a list with "
            "one reward per completion"
        )
    return result[0]


def _to_reward(value: Any) -> float:
    """``value`` as a finite float; a string, None, or anything without ``__float__`` is not a reward."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"the reward function returned {value!r} ({type(value).__name__}), not a number")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"the reward function returned {value!r}, which is not finite")
    return reward


# ----------------------------------------------------------------------------------------
# Worker processes
# ----------------------------------------------------------------------------------------


def _worker_main(conn: Connection, fn_spec: str | RewardFn, fn_kwargs: dict[str, Any]) -> None:
    """Worker loop: announce readiness, then answer one (id, prompt, completion, answer) at a time."""
    # Ctrl-C reaches the whole process group; the trainer decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fn = get_reward_fn(fn_spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which gives 0.0
        conn.send(("init_error", repr(exc)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        task_id, prompt, completion, answer, kw = task
        try:
            conn.send(("ok", task_id, _to_reward(fn(prompt, completion, answer, **fn_kwargs, **kw))))
        except BaseException as exc:  # noqa: BLE001 - any failure of user code is that sample's 0.0
            conn.send(("error", task_id, f"{type(exc).__name__}: {exc}"))


_TASKS_PER_WORKER = 8
"""Samples sent to a worker ahead of its answers (each still gets the whole ``timeout_s``)."""


@dataclass
class _Worker:
    process: Any
    conn: Connection
    ready: bool = False
    tasks: deque[tuple] = field(default_factory=deque)
    """Sent and not answered yet, in order: the worker is scoring the first."""
    deadline: float = 0.0
    """When the first of ``tasks`` runs out of time."""


@dataclass
class RewardCounters:
    """Totals since the computer was built (for metrics)."""

    calls: int = 0
    """Reward calls answered (including failures)."""
    failures: int = 0
    """Calls that raised, returned a non-number, or killed their worker (reward 0.0)."""
    timeouts: int = 0
    """Calls cut off after timeout_s (reward 0.0)."""
    restarts: int = 0
    """Workers replaced after a crash or a timeout."""
    failure_examples: list[str] = field(default_factory=list)
    """The first few failure messages."""
    last_failures: int = 0
    """Failures and timeouts of the latest ``compute()`` call."""
    last_samples: int = 0
    """Samples of the latest ``compute()`` call."""


class RewardComputer:
    """Computes rewards in ``n_workers`` processes; failures and timeouts give 0.0.

    ``compute(prompts, completions, answers, **kw)`` returns one float per sample in
    order, or raises ``RewardError`` when more than ``max_failure_frac`` of them failed.
    Extra keyword arguments are either one value for all samples or a list with one value
    per sample.  ``n_workers=0`` calls the function in the calling process
    (no protection against crashes or hangs; for debugging).
    """

    def __init__(
        self,
        fn: str | RewardFn = "math",
        *,
        n_workers: int = 2,
        timeout_s: float = 15.0,
        start_method: str = "spawn",
        startup_timeout_s: float = 120.0,
        fn_kwargs: dict | None = None,
        max_failure_frac: float = 1.0,
    ):
        if not 0.0 <= max_failure_frac <= 1.0:
            raise ConfigError(f"reward.max_failure_frac = {max_failure_frac} must be between 0 and 1 (1 never stops)")
        self.fn_spec = fn
        self.max_failure_frac = max_failure_frac
        self.fn = get_reward_fn(fn)  # fail fast, in the trainer, on a bad name
        self.n_workers = n_workers
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.fn_kwargs = dict(fn_kwargs or {})
        if self.fn in (math_reward,) and "timeout_s" not in self.fn_kwargs:
            self.fn_kwargs["timeout_s"] = timeout_s
        self.counters = RewardCounters()
        self._call_failures: list[str] = []  # 'sample i: why' for each failure of the current call
        self._ctx = mp.get_context(start_method)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(n_workers):
            self._workers.append(self._start_worker())

    # -- public -------------------------------------------------------------------------

    def compute(self, prompts: list[str], completions: list[str], answers: list[str], **kw: Any) -> list[float]:
        n = len(completions)
        if len(prompts) != n or len(answers) != n:
            raise ValueError(
                f"compute() got {len(prompts)} prompts, {n} completions and {len(answers)} answers; "
                "they must have one entry per sample"
            )
        per_sample = [{k: (v[i] if isinstance(v, (list, tuple)) else v) for k, v in kw.items()} for i in range(n)]
        for k, v in kw.items():
            if isinstance(v, (list, tuple)) and len(v) != n:
                raise ValueError(f"compute() keyword '{k}' has {len(v)} values for {n} samples")
        tasks = [(i, prompts[i], completions[i], answers[i], per_sample[i]) for i in range(n)]
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardComputer.compute() called after close()")
            self._call_failures = []
            if self.n_workers == 0:
                results = [self._call_inline(t) for t in tasks]
            else:
                results = self._run(tasks)
        self._check_failures(n)
        return results

    def _check_failures(self, n: int) -> None:
        failed = len(self._call_failures)
        self.counters.last_failures, self.counters.last_samples = failed, n
        if failed and failed > self.max_failure_frac * n:
            raise RewardError(
                f"{failed} of {n} reward calls failed (raised, ran past reward.timeout_s={self.timeout_s:g} s, or "
                f"returned a non-number), more than reward.max_failure_frac={self.max_failure_frac:g}; the first: "
                f"{self._call_failures[0]}; fix the reward function {self.fn_spec!r} or raise "
                "reward.max_failure_frac"
            )

    def metrics(self) -> dict[str, float]:
        """Totals since construction, and the failed fraction of the latest ``compute()`` call."""
        c = self.counters
        return {
            "reward/calls": c.calls,
            "reward/failures": c.failures,
            "reward/timeouts": c.timeouts,
            "reward/worker_restarts": c.restarts,
            "reward/failed_frac": c.last_failures / c.last_samples if c.last_samples else 0.0,
        }

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for w in self._workers:
                self._stop_worker(w, graceful=True)
            self._workers = []

    def __enter__(self) -> RewardComputer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- internals ----------------------------------------------------------------------

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(  # pyright: ignore[reportAttributeAccessIssue] - typeshed's BaseContext has none
            target=_worker_main, args=(child, self.fn_spec, self.fn_kwargs), daemon=True, name="archon-reward"
        )
        proc.start()  # returns at once; the worker boots in the background and reports 'ready'
        child.close()
        return _Worker(proc, parent)

    def _stop_worker(self, w: _Worker, graceful: bool = False) -> None:
        if graceful and w.process.is_alive() and not w.tasks:
            try:
                w.conn.send(None)
                w.process.join(timeout=1.0)
            except (OSError, ValueError):
                pass
        if w.process.is_alive():
            w.process.kill()
        w.process.join(timeout=5.0)
        w.conn.close()

    def _replace(self, index: int) -> None:
        self._stop_worker(self._workers[index])
        self._workers[index] = self._start_worker()
        self.counters.restarts += 1

    def _fail(self, task_id: int, message: str, *, timeout: bool = False) -> None:
        self._call_failures.append(f"sample {task_id}: {message}")
        self.counters.calls += 1
        if timeout:
            self.counters.timeouts += 1
        else:
            self.counters.failures += 1
            if len(self.counters.failure_examples) < 5:
                self.counters.failure_examples.append(message)
        logger.warning("reward for sample %d is 0.0: %s", task_id, message)

    def _call_inline(self, task: tuple) -> float:
        task_id, prompt, completion, answer, kw = task
        try:
            reward = _to_reward(self.fn(prompt, completion, answer, **self.fn_kwargs, **kw))
        except Exception as exc:  # noqa: BLE001
            self._fail(task_id, f"{type(exc).__name__}: {exc}")
            return 0.0
        self.counters.calls += 1
        return reward

    def _run(self, tasks: list[tuple]) -> list[float]:
        results = [0.0] * len(tasks)
        queue = deque(tasks)
        startup_deadline = time.monotonic() + self.startup_timeout_s
        while queue or any(w.tasks for w in self._workers):
            now = time.monotonic()
            for w in self._workers:
                # A few samples queued per worker: it scores the next while we read the last answer,
                # instead of one pipe round trip per sample.
                while w.ready and len(w.tasks) < _TASKS_PER_WORKER and queue:
                    task = queue.popleft()
                    try:
                        w.conn.send(task)
                    except (OSError, ValueError):
                        queue.appendleft(task)  # the worker died: not this sample's fault
                        break
                    if not w.tasks:
                        w.deadline = now + self.timeout_s
                    w.tasks.append(task)
            if not any(w.ready for w in self._workers) and now > startup_deadline:
                raise RewardError(
                    f"no reward worker started within {self.startup_timeout_s:.0f}s "
                    f"(reward function {self.fn_spec!r}); check that it imports quickly"
                )
            deadlines = [w.deadline for w in self._workers if w.tasks]
            wake = min(deadlines + [now + 1.0]) - now
            waitables: list[Any] = [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers]
            wait(waitables, timeout=max(wake, 0.0))
            for i, w in enumerate(self._workers):
                self._poll(i, w, results, queue)

        return results

    def _poll(self, index: int, w: _Worker, results: list[float], queue: deque[tuple]) -> None:
        """Collect what worker ``index`` has to say; replace it if it died or ran out of time.

        A replaced worker's first task is that sample's failure; the others go back to ``queue``.
        """
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                kind = msg[0]
                if kind == "ready":
                    w.ready = True
                elif kind in ("ok", "error") and w.tasks and msg[1] == w.tasks[0][0]:
                    w.tasks.popleft()
                    w.deadline = time.monotonic() + self.timeout_s  # the worker starts the next one now
                    if kind == "ok":
                        results[msg[1]] = msg[2]
                        self.counters.calls += 1
                    else:
                        self._fail(msg[1], msg[2])
                elif kind == "init_error":
                    raise RewardError(
                        f"reward worker could not load reward function {self.fn_spec!r}: {msg[1]}; "
                        "make it importable in a fresh Python process"
                    )
        except (EOFError, OSError):
            pass  # the worker died; handled below
        if not w.process.is_alive():
            if w.tasks:
                self._fail(w.tasks[0][0], f"reward worker died (exit code {w.process.exitcode}) while scoring it")
            self._requeue(w, queue)
            self._replace(index)
        elif w.tasks and time.monotonic() > w.deadline:
            self._fail(w.tasks[0][0], f"reward function took longer than timeout_s={self.timeout_s}", timeout=True)
            self._requeue(w, queue)
            self._replace(index)

    @staticmethod
    def _requeue(w: _Worker, queue: deque[tuple]) -> None:
        """Put the tasks queued behind a failed one back in front, in order."""
        behind = list(w.tasks)[1:]
        w.tasks.clear()
        queue.extendleft(reversed(behind))
