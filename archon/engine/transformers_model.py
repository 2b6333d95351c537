"""A transformers ``AutoModelForCausalLM`` (or ``...ForTokenClassification`` critic) laid over a mesh.

What the ``fsdp:`` engine needs from transformers, and nothing Archon-model-specific:

* ``build_meta_model``: the model with parameters on the meta device and buffers (RoPE
  frequencies, embedding scales) computed on the CPU, so they can be restored after
  ``to_empty``; dropout turned off (it would make a step depend on the allocation).
* ``apply_tp_plan``: tensor parallel from the plan transformers ships with the model
  (``config.base_model_tp_plan`` plus the head's ``_tp_plan``), applied with torch's own
  ``ColwiseParallel``/``RowwiseParallel`` on the engine's TP mesh; the LM head returns
  vocab-sharded logits for the vocab-parallel loss.
* ``ulysses_attention``: an attention function registered with transformers'
  ``AttentionInterface``; under context parallel every attention layer trades its sequence
  chunk for heads (``parallel.context_parallel``), attends over the packed full row and
  trades back.
* ``decoder_blocks`` / ``fsdp_units``: the repeated blocks (``_no_split_modules``) that
  activation checkpointing, compile and FSDP2 wrap one by one.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from archon.engine.fsdp_lora import with_peft_placements
from models.common.attention import CoreAttention
from models.common.packing import packed_causal_mask
from parallel.context_parallel import heads_to_sequence, kv_repeats_for_cp, sequence_to_heads
from parallel.fqn import clean_fqn

logger = logging.getLogger("archon.engine")

ULYSSES_ATTENTION = "archon_ulysses"
"""Name under which ``ulysses_attention`` is registered with transformers' AttentionInterface."""


class TransformersModelError(ValueError):
    """A transformers model cannot be built or laid out as the allocation asks."""


