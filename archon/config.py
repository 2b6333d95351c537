"""Archon's configuration: nested dataclasses, TOML files and command-line overrides.

Precedence is overrides > TOML > defaults.  Overrides are ``dotted.key=value`` where the
value is a TOML literal (``=false``, ``=1e-3``, ``='archon:d4'``); ``True``/``False`` are
accepted too, and a value that is not valid TOML is taken as a plain string, so
``actor.backend=archon:d2t2`` works without quotes.  A leading ``+`` on a key is accepted
(``+actor.archon.enable_compile=False``) for compatibility with AReaL command lines.

Section and key names follow AReaL's wherever AReaL has one.  ``critic`` and ``ref`` have
the shape of ``actor``'s engine fields and inherit every one of them from ``actor`` unless
set explicitly (an empty ``backend`` or ``path`` also means "inherit").

``python -m archon.config --config x.toml [overrides]`` prints the resolved config and the
allocation table; ``--describe SECTION`` prints the documented keys of a section.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from archon.alloc import AllocationError, ModelAllocation


class ConfigError(ValueError):
    """A config file, key or value a user wrote is wrong; the message says where and how to fix it."""


# --------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------

NormLevel = Literal["batch", "group", "none"]


@dataclass
class ClusterConfig:
    n_nodes: int = 1
    """Number of nodes in the cluster."""
    n_gpus_per_node: int = 8
    """Accelerators per node; on a CPU-only machine, the number of processes per node the run may use."""


@dataclass
class OptimizerConfig:
    type: Literal["adamw"] = "adamw"
    """Optimizer; AdamW is the one Archon ships."""
    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW beta1 and beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to `lr`."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate shape after warmup."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine/linear schedule, as a fraction of `lr`."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip; 0 disables clipping (the norm is still reported)."""


@dataclass
class MicroBatchSpec:
    n_mbs: int = 1
    """Minimum number of microbatches per data-parallel rank and optimizer step."""
    max_tokens_per_mb: int = 0
    """Upper bound on packed tokens in one microbatch (more microbatches are made if needed); 0 means no bound."""


@dataclass
class ArchonEngineConfig:
    pp_schedule: Literal["1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", "GPipe"] = "Interleaved1F1B"
    """Pipeline schedule used when the allocation has p > 1."""
    pp_layers_per_stage: int = 0
    """Transformer blocks per pipeline stage; 0 derives it from the layer count and schedule."""
    enable_compile: bool = True
    """torch.compile each block (after activation checkpointing, before FSDP); leave off on CPU."""
    ac_mode: Literal["none", "full", "selective", "memory_budget"] = "selective"
    """Activation checkpointing mode, applied only when `gradient_checkpointing` is true."""
    selective_ac_option: str = "op"
    """For ac_mode=selective: 'op' (save matmul/attention outputs) or an integer N (checkpoint every Nth block)."""
    ac_memory_budget: float = 0.5
    """For ac_mode=memory_budget (needs compile): 0.0 recomputes everything, 1.0 nothing."""
    offload_params: bool = False
    """Keep FSDP-sharded parameters, gradients and optimizer state on the CPU (CPUOffloadPolicy)."""
    reshard_after_forward_policy: Literal["default", "always", "never"] = "default"
    """FSDP resharding after forward: default reshards except with pipeline parallel."""
    use_deterministic_algorithms: bool = False
    """Deterministic kernels, cuBLAS workspace, NCCL Ring and compile; slower, for debugging."""
    ac_debug: bool = False
    """Log which activations are saved and which are recomputed (slow)."""
    dp_replicate: int = 1
    """HSDP: split the allocation's d into dp_replicate replica groups x d/dp_replicate shards."""


@dataclass
class TrainEngineConfig:
    backend: str = ""
    """Allocation string for this engine, e.g. 'archon:d4p2t2' (see the allocation grammar)."""
    path: str = ""
    """Hugging Face model folder (config.json + safetensors); empty initialises from `model_config`."""
    model_config: str = ""
    """Folder or config.json used to build an uninitialised model when `path` is empty."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Parameter dtype for compute (FSDP mixed precision); master weights stay float32."""
    grad_reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of gradient reduce-scatter/all-reduce."""
    gradient_checkpointing: bool = False
    """Turn on activation checkpointing with `archon.ac_mode`."""
    pad_to_maximum: bool = False
    """Pad every microbatch to `mb_spec.max_tokens_per_mb` (fixed shapes; forced on under compile)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    """How a data-parallel rank's share of the batch is cut into packed microbatches."""
    archon: ArchonEngineConfig = field(default_factory=ArchonEngineConfig)
    """Archon-specific engine options."""


