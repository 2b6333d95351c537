"""Reading a config: defaults, then a TOML or YAML file, then ``dotted.key=value`` overrides; then checks.

Precedence is overrides > TOML > defaults.  Overrides are ``dotted.key=value`` where the
value is a TOML literal (``=false``, ``=1e-3``, ``='archon:d4'``); ``True``/``False`` are
accepted too, and a value that is not valid TOML is taken as a plain string, so
``actor.backend=archon:d2t2`` works without quotes.  A leading ``+`` on a key is accepted
(``+actor.archon.enable_compile=False``) for compatibility with AReaL command lines.
Unknown keys and wrong types are errors that name the key, where it came from, and the
closest valid key.  A ``.yaml``/``.yml`` file is read as AReaL writes one (``archon.config.yaml_files``: its
``${a.b}`` references resolved after the overrides), and AReaL's keys that Archon lacks are translated, dropped
with a warning or refused with one sentence each (``archon.config.areal_keys``), whatever the file's format.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import sys
import typing
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib  # pyright: ignore[reportMissingImports]

from archon.alloc import AllocationError, ModelAllocation, megatron_refusal
from archon.config.areal_keys import find_areal_key
from archon.config.areal_translate import apply_warmup_proportions, translate_areal_keys
from archon.config.colocate_checks import apply_colocate_defaults, check_colocation
from archon.config.device_defaults import apply_device_defaults
from archon.config.lora_sync import check_lora_sync
from archon.config.ranges import check_ranges
from archon.config.schema import INHERITED_ENGINE_FIELDS, Config, ConfigError, default_norms
from archon.config.vllm_checks import check_vllm_config
from archon.config.yaml_files import YAML_SUFFIXES, read_yaml, resolve_references
from archon.placement import plan_cluster

logger = logging.getLogger("archon.config")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return "an array"
    if origin is dict or dataclasses.is_dataclass(tp):
        return "a table"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


LITERAL_ALIASES: dict[str, dict[str, str]] = {
    # The short schedule names of the Archon document (seed 003) and AReaL's docs, for torch's class names.
    "pp_schedule": {"I1F1B": "Interleaved1F1B", "IZB": "InterleavedZeroBubble", "ZBV": "ZBVZeroBubble"}
}
"""Other spellings a choice field accepts, by field name: what they stand for."""


def did_you_mean(word: str, options: typing.Iterable[str]) -> str:
    """ "; did you mean ..." naming the closest of ``options`` to ``word``, or "" when none is close."""
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else ""


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        keys.append(name)
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(_all_keys(hints[f.name], name + "."))
    return keys


# Keys Archon had or AReaL has under another name: the error says what replaces them.
_RENAMED = {
    "actor.behav_imp_weight_cap": "actor.rejection_sampling.upper",
    "actor.behave_imp_weight_cap": "actor.rejection_sampling.upper",
    "actor.behav_imp_weight_mode": "actor.rejection_sampling.action ('mask' or 'clamp')",
    "actor.behave_imp_weight_mode": "actor.rejection_sampling.level and .action (e.g. token_mask = 'token' + 'mask')",
    "actor.behav_imp_weight_level": "actor.rejection_sampling.level",
}


class _Builder:
    """Builds a dataclass tree from nested dicts, checking keys and types; remembers which keys were set."""

    def __init__(self, sources: dict[str, str]):
        self.sources = sources  # dotted key -> where its value came from
        self.explicit: set[str] = set()

    def where(self, key: str) -> str:
        if key in self.sources:
            return self.sources[key]
        # A section named by an override's longer key (actor.optimiser.lr=... for 'actor.optimiser').
        inner = [src for k, src in self.sources.items() if k.startswith(key + ".")]
        return inner[0] if inner else "the config"

    def build(self, cls: type, data: dict[str, Any], prefix: str = "") -> Any:
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            dotted = prefix + key
            if key not in names:
                if dotted in _RENAMED:
                    raise ConfigError(
                        f"config key '{dotted}' (from {self.where(dotted)}) was replaced by "
                        f"{_RENAMED[dotted]} (AReaL's rejection_sampling options)"
                    )
                areal = find_areal_key(dotted)
                if areal:  # load_config translates these first; other callers still get the table's sentence
                    raise ConfigError(f"config key '{dotted}' (from {self.where(dotted)}): {areal[0].note}")
                # Suggest full dotted keys, so the suggestion can be pasted as it is.
                near = did_you_mean(dotted, [prefix + n for n in names]) or did_you_mean(dotted, _all_keys(Config))
                raise ConfigError(f"unknown config key '{dotted}' (from {self.where(dotted)}){near}")
            self.explicit.add(dotted)
            kwargs[key] = self.convert(hints[key], value, dotted)
        return cls(**kwargs)

    def convert(self, tp: Any, value: Any, key: str) -> Any:
        origin = typing.get_origin(tp)
        bad = ConfigError(f"config key '{key}' (from {self.where(key)}) must be {_type_name(tp)}, got {value!r}")
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"config key '{key}' (from {self.where(key)}) is a section; "
                    f"set its fields as '{key}.<field>' or a [{key}] table, got {value!r}"
                )
            return self.build(typing.cast(type, tp), value, key + ".")
        if origin is Literal:
            choices = typing.get_args(tp)
            value = LITERAL_ALIASES.get(key.rsplit(".", 1)[-1], {}).get(value, value)
            if value not in choices:
                hint = did_you_mean(str(value), [str(c) for c in choices])
                raise ConfigError(
                    f"config key '{key}' (from {self.where(key)}) must be {_type_name(tp)}, got {value!r}{hint}"
                )
            return value
        if origin in (list, tuple):
            if not isinstance(value, (list, tuple)):
                raise bad
            args = typing.get_args(tp)
            if origin is tuple and args and args[-1] is not Ellipsis:
                if len(value) != len(args):
                    raise ConfigError(
                        f"config key '{key}' (from {self.where(key)}) must have {len(args)} elements, got {value!r}"
                    )
                return tuple(self.convert(a, v, key) for a, v in zip(args, value))
            item = args[0] if args else Any
            items = [self.convert(item, v, key) for v in value]
            return tuple(items) if origin is tuple else items
        if origin is dict:  # free-form keyword arguments (e.g. rollout.workflow_kwargs), passed on as they are
            if not isinstance(value, dict):
                raise bad
            return dict(value)
        if tp is bool:
            if not isinstance(value, bool):
                raise bad
            return value
        if tp is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad
            return value
        if tp is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad
            return float(value)
        if tp is str:
            if not isinstance(value, str):
                raise bad
            return value
        if tp is Any:
            return value
        raise TypeError(f"unsupported config field type {tp!r} for {key}")  # schema bug, not user error


def parse_override(arg: str) -> tuple[str, Any]:
    """Split ``[+]dotted.key=value`` and parse the value as a TOML literal (bare strings allowed)."""
    if "=" not in arg:
        raise ConfigError(
            f"command-line override '{arg}' has no '='; write it as dotted.key=value, e.g. actor.optimizer.lr=1e-5"
        )
    key, raw = arg.split("=", 1)
    key = key.strip().lstrip("+")
    if not key or any(not part.isidentifier() for part in key.split(".")):
        raise ConfigError(
            f"command-line override '{arg}' has an invalid key '{key}'; "
            "keys are dotted names such as actor.archon.ac_mode"
        )
    raw = raw.strip()
    literal = {"True": "true", "False": "false"}.get(raw, raw)
    try:
        value = tomllib.loads(f"v = {literal}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare string such as archon:d2t2
    return key, value


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{key}' goes inside '{'.'.join(parts[: i + 1])}', which is not a section")
        node = child
    node[parts[-1]] = value


def _record_sources(tree: dict[str, Any], source: str, sources: dict[str, str], prefix: str = "") -> None:
    for key, value in tree.items():
        sources[prefix + key] = source
        if isinstance(value, dict):
            _record_sources(value, source, sources, prefix + key + ".")


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass an existing TOML or YAML file to --config")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file '{path}' is not valid TOML: {exc}") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The tree of a config file: YAML for a ``.yaml``/``.yml`` name, else TOML (references not yet resolved)."""
    path = Path(path)
    if path.suffix.lower() in YAML_SUFFIXES:
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist; pass an existing TOML or YAML file to --config")
        return read_yaml(path)
    return read_toml(path)