# ------------------------------------------------------------------------------ build
def zero_dropout(config: Any) -> list[str]:
    """Set every dropout probability of ``config`` to 0; returns the names that were non-zero.

    Dropout draws different masks on different layouts, so with it a step would depend on the
    allocation (and RL trainers turn it off anyway).
    """
    changed = []
    for name, value in list(vars(config).items()):
        if ("dropout" in name or name.endswith("_pdrop")) and isinstance(value, float) and not isinstance(value, bool):
            if value != 0.0:
                changed.append(name)
            setattr(config, name, 0.0)
    # A token-classification head reads this (default 0.1 when absent).
    config.classifier_dropout = 0.0
    return changed


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create parameters on the meta device and buffers where they would normally go (the CPU)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        # A parameter already on meta is kept as is, so tying (head.weight = embedding.weight) holds.
        if param is not None and param.device.type != "meta":
            registered = module._parameters[name]
            assert registered is not None  # ``original`` just registered ``param``
            kwargs = dict(registered.__dict__, requires_grad=param.requires_grad)
            module._parameters[name] = type(param)(registered.to("meta"), **kwargs)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def model_class_for(config: Any, is_critic: bool) -> type:
    """The transformers class for ``config``: ``*ForCausalLM``, or ``*ForTokenClassification`` for a critic."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    auto = AutoModelForTokenClassification if is_critic else AutoModelForCausalLM
    try:
        return cast(type, auto._model_mapping[type(config)])
    except KeyError:
        kind = "ForTokenClassification (a critic's value head)" if is_critic else "ForCausalLM"
        raise TransformersModelError(
            f"transformers has no *{kind} class for model_type '{config.model_type}'; the fsdp: engine builds "
            f"models through {auto.__name__}, so use a model type it supports"
        ) from None


def critic_config(config: Any) -> Any:
    """``config`` for a one-output token-classification head without bias (Archon's critic convention)."""
    config = copy.deepcopy(config)
    config.num_labels = 1
    config.id2label = {0: "LABEL_0"}
    config.label2id = {"LABEL_0": 0}
    config.token_classification_bias = False
    return config


def build_meta_model(
    config: Any, is_critic: bool, attn_implementation: str | None
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model with meta parameters, and a CPU copy of every buffer to restore after ``to_empty``."""
    cls = model_class_for(config, is_critic)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with _parameters_on_meta():
        model = cls._from_config(config, dtype=torch.float32, **kwargs)
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers() if buf.device.type != "meta"}
    return model, buffers


@torch.no_grad()
def restore_buffers(model: nn.Module, buffers: dict[str, torch.Tensor], device: torch.device) -> None:
    """Copy the buffers saved by ``build_meta_model`` back after ``to_empty`` left them uninitialised.

    Every buffer ends on the compute ``device``: under CPU offload ``to_empty`` put them on the
    CPU with the parameters, and FSDP moves parameters only.
    """
    for name, buf in model.named_buffers():
        saved = buffers.get(clean_fqn(name))
        if saved is not None:
            buf.copy_(saved.to(buf.device, buf.dtype))
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[key] = buf.to(device)


def embeddings_tied(model: nn.Module) -> bool:
    """True when the LM head and the input embedding share one parameter."""
    hf: Any = model  # a transformers PreTrainedModel
    out = hf.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inp = hf.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return out is not None and inp is not None and out.weight is inp.weight


def retie_embeddings(model: nn.Module) -> None:
    """Make the LM head use the embedding's parameter again (after a step that replaced one of them)."""
    hf: Any = model  # a transformers PreTrainedModel
    out, inp = hf.get_output_embeddings(), hf.get_input_embeddings()
    if out.weight is not inp.weight:
        out.weight = inp.weight


# ------------------------------------------------------------------------------ blocks
def decoder_blocks(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """``(parent, attribute, block)`` for every repeated block named in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise TransformersModelError(
            f"{type(model).__name__} names no _no_split_modules, so the fsdp: engine cannot "
            "tell which modules are its transformer blocks"
        )
    found = []
    for parent in model.modules():
        for attr, child in parent.named_children():
            if type(child).__name__ in names:
                found.append((parent, attr, child))
    if not found:
        raise TransformersModelError(
            f"{type(model).__name__} has no module of the classes {sorted(names)} it lists in _no_split_modules"
        )
    return found


def wrap_blocks(model: nn.Module, wrap) -> None:
    """Replace every block by ``wrap(block)`` (activation checkpointing); parameter names keep a wrapper prefix."""
    for parent, attr, block in decoder_blocks(model):
        parent.register_module(attr, wrap(block))


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The blocks (each its own FSDP unit); embeddings, final norm and head stay with the root."""
    return [block for _, _, block in decoder_blocks(model)]


# ------------------------------------------------------------------------------ tensor parallel
def _styles(loss_parallel: bool) -> dict[str, Any]:
    return {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "colwise_rep": ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
        # A norm between a colwise and a rowwise layer sees only this rank's heads: its weight
        # stays replicated and its gradient is summed over TP.  Declaring the local input as
        # sharded on dim 0 (any dim but the normalised last one) gives exactly that.
        "replicated_with_grad_allreduce": SequenceParallel(sequence_dim=0, use_local_output=True),
    }


def tp_plan_of(model: nn.Module) -> dict[str, str]:
    """The module-path -> style-name plan transformers ships with this model (empty when it has none)."""
    plan = dict(getattr(model, "_tp_plan", None) or {})
    if not plan:
        prefix = getattr(model, "base_model_prefix", "model")
        base = getattr(model.config, "base_model_tp_plan", None) or {}
        plan = {f"{prefix}.{k}": v for k, v in base.items()}
        plan.update(getattr(type(model), "_tp_plan", None) or {})
    return plan


def check_tp_sizes(config: Any, tp: int, plan: dict[str, str]) -> None:
    """Heads and the MLP width must split evenly over ``tp`` where the plan shards them (a rowwise
    layer takes its input as equal local slices); the vocabulary may split unevenly."""
    sharded = set(plan.values())
    sizes = {}
    if {"colwise", "rowwise"} & sharded:
        for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = getattr(config, key, None)
            if isinstance(value, int):
                sizes[key] = value
    for key, value in sizes.items():
        if value % tp:
            raise TransformersModelError(
                f"model_type '{config.model_type}': {key}={value} is not divisible by the "
                f"tensor-parallel size t{tp}; choose t from the divisors of {value}"
            )


def apply_tp_plan(model: nn.Module, tp_mesh, loss_parallel: bool = True) -> None:
    """Shard ``model`` over ``tp_mesh`` following transformers' own plan for it.

    Raises when the model ships no plan, or uses a style this mapping does not cover (fused
    MoE experts, packed projections): such a model trains with t1, or with ``archon:``.  Layers
    PEFT adapted are placed whole, their adapters split as their base layer
    (``fsdp_lora.with_peft_placements``); frozen parameters stay frozen.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tp_plan_of(model)
    hf: Any = model  # a transformers PreTrainedModel
    config = hf.config
    if not plan:
        raise TransformersModelError(
            f"transformers ships no tensor-parallel plan for model_type "
            f"'{config.model_type}' ({type(model).__name__}); use t1 with the fsdp: backend, "
            "or an archon: allocation if Archon has this model type"
        )
    styles = _styles(loss_parallel)
    unknown = sorted({style for style in plan.values() if style not in styles})
    if unknown:
        raise TransformersModelError(
            f"the tensor-parallel plan of model_type '{config.model_type}' uses styles "
            f"{unknown}, which the fsdp: engine does not apply; use t1, or an archon: "
            "allocation if Archon has this model type"
        )
    check_tp_sizes(config, tp_mesh.size(), plan)
    tied = embeddings_tied(model)
    head = hf.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = next((n for n, m in model.named_modules() if head is not None and m is head), None)
    torch_plan = {}
    for path, style in plan.items():
        if path == head_name:
            # Vocab-sharded logits (a DTensor): the loss reduces over TP instead of gathering V.
            head_style = ColwiseParallel(output_layouts=Shard(-1), use_local_output=not loss_parallel)
            torch_plan[path] = with_peft_placements(head_style)
        else:
            torch_plan[path] = with_peft_placements(styles[style])
    if tied and head_name not in torch_plan:
        raise TransformersModelError(
            f"model_type '{config.model_type}' ties its LM head to the embedding, but the "
            "tensor-parallel plan splits only one of them; use t1"
        )
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, tp_mesh, torch_plan)
    # SequenceParallel (replicated_with_grad_allreduce) makes the parameters it distributes trainable: keep a
    # LoRA model's frozen base frozen.
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    if tied:
        # The embedding (rowwise: Shard(0) over the vocabulary) and the head (colwise: Shard(0))
        # were distributed separately with the same layout; share one DTensor parameter again.
        retie_embeddings(model)


# ------------------------------------------------------------------------------ context parallel
def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function for Ulysses context parallel over packed rows.

    ``query/key/value`` are ``[batch, heads, seq/cp, head_dim]`` (this rank's chunk, RoPE
    applied); the engine passes ``archon_cp_group``, ``archon_cp_size`` and the full row's
    ``archon_cu_seqlens`` through the model's keyword arguments.  Returns ``[batch, seq/cp,
    heads, head_dim]`` as transformers' attention functions do.
    """
    group, cp, cu_seqlens = (kwargs.get(k) for k in ("archon_cp_group", "archon_cp_size", "archon_cu_seqlens"))
    cp = cast(int, cp)  # the engine passes it with the group
    name = type(module).__name__
    if group is None or cu_seqlens is None:
        raise TransformersModelError(
            f"{name} did not pass the engine's keyword arguments to its attention function, "
            "so Ulysses context parallel cannot run on this model; use c1"
        )
    if dropout:
        raise TransformersModelError(
            f"{name} asks for attention dropout {dropout}; context parallel attention has none"
        )
    if kwargs.get("s_aux") is not None:
        raise TransformersModelError(
            f"{name} uses attention sinks, which context parallel attention does not implement; use c1"
        )
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [b, s/cp, h, d]
    repeats = kv_repeats_for_cp(q.shape[2], k.shape[2], cp)
    if repeats > 1:
        k = k.repeat_interleave(repeats, dim=2)
        v = v.repeat_interleave(repeats, dim=2)
    q, k, v = (sequence_to_heads(t, group, cp) for t in (q, k, v))  # [b, s, h/cp, d]
    out = packed_attention(
        q,
        k,
        v,
        cu_seqlens,
        scale=scaling if scaling is not None else q.shape[-1] ** -0.5,
        sliding_window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
    )
    return heads_to_sequence(out, group, cp).contiguous(), None


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention inside each packed sequence, ``[b, s, h, d]`` in and out (kv may have fewer heads).

    The plain case is Archon's ``CoreAttention`` (FlashAttention varlen on CUDA, masked SDPA on
    CPU); a sliding window or logit soft-capping (Gemma-2) takes an explicit masked softmax.
    """
    if not sliding_window and not softcap:
        return CoreAttention(scale)(q, k, v, cu_seqlens=cu_seqlens)
    seqlen = q.shape[1]
    mask = packed_causal_mask(cu_seqlens, seqlen, q.device)
    if sliding_window:
        idx = torch.arange(seqlen, device=q.device)
        mask = mask & (idx[:, None] - idx[None, :] < sliding_window)
    groups = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2)
    v = v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def register_ulysses_attention() -> str:
    """Register ``ulysses_attention`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)
    return ULYSSES_ATTENTION