@dataclass
class NormConfig:
    mean_level: NormLevel = "group"
    """Subtract the mean over the 'group' of samples of one prompt, the whole 'batch', or 'none'."""
    std_level: NormLevel = "group"
    """Divide by the std over 'group', 'batch', or 'none' (Dr.GRPO uses none)."""
    mean_leave1out: bool = False
    """Use the leave-one-out mean (each sample's baseline excludes itself)."""
    std_unbiased: bool = True
    """Unbiased (n-1) standard deviation."""
    eps: float = 1e-5
    """Added to the std before dividing."""
    group_size: int = 0
    """Samples per group; 0 takes `actor.group_size`."""


@dataclass
class ActorConfig(TrainEngineConfig):
    backend: str = "archon:d1"
    group_size: int = 0
    """Rows that form one group for group-normalised advantages; 0 uses gconfig.n_samples (must divide it)."""
    ppo_n_minibatches: int = 1
    """Optimizer steps per rollout batch (the batch is cut into this many minibatches)."""
    recompute_logprob: bool = False
    """Recompute proximal logprobs with the trainer before the update instead of using the rollout's."""
    use_decoupled_loss: bool = False
    """Decoupled PPO: behaviour logprobs from the rollout, proximal logprobs recomputed by the trainer."""
    adv_estimator: Literal["grpo", "gae", "rloo", "reinforce++"] = "grpo"
    """Advantage estimator; 'gae' needs a critic."""
    eps_clip: float = 0.2
    """PPO ratio clip (lower side, and upper side unless `eps_clip_higher` is set)."""
    eps_clip_higher: float = 0.0
    """Upper clip for the ratio (DAPO clip-higher); 0 uses `eps_clip`."""
    c_clip: float = 0.0
    """Dual-clip constant (> 1) for negative advantages; 0 disables dual clip."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token (PPO) or per sequence (GSPO)."""
    behav_imp_weight_cap: float = 0.0
    """Decoupled loss: cap on the behaviour importance weight; 0 means no cap."""
    behav_imp_weight_mode: Literal["truncate", "mask"] = "truncate"
    """Decoupled loss: truncate weights above the cap, or mask those tokens out."""
    behav_imp_weight_level: Literal["token", "sequence"] = "token"
    """Decoupled loss: compute the behaviour importance weight per token or per sequence."""
    temperature: float = 0.0
    """Trainer logprobs are of logits / temperature; 0 follows gconfig.temperature (1 when greedy), as the server reports."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus in the actor loss."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses are aggregated over the global batch."""
    kl_ctl: float = 0.0
    """KL-to-reference penalty inside the reward; 0 disables it."""
    kl_loss_coef: float = 0.0
    """KL-to-reference term inside the loss; 0 disables it."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator for the reward penalty and the loss term."""
    discount: float = 1.0
    """Discount factor (GAE, REINFORCE++)."""
    gae_lambda: float = 1.0
    """GAE lambda."""
    reward_scaling: float = 1.0
    """Rewards are (reward + reward_bias) * reward_scaling, then clipped."""
    reward_bias: float = 0.0
    """Added to every reward before scaling."""
    reward_clip: float = 20.0
    """Rewards are clipped to [-reward_clip, reward_clip]."""
    overlong_reward_penalty: bool = False
    """DAPO overlong penalty on responses longer than max_new_tokens - overlong_tokens."""
    overlong_tokens: int = 0
    """Length of the soft overlong-penalty window."""
    overlong_penalty_factor: float = 1.0
    """Penalty at the end of the overlong window."""
    mask_no_eos_with_zero: bool = False
    """Give zero reward/loss weight to responses cut off without EOS."""
    reward_norm: NormConfig = field(default_factory=NormConfig)
    """Normalisation of sequence rewards into advantages (GRPO: group mean and std)."""
    adv_norm: NormConfig = field(default_factory=lambda: NormConfig(mean_level="none", std_level="none"))
    """Final normalisation of token advantages (e.g. batch-level whitening for PPO)."""


