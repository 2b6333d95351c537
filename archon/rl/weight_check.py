"""Checking that every rollout server computes with the trainer's weights, after a weight update.

A weight update can succeed by every server's own account and still leave a server on other
weights: vLLM's in-place reload put a tied LM head's old tensor back and sampled from the new body
through the old head (``archon.rollout.tied_embeddings``), a server may have started from another
model, a reload may half-fail.  Nothing in the sync's answer says what a server computes, so every
``rollout.weight_check_freq``-th update (and at start) each up server samples a short probe: the
first training prompt, ``n_tokens`` tokens with the run's sampling parameters, a fixed seed, EOS
ignored.  The trainer recomputes the logprobs of those tokens with its own weights, exactly as it
recomputes a rollout's, and the run stops when a server's mean |server - trainer| logprob exceeds
``rollout.weight_check_tol`` or it reports another weight version than the one just sent.  The
probes go out right after the update and are recomputed at the next step, before it trains on
anything those weights generated (``start`` / ``finish``): a round trip per update would have
cost the digits demo 10% of a synchronous step and half the asynchronous speed-up.

The figure is the train/inference mismatch of fresh weights on one short sequence: 1e-6 between
the built-in server and the trainer in float32, ~1e-2 for bf16 engines, ~1 for a stale LM head.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from archon.errors import ArchonError
from archon.rl.rank0 import run_on_rank0
from archon.rl.rollout_batch import Completion, build_rollout_batch
from archon.rollout.server_api import RolloutError

logger = logging.getLogger("archon.rl")

PROBE_SEED = 20_241_126
"""Sampling seed of the probe: the same tokens every time for the same weights."""
FLOAT32_TOL = 1e-3
"""Default tolerance when the servers and the trainer both compute in float32."""
HALF_PRECISION_TOL = 0.2
"""Default tolerance otherwise: bf16 noise on a few tokens stays well below it, wrong weights do not."""
_ANSWER_TIMEOUT_S = 600.0
# Ahead of a queued rollout round on servers that admit by priority (the built-in one): an asynchronous run waits
# for its probe, 54 ms of a 150 ms digits-demo step with it, ~85 ms without.
_PROBE_PRIORITY = 1


class WeightCheckError(ArchonError, RuntimeError):
    """A rollout server does not compute with the weights the trainer sent it."""


class LogprobScorer(Protocol):
    """What the check needs of the actor: per-token logprobs of a rollout batch (collective)."""

    def compute_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...


def default_tolerance(server_dtype: str, trainer_dtype: str) -> float:
    """``FLOAT32_TOL`` when both sides compute in float32, else ``HALF_PRECISION_TOL``."""
    both_fp32 = all(d in ("float32", "fp32") for d in (server_dtype, trainer_dtype))
    return FLOAT32_TOL if both_fp32 else HALF_PRECISION_TOL


ASYNC_FREQ = 10
"""Updates between checks of an asynchronous run by default: there the next step starts while the servers still
generate a round ahead of the probe, so a check waits (~half a step of the digits demo)."""


def weight_check_freq(configured: int, asynchronous: bool) -> int:
    """Updates between checks: ``rollout.weight_check_freq``, or for -1 every update of a synchronous run (its probe
    is answered during the next rollout, at the cost of one tiny forward) and every ``ASYNC_FREQ``-th of an
    asynchronous one."""
    if configured >= 0:
        return configured
    return ASYNC_FREQ if asynchronous else 1


def probe_sampling(sampling: dict[str, Any], n_tokens: int) -> dict[str, Any]:
    """The run's sampling parameters for a probe of ``n_tokens`` tokens: fixed seed, EOS and stop tokens ignored."""
    params = dict(sampling, max_new_tokens=n_tokens, ignore_eos=True, sampling_seed=PROBE_SEED)
    params.pop("min_new_tokens", None)
    return params


def _answers(sent: list[tuple[str, Future[Any]]]) -> list[tuple[str, Any]]:
    """The probe answers of the servers that answered; one that could not (it died, it is being restarted) is left to
    the server supervisor, which deals with lost servers, and warned about here."""
    out = []
    for url, future in sent:
        try:
            out.append((url, future.result(timeout=_ANSWER_TIMEOUT_S)))
        except (RolloutError, concurrent.futures.TimeoutError) as exc:
            logger.warning("rollout server %s did not answer the weight probe (%s); not checked this time", url, exc)
    return out


