"""The RL loop: rollout -> rewards -> ref/old logprobs and values -> advantages -> updates -> weight sync.

Every training rank runs this loop.  Rank 0 talks to the rollout servers and the reward
workers and broadcasts what it got; then every rank holds the whole rollout batch and each
engine (actor, critic, reference; each with its own allocation over the same ranks) takes
its data-parallel share of it.  The batches come from a rollout strategy built at setup
(``archon.rl.rollout_strategy``): synchronous, or with ``rollout.max_head_offpolicyness > 0``
asynchronous (``archon.rl.async_rollout``), which keeps generating while the ranks train.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from archon.checkpoint.manager import CheckpointManager
from archon.checkpoint.schedule import SaveSchedule
from archon.cli import init_run
from archon.config import Config, ConfigError
from archon.config.preflight import preflight, resolved_group_size  # noqa: F401 - resolved_group_size is public here
from archon.config.reference import reference_is_actor_base
from archon.data.encoding import load_tokenizer
from archon.data.from_config import build_rl_dataset, describe_chat_template
from archon.data.rl_dataset import PromptLoader
from archon.engine import ArchonEngine, TrainEngine, build_engine
from archon.engine.final_export import export_final
from archon.eval.periodic import PeriodicEvaluation
from archon.launch.discovery import server_source
from archon.launch.recovery import ServerSupervisor
from archon.metrics import MetricsLogger, peak_memory_gb
from archon.rl.actor import PPOActor, ReferenceModel
from archon.rl.advantages import check_advantage_options, compute_advantages
from archon.rl.agent.agent_batch import agent_metrics, build_agent_batch
from archon.rl.agent.agent_rollout import AgentRollout
from archon.rl.agent.agent_worker import AgentRolloutWorker
from archon.rl.agent.episodes import EpisodeSpec
from archon.rl.agent.workflow import load_workflow
from archon.rl.async_rollout import AsyncRollout, RolloutWorker
from archon.rl.colocation import ColocatedPhases
from archon.rl.critic import PPOCritic
from archon.rl.inprocess import InProcessRollout
from archon.rl.kl import KLController, kl_estimate
from archon.rl.losses import aggregate
from archon.rl.mismatch import MismatchMonitor
from archon.rl.offpolicy import MISMATCH, behaviour_ratio_metrics, mismatch
from archon.rl.rank0 import RankZeroError, run_on_rank0  # noqa: F401 - RankZeroError is public here
from archon.rl.rewards import RewardComputer, get_reward_fn
from archon.rl.rollout_batch import FRESH_MASK, build_rollout_batch
from archon.rl.rollout_strategy import RolloutInputs, RolloutStrategy, SyncRollout
from archon.rl.scoring import CompletionScorer
from archon.rl.weight_check import ServerWeightCheck, default_tolerance, weight_check_freq
from archon.rollout.client import RolloutClient
from archon.rollout.server_api import sampling_params
from archon.rollout.weight_sync import WeightSync, server_dtype, weight_sync_for
from archon.runtime.gc_freeze import freeze_startup_objects, thaw_startup_objects

if TYPE_CHECKING:
    from archon.launch.discovery import PublishedServers
    from archon.launch.servers import RolloutLauncher

logger = logging.getLogger("archon.rl")


def policy_temperature(cfg: Config) -> float:
    """What the trainer divides logits by, matching what the server reports (1 when greedy).

    Greedy is temperature 0 or ``top_k = 1``: SGLang (and the built-in server) sample ``top_k = 1``
    on their greedy path, whose logprobs are unscaled whatever the temperature.
    """
    if cfg.actor.temperature:
        return cfg.actor.temperature
    t = cfg.gconfig.temperature
    return t if t > 0 and cfg.gconfig.top_k != 1 else 1.0


class RLTrainer:
    """One RL run: ``RLTrainer(cfg).run()`` on every training rank (torchrun)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        # What `python -m archon.config` checks, on every rank before any process group; resolves hub ids in cfg.
        self.preflight_report = preflight(cfg, "rl")
        self.group_size = resolved_group_size(cfg)
        self.temperature = policy_temperature(cfg)
        self.use_ref = bool(cfg.actor.kl_ctl or cfg.actor.kl_loss_coef)
        self.use_teacher = bool(cfg.actor.kd_coef)
        self.use_critic = cfg.actor.adv_estimator == "gae"
        try:
            check_advantage_options(cfg.actor, group_size=self.group_size)
        except ValueError as exc:
            raise ConfigError(f"actor: {exc}") from None
        # The reward's KL coefficient; adaptive controllers change it, so it is checkpointed.
        self.kl_ctl = KLController(
            cfg.actor.kl_ctl, cfg.actor.kl_ctl_type, cfg.actor.kl_ctl_target, cfg.actor.kl_ctl_horizon
        )
        # Built in run(); close() releases whatever was built.
        self.launcher: RolloutLauncher | PublishedServers | None = None
        self.client: RolloutClient | None = None
        self.rewards: RewardComputer | None = None
        self.weight_sync: WeightSync | None = None
        self.supervisor: ServerSupervisor | None = None
        self.rollout: RolloutStrategy | None = None  # built by setup(): where each step's batch comes from
        self.weight_check: ServerWeightCheck | None = None  # built with the weight sync
        self.inprocess: InProcessRollout | None = None  # rollout.backend = 'inprocess:dN' only
        self.colocated: ColocatedPhases | None = None  # rollout.colocate only
        self.evaluation: PeriodicEvaluation | None = None  # valid_dataset.path set only
        self.mismatch_monitor = MismatchMonitor(cfg.rollout.mismatch_warn, cfg.rollout.mismatch_stop)

    # ------------------------------------------------------------------ setup
    def _build_engines(self) -> None:
        cfg = self.cfg
        common: dict[str, Any] = dict(seed=cfg.seed, device=cfg.device, temperature=self.temperature)
        actor_steps = cfg.total_train_steps * cfg.actor.ppo_n_minibatches * cfg.actor.ppo_epochs
        self.actor_engine = build_engine(cfg.actor, name="actor", total_steps=actor_steps, **common).initialize()
        self.actor = PPOActor(self.actor_engine, cfg.actor, max_new_tokens=cfg.gconfig.max_new_tokens)
        self.engines: dict[str, TrainEngine] = {"actor": self.actor_engine}
        self.ref = None
        if self.use_ref and reference_is_actor_base(cfg):
            if self.rank0:
                logger.info("reference: the actor's base weights (adapters off)")
            self.ref = ReferenceModel(self.actor_engine, adapters_off=True)
        elif self.use_ref:
            ref_engine = build_engine(cfg.ref, name="ref", trainable=False, **common).initialize()
            self.ref = ReferenceModel(ref_engine)
        self.teacher = None
        if self.use_teacher:
            teacher_engine = build_engine(cfg.teacher, name="teacher", trainable=False, **common).initialize()
            self.teacher = ReferenceModel(teacher_engine)
        self.critic = None
        if self.use_critic:
            critic_steps = cfg.total_train_steps * cfg.critic.ppo_n_minibatches * cfg.critic.ppo_epochs
            critic_engine = build_engine(
                cfg.critic, name="critic", is_critic=True, total_steps=critic_steps, **common
            ).initialize()
            self.critic = PPOCritic(
                critic_engine, cfg.critic, agg_mode=cfg.actor.loss_agg_mode, max_new_tokens=cfg.gconfig.max_new_tokens
            )
            self.engines["critic"] = critic_engine

    def _build_data(self) -> None:
        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.actor.path)
        dataset = build_rl_dataset(cfg.train_dataset, self.tokenizer)
        if self.rank0:
            logger.info(describe_chat_template(cfg.train_dataset, self.tokenizer))
            logger.info(
                "RL data: %d prompts from %s (%d dropped as longer than train_dataset.max_length=%d)",
                len(dataset),
                cfg.train_dataset.path,
                dataset.n_dropped,
                cfg.train_dataset.max_length,
            )
        self.loader = PromptLoader(
            dataset,
            cfg.train_dataset.batch_size,
            seed=cfg.seed,
            shuffle=cfg.train_dataset.shuffle,
            drop_last=cfg.train_dataset.drop_last,
            group_size=cfg.gconfig.n_samples,
        )
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self.probe_prompt = list(dataset[0].input_ids)  # the weight check's probe
        # The tokenizer's EOS may differ from config.json's eos_token_id (which the server stops on).
        eos = self.tokenizer.eos_token_id
        stop = sorted(set(cfg.gconfig.stop_token_ids) | ({eos} if eos is not None else set()))
        self.sampling = sampling_params(cfg.gconfig, stop_token_ids=stop)

    def _build_rollout(self) -> None:
        """Rank 0 gets the servers (``server_source``: launched, published, given); every rank joins the weight sync."""
        cfg = self.cfg
        rollout_alloc = cfg.allocations()["rollout"]

        if rollout_alloc.backend == "inprocess":
            self._build_inprocess_rollout()
            return

        def connect() -> None:
            self.launcher = server_source(cfg)
            addrs = self.launcher.start()
            self.client = RolloutClient.from_config(cfg.rollout, addrs, api_key=self.launcher.api_key)
            self.client.wait_healthy(cfg.rollout.setup_timeout)
            self.supervisor = ServerSupervisor(self.client, self.launcher, cfg.rollout.max_server_restarts)

        run_on_rank0(connect, "starting the rollout servers")
        if cfg.actor.archon.moe_load_balance == "aux_free" and rollout_alloc.backend != "local" and self.rank0:
            logger.warning(
                "actor.archon.moe_load_balance = 'aux_free': the routing bias reaches Archon's built-in "
                "servers only; SGLang's Qwen3-MoE has no field for it and routes without it"
            )
        self.weight_sync = weight_sync_for(cfg, self.actor_engine, self.client, self.actor_engine.device_type)
        if cfg.rollout.colocate:
            # A LoRA actor's reference is the actor engine itself (adapters off): listed once.
            others = [e.engine for e in (self.ref, self.teacher, self.critic) if e is not None]
            engines = [self.actor_engine] + [e for e in others if e is not self.actor_engine]
            self.colocated = ColocatedPhases(self.client if self.rank0 else None, engines, cfg.actor.offload)
        check_freq = weight_check_freq(cfg.rollout.weight_check_freq, asynchronous=self._asynchronous())
        if check_freq > 0:
            self.weight_check = ServerWeightCheck(
                self.actor,
                self.probe_prompt,
                self.sampling,
                tol=cfg.rollout.weight_check_tol or default_tolerance(server_dtype(cfg), cfg.actor.dtype),
                freq=check_freq,
                pad_token_id=self.pad_token_id,
            )

    def _build_inprocess_rollout(self) -> None:
        """The one training rank generates on its own weights (``archon.rl.inprocess``): no servers, no sync."""
        self.inprocess = InProcessRollout(self.actor_engine, self.cfg)
        self.client = self.inprocess.client
        self.weight_sync = self.inprocess.weight_sync
        if self.client is not None:  # rank 0: nothing to restart, but a failure is reported as for servers
            self.supervisor = ServerSupervisor(self.client)
        # The weights generated with are the ones trained, so the weight check has nothing to find.

    def _build_rewards(self) -> None:
        r = self.cfg.reward
        if self.cfg.rollout.workflow:
            return  # agent workflows return their episodes' rewards themselves
        get_reward_fn(r.fn)  # a bad name is the same clear error on every rank

        def start() -> None:
            self.rewards = RewardComputer(
                r.fn, n_workers=r.n_workers, timeout_s=r.timeout_s, max_failure_frac=r.max_failure_frac
            )

        run_on_rank0(start, "starting the reward workers")

    def _build_rollout_strategy(self, start: int, served_version: str | None, resumed: dict[str, Any]) -> None:
        """Where each step's batch comes from: asynchronous rollout when it runs ahead of training, else synchronous."""
        cfg = self.cfg
        assert self.weight_sync is not None  # every rank built it in _build_rollout
        inputs = RolloutInputs(
            loader=self.loader,
            sampling=self.sampling,
            seed=cfg.seed,
            n_samples=cfg.gconfig.n_samples,
            rollout=cfg.rollout,
            dynamic_filter=cfg.dynamic_filter,
            weight_sync=self.weight_sync,
            client=self.client,
            score=CompletionScorer(self.rewards, self.tokenizer) if self.rewards is not None else None,
        )
        # Routing replay runs on Archon's own MoE layers (ArchonEngine), whose shape the servers' experts take.
        args = cast(ArchonEngine, self.actor_engine).model_args if cfg.actor.moe_routing_replay else None
        routed = (args.n_layers, args.top_k) if args is not None else None
        episodes = self._episode_spec(routed) if cfg.rollout.workflow else None
        if self._asynchronous():
            make_worker: Callable[..., RolloutWorker] = (
                functools.partial(AgentRolloutWorker, episodes=episodes) if episodes is not None else RolloutWorker
            )
            self.rollout = AsyncRollout(
                inputs,
                start_step=start,
                total_steps=cfg.total_train_steps,
                resumed=resumed,
                decoupled=self._recomputes_proximal(),
                make_worker=make_worker,
            )
        elif episodes is not None:
            self.rollout = AgentRollout(
                inputs, episodes=episodes, supervisor=self.supervisor, served_version=served_version
            )
        else:
            self.rollout = SyncRollout(
                inputs, supervisor=self.supervisor, served_version=served_version, routed_experts=routed
            )

    def _episode_spec(self, routed: tuple[int, int] | None) -> EpisodeSpec:
        """How each sample runs as an agent episode (``rollout.workflow``); ``routed``: routing replay's shape."""
        r = self.cfg.rollout
        return EpisodeSpec(
            workflow=load_workflow(r.workflow),  # a bad name is the same clear error on every rank
            tokenizer=self.tokenizer,
            max_turns=r.max_turns,
            max_total_tokens=r.max_total_tokens
            or self.cfg.train_dataset.max_length + r.max_turns * self.cfg.gconfig.max_new_tokens,
            timeout_s=r.workflow_timeout_s,
            workflow_kwargs=dict(r.workflow_kwargs),
            routed_experts=routed,
        )

    # ------------------------------------------------------------------ one step
    def _prepare(self, batch: dict[str, torch.Tensor]) -> dict[str, float | None]:
        """Reference/proximal logprobs, values and advantages, added to ``batch``; returns metrics (None: not
        measured this step)."""
        metrics: dict[str, float | None] = {}
        mask = batch["loss_mask"]
        if self.ref is not None:
            batch["ref_logprobs"] = self.ref.compute_logprobs(batch)
        if self._recomputes_proximal() and not self._proximal_from_update():
            batch["old_logprobs"] = self.actor.compute_logprobs(batch)
            diff = (batch["old_logprobs"] - batch["logprobs"]).abs()
            metrics["behav_prox_logprob_diff"] = float(aggregate(diff, mask, "token-mean"))
            metrics[MISMATCH] = mismatch(batch["old_logprobs"], batch["logprobs"], mask, batch.get(FRESH_MASK))
            if self._strategy().off_policy:
                metrics.update(behaviour_ratio_metrics(batch["old_logprobs"], batch["logprobs"], mask))
        if self.ref is not None:
            policy = batch.get("old_logprobs", batch["logprobs"])
            metrics["kl_ref"] = float(aggregate(kl_estimate(policy, batch["ref_logprobs"], "k1"), mask, "token-mean"))
        if self.teacher is not None:
            batch["teacher_logprobs"] = self.teacher.compute_logprobs(batch)
            policy = batch.get("old_logprobs", batch["logprobs"])
            metrics["kl_teacher"] = float(
                aggregate(kl_estimate(policy, batch["teacher_logprobs"], "k1"), mask, "token-mean")
            )
        if self.critic is not None:
            batch["values"], batch["values_after"] = self.critic.compute_values(batch)
        adv = compute_advantages(
            batch,
            self.cfg.actor,
            group_size=self.group_size,
            max_new_tokens=self.cfg.gconfig.max_new_tokens,
            kl_ctl=self.kl_ctl.value,
        )
        batch["advantages"] = adv["advantages"]
        batch["returns"] = adv["returns"]
        if self.kl_ctl.value:
            # verl's measure: the mean over sequences of each sequence's mean penalty KL.
            seq_kl = aggregate(adv["kl"], mask, "seq-mean-token-mean")
            metrics.update(kl_ctl=self.kl_ctl.value, kl_penalty=float(seq_kl))
            self.kl_ctl.update(float(seq_kl), n_samples=int(mask.shape[0]))
        if self.critic is not None:
            batch["old_values"] = batch["values"]
        metrics["advantages_abs_mean"] = float(aggregate(batch["advantages"].abs(), mask, "token-mean"))
        return metrics

    def _recomputes_proximal(self) -> bool:
        return self.cfg.actor.recompute_logprob or self.cfg.actor.use_decoupled_loss

    def _proximal_from_update(self) -> bool:
        """Whether the proximal logprobs come from the update's own forward (``actor.proximal_from_update``):
        it makes one optimizer step, and nothing needs them before it (reference, teacher; overlong
        filtering would leave tokens out of the update but not out of the proximal metrics)."""
        a = self.cfg.actor
        return (
            a.proximal_from_update
            and self._recomputes_proximal()
            and self.actor.single_step_update()
            and not a.overlong_filtering
            and self.ref is None
            and self.teacher is None
        )

    def _step(self, step: int) -> dict[str, Any]:
        t_start = time.perf_counter()
        strategy = self._strategy()
        with self._generation_phase():
            rollout = strategy.next_batch(step)
        completions, rewards = rollout.completions, rollout.rewards
        # The servers' weights checked before the step trains on what they generated (probed after the last update).
        checked = self.weight_check.finish() if self.weight_check is not None else {}
        # Asynchronous batches mark the tokens of the version this step trains (step - 1): the mismatch's tokens.
        fresh = rollout.fresh_version
        if rollout.trajectories is not None:  # agent episodes: exactly the ids recorded turn by turn
            batch = build_agent_batch(rollout.trajectories, pad_token_id=self.pad_token_id, fresh_version=fresh)
            rollout.metrics.update(agent_metrics(rollout.trajectories))
            lengths = batch["loss_mask"].sum(dim=1).to(torch.float64)
        else:
            batch = build_rollout_batch(completions, rewards, pad_token_id=self.pad_token_id, fresh_version=fresh)
            lengths = torch.tensor([len(c.output_ids) for c in completions], dtype=torch.float64)
        t_train = time.perf_counter()
        record: dict[str, Any] = {
            "step": step,
            "epoch": self.loader.epoch,
            "kl_ref": None,
            "behav_prox_logprob_diff": None,
        }
        record.update(self._prepare(batch))
        fused = self._proximal_from_update()
        actor_stats = self.actor.ppo_update(batch, proximal_from_update=fused)
        if fused and not strategy.off_policy:
            # As with a separate recompute, the ratio statistics are reported for asynchronous runs.
            actor_stats = {k: v for k, v in actor_stats.items() if not k.startswith("behav_ratio/")}
        if record["behav_prox_logprob_diff"] is None:
            record["behav_prox_logprob_diff"] = actor_stats.get("actor/behav_logprob_diff_first_mb")
        actor_stats.pop("actor/behav_logprob_diff_first_mb", None)
        record.update(actor_stats)
        if fresh is None:
            # Synchronous: every token came from the weights trained, so the whole difference is the mismatch.
            record[MISMATCH] = record["behav_prox_logprob_diff"]
        record.update(self.mismatch_monitor.bounds())
        if self.critic is not None:
            record.update(self.critic.ppo_update(batch))
        train_time = time.perf_counter() - t_train
        with self.colocated.syncing() if self.colocated is not None else nullcontext():
            sync = strategy.sync_weights(step)
        if self.colocated is not None:
            sync.update(self.colocated.take_metrics())
        if self.weight_check is not None and self.weight_check.due(step):
            self.weight_check.start(self.client if self.rank0 else None, str(step))

        r = torch.tensor(rewards, dtype=torch.float64)
        record.update(
            {
                "reward_mean": float(r.mean()),
                "reward_std": float(r.std()) if len(r) > 1 else 0.0,
                "response_len_mean": float(lengths.mean()),
                "response_len_max": float(lengths.max()),
                "no_eos_frac": float(batch["seq_no_eos_mask"].float().mean()),
                "n_samples": len(rewards),
                **rollout.metrics,
                "train_time_s": train_time,
                **sync,
                **checked,
                "step_time_s": time.perf_counter() - t_start,
            }
        )
        record["peak_mem_gb"] = peak_memory_gb(self.actor_engine.device_type)
        if self.rank0 and self.rewards is not None:
            record.update(self.rewards.metrics())
        if self.rank0 and self.supervisor is not None:
            record.update(self.supervisor.stats())
        return record

    # ------------------------------------------------------------------ run
    def setup(self) -> int:
        """Build data, engines, rollout servers, rewards and the weight sync; resume from the
        latest complete checkpoint.  Returns the first RL step to run; ``close()`` releases everything."""
        cfg = self.cfg
        init_run(cfg, "rl")
        self.rank0 = dist.get_rank() == 0
        if self.rank0:
            logger.info("start checks: %s", "; ".join(self.preflight_report))
        self.ckpt = CheckpointManager(cfg.run_dir, cfg.saver.keep_last)
        self.ckpt.check_writable()
        self._build_data()
        if cfg.valid_dataset.path:
            self.evaluation = PeriodicEvaluation(cfg, self.tokenizer, self.sampling)
        self._build_engines()
        self.ckpt.check_space(self.engines)
        extra = self.ckpt.load(self.engines)
        start = 0
        if extra is not None:
            self.loader.load_state_dict(extra["loader"])
            if "kl_ctl" in extra:
                self.kl_ctl.load_state_dict(extra["kl_ctl"])
            start = int(extra["step"])
            if self.rank0:
                logger.info("resumed from %s at RL step %d", self.ckpt.loaded, start)
        self._build_rollout()
        self._build_rewards()
        assert self.weight_sync is not None  # every rank built it in _build_rollout
        self.weight_sync.setup()
        served_version = None  # the weights the servers hold (None: actor.path's)
        if start > 0:
            # The servers started from actor.path; give them the resumed policy.
            self.weight_sync.sync(str(start))
            served_version = str(start)
        if self.weight_check is not None:  # what the servers start from, checked before the first step trains
            self.weight_check.start(self.client if self.rank0 else None, served_version)
        self._build_rollout_strategy(start, served_version, extra or {})
        if self.colocated is not None:
            self.colocated.start()
        freeze_startup_objects()
        return start + 1

    def step(self, step: int) -> dict[str, Any]:
        """One RL step (rollout, rewards, advantages, updates, weight sync); its metrics record."""
        return self._step(step)

    def run(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        history: list[dict[str, Any]] = []
        try:
            first = self.setup()
            metrics_log = MetricsLogger(
                cfg.run_dir,
                cfg.total_train_steps,
                enabled=self.rank0,
                headline=("reward_mean", "response_len_mean", "actor/loss"),
                start_step=first - 1,
                run_config=cfg,
            )
            schedule = SaveSchedule(cfg.saver, cfg.total_train_steps)
            try:
                if self.evaluation is not None and first == 1:  # the policy before any update: a record of its own
                    history.append({"step": 0, **self._evaluate(0)})
                    metrics_log.log(history[-1])
                for step in range(first, cfg.total_train_steps + 1):
                    record = self.step(step)
                    if self.evaluation is not None and self.evaluation.due(step):
                        record.update(self._evaluate(step))  # the weights the servers got at the end of the step
                    history.append(record)
                    metrics_log.log(record)
                    self.mismatch_monitor.observe(step, record.get(MISMATCH))
                    if schedule.due(step):
                        self.ckpt.save(
                            step,
                            self.engines,
                            {
                                "loader": self.loader.state_dict(),
                                "step": step,
                                "kl_ctl": self.kl_ctl.state_dict(),
                                **self._strategy().state_dict(),
                            },
                        )
                if self.weight_check is not None:
                    self.weight_check.finish()  # the last update's probes
            finally:
                metrics_log.close()
            export_final(cfg, self.actor_engine, self.tokenizer, self.rank0)
        finally:
            self.close()
        return history

    def _evaluate(self, step: int) -> dict[str, float]:
        """Collective: the ``eval/*`` metrics of the current policy (``archon.eval.periodic``)."""
        assert self.evaluation is not None
        with self.inprocess.generating() if self.inprocess is not None else nullcontext():
            return self.evaluation.run(step, self.client, self.rewards, self.tokenizer)

    def _asynchronous(self) -> bool:
        """Whether rollout runs ahead of training (k = 0 keeps today's synchronous loop)."""
        return self.cfg.rollout.max_head_offpolicyness > 0

    def _generation_phase(self) -> AbstractContextManager[Any]:
        """Collective, around a step's rollout: what generating needs that training does not (the in-process
        engine's whole parameters under data parallel; colocated servers releasing the GPU after it)."""
        if self.inprocess is not None:
            return self.inprocess.generating()
        return self.colocated.generating() if self.colocated is not None else nullcontext()

    def _strategy(self) -> RolloutStrategy:
        assert self.rollout is not None, "setup() builds the rollout strategy"
        return self.rollout

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.close()  # before the client it sends through
            self.rollout = None
        if self.weight_sync is not None:
            self.weight_sync.close()
            self.weight_sync = None
        if self.rewards is not None:
            self.rewards.close()
            self.rewards = None
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.launcher is not None:
            self.launcher.stop()
            self.launcher = None
        if self.inprocess is not None:
            self.inprocess.close()
            self.inprocess = None
        thaw_startup_objects()