def load_config(
    config_path: str | Path | None = None, overrides: typing.Sequence[str] = (), validate: bool = True, job: str = "rl"
) -> Config:
    """Defaults, then the TOML or YAML file, then the overrides; then AReaL's keys, inheritance and validation.

    ``job`` ('rl' or 'sft') says which processes the cluster check counts: an SFT run starts
    no rollout server.
    """
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if config_path:
        tree = read_config_file(config_path)
        _record_sources(tree, f"'{config_path}'", sources)
    for arg in overrides:
        key, value = parse_override(arg)
        _set_dotted(tree, key, value)
        _record_sources({key: value}, "the command line", sources)
        sources[key] = "the command line"
    if config_path and Path(config_path).suffix.lower() in YAML_SUFFIXES:
        tree = resolve_references(tree, f"'{config_path}'")
    translation = translate_areal_keys(tree, sources)
    builder = _Builder(sources)
    cfg = builder.build(Config, tree)
    apply_warmup_proportions(cfg, translation, builder.explicit)
    _warn_inherited_critic_path(cfg, builder.explicit)
    apply_device_defaults(cfg, builder.explicit)  # before critic/ref/teacher inherit actor's dtype and compile
    _inherit_from_actor(cfg, builder.explicit)
    _pad_under_compile(cfg, builder.explicit)
    _apply_estimator_defaults(cfg, builder.explicit)
    apply_colocate_defaults(cfg, builder.explicit)
    if validate:
        validate_config(cfg, sources, job=job)
    return cfg