class ServerWeightCheck:
    """The probe of every server and its verdict (``start`` and ``finish`` are collective over the training ranks)."""

    def __init__(
        self,
        actor: LogprobScorer,
        prompt_ids: Sequence[int],
        sampling: dict[str, Any],
        *,
        tol: float,
        freq: int = 1,
        n_tokens: int = 8,
        pad_token_id: int = 0,
    ):
        if not prompt_ids:
            raise ValueError("the weight check needs a non-empty probe prompt")
        self.actor = actor
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.sampling = probe_sampling(sampling, n_tokens)
        self.tol = tol
        self.freq = freq
        self.pad_token_id = pad_token_id
        # (version, rank 0's probe requests in flight) between start() and finish().
        self._pending: tuple[str | None, list[tuple[str, Future[Any]]]] | None = None

    def due(self, step: int) -> bool:
        """Whether the update of RL step ``step`` is checked."""
        return self.freq > 0 and step % self.freq == 0

    def run(self, client: Any, version: str | None) -> dict[str, float]:
        """Collective: ``start`` then ``finish`` at once (the check at start, and tests)."""
        self.start(client, version)
        return self.finish()

    def start(self, client: Any, version: str | None) -> None:
        """Collective, returns at once: rank 0 sends every up server the probe (``client``: rank 0's
        ``RolloutClient``, None elsewhere) of the weights just sent as ``version`` (None: the model folder's).

        The probes are answered while the next rollout runs (servers batch them with its requests;
        an asynchronous server is busy generating anyway), so a check costs the trainer a tiny
        forward in ``finish``, not a round trip.
        """
        self._pending = (version, [] if client is None else self._send(client))

    def _send(self, client: Any) -> list[tuple[str, Future[Any]]]:
        return [
            (url, client.submit(client.agenerate_on(url, self.prompt_ids, self.sampling, priority=_PROBE_PRIORITY)))
            for url in client.up_addrs
        ]

    def finish(self) -> dict[str, float]:
        """Collective, before the trainer's weights change again: recompute the probes ``start`` sent on every rank;
        raise ``WeightCheckError`` on every rank if a server disagrees.  Returns ``weight_check/logprob_diff``, the
        worst server's mean |server - trainer| logprob (nothing when no check is pending).
        """
        if self._pending is None:
            return {}
        (version, sent), self._pending = self._pending, None
        t0 = time.perf_counter()
        probes: list[tuple[str, Any]] = run_on_rank0(lambda: _answers(sent), "probing the rollout servers' weights")
        if not probes:
            return {}
        completions = [
            Completion(self.prompt_ids, list(r.output_ids), list(r.output_logprobs), r.finish_reason) for _, r in probes
        ]
        batch = build_rollout_batch(completions, [0.0] * len(completions), pad_token_id=self.pad_token_id)
        trainer = self.actor.compute_logprobs(batch)
        mask = batch["loss_mask"] > 0
        diffs = [
            float((trainer[i][mask[i]].double() - batch["logprobs"][i][mask[i]].double()).abs().mean())
            for i in range(len(probes))
        ]
        # Rank 0's verdict on every rank: recomputations agree across ranks only to rounding.
        problem = run_on_rank0(lambda: self._problem(probes, diffs, version), "checking the rollout servers' weights")
        if problem is not None:
            raise WeightCheckError(problem)
        return {"weight_check/logprob_diff": max(diffs, default=0.0), "weight_check/time_s": time.perf_counter() - t0}

    def _problem(self, probes: list[tuple[str, Any]], diffs: list[float], version: str | None) -> str | None:
        """What is wrong with the servers' answers, in one sentence; None when every server passes."""
        for (url, result), diff in zip(probes, diffs):
            if not result.output_ids:
                return f"rollout server {url} returned no tokens for the weight probe; is it healthy?"
            if diff > self.tol:
                return (
                    f"rollout server {url} does not compute with the trainer's weights"
                    f"{f' of version {version}' if version is not None else ''}: the mean |server - trainer| "
                    f"logprob of a {len(result.output_ids)}-token probe is {diff:.3g} > rollout.weight_check_tol = "
                    f"{self.tol:g}; likely a weight update that did not take effect in full (vLLM: start it from the "
                    "untied folder Archon makes for tied embeddings), a server started from another model or dtype, "
                    "or a tolerance too tight for this precision (raise rollout.weight_check_tol)"
                )
        stale = [(url, r.weight_version) for url, r in probes if version is not None and r.weight_version != version]
        if stale:
            shown = ", ".join(f"{url} reports '{got}'" for url, got in stale)
            return f"after the update to weight version '{version}' {shown}; the update did not reach every server"
        return None