@dataclass
class CriticConfig(TrainEngineConfig):
    ppo_n_minibatches: int = 1
    """Critic optimizer steps per rollout batch."""
    eps_clip: float = 0.5
    """Value clip: new values are kept within old values +- eps_clip; 0 disables clipping."""
    mask_no_eos_with_zero: bool = False
    """Give zero loss weight to responses cut off without EOS."""


@dataclass
class GenerationConfig:
    n_samples: int = 1
    """Completions sampled per prompt."""
    max_new_tokens: int = 512
    """Maximum completion length."""
    min_new_tokens: int = 0
    """Minimum completion length (EOS is suppressed before it)."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    min_p: float = 0.0
    """Min-p sampling threshold; 0 disables it."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a completion (EOS always does unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating after EOS (benchmarks only)."""


@dataclass
class RolloutConfig:
    backend: str = "local:d1"
    """Inference allocation: 'sglang:dNtM' (N servers of M GPUs) or 'local:dN' (N built-in CPU servers)."""
    server_addrs: list[str] = field(default_factory=list)
    """host:port of servers already running; when set, no servers are launched."""
    request_timeout: float = 3600.0
    """Seconds before one generate request is abandoned."""
    request_retries: int = 3
    """Retries (with backoff) of a request after a connection error or a 5xx."""
    setup_timeout: float = 300.0
    """Seconds to wait for launched servers to become healthy."""
    weight_sync: Literal["distributed", "disk"] = "distributed"
    """How new weights reach the servers: a broadcast group, or an HF folder on shared disk."""
    weight_chunk_mb: int = 512
    """Bucket size of the distributed weight broadcast."""
    max_concurrent_rollouts: int = 0
    """Requests in flight per trainer process; 0 sends the whole batch at once."""


@dataclass
class SGLangConfig:
    model_path: str = ""
    """Model the servers start from; empty uses `actor.path`."""
    random_seed: int = 1
    """Server-side sampling seed."""
    dtype: str = "bfloat16"
    """Inference dtype."""
    context_length: int = 32768
    """Maximum context of a request."""
    mem_fraction_static: float = 0.8
    """Fraction of GPU memory SGLang reserves for weights and KV cache."""
    dp_size: int = 1
    """SGLang's internal data parallel inside one server (with enable_dp_attention); never changes GPU counts."""
    ep_size: int = 1
    """SGLang's internal expert parallel inside one server; never changes GPU counts."""
    enable_dp_attention: bool = False
    """Data-parallel attention inside one server (large MoE)."""
    disable_cuda_graph: bool = False
    """Turn off CUDA graphs (debugging)."""
    max_running_requests: int = 0
    """Cap on concurrent requests per server; 0 keeps SGLang's default."""
    attention_backend: str = ""
    """SGLang attention backend; empty keeps SGLang's default."""
    log_level: str = "warning"
    """SGLang server log level."""
    extra_args: list[str] = field(default_factory=list)
    """Further raw arguments appended to `python -m sglang.launch_server`."""


@dataclass
class DatasetConfig:
    path: str = ""
    """jsonl file (RL: prompt/answer or GSM8K question/answer; SFT: prompt/completion)."""
    batch_size: int = 8
    """Prompts (RL) or sequences (SFT) per step, over all ranks."""
    shuffle: bool = True
    """Shuffle every epoch with a seed that depends only on `seed` and the epoch."""
    max_length: int = 1024
    """RL: longest prompt kept (longer ones are dropped and counted); SFT: longest sequence."""
    drop_last: bool = True
    """Drop the incomplete last batch of an epoch."""


@dataclass
class RewardConfig:
    fn: str = "math"
    """Reward function: 'math', 'exact_match', or 'package.module:function'."""
    timeout_s: float = 15.0
    """Seconds before one reward call counts as failed (reward 0)."""
    n_workers: int = 2
    """Reward worker processes."""


