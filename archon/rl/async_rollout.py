"""Asynchronous RL: rollout keeps generating while the trainer trains, within a bound on staleness.

With ``rollout.max_head_offpolicyness = k > 0`` the trainer (``archon.rl.trainer``) takes its
batches from ``AsyncRollout``, the asynchronous ``RolloutStrategy`` (``archon.rl.rollout_strategy``
has the interface and the synchronous one).  The design follows AReaL's
(workflow executor, staleness manager, interruptible generation); what differs is said below.

Versions.  Version ``v`` is the policy after ``v`` RL steps; the servers hold version ``v`` once
the weight sync of step ``v`` is done.  Step ``s`` trains on version ``s - 1`` and publishes
version ``s``.  Every generated token carries the version that produced it
(``Completion.output_versions``); a trajectory is ``(s - 1) - v0`` versions stale at step ``s``,
``v0`` being its first token's version.

Rounds.  Prompts are drawn from the data loader in rounds of one batch (``batch_size`` prompts,
``n_samples`` samples each), in data order, and round ``r`` samples with the seeds
``rollout_seed(seed, r + 1, i)``.  Steps take rounds in order, one each (several with the dynamic
filter), so without the filter round ``r`` is step ``r + 1``'s batch with the synchronous
trainer's prompts and seeds.  Unlike AReaL, whose batches are the first trajectories to finish,
a batch here is always whole rounds in data order: a slow trajectory delays its step instead of
slipping into a later one, which keeps the bound below exact and runs reproducible.

Capacity (AReaL's staleness manager, per round).  With ``C`` rounds taken, ``S`` steps started
and the servers at version ``v``, round ``r >= C`` is submitted only when
``S + (r - C) - v <= k``: it will be taken by step ``S + 1 + (r - C)`` at the latest (every later
step takes at least one round), which trains version ``S + (r - C)``, so its first token is at
most ``k`` versions stale; ``r < C`` is already some started step's, whose version is current.
Submitting stops when the next round would break the bound, so no sample is ever generated
only to be thrown away as too stale; the trainer still checks every trajectory.

Weight updates.  With ``rollout.partial_rollout`` (default) the update pauses the servers in
``rollout.pause_generation_mode``: 'retract' keeps each request's tokens on the server, which
prefills prompt + tokens again under the new weights and continues (partial rollouts; SGLang
and the built-in server report the version of each token span); 'abort' ends the requests
and they are sent again here with their tokens appended to the prompt.  Without per-token
versions from the server (older SGLang), each answer's tokens get the version the server
reports with it, or the version known here when it was sent.  With ``partial_rollout = false``
an update first submits every round the bound allows and waits until all of them are
generated, so each round comes from one version: the version that generates round ``r`` is
then a function of ``r``, ``k`` and the rewards alone, and runs are reproducible (and equal
under every allocation), which a timed interruption never is.

Checkpoints.  The checkpoint holds the trainer's data position, which counts only the rounds
that steps took, and the number of rounds taken.  Rounds in flight at a kill are dropped and,
after resume, generated again from the same prompts (by the resumed policy), so no
trajectory is lost or used twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch.distributed as dist

from archon.data.rl_dataset import PromptLoader, PromptSample
from archon.rl.dynamic_filter import collect_mixed_groups
from archon.rl.offpolicy import staleness_metrics
from archon.rl.rank0 import run_on_rank0
from archon.rl.rollout_batch import Completion
from archon.rl.rollout_strategy import RolloutInputs, RolloutStrategy, StepRollout, rollout_seed
from archon.rl.scoring import ScoreFn
from archon.rollout.aio import gather_or_cancel

if TYPE_CHECKING:
    from archon.rl.agent.trajectory import Trajectory

logger = logging.getLogger("archon.rl")

STATE_KEY = "async_rollout"
"""The checkpoint's extra-state entry of ``AsyncRollout.state_dict``."""


def continuation_seed(seed: int, n_tokens: int) -> int:
    """The sampling seed of a request sent again after ``n_tokens`` tokens (its own random stream)."""
    return (int(seed) * 1_000_003 + n_tokens * 104_729 + 7) % (2**31 - 1)


def parse_version(version: str, default: int) -> int:
    """A server's weight version string as a policy version; ``default`` for names that are not
    integers (the servers' initial 'default')."""
    return int(version) if version.isdecimal() else default


