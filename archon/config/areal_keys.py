"""AReaL's config keys that Archon does not have, and what each becomes: one sentence apiece.

An AReaL config (``examples/math/gsm8k_grpo.yaml``, the Archon document's examples) loads with the keys Archon
shares; every other key is looked up here (``archon.config.areal_translate`` applies the table):

- ``ignored``: harmless to drop, because it only says where AReaL's own processes keep files, find each other or
  are scheduled, or repeats another key; the run warns once per entry, with its sentence, and goes on.
- ``refused``: dropping it would change what is trained (the data, the loss, the model, the run's length in
  samples), so it is an error whose sentence says what to write instead; the values that change nothing
  (``harmless``, e.g. ``gconfig.greedy: false``) are dropped with the warning, as ignored keys are.
- ``translated``: Archon has the same setting under another name; the value is moved there (``archon``).

``render_markdown()`` writes the table as the README's "Coming from AReaL" table.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

ENGINE_SECTIONS = ("actor", "critic", "ref", "teacher")
"""The sections a ``<engine>`` pattern stands for."""

Kind = Literal["ignored", "refused", "translated"]


@dataclass(frozen=True, eq=False)  # compared by identity: one warning per entry
class AReaLKey:
    """One AReaL key (or pattern) and what Archon does with it."""

    pattern: str
    """Dotted AReaL key; '*' matches any name, '<engine>' each of actor, critic, ref and teacher."""
    kind: Kind
    """'ignored' (a warning, once), 'refused' (an error) or 'translated' (moved to `archon`)."""
    note: str
    """One sentence: what the key is in AReaL and what to use in Archon (or that it is not supported)."""
    archon: str = ""
    """The Archon key a translated value moves to ('<engine>' as in `pattern`); for the README's table otherwise."""
    harmless: Callable[[Any, dict[str, Any]], bool] | None = None
    """For 'refused': the values (given the whole config tree) that change nothing and are dropped with a warning."""
    values: dict[Any, Any] | None = None
    """For 'translated': AReaL's values that Archon spells differently (others pass as they are)."""
    harmless_text: str = ""
    """The harmless values in words, for the README's table."""


def _is(*allowed: Any) -> Callable[[Any, dict[str, Any]], bool]:
    return lambda value, tree: value in allowed


def _lookup(tree: dict[str, Any], dotted: str, default: Any) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return default if node is None else node


def _equals(dotted: str, default: Any) -> Callable[[Any, dict[str, Any]], bool]:
    """Harmless when the value is empty, null or the same as ``dotted`` (``default`` where the tree does not set it)."""
    return lambda value, tree: value in (None, "") or value == _lookup(tree, dotted, default)


_TOKENIZER = (
    "AReaL's tokenizer folder; Archon loads the tokenizer from actor.path (the model folder), so put the "
    "tokenizer files there"
)
_PLACEMENT = (
    "AReaL's worker placement for its single controller; Archon places every process from the backend allocation "
    "strings (rollout.colocate for colocation), see `python -m archon.plan`"
)