@dataclass
class SaverConfig:
    freq_steps: int = 0
    """Save a resumable checkpoint every N steps; 0 only at the end."""
    keep_last: int = 2
    """Checkpoints kept on disk (older ones are deleted)."""
    export_hf: bool = True
    """Export the final actor as a Hugging Face folder under output_dir/hf."""


@dataclass
class Config:
    experiment_name: str = "archon"
    """Name of the experiment (groups trials)."""
    trial_name: str = "trial0"
    """Name of this trial."""
    output_dir: str = ""
    """Run directory for metrics.jsonl and checkpoints; empty means outputs/<experiment_name>/<trial_name>."""
    seed: int = 1
    """Seed of data order, initialisation and sampling; results never depend on the allocation."""
    total_train_steps: int = 100
    """Optimizer steps (RL steps) to run."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device type; auto picks CUDA when available."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Cluster size used to check that the allocations fit."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy model: training engine and PPO/GRPO options."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (used by adv_estimator = 'gae'); inherits actor's engine fields."""
    ref: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    """Reference model for the KL terms; inherits actor's engine fields."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout servers."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """Options passed to each SGLang server."""
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    """Sampling of completions."""
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """Training data."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function."""
    saver: SaverConfig = field(default_factory=SaverConfig)
    """Checkpointing."""

    @property
    def run_dir(self) -> Path:
        """Where this run writes metrics and checkpoints."""
        return Path(self.output_dir or f"outputs/{self.experiment_name}/{self.trial_name}")

    def allocations(self) -> dict[str, ModelAllocation]:
        """The parsed allocation of every engine (critic/ref already inherited)."""
        return {
            "rollout": ModelAllocation.from_str(self.rollout.backend),
            "actor": ModelAllocation.from_str(self.actor.backend),
            "critic": ModelAllocation.from_str(self.critic.backend),
            "ref": ModelAllocation.from_str(self.ref.backend),
        }


# Engine fields critic/ref inherit from actor when the user did not set them.
INHERITED_ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(TrainEngineConfig))


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (and its dataclass bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return "an array"
    if dataclasses.is_dataclass(tp):
        return "a table"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _closest(word: str, options: typing.Iterable[str]) -> str:
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
                near = _closest(key, names) or _closest(dotted, _all_keys(Config))
                raise ConfigError(f"unknown config key '{dotted}' (from {self.where(dotted)}){near}")
            self.explicit.add(dotted)
            kwargs[key] = self.convert(hints[key], value, dotted)
        return cls(**kwargs)

    def convert(self, tp: Any, value: Any, key: str) -> Any:
        origin = typing.get_origin(tp)
        bad = ConfigError(f"config key '{key}' (from {self.where(key)}) must be {_type_name(tp)}, got {value!r}")
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{key}' (from {self.where(key)}) is a section; "
                                  f"set its fields as '{key}.<field>' or a [{key}] table, got {value!r}")
            return self.build(tp, value, key + ".")
        if origin is Literal:
            choices = typing.get_args(tp)
            if value not in choices:
                hint = _closest(str(value), [str(c) for c in choices])
                raise ConfigError(f"config key '{key}' (from {self.where(key)}) must be {_type_name(tp)}, "
                                  f"got {value!r}{hint}")
            return value
        if origin in (list, tuple):
            if not isinstance(value, (list, tuple)):
                raise bad
            args = typing.get_args(tp)
            if origin is tuple and args and args[-1] is not Ellipsis:
                if len(value) != len(args):
                    raise ConfigError(f"config key '{key}' (from {self.where(key)}) must have "
                                      f"{len(args)} elements, got {value!r}")
                return tuple(self.convert(a, v, key) for a, v in zip(args, value))
            item = args[0] if args else Any
            items = [self.convert(item, v, key) for v in value]
            return tuple(items) if origin is tuple else items
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
        raise ConfigError(f"command-line override '{arg}' has no '='; write it as dotted.key=value, "
                          "e.g. actor.optimizer.lr=1e-5")
    key, raw = arg.split("=", 1)
    key = key.strip().lstrip("+")
    if not key or any(not part.isidentifier() for part in key.split(".")):
        raise ConfigError(f"command-line override '{arg}' has an invalid key '{key}'; "
                          "keys are dotted names such as actor.archon.ac_mode")
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
        raise ConfigError(f"config file '{path}' does not exist; pass an existing TOML file to --config")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file '{path}' is not valid TOML: {exc}") from None