@dataclass
class Round:
    """One round of rollouts, generated and scored."""

    index: int
    """Position in data order (0 is the first round the run ever drew)."""
    prompts: list[PromptSample]
    """One entry per sample (each prompt ``n_samples`` times in a row)."""
    completions: list[Completion]
    """Completions with per-token versions."""
    rewards: list[float]
    """One reward per completion."""
    timing: dict[str, float]
    """``rollout_time_s`` (first request sent to last answer), ``reward_time_s``."""
    trajectories: list[Trajectory] | None = None
    """Agent episodes in place of ``completions`` (``archon.rl.agent.agent_worker``), their rewards ``rewards``."""


class RolloutWorker:
    """Rank 0's generator of rounds: submits under capacity control, continues interrupted requests.

    Its state lives on the rollout client's event loop; the blocking methods may be called from
    any other thread (the trainer's).
    """

    def __init__(
        self,
        client: Any,
        loader: PromptLoader,
        *,
        sampling: dict[str, Any],
        seed: int,
        max_offpolicyness: int,
        score_fn: ScoreFn | None,
        version: int = 0,
        rounds_taken: int = 0,
        steps_started: int = 0,
        partial_rollout: bool = True,
        pause_mode: str = "retract",
        max_concurrency: int = 0,
        max_rounds: int | None = None,
    ):
        if max_offpolicyness < 0:
            raise ValueError(f"max_head_offpolicyness = {max_offpolicyness} must be 0 or more")
        self.client = client
        self.loader = loader
        self.sampling = dict(sampling)
        self.seed = seed
        self.k = max_offpolicyness
        self.score_fn = score_fn
        self.partial_rollout = partial_rollout
        self.pause_mode = pause_mode
        self.max_concurrency = max_concurrency
        self.max_rounds = max_rounds
        # Counters of the capacity rule (see the module docstring).
        self.version = version
        self.rounds_taken = rounds_taken
        self.steps_started = steps_started
        self.next_round = rounds_taken
        self.resubmitted = 0
        """Requests sent again after a pause aborted them (pause mode 'abort')."""
        self._pauses = 0
        self.servers_paused = False
        """Whether before_update paused the servers (after_update resumes them)."""
        self._closed = False
        self._finished: dict[int, Round] = {}
        """Rounds generated and scored, by index, for ``take`` to pick up without a trip through the loop."""
        self._taken = rounds_taken
        """Rounds handed out by ``take`` (the trainer's side of ``rounds_taken``)."""
        self._posted: list[concurrent.futures.Future] = []
        """Calls posted to the loop without waiting; a failure is raised by a later call."""
        self._rounds: dict[int, asyncio.Task] = {}
        self._generating: dict[int, asyncio.Task] = {}
        # One thread scores rounds one after another, beside the trainer (RewardComputer is not
        # meant for concurrent callers).
        self._scorer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="archon-async-reward")
        self._open: asyncio.Event | None = None
        self._limit: asyncio.Semaphore | None = None

    # ---------------------------------------------------------------- blocking API (trainer thread)
    def start(self) -> None:
        """Submit the first rounds."""
        self.client.submit(self._astart()).result()

    def take(self, new_step: bool) -> Round:
        """The next round in data order (waits for it); ``new_step``: the first round of a step.

        A round already generated and scored is returned at once, and the counters it changes are
        updated on the loop afterwards: calls reach the loop in order, so the next ``before_update``
        finds them updated.  (Waiting for the loop thread to answer cost ~2 ms a step, ~3% of a
        digits-demo step.)
        """
        finished = self._finished.pop(self._taken, None)
        # Waiting for a round, wait first for what was posted: a failed resume would hold the round forever.
        self._raise_posted(wait=finished is None)
        self._taken += 1
        if finished is not None:
            self._posted.append(self.client.submit(self._aaccount_take(new_step)))
            return finished
        return self.client.submit(self._atake(new_step)).result()

    def before_update(self) -> float:
        """Get the servers ready for new weights (see the module docstring); returns seconds waited.

        Afterwards no request of ours runs or starts until ``after_update``: paused, or none was in flight.
        """
        self._raise_posted(wait=True)
        return self.client.submit(self._abefore_update()).result()

    def after_update(self, version: int, wait: bool = True) -> None:
        """The servers now hold ``version``: resume them and submit what the bound allows.

        ``wait = False`` returns at once; a failure is then raised by the next call.
        """
        self._raise_posted(wait=True)
        posted = self.client.submit(self._aafter_update(version))
        if wait:
            posted.result()
        else:
            self._posted.append(posted)

    def _raise_posted(self, wait: bool) -> None:
        """Raise the failure of a posted call; ``wait``: wait for every one, else check those done."""
        for posted in list(self._posted):
            if wait or posted.done():
                self._posted.remove(posted)
                posted.result()

    def close(self) -> None:
        """Cancel every round in flight and stop the scoring thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.client.submit(self._aclose()).result(timeout=60)
        except (RuntimeError, concurrent.futures.TimeoutError):  # the client is closed already
            pass
        self._scorer.shutdown(wait=True, cancel_futures=True)

    # ---------------------------------------------------------------- on the event loop
    async def _astart(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._limit = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency > 0 else None
        self._fill()

    def _may_submit(self, r: int) -> bool:
        if self.max_rounds is not None and r >= self.max_rounds:
            return False
        if r < self.rounds_taken:
            return True  # a started step waits for it; that step trains the current version
        return self.steps_started + (r - self.rounds_taken) - self.version <= self.k

    def _fill(self) -> None:
        """Submit rounds in order while the bound allows (called whenever a counter changes)."""
        assert self._open is not None, "RolloutWorker.start() was not called"
        while self._open.is_set() and not self._closed and self._may_submit(self.next_round):
            r = self.next_round
            self.next_round += 1
            prompts = self.loader.next_rollout_batch()
            gen = asyncio.get_running_loop().create_task(self._generate_round(r, prompts))
            self._generating[r] = gen
            task = asyncio.get_running_loop().create_task(self._score_round(r, prompts, gen))
            task.add_done_callback(self._keep_finished)
            self._rounds[r] = task

    def _keep_finished(self, task: asyncio.Task) -> None:
        # Only rounds that succeeded and are not taken yet; a failure reaches take() through the task.
        if not task.cancelled() and task.exception() is None and task.result().index >= self.rounds_taken:
            rnd = task.result()
            self._finished[rnd.index] = rnd

    async def _generate_round(self, r: int, prompts: list[PromptSample]) -> tuple[list[Any], float]:
        t0 = time.perf_counter()
        params = [{**self.sampling, "sampling_seed": rollout_seed(self.seed, r + 1, i)} for i in range(len(prompts))]
        try:
            if self._limit is None:
                completions = await self._generate([p.input_ids for p in prompts], params)
            else:
                # At most max_concurrency requests in flight over every round: one sample per request.
                groups = await gather_or_cancel(self._generate([p.input_ids], [q]) for p, q in zip(prompts, params))
                completions = [c for group in groups for c in group]
        finally:
            self._generating.pop(r, None)
        return completions, time.perf_counter() - t0

    async def _score_round(self, r: int, prompts: list[PromptSample], gen: asyncio.Task) -> Round:
        completions, gen_time = await gen
        t1 = time.perf_counter()
        assert self.score_fn is not None  # rounds of completions are scored here (agent episodes score themselves)
        rewards = await asyncio.get_running_loop().run_in_executor(self._scorer, self.score_fn, prompts, completions)
        return Round(
            r,
            prompts,
            completions,
            list(rewards),
            {"rollout_time_s": gen_time, "reward_time_s": time.perf_counter() - t1},
        )

    async def _generate(self, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[Completion]:
        """Samples sent together; those a pause for new weights aborted are sent again with their tokens so far."""
        outs: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        versions: list[list[int]] = [[] for _ in prompts]
        reasons = [""] * len(prompts)
        todo = list(range(len(prompts)))
        sent = False
        while todo:
            if sent:
                # Sent again once the servers hold the new weights.
                assert self._open is not None
                await self._open.wait()
            sent = True
            requests = [self._continuation(params[i], len(outs[i])) for i in todo]
            pauses, known = self._pauses, self.version
            inputs = [list(prompts[i]) + outs[i] for i in todo]
            if self._limit is not None:
                async with self._limit:
                    results = await self.client.agenerate_many(inputs, requests)
            else:
                results = await self.client.agenerate_many(inputs, requests)
            again = []
            for i, res in zip(todo, results):
                outs[i] += res.output_ids
                logprobs[i] += res.output_logprobs
                versions[i] += [parse_version(v, known) for v in res.output_versions]
                full = len(outs[i]) >= int(params[i].get("max_new_tokens", 0))
                if res.finish_reason == "abort" and self._pauses != pauses and not full:
                    self.resubmitted += 1
                    again.append(i)
                else:
                    reasons[i] = "length" if res.finish_reason == "abort" and full else res.finish_reason
            todo = again
        return [
            Completion(list(p), out, lps, reason, output_versions=vs)
            for p, out, lps, reason, vs in zip(prompts, outs, logprobs, reasons, versions)
        ]

    @staticmethod
    def _continuation(params: dict[str, Any], done: int) -> dict[str, Any]:
        """A sample's request after ``done`` tokens: the rest of the budget and a random stream of its own
        (the first part's draws must not repeat)."""
        if not done:
            return params
        request = {
            **params,
            "max_new_tokens": int(params.get("max_new_tokens", 0)) - done,
            "min_new_tokens": max(0, int(params.get("min_new_tokens", 0) or 0) - done),
        }
        if params.get("sampling_seed") is not None:
            request["sampling_seed"] = continuation_seed(params["sampling_seed"], done)
        return request

    def _account_take(self, new_step: bool) -> asyncio.Task:
        """Count a round as taken (submitting what that allows); the task that makes the round."""
        if new_step:
            self.steps_started += 1
        r = self.rounds_taken
        self.rounds_taken += 1
        self._fill()
        task = self._rounds.pop(r, None)
        assert task is not None, f"round {r} was taken but never submitted"
        self._finished.pop(r, None)
        return task

    async def _aaccount_take(self, new_step: bool) -> None:
        self._account_take(new_step)

    async def _atake(self, new_step: bool) -> Round:
        return await self._account_take(new_step)

    async def _abefore_update(self) -> float:
        assert self._open is not None
        t0 = time.perf_counter()
        if not self.partial_rollout:
            # Everything the current version may generate is generated by it, to the end.
            self._fill()
            self._open.clear()
            pending = list(self._generating.values())
            if pending:
                await asyncio.wait(pending)
        else:
            self._open.clear()
        self._pauses += 1
        # Nothing in flight (the round finished while the trainer trained) and nothing sent until
        # after_update: the servers are idle, so the pause and continue round trips are skipped.
        self.servers_paused = self.partial_rollout and bool(self._generating)
        if self.servers_paused:
            await self.client.apause_generation(self.pause_mode)
        return time.perf_counter() - t0

    async def _aafter_update(self, version: int) -> None:
        assert self._open is not None
        self.version = version
        if self.servers_paused:
            await self.client.acontinue_generation()
            self.servers_paused = False
        self._open.set()
        self._fill()

    async def _aclose(self) -> None:
        self._finished.clear()
        tasks = list(self._rounds.values()) + list(self._generating.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._rounds.clear()
        self._generating.clear()


def fork_loader(loader: PromptLoader) -> PromptLoader:
    """A loader over the same prompts at the same position that advances on its own."""
    fork = copy.copy(loader)
    fork.sampler = copy.deepcopy(loader.sampler)
    return fork


class AsyncRollout(RolloutStrategy):
    """Every training rank's side of asynchronous rollout (the strategy when k > 0).

    Rank 0 runs the ``RolloutWorker``; each round reaches every rank through a broadcast, and
    every rank advances its own data loader by the rounds its steps take, so the checkpointed
    data position counts exactly the trajectories that were trained.
    """

    off_policy = True

    def __init__(
        self,
        inputs: RolloutInputs,
        *,
        start_step: int,
        total_steps: int,
        resumed: Mapping[str, Any],
        decoupled: bool,
        make_worker: Callable[..., RolloutWorker] = RolloutWorker,
    ):
        """``start_step``: the last step trained (the version the servers hold); ``resumed``: the checkpoint's
        extra state (empty for a new run); ``decoupled``: whether the PPO ratio is taken against recomputed
        proximal logprobs (a warning says what happens without); ``make_worker``: rank 0's worker class (agent
        episodes: ``archon.rl.agent.agent_worker.AgentRolloutWorker`` with its episodes bound)."""
        cfg = inputs.rollout
        self.inputs = inputs
        self.k = cfg.max_head_offpolicyness
        state = resumed.get(STATE_KEY) or {}
        self.rounds_taken = int(state.get("rounds_taken", start_step))
        self.worker: RolloutWorker | None = None
        partial = cfg.partial_rollout
        if hasattr(inputs.weight_sync, "pause_mode"):
            # The broadcast's own pause must keep requests (retract) rather than end them.
            cast(Any, inputs.weight_sync).pause_mode = cfg.pause_generation_mode if partial else None

        def start() -> None:
            self.worker = make_worker(
                inputs.client,
                fork_loader(inputs.loader),
                sampling=inputs.sampling,
                seed=inputs.seed,
                max_offpolicyness=self.k,
                score_fn=inputs.score,
                version=start_step,
                rounds_taken=self.rounds_taken,
                steps_started=start_step,
                partial_rollout=partial,
                pause_mode=cfg.pause_generation_mode,
                max_concurrency=cfg.max_concurrent_rollouts,
                max_rounds=None if inputs.dynamic_filter.enable else self.rounds_taken + total_steps - start_step,
            )
            self.worker.start()

        run_on_rank0(start, "starting asynchronous rollout")
        if dist.get_rank() == 0:
            logger.info(
                "asynchronous rollout: up to %d policy versions of staleness, %s",
                self.k,
                "partial rollouts (weight updates interrupt generation)"
                if partial
                else "each round generated by one version (reproducible)",
            )
            if not decoupled:
                logger.warning(
                    "rollout.max_head_offpolicyness = %d without actor.use_decoupled_loss: the PPO ratio "
                    "is taken against the behaviour policy, up to %d versions old, and clipped around it; "
                    "set actor.use_decoupled_loss = true to clip around the current policy",
                    self.k,
                    self.k,
                )

    def _take(self, step: int, new_step: bool) -> tuple[list[Any], list[float], dict[str, float]]:
        """The next round: its completions (or agent trajectories), rewards and timings, on every rank."""
        t0 = time.perf_counter()

        def take() -> tuple[list[int], list[Any], list[float], dict[str, float]]:
            assert self.worker is not None
            rnd = self.worker.take(new_step)
            items = rnd.trajectories if rnd.trajectories is not None else rnd.completions
            return [p.index for p in rnd.prompts], items, rnd.rewards, rnd.timing

        indices, items, rewards, timing = run_on_rank0(take, f"rollout of step {step}")
        # Every rank keeps the data position of what was trained; it must be what rank 0 generated.
        expected = [p.index for p in self.inputs.loader.next_rollout_batch()]
        if expected != indices:
            raise RuntimeError(
                f"asynchronous rollout of step {step} generated prompts {indices[:4]}.. where the "
                f"data position says {expected[:4]}..; this is a bug in archon.rl.async_rollout"
            )
        self.rounds_taken += 1
        return items, rewards, {**timing, "async/wait_s": time.perf_counter() - t0}

    def next_batch(self, step: int) -> StepRollout:
        """Step ``step``'s completions, rewards and metrics (rollout timings, staleness); its tokens of
        version ``step - 1`` (the one it trains) are the mismatch's."""
        dyn = self.inputs.dynamic_filter
        if dyn.enable:
            items, rewards, timing = collect_mixed_groups(
                lambda round_idx: self._take(step, new_step=round_idx == 0),
                group_size=self.inputs.n_samples,
                max_rounds=dyn.max_num_gen_batches,
            )
        else:
            items, rewards, timing = self._take(step, new_step=True)
        episodes = bool(self.inputs.rollout.workflow)
        trajectories: list[Trajectory] | None = items if episodes else None
        if trajectories is not None:
            metrics = staleness_metrics([t.sampled_versions() for t in trajectories], step - 1, self.k)
        else:
            metrics = staleness_metrics([c.output_versions for c in items], step - 1, self.k)
        if metrics.get("async/staleness_max", 0.0) > self.k:
            raise RuntimeError(
                f"step {step} got a trajectory {metrics['async/staleness_max']:.0f} policy versions "
                f"stale, beyond rollout.max_head_offpolicyness = {self.k}; this is a bug in "
                "archon.rl.async_rollout"
            )
        # Where the data loader stands after this step (epoch * prompts + position): equal in a
        # resumed run and an uninterrupted one when no prompt was lost or taken twice.
        sampler = self.inputs.loader.sampler
        metrics["async/data_position"] = float(sampler.epoch * sampler.n + sampler.position)
        if self.worker is not None:
            metrics["async/resubmitted"] = float(self.worker.resubmitted)
        completions = [] if episodes else items
        return StepRollout(
            completions, rewards, {**timing, **metrics}, fresh_version=step - 1, trajectories=trajectories
        )

    def _rank0_worker(self) -> RolloutWorker:
        assert self.worker is not None  # rank 0 started it in __init__
        return self.worker

    def sync_weights(self, step: int) -> dict[str, float]:
        """Publish version ``step`` to the servers around the rollout in flight."""
        waited = run_on_rank0(
            lambda: self._rank0_worker().before_update(), f"pausing rollout for the weights of step {step}"
        )
        # The worker holds back every request until after_update, so the sync need not pause the servers.
        stats = self.inputs.weight_sync.sync(str(step), servers_quiet=True)
        run_on_rank0(
            # Not waited for (~1 ms of the loop thread's time a step): take() or the next update
            # raises its failure.
            lambda: self._rank0_worker().after_update(step, wait=False),
            f"resuming rollout after the weights of step {step}",
        )
        return {**stats, "async/update_wait_s": waited}

    def state_dict(self) -> dict[str, Any]:
        return {STATE_KEY: {"rounds_taken": self.rounds_taken}}

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