def _inherit_from_actor(cfg: Config, explicit: set[str]) -> None:
    """critic/ref/teacher take actor's engine fields unless the user set them (empty backend/path inherit too)."""
    for engine in ("critic", "ref", "teacher"):
        target = getattr(cfg, engine)
        for name in INHERITED_ENGINE_FIELDS:
            value = getattr(target, name)
            unset = f"{engine}.{name}" not in explicit and not any(k.startswith(f"{engine}.{name}.") for k in explicit)
            if unset or (name in ("backend", "path") and value == ""):
                setattr(target, name, _copy(getattr(cfg.actor, name)))
            elif dataclasses.is_dataclass(value):
                # A partially set section (e.g. ref.archon.ac_mode) inherits its other keys.
                setattr(target, name, _merge_section(getattr(cfg.actor, name), value, f"{engine}.{name}", explicit))


def _warn_inherited_critic_path(cfg: Config, explicit: set[str]) -> None:
    """A critic that trains (adv_estimator 'gae') and names no model of its own starts from actor.path: say so."""
    if cfg.actor.adv_estimator != "gae" or ("critic.path" in explicit and cfg.critic.path):
        return
    logger.warning(
        "critic.path is not set, so the critic starts from actor.path = '%s' with a new value head; set critic.path "
        "to a value or reward model folder to start from one (AReaL's examples write critic.path: ${actor.path})",
        cfg.actor.path,
    )


def _pad_under_compile(cfg: Config, explicit: set[str]) -> None:
    """pad_to_maximum on for every engine that compiles and has a microbatch bound (torch.compile wants fixed
    shapes; the engine pads under compile either way), said once for the actor at start."""
    for engine in ("actor", "critic", "ref", "teacher"):
        section = getattr(cfg, engine)
        bound = section.mb_spec.max_tokens_per_mb
        if not section.archon.enable_compile or section.pad_to_maximum or bound <= 0:
            continue
        section.pad_to_maximum = True
        if engine != "actor":
            continue
        if f"{engine}.pad_to_maximum" in explicit:
            logger.warning(
                "actor.pad_to_maximum = false is overridden: actor.archon.enable_compile pads every microbatch to "
                "actor.mb_spec.max_tokens_per_mb = %d for torch.compile's fixed shapes; turn compile off to train "
                "without padding",
                bound,
            )
        else:
            logger.info(
                "actor.pad_to_maximum set to true: actor.archon.enable_compile is on, so every microbatch is padded "
                "to actor.mb_spec.max_tokens_per_mb = %d (fixed shapes for torch.compile)",
                bound,
            )