def load_config(config_path: str | Path | None = None, overrides: typing.Sequence[str] = (),
                validate: bool = True) -> Config:
    """Defaults, then the TOML file, then the overrides; then inheritance and validation."""
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if config_path:
        tree = read_toml(config_path)
        _record_sources(tree, f"'{config_path}'", sources)
    for arg in overrides:
        key, value = parse_override(arg)
        _set_dotted(tree, key, value)
        _record_sources({key: value}, "the command line", sources)
        sources[key] = "the command line"
    builder = _Builder(sources)
    cfg = builder.build(Config, tree)
    _inherit_from_actor(cfg, builder.explicit)
    if validate:
        validate_config(cfg, sources)
    return cfg


def _inherit_from_actor(cfg: Config, explicit: set[str]) -> None:
    """critic/ref take actor's engine fields unless the user set them (empty backend/path inherit too)."""
    for engine in ("critic", "ref"):
        target = getattr(cfg, engine)
        for name in INHERITED_ENGINE_FIELDS:
            value = getattr(target, name)
            unset = f"{engine}.{name}" not in explicit and not any(
                k.startswith(f"{engine}.{name}.") for k in explicit)
            if unset or (name in ("backend", "path") and value == ""):
                setattr(target, name, _copy(getattr(cfg.actor, name)))
            elif dataclasses.is_dataclass(value):
                # A partially set section (e.g. ref.archon.ac_mode) inherits its other keys.
                setattr(target, name, _merge_section(getattr(cfg.actor, name), value, f"{engine}.{name}", explicit))


def _copy(value: Any) -> Any:
    return dataclasses.replace(value) if dataclasses.is_dataclass(value) else value


def _merge_section(base: Any, own: Any, prefix: str, explicit: set[str]) -> Any:
    changes = {f.name: getattr(own, f.name) for f in dataclasses.fields(own) if f"{prefix}.{f.name}" in explicit}
    return dataclasses.replace(base, **changes)


def validate_config(cfg: Config, sources: dict[str, str] | None = None) -> None:
    """Cross-field checks: allocations parse, engines fit the cluster, sizes are positive."""
    from archon.plan import check_cluster_fit

    sources = sources or {}
    allocs: dict[str, ModelAllocation] = {}
    for engine in ("rollout", "actor", "critic", "ref"):
        key = f"{engine}.backend"
        value = getattr(cfg, engine).backend
        try:
            allocs[engine] = ModelAllocation.from_str(value)
        except AllocationError as exc:
            raise ConfigError(f"{key} (from {sources.get(key, 'the defaults')}): {exc}") from None
        inference = engine == "rollout"
        if allocs[engine].is_inference != inference:
            kind = "an inference backend (sglang, vllm, local)" if inference else "a training backend (archon, fsdp, megatron)"
            raise ConfigError(f"{key} = '{value}' must use {kind}")
    for engine in ("actor", "critic", "ref"):
        if allocs[engine].backend != "archon":
            raise ConfigError(f"{engine}.backend = '{allocs[engine]}' uses backend "
                              f"'{allocs[engine].backend}', but this is Archon; write 'archon:{_dims_of(allocs[engine])}'")
    try:
        check_cluster_fit(allocs, cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node)
    except AllocationError as exc:
        raise ConfigError(str(exc)) from None
    positive = {
        "total_train_steps": cfg.total_train_steps, "train_dataset.batch_size": cfg.train_dataset.batch_size,
        "actor.mb_spec.n_mbs": cfg.actor.mb_spec.n_mbs,
        "actor.ppo_n_minibatches": cfg.actor.ppo_n_minibatches, "gconfig.n_samples": cfg.gconfig.n_samples,
        "gconfig.max_new_tokens": cfg.gconfig.max_new_tokens, "cluster.n_nodes": cfg.cluster.n_nodes,
        "cluster.n_gpus_per_node": cfg.cluster.n_gpus_per_node, "actor.archon.dp_replicate": cfg.actor.archon.dp_replicate,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key} = {value} (from {sources.get(key, 'the defaults')}) must be at least 1")
    group = cfg.actor.group_size
    if group < 0 or (group and cfg.gconfig.n_samples % group):
        raise ConfigError(f"actor.group_size = {group} must divide gconfig.n_samples = {cfg.gconfig.n_samples} "
                          "(the samples of one prompt), or be 0 to use gconfig.n_samples")
    if cfg.actor.temperature < 0 or cfg.gconfig.temperature < 0:
        raise ConfigError("actor.temperature and gconfig.temperature must not be negative (0 = greedy / follow "
                          "gconfig)")
    if cfg.actor.c_clip and cfg.actor.c_clip <= 1.0:
        raise ConfigError(f"actor.c_clip = {cfg.actor.c_clip} must be greater than 1 (dual clip), or 0 to disable it")
    if cfg.actor.archon.ac_mode == "memory_budget" and cfg.actor.gradient_checkpointing \
            and not cfg.actor.archon.enable_compile:
        raise ConfigError("actor.archon.ac_mode = 'memory_budget' needs torch.compile; set "
                          "actor.archon.enable_compile=true or choose ac_mode 'selective' or 'full'")
    opt = cfg.actor.archon.selective_ac_option
    if opt != "op" and not (opt.isdigit() and int(opt) >= 1):
        raise ConfigError(f"actor.archon.selective_ac_option = '{opt}' must be 'op' or a positive integer N "
                          "(checkpoint every Nth block)")