AREAL_KEYS: tuple[AReaLKey, ...] = (
    # ---- the run ------------------------------------------------------------------------------------------------
    AReaLKey(
        "allocation_mode",
        "translated",
        "AReaL's deprecated combined allocation ('sglang:d4t2+archon:d4p2t2'); it is split into rollout.backend and "
        "actor.backend with a deprecation warning, so write those two instead",
        archon="rollout.backend, actor.backend",
    ),
    AReaLKey(
        "total_train_epochs",
        "ignored",
        "AReaL's run length in epochs; Archon counts RL steps, so set total_train_steps (epochs x dataset rows / "
        "train_dataset.batch_size), else the run stops after total_train_steps (100 by default)",
        archon="total_train_steps",
    ),
    AReaLKey(
        "total_train_n_seqs",
        "refused",
        "AReaL's run length in samples; set total_train_steps (samples / train_dataset.batch_size) instead",
        archon="total_train_steps",
        harmless=_is(None),
        harmless_text="null",
    ),
    AReaLKey(
        "tokenizer_path", "refused", _TOKENIZER, "actor.path", _equals("actor.path", ""), harmless_text="actor.path"
    ),
    AReaLKey(
        "enable_offload",
        "refused",
        "AReaL's torch_memory_saver offload of the trainer; use actor.offload = true with rollout.colocate = true",
        archon="actor.offload",
        harmless=_is(False),
        harmless_text="false",
    ),
    AReaLKey(
        "dynamic_bs",
        "refused",
        "AReaL's variable batch of accepted samples; use dynamic_filter.enable = true, which refills the batch",
        archon="dynamic_filter.enable",
        harmless=_is(False),
        harmless_text="false",
    ),
    AReaLKey(
        "cluster.fileroot",
        "ignored",
        "AReaL's root folder for logs and checkpoints; Archon writes a run's files under output_dir "
        "(default outputs/<experiment_name>/<trial_name>)",
        archon="output_dir",
    ),
    AReaLKey(
        "cluster.name_resolve",
        "ignored",
        "AReaL's name-resolving store through which its workers find each other; Archon's launchers "
        "(`python -m archon.launch`) pass the servers' addresses themselves",
    ),
    AReaLKey("cluster.cluster_name", "ignored", "AReaL's cluster name for cluster-specific environment variables"),
    AReaLKey(
        "scheduler.*",
        "ignored",
        "AReaL's single-controller scheduler settings; Archon has no controller, and scheduler.type says only which "
        "launcher starts the run",
    ),
    AReaLKey(
        "launcher",
        "ignored",
        "AReaL's per-GPU CPU and memory requests of its launchers; give `python -m archon.launch ray` --cpus-per-gpu, "
        "and Slurm resources as --sbatch-arg",
    ),
    AReaLKey(
        "recover",
        "ignored",
        "AReaL's resume settings; an Archon run always resumes from the newest complete checkpoint under output_dir "
        "when rerun, saved every saver.freq_steps steps or saver.freq_secs seconds (AReaL's recover.freq_*), so use "
        "a new output_dir or trial_name for a fresh run",
        archon="saver.freq_steps, saver.freq_secs",
    ),
    AReaLKey(
        "saver.freq_epochs",
        "ignored",
        "AReaL's save interval in epochs; Archon saves every saver.freq_steps steps and saver.freq_secs seconds",
        archon="saver.freq_steps",
    ),
    AReaLKey(
        "evaluator.freq_epochs",
        "ignored",
        "AReaL's evaluation interval in epochs; Archon evaluates every evaluator.freq_steps steps",
        archon="evaluator.freq_steps",
    ),
    AReaLKey("perf_tracer", "ignored", "AReaL's performance tracer; not supported (Archon logs step timings)"),
    AReaLKey("memory_profiler", "ignored", "AReaL's memory snapshot profiler; not supported"),
    AReaLKey(
        "*.experiment_name",
        "ignored",
        "AReaL's copy of the top-level experiment_name in a section; Archon's sections use the top-level one",
        archon="experiment_name",
    ),
    AReaLKey(
        "*.trial_name",
        "ignored",
        "AReaL's copy of the top-level trial_name in a section; Archon's sections use the top-level one",
        archon="trial_name",
    ),
    AReaLKey(
        "*.fileroot",
        "ignored",
        "AReaL's copy of cluster.fileroot in a section; Archon writes a run's files under output_dir",
        archon="output_dir",
    ),
    # ---- rollout and sampling -------------------------------------------------------------------------------------
    AReaLKey(
        "rollout.consumer_batch_size",
        "refused",
        "AReaL's prompts per training step; Archon trains on train_dataset.batch_size prompts per step, so set that",
        archon="train_dataset.batch_size",
        harmless=_equals("train_dataset.batch_size", 8),
        harmless_text="train_dataset.batch_size",
    ),
    AReaLKey(
        "rollout.queue_size",
        "ignored",
        "AReaL's bound of the rollout queue; Archon bounds asynchronous rollouts by rollout.max_head_offpolicyness "
        "and rollout.max_concurrent_rollouts",
    ),
    AReaLKey(
        "rollout.enable_rollout_tracing",
        "ignored",
        "AReaL's per-request rollout tracing; not supported (Archon logs rollout metrics in metrics.jsonl)",
    ),
    AReaLKey("rollout.dump_to_file", "ignored", "AReaL's dump of generated trajectories to files; not supported"),
    AReaLKey(
        "rollout.tokenizer_path",
        "refused",
        _TOKENIZER,
        "actor.path",
        _equals("actor.path", ""),
        harmless_text="actor.path",
    ),
    AReaLKey("rollout.scheduling_spec", "ignored", _PLACEMENT, "rollout.backend"),
    AReaLKey(
        "gconfig.greedy",
        "refused",
        "AReaL's greedy decoding switch; set gconfig.temperature = 0 for greedy sampling",
        archon="gconfig.temperature",
        harmless=_is(False),
        harmless_text="false",
    ),
    AReaLKey(
        "sglang.skip_tokenizer_init",
        "ignored",
        "Archon starts SGLang with --skip-tokenizer-init itself (it sends and receives token ids)",
    ),
    AReaLKey("vllm.skip_tokenizer_init", "ignored", "Archon sets vLLM's tokenizer options itself"),
    # ---- training engines -----------------------------------------------------------------------------------------
    AReaLKey(
        "<engine>.optimizer.beta1",
        "translated",
        "AdamW's beta1; Archon writes both betas as one pair",
        archon="<engine>.optimizer.betas",
    ),
    AReaLKey(
        "<engine>.optimizer.beta2",
        "translated",
        "AdamW's beta2; Archon writes both betas as one pair",
        archon="<engine>.optimizer.betas",
    ),
    AReaLKey(
        "<engine>.optimizer.lr_scheduler_type",
        "translated",
        "The learning-rate shape after warmup (constant, cosine, linear)",
        archon="<engine>.optimizer.lr_schedule",
    ),
    AReaLKey(
        "<engine>.optimizer.gradient_clipping",
        "translated",
        "The global gradient-norm clip",
        archon="<engine>.optimizer.max_grad_norm",
    ),
    AReaLKey("<engine>.use_lora", "translated", "Train LoRA adapters on a frozen base", archon="<engine>.lora.enabled"),
    AReaLKey("<engine>.lora_rank", "translated", "The adapters' rank", archon="<engine>.lora.rank"),
    AReaLKey("<engine>.lora_alpha", "translated", "The adapters' scale numerator", archon="<engine>.lora.alpha"),
    AReaLKey(
        "<engine>.target_modules",
        "translated",
        "The module names that get adapters",
        archon="<engine>.lora.target_modules",
    ),
    AReaLKey("<engine>.peft_type", "translated", "The adapter kind (only 'lora')", archon="<engine>.lora.peft_type"),
    AReaLKey(
        "<engine>.optimizer.warmup_steps_proportion",
        "translated",
        "The warmup as a fraction of the optimizer steps; it becomes int(fraction x the run's optimizer steps), as "
        "AReaL rounds it",
        archon="<engine>.optimizer.warmup_steps",
    ),
    AReaLKey(
        "<engine>.optimizer.type",
        "translated",
        "AReaL's 'adam' is torch's AdamW, Archon's 'adamw'; 'sgd' and 'adam_bf16' are not supported",
        archon="<engine>.optimizer.type",
        values={"adam": "adamw"},
    ),
    AReaLKey(
        "<engine>.optimizer.initial_loss_scale",
        "ignored",
        "fp16 loss scaling; Archon trains in bfloat16 or float32 without loss scaling",
    ),
    AReaLKey("<engine>.optimizer.min_loss_scale", "ignored", "fp16 loss scaling; not used by Archon"),
    AReaLKey("<engine>.optimizer.loss_scale_window", "ignored", "fp16 loss scaling; not used by Archon"),
    AReaLKey("<engine>.optimizer.hysteresis", "ignored", "fp16 loss scaling; not used by Archon"),
    AReaLKey(
        "actor.weight_update_mode",
        "translated",
        "How new weights reach the rollout servers ('xccl' is Archon's 'distributed', 'disk' is 'disk')",
        archon="rollout.weight_sync",
        values={"xccl": "distributed"},
    ),
    AReaLKey(
        "<engine>.weight_update_mode",
        "ignored",
        "Weight updates reach the rollout servers from the actor only, set by rollout.weight_sync",
        archon="rollout.weight_sync",
    ),
    AReaLKey(
        "actor.max_new_tokens",
        "refused",
        "AReaL's actor copy of the generation length; Archon's loss reads gconfig.max_new_tokens, so set that",
        archon="gconfig.max_new_tokens",
        harmless=_equals("gconfig.max_new_tokens", 512),
        harmless_text="gconfig.max_new_tokens",
    ),
    AReaLKey(
        "<engine>.init_from_scratch",
        "refused",
        "AReaL's random initialisation; leave <engine>.path empty and set <engine>.model_config to the model's "
        "config.json (or its folder)",
        archon="<engine>.model_config",
        harmless=_is(False),
        harmless_text="false",
    ),
    AReaLKey(
        "<engine>.disable_dropout",
        "ignored",
        "Archon's models have no dropout and the fsdp: engine turns it off (so a step never depends on the allocation)",
    ),
    AReaLKey(
        "<engine>.mb_spec.packing_algorithm",
        "ignored",
        "Archon packs microbatches itself, balancing tokens across them; the algorithm is not a setting",
    ),
    AReaLKey(
        "<engine>.enable_tree_training",
        "translated",
        "AReaL's tree training (a prefix that several sequences share goes through the model once); Archon's form "
        "shares each prompt among its samples (one level, not a trie), on layouts of d and t",
        archon="<engine>.archon.prefix_sharing",
    ),
    AReaLKey(
        "<engine>.attn_impl",
        "ignored",
        "transformers' attention implementation; Archon's engines choose the attention kernel themselves",
    ),
    AReaLKey(
        "critic.is_critic",
        "refused",
        "AReaL's marker of a value model; Archon's critic section always is one",
        harmless=_is(True),
        harmless_text="true",
    ),
    AReaLKey(
        "<engine>.is_critic",
        "refused",
        "AReaL's marker of a value or reward model; only Archon's critic section is one (reward models are not "
        "supported)",
        harmless=_is(False),
        harmless_text="false",
    ),
    AReaLKey("<engine>.scheduling_spec", "ignored", _PLACEMENT, "<engine>.backend"),
    AReaLKey("<engine>.scheduling_strategy", "ignored", _PLACEMENT, "<engine>.backend"),
    AReaLKey(
        "<engine>.megatron",
        "ignored",
        "AReaL's Megatron engine options; Archon has no Megatron engine, use an archon: backend and <engine>.archon.*",
        archon="<engine>.archon",
    ),
    AReaLKey(
        "<engine>.fsdp",
        "ignored",
        "AReaL's FSDP engine options; Archon's fsdp: engine reads its FSDP, offload and checkpointing options from "
        "<engine>.archon.*",
        archon="<engine>.archon",
    ),
    # ---- data -------------------------------------------------------------------------------------------------------
    AReaLKey(
        "*_dataset.type",
        "refused",
        "AReaL's kind of dataset; Archon knows it from the entry point (scripts/train_rl.py or scripts/train_sft.py) "
        "and has no other kinds",
        harmless=_is("rl", "sft"),
        harmless_text="'rl', 'sft'",
    ),
    AReaLKey(
        "*_dataset.pin_memory", "ignored", "a torch DataLoader option; Archon's prompt loader has no worker processes"
    ),
    AReaLKey(
        "*_dataset.num_workers", "ignored", "a torch DataLoader option; Archon's prompt loader has no worker processes"
    ),
    AReaLKey(
        "*_dataset.num_dataset_workers",
        "ignored",
        "AReaL's remote data-service workers; Archon reads the data in the trainer",
    ),
    AReaLKey(
        "*_dataset.dataset_kwargs",
        "refused",
        "arguments of AReaL's dataset loading functions; Archon reads rows by train_dataset.prompt_key, answer_key "
        "and messages_key",
        harmless=_is({}, None),
        harmless_text="{}",
    ),
)
"""Every AReaL key Archon lacks that an AReaL config is expected to hold, in the README's order."""


