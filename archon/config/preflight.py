"""Checks a run can make before any process starts; the RL trainer and SFT run the same ones at start.

``preflight(cfg, job)`` runs them all and returns one line per thing checked; the first problem raises a
``ConfigError`` naming the keys and the fix.  ``python -m archon.config`` prints the lines.  What they cover,
beyond ``validate_config``'s cross-field checks:

- the model folders: ``actor/critic/ref/teacher.path``, ``sglang.model_path`` and ``vllm.model`` given as a hub id
  (``Qwen/Qwen3-8B``) are resolved to the local Hugging Face cache (``archon.model_path``), once, so every
  process after this gets a folder;
- RL: a model and a dataset are named, group-level normalisation has groups of more than one sample, and
  ``reward.fn`` imports with a signature Archon can call (``archon.config.reward_check``);
- RL: the longest prompt plus ``gconfig.max_new_tokens`` fits the rollout servers' context (the model's
  ``config.json``).  Bounded cost: nothing is read when ``train_dataset.max_length + max_new_tokens`` fits;
  otherwise the rows are read once (no tokenising) and only the ``LONGEST_PROMPTS`` longest by characters are
  tokenised;
- pipeline parallel: the model's layers split into the stages the schedule needs (the fix is named otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from archon.config.dataset import DatasetConfig
from archon.config.device_defaults import describe_device_choice
from archon.config.reward_check import check_reward_fn
from archon.config.schema import ActorConfig, Config, ConfigError
from archon.data.encoding import encode_messages, encode_prompt, load_tokenizer
from archon.data.rl_dataset import read_prompt_row
from archon.data.sources import load_rows
from archon.errors import DataError
from archon.model_path import is_hub_id, resolve_model_path
from pipeline.schedules import required_stages_per_rank
from pipeline.split import PipelineConfigError, count_stages

LONGEST_PROMPTS = 16
"""Prompts tokenised by the context check: the longest by characters (tokens per character vary little)."""

# SGLang's get_context_length (vLLM's rule is alike): the first of these keys, times a rope scaling factor.
_CONTEXT_LENGTH_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)


def resolved_group_size(cfg: Config) -> int:
    """Rows per normalisation group: ``actor.group_size``, or ``gconfig.n_samples`` when 0."""
    return cfg.actor.group_size or cfg.gconfig.n_samples


def read_model_config(folder: str) -> dict[str, Any] | None:
    """``<folder>/config.json`` with a multimodal model's ``text_config`` merged in; None when there is none here."""
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return {**cfg, **(cfg.get("text_config") or {})}


def model_context_length(model_path: str) -> int | None:
    """The context SGLang derives from ``<model_path>/config.json``; None if there is no such file here."""
    cfg = read_model_config(model_path)
    if cfg is None:
        return None
    factor = 1.0
    rope = cfg.get("rope_scaling")
    if isinstance(rope, dict) and "original_max_position_embeddings" not in rope and rope.get("rope_type") != "llama3":
        factor = float(rope.get("factor", 1))
    for key in _CONTEXT_LENGTH_KEYS:
        if cfg.get(key) is not None:
            return int(factor * cfg[key])
    return 2048


def check_group_normalisation(actor: ActorConfig, group_size: int) -> None:
    """Refuse a normalisation over groups of one sample (each value normalised against itself: GRPO learns
    nothing).  ``group_size`` is the resolved samples per prompt (``resolved_group_size``)."""
    used = [("adv_norm", actor.adv_norm)]
    if actor.adv_estimator in ("grpo", "gae"):
        used.insert(0, ("reward_norm", actor.reward_norm))
    for name, norm in used:
        if "group" not in (norm.mean_level, norm.std_level):
            continue
        if (norm.group_size or group_size) == 1:
            raise ConfigError(
                f"{name} normalises over groups of samples of one prompt, but every group has "
                "one sample, so each value would be normalised against itself (GRPO would learn "
                "nothing); sample several completions per prompt (gconfig.n_samples > 1, and "
                f"actor.group_size 0 or > 1) or set {name}.mean_level/std_level to 'batch' or "
                "'none'"
            )


def engines_in_use(cfg: Config, job: str) -> tuple[str, ...]:
    """The training engines a run builds: actor, and for RL the critic, reference and teacher it needs."""
    if job == "sft":
        return ("actor",)
    a = cfg.actor
    used = {"critic": a.adv_estimator == "gae", "ref": bool(a.kl_ctl or a.kl_loss_coef), "teacher": bool(a.kd_coef)}
    return ("actor", *(name for name, on in used.items() if on))