def _apply_estimator_defaults(cfg: Config, explicit: set[str]) -> None:
    """The estimator's own normalisation (``default_norms``) for reward_norm and adv_norm unless the user set
    them: PPO with a critic gets standard PPO's; the schema's defaults are GRPO's."""
    if cfg.actor.adv_estimator != "gae":
        return
    for name, norm in zip(("reward_norm", "adv_norm"), default_norms(cfg.actor.adv_estimator), strict=True):
        key = f"actor.{name}"
        if key not in explicit and not any(k.startswith(key + ".") for k in explicit):
            setattr(cfg.actor, name, norm)


def _copy(value: Any) -> Any:
    return dataclasses.replace(typing.cast(Any, value)) if dataclasses.is_dataclass(value) else value


def _merge_section(base: Any, own: Any, prefix: str, explicit: set[str]) -> Any:
    changes = {f.name: getattr(own, f.name) for f in dataclasses.fields(own) if f"{prefix}.{f.name}" in explicit}
    return dataclasses.replace(base, **changes)


def validate_config(cfg: Config, sources: dict[str, str] | None = None, job: str = "rl") -> None:
    """Cross-field checks: allocations parse, the run's processes fit the cluster, sizes are positive.

    ``job`` 'sft' leaves the rollout servers out of the cluster check (SFT starts none).
    """
    sources = sources or {}
    allocs = cfg.allocations(sources)
    for engine, alloc in allocs.items():
        inference = engine == "rollout"
        if alloc.is_inference != inference:
            kind = "a training backend (archon, fsdp)"
            if inference:
                kind = "an inference backend (sglang, vllm, local, inprocess)"
            raise ConfigError(f"{engine}.backend = '{getattr(cfg, engine).backend}' must use {kind}")
    for engine in ("actor", "critic", "ref", "teacher"):
        if allocs[engine].backend == "megatron":
            raise ConfigError(megatron_refusal(f"{engine}.backend", allocs[engine]))
    if job not in ("rl", "sft"):
        raise ValueError(f"job must be 'rl' or 'sft', got {job!r}")
    if cfg.cluster.gpu_memory_gb <= 0:
        raise ConfigError(
            f"cluster.gpu_memory_gb = {cfg.cluster.gpu_memory_gb} (from "
            f"{sources.get('cluster.gpu_memory_gb', 'the defaults')}) must be positive: the memory "
            "of one GPU in GB, e.g. 80 for an H100 80GB"
        )
    check_colocation(cfg, allocs, sources, job)
    try:
        placed = {k: a for k, a in allocs.items() if job == "rl" or k != "rollout"}
        colocate = cfg.rollout.colocate and job == "rl"
        plan_cluster(placed, cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node, colocate=colocate)
    except AllocationError as exc:
        raise ConfigError(str(exc)) from None
    _check_rollout_backend(cfg, allocs["rollout"])
    check_lora_sync(cfg, sources)
    positive = {
        "total_train_steps": cfg.total_train_steps,
        "train_dataset.batch_size": cfg.train_dataset.batch_size,
        "actor.mb_spec.n_mbs": cfg.actor.mb_spec.n_mbs,
        "actor.ppo_n_minibatches": cfg.actor.ppo_n_minibatches,
        "gconfig.n_samples": cfg.gconfig.n_samples,
        "gconfig.max_new_tokens": cfg.gconfig.max_new_tokens,
        "cluster.n_nodes": cfg.cluster.n_nodes,
        "cluster.n_gpus_per_node": cfg.cluster.n_gpus_per_node,
        "actor.archon.dp_replicate": cfg.actor.archon.dp_replicate,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key} = {value} (from {sources.get(key, 'the defaults')}) must be at least 1")
    for engine in ("actor", "critic", "ref"):
        archon = getattr(cfg, engine).archon
        for key in ("moe_aux_loss_coef", "moe_bias_update_rate"):
            if getattr(archon, key) < 0:
                raise ConfigError(
                    f"{engine}.archon.{key} = {getattr(archon, key)} must not be negative "
                    "(0 turns that load balancing off)"
                )
    check_ranges(cfg, sources)
    group = cfg.actor.group_size
    if group < 0 or (group and cfg.gconfig.n_samples % group):
        raise ConfigError(
            f"actor.group_size = {group} must divide gconfig.n_samples = {cfg.gconfig.n_samples} "
            "(the samples of one prompt), or be 0 to use gconfig.n_samples"
        )
    if cfg.actor.temperature < 0 or cfg.gconfig.temperature < 0:
        raise ConfigError(
            "actor.temperature and gconfig.temperature must not be negative (0 = greedy / follow gconfig)"
        )
    if cfg.actor.c_clip and cfg.actor.c_clip <= 1.0:
        raise ConfigError(f"actor.c_clip = {cfg.actor.c_clip} must be greater than 1 (dual clip), or 0 to disable it")
    if (
        cfg.actor.archon.ac_mode == "memory_budget"
        and cfg.actor.gradient_checkpointing
        and not cfg.actor.archon.enable_compile
    ):
        raise ConfigError(
            "actor.archon.ac_mode = 'memory_budget' needs torch.compile; set "
            "actor.archon.enable_compile=true or choose ac_mode 'selective' or 'full'"
        )
    _validate_rl_options(cfg, sources)
    opt = cfg.actor.archon.selective_ac_option
    if opt != "op" and not (opt.isdigit() and int(opt) >= 1):
        raise ConfigError(
            f"actor.archon.selective_ac_option = '{opt}' must be 'op' or a positive integer N "
            "(checkpoint every Nth block)"
        )