def _expand(entry: AReaLKey) -> list[tuple[str, str, AReaLKey]]:
    """``(pattern, archon key, entry)`` with ``<engine>`` replaced by each engine section."""
    if "<engine>" not in entry.pattern:
        return [(entry.pattern, entry.archon, entry)]
    return [(entry.pattern.replace("<engine>", s), entry.archon.replace("<engine>", s), entry) for s in ENGINE_SECTIONS]


_EXPANDED = [row for entry in AREAL_KEYS for row in _expand(entry)]


def find_areal_key(dotted: str) -> tuple[AReaLKey, str] | None:
    """The entry for the AReaL key ``dotted`` and its Archon key (engine section filled in), or None.

    A pattern matches the key itself or a section above it (``perf_tracer`` covers ``perf_tracer.enabled``); the
    first matching entry of the table wins, so specific entries come before general ones.
    """
    for pattern, archon, entry in _EXPANDED:
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            if fnmatch.fnmatchcase(".".join(parts[:n]), pattern):
                return entry, archon
    return None


def render_markdown() -> str:
    """The table as Markdown: AReaL key | Archon key | note (the README's "Coming from AReaL" table)."""
    lines = ["| AReaL key | Archon key | note |", "|---|---|---|"]
    for entry in AREAL_KEYS:
        archon = f"`{entry.archon}`" if entry.archon else "-"
        if entry.kind == "ignored":
            what = "ignored, with a warning"
        elif entry.kind == "translated":
            what = "translated"
        elif entry.harmless is None:
            what = "an error"
        else:
            what = f"ignored when {entry.harmless_text}, otherwise an error"
        lines.append(f"| `{entry.pattern}` | {archon} | {what}: {entry.note} |")
    return "\n".join(lines)