def resolve_model_paths(cfg: Config, job: str, *, download: bool = True) -> list[str]:
    """Replace hub ids in the model paths by their local snapshot folders; lines saying what was resolved.

    ``download`` False (the config CLI) only looks in the cache: a hub id not there is reported, not fetched,
    and is an error only under ``HF_HUB_OFFLINE`` (the run could not fetch it either).
    """
    slots: list[tuple[str, Any, str]] = [(f"{e}.path", getattr(cfg, e), "path") for e in engines_in_use(cfg, job)]
    if job == "rl":
        slots += [("sglang.model_path", cfg.sglang, "model_path"), ("vllm.model", cfg.vllm, "model")]
    lines = []
    for key, section, attr in slots:
        value = getattr(section, attr)
        if not is_hub_id(value):
            continue
        try:
            local = resolve_model_path(value, key, download=download)
        except ConfigError:
            if download or "HF_HUB_OFFLINE is set" in _offline_probe(value, key):
                raise
            lines.append(f"{key} = '{value}': not in the Hugging Face cache; the run downloads it at start")
            continue
        setattr(section, attr, local)
        for engine in ("critic", "ref", "teacher"):  # inherited copies of actor.path follow it
            if key == "actor.path" and getattr(cfg, engine).path == value:
                getattr(cfg, engine).path = local
        lines.append(f"{key} = '{value}' resolved to {local}")
    return lines


def _offline_probe(path: str, key: str) -> str:
    """The message a cache-only lookup gives (says whether HF_HUB_OFFLINE is set)."""
    try:
        resolve_model_path(path, key, download=False)
    except ConfigError as exc:
        return str(exc)
    return ""


def check_pipeline_split(cfg: Config, job: str) -> list[str]:
    """Each archon engine with p > 1: its model's layers split into the stages its schedule needs."""
    lines = []
    for engine in engines_in_use(cfg, job):
        section = getattr(cfg, engine)
        alloc = cfg.allocations()[engine]
        pp = alloc.parallel.pp_size
        if alloc.backend != "archon" or pp <= 1:
            continue
        model = read_model_config(section.path or section.model_config)
        if model is None or "num_hidden_layers" not in model:
            lines.append(f"{engine}: pipeline split not checked (no config.json with num_hidden_layers here)")
            continue
        n_layers = int(model["num_hidden_layers"])
        arch = section.archon
        per_rank = required_stages_per_rank(arch.pp_schedule)
        try:
            n_stages = count_stages(n_layers, pp, per_rank, arch.pp_layers_per_stage)
        except PipelineConfigError as exc:
            raise ConfigError(f"{engine}: {exc}; {_split_fix(engine, n_layers, pp, per_rank)}") from None
        lines.append(f"{engine}: {n_layers} layers split into {n_stages} stages over p{pp} ({arch.pp_schedule})")
    return lines