def _dims_of(alloc: ModelAllocation) -> str:
    return str(alloc).split(":", 1)[1]


# --------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain dicts/lists (TOML-ready)."""
    out = dataclasses.asdict(cfg)

    def fix(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, tuple):
            return [fix(x) for x in v]
        return v

    return fix(out)


def to_toml(cfg: Any) -> str:
    import tomli_w

    return tomli_w.dumps(to_dict(cfg))


def allocation_table(cfg: Config):
    """A rich Table with one row per engine: backend, dims, world size."""
    from rich.table import Table

    table = Table(title="Allocation")
    for col in ("engine", "backend", "allocation", "dp", "tp", "pp", "cp", "ep", "etp", "world size"):
        table.add_column(col, justify="right" if col not in ("engine", "backend", "allocation") else "left",
                         no_wrap=True)
    for engine, alloc in cfg.allocations().items():
        p = alloc.parallel
        table.add_row(engine, alloc.backend, str(alloc), str(p.dp_size), str(p.tp_size), str(p.pp_size),
                      str(p.cp_size), str(p.ep_size), str(p.etp_size), str(alloc.world_size))
    return table


def describe_section(section: str) -> str:
    """Documented keys of a section such as 'actor.archon' (default values and one-line docs)."""
    cls: Any = Config
    obj: Any = Config()
    for part in [p for p in section.split(".") if p]:
        names = {f.name for f in dataclasses.fields(cls)}
        if part not in names:
            raise ConfigError(f"unknown config section '{section}'{_closest(part, names)}")
        cls = typing.get_type_hints(cls)[part]
        obj = getattr(obj, part)
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"'{section}' is a key, not a section")
    docs = field_docs(cls)
    lines = []
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        shown = "{...}" if dataclasses.is_dataclass(value) else repr(value)
        lines.append(f"{(section + '.' if section else '') + f.name} = {shown}\n    {docs.get(f.name, '')}")
    return "\n".join(lines)


def main(argv: typing.Sequence[str] | None = None) -> int:
    from rich.console import Console
    from rich.syntax import Syntax

    parser = argparse.ArgumentParser(prog="python -m archon.config",
                                     description="Print the resolved Archon config and its allocation table.")
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--describe", metavar="SECTION", help="list the documented keys of a section ('' = top level)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)
    # Off a terminal rich assumes 80 columns and would truncate long (hybrid MoE) allocation strings.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    try:
        if args.describe is not None:
            console.print(describe_section(args.describe), highlight=False)
            return 0
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        Console(stderr=True).print(f"[bold red]config error:[/] {exc}", highlight=False)
        return 2
    console.print(Syntax(to_toml(cfg), "toml", theme="ansi_dark", background_color="default"))
    console.print(allocation_table(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