def _validate_rl_options(cfg: Config, sources: dict[str, str]) -> None:
    """Cross-field checks of the RL algorithm options that hold for any run (whether a group-level
    normalisation has groups to normalise over is checked when an RL run starts)."""
    actor = cfg.actor

    def where(key: str) -> str:
        return sources.get(key, "the defaults")

    for key, value in (
        ("actor.ppo_epochs", actor.ppo_epochs),
        ("critic.ppo_epochs", cfg.critic.ppo_epochs),
        ("critic.ppo_n_minibatches", cfg.critic.ppo_n_minibatches),
    ):
        if value < 1:
            raise ConfigError(f"{key} = {value} (from {where(key)}) must be at least 1")
    if cfg.critic.loss_fn_type == "huber" and cfg.critic.huber_delta <= 0:
        raise ConfigError(f"critic.huber_delta = {cfg.critic.huber_delta} must be positive for the Huber value loss")
    if actor.kl_ctl_type == "adaptive":
        if actor.kl_ctl <= 0:
            raise ConfigError(
                "actor.kl_ctl_type = 'adaptive' scales actor.kl_ctl multiplicatively; set an initial "
                "actor.kl_ctl > 0 (e.g. 0.05)"
            )
        if actor.kl_ctl_target <= 0 or actor.kl_ctl_horizon <= 0:
            raise ConfigError(
                f"the adaptive KL controller needs actor.kl_ctl_target ({actor.kl_ctl_target}) and "
                f"actor.kl_ctl_horizon ({actor.kl_ctl_horizon}) above 0"
            )
    rs = actor.rejection_sampling
    if rs.level != "none":
        if rs.lower > rs.upper:
            raise ConfigError(f"actor.rejection_sampling.lower = {rs.lower} is above upper = {rs.upper}")
        if rs.metric == "ratio" and rs.upper <= 1.0:
            raise ConfigError(
                f"actor.rejection_sampling.upper = {rs.upper} must be above 1 for metric 'ratio' "
                "(otherwise every token whose policies differ is rejected)"
            )
        if rs.metric == "ratio" and rs.lower != float("-inf") and rs.lower <= 0:
            raise ConfigError(
                f"actor.rejection_sampling.lower = {rs.lower} must be positive for metric 'ratio' "
                "(or -inf for no lower bound)"
            )
        if rs.metric in ("kl_k2", "kl_k3") and rs.upper <= 0:
            raise ConfigError(f"actor.rejection_sampling.upper = {rs.upper} must be positive for metric '{rs.metric}'")
        if rs.action == "clamp" and rs.metric != "ratio":
            raise ConfigError(
                f"actor.rejection_sampling.action = 'clamp' bounds the importance ratio and needs "
                f"metric 'ratio', not '{rs.metric}'; use action 'mask' with KL metrics"
            )
    if cfg.rollout.max_head_offpolicyness < 0:
        raise ConfigError(
            f"rollout.max_head_offpolicyness = {cfg.rollout.max_head_offpolicyness} (from "
            f"{where('rollout.max_head_offpolicyness')}) must be 0 (synchronous) or a positive number of "
            "policy versions"
        )
    if cfg.rollout.workflow and (
        cfg.rollout.max_turns < 1 or cfg.rollout.max_total_tokens < 0 or cfg.rollout.workflow_timeout_s <= 0
    ):
        raise ConfigError(
            f"rollout.max_turns ({cfg.rollout.max_turns}) must be >= 1, rollout.max_total_tokens "
            f"({cfg.rollout.max_total_tokens}) >= 0 and rollout.workflow_timeout_s "
            f"({cfg.rollout.workflow_timeout_s}) > 0"
        )
    if cfg.rollout.max_head_offpolicyness > 0 and cfg.actor.moe_routing_replay:
        raise ConfigError(
            "actor.moe_routing_replay is not supported with asynchronous rollouts "
            f"(rollout.max_head_offpolicyness = {cfg.rollout.max_head_offpolicyness}): a trajectory "
            "generated across a weight update has no single routing to replay; set one of them off"
        )
    if cfg.actor.moe_routing_replay and cfg.actor.backend.startswith("fsdp:"):
        raise ConfigError(
            f"actor.moe_routing_replay replays the experts of Archon's MoE models, but actor.backend = "
            f"'{cfg.actor.backend}' runs a transformers model; use an archon: backend or set "
            "actor.moe_routing_replay = false"
        )
    dyn = cfg.dynamic_filter
    if dyn.max_num_gen_batches < 0:
        raise ConfigError(
            f"dynamic_filter.max_num_gen_batches = {dyn.max_num_gen_batches} must be 0 (no limit) or positive"
        )
    if dyn.enable and cfg.gconfig.n_samples < 2:
        raise ConfigError(
            "dynamic_filter.enable drops prompts whose samples all got the same reward, which with "
            "gconfig.n_samples = 1 is every prompt; set gconfig.n_samples > 1 or disable the filter"
        )