def _split_fix(engine: str, n_layers: int, pp: int, per_rank: int | None) -> str:
    """The setting that makes ``n_layers`` split over ``pp`` ranks: a stage size, else the p values that work."""
    sizes = [
        size
        for size in range(1, n_layers + 1)
        if n_layers % size == 0
        and (n_layers // size) % pp == 0
        and (per_rank is None or n_layers // size == per_rank * pp)
    ]
    if sizes:
        two_per_rank = [s for s in sizes if n_layers // s == 2 * pp]
        size = two_per_rank[0] if two_per_rank else max(sizes)
        stages = n_layers // size
        return f"the fix: set {engine}.archon.pp_layers_per_stage = {size} ({stages} stages, {stages // pp} per rank)"
    need = per_rank or 1
    good = [p for p in range(2, n_layers + 1) if n_layers % (p * need) == 0]
    return (
        f"no stage size splits {n_layers} layers over p{pp} with this schedule; use a p in {good[:8]} "
        f"or another {engine}.archon.pp_schedule"
    )


def server_context_length(cfg: Config) -> tuple[int | None, str]:
    """The rollout servers' context (the model's own, clamped by the configured one) and where it comes from."""
    model = (cfg.vllm.model if cfg.rollout.backend.startswith("vllm") else cfg.sglang.model_path) or cfg.actor.path
    own = model_context_length(model)
    requested, key = (
        (cfg.vllm.max_model_len, "vllm.max_model_len")
        if cfg.rollout.backend.startswith("vllm")
        else (cfg.sglang.context_length, "sglang.context_length")
    )
    if own is None:
        return None, f"{model}/config.json"
    if 0 < requested < own:
        return requested, key
    return own, f"the context of {model}/config.json"


def check_prompt_fits(cfg: Config) -> str:
    """The longest prompt plus ``gconfig.max_new_tokens`` within the servers' context (bounded cost, see above)."""
    new = cfg.gconfig.max_new_tokens
    ds = cfg.train_dataset
    context, source = server_context_length(cfg)
    if context is None:
        return f"prompt length not checked: no {source} here"
    if ds.max_length + new <= context:
        return (
            f"prompts (at most train_dataset.max_length = {ds.max_length} tokens) + gconfig.max_new_tokens = {new} "
            f"fit the context of {context} ({source})"
        )
    try:
        longest, row = longest_prompt(ds, cfg.actor.path)
    except (DataError, OSError, ValueError) as exc:
        return (
            f"prompt length not checked ({str(exc).splitlines()[0]}); prompts above {context - new} tokens would "
            f"exceed the context of {context} with gconfig.max_new_tokens = {new}"
        )
    if longest + new > context:
        raise ConfigError(
            f"the longest prompt of train_dataset.path (row {row}) is {longest} tokens, and with gconfig.max_new_tokens"
            f" = {new} that is {longest + new}, above the rollout servers' context of {context} ({source}), which "
            f"they refuse (HTTP 400); lower gconfig.max_new_tokens to {context - longest} or set "
            f"train_dataset.max_length to {context - new} (longer prompts are dropped)"
        )
    return f"longest prompt {longest} tokens + gconfig.max_new_tokens = {new} fit the context of {context} ({source})"


def longest_prompt(ds: DatasetConfig, tokenizer_path: str) -> tuple[int, int]:
    """Token count and row number (1-based) of the longest prompt that ``train_dataset.max_length`` keeps,
    among the ``LONGEST_PROMPTS`` longest by characters."""
    rows = load_rows(ds.path, split=ds.split, subset=ds.subset or None)
    keys = dict(prompt_key=ds.prompt_key, answer_key=ds.answer_key, messages_key=ds.messages_key)
    parsed = [read_prompt_row(row, f"{ds.path} row {i + 1}", **keys) for i, row in enumerate(rows)]

    def chars(i: int) -> int:
        p = parsed[i]
        return len(json.dumps(p.messages)) if p.messages is not None else len(p.text)

    tokenizer = load_tokenizer(tokenizer_path)
    best = (0, 0)
    for i in sorted(range(len(parsed)), key=chars, reverse=True)[:LONGEST_PROMPTS]:
        p = parsed[i]
        if p.messages is not None:
            n = len(encode_messages(tokenizer, p.messages, tools=p.tools))
        else:
            n = len(encode_prompt(tokenizer, p.text, use_chat_template=ds.apply_chat_template))
        if n <= ds.max_length and n > best[0]:
            best = (n, i + 1)
    return best


def check_before_start(cfg: Config, job: str) -> list[str]:
    """What the trainer refused at start before any process group: a model and a dataset named, groups to
    normalise over, and (RL without agent workflows) a reward function Archon can call."""
    what = "a tokenizer" if job == "sft" else "weights and tokenizer"
    if not cfg.actor.path:
        raise ConfigError(f"actor.path is empty; {job.upper()} starts from a Hugging Face model folder ({what})")
    if not cfg.train_dataset.path:
        rows = '{"prompt", "completion"}' if job == "sft" else '{"prompt", "answer"}'
        raise ConfigError(
            f"train_dataset.path is empty; point it at a jsonl, json or parquet file of {rows} rows or a dataset folder"
        )
    if job == "sft":
        return []
    check_group_normalisation(cfg.actor, resolved_group_size(cfg))
    if cfg.actor.lora.enabled and not cfg.actor.lora.init_lora_weights:
        raise ConfigError(
            "actor.lora.init_lora_weights = false starts RL from non-zero adapters, but the rollout servers load "
            "actor.path without them, so the first rollout would come from another policy; keep it true for RL"
        )
    lines = [f"normalisation groups of {resolved_group_size(cfg)} samples"]
    if not cfg.rollout.workflow:
        lines.append(check_reward_fn(cfg.reward.fn))
    return lines


def preflight(cfg: Config, job: str = "rl", *, download: bool = True) -> list[str]:
    """Every check above, in order; resolves hub ids in ``cfg`` in place.  Returns what was checked, one line
    each; raises ``ConfigError`` at the first problem."""
    lines = [describe_device_choice(cfg)]
    lines += check_before_start(cfg, job)
    lines += resolve_model_paths(cfg, job, download=download)
    lines += check_pipeline_split(cfg, job)
    if job == "rl" and not cfg.rollout.workflow and not is_hub_id(cfg.actor.path):
        lines.append(check_prompt_fits(cfg))
    return lines