def _check_rollout_backend(cfg: Config, rollout: ModelAllocation) -> None:
    """Sampling options the rollout servers would refuse, or report logprobs for that the trainer cannot match."""
    g = cfg.gconfig
    if rollout.backend == "sglang" and g.min_new_tokens > 0:
        # SGLang 0.5.23: raise_if_tokenizer_required (HTTP 400), and BatchedMinNewTokensPenalizer acts on the logits.
        raise ConfigError(
            f"gconfig.min_new_tokens = {g.min_new_tokens} cannot be used with rollout.backend = "
            f"'{cfg.rollout.backend}': SGLang started with --skip-tokenizer-init (as Archon starts it) answers HTTP "
            "400, and with a tokenizer it renormalises the reported logprobs without the stop tokens, "
            "unlike the trainer's recomputation; set gconfig.min_new_tokens = 0"
        )
    if rollout.backend == "sglang" and cfg.sglang.enable_deterministic_inference and g.min_p > 0:
        # Deterministic inference switches SGLang to its PyTorch sampler, which asserts on min-p with seeds.
        raise ConfigError(
            f"gconfig.min_p = {g.min_p} with sglang.enable_deterministic_inference = true would crash "
            "SGLang's seeded sampler; set gconfig.min_p = 0 or turn deterministic inference off"
        )
    if rollout.backend == "vllm":
        check_vllm_config(cfg)
