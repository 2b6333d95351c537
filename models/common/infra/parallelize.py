"""The shared decoder's parallel plan: TP -> EP -> CP -> AC -> compile -> FSDP.

The plan (which module is split how) lives here because it names the decoder's modules
(``models/common/``); the techniques themselves live in ``parallel/``.  Every model package
built on the shared decoder points its ``infra/parallelize.py`` here.  What to apply comes
from ``ParallelDims`` (the sizes) and ``ParallelizeOptions`` (dtypes, AC, compile, offload),
both from ``parallel/``, so this module depends on nothing above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from parallel.activation_checkpoint import apply_ac
from parallel.compile import apply_compile
from parallel.context_parallel import apply_cp, check_heads_divisible
from parallel.dims import ParallelDims
from parallel.dtypes import to_dtype
from parallel.expert_parallel import apply_expert_fsdp, apply_moe_folding, check_expert_parallel, expert_fsdp_mesh
from parallel.fsdp import apply_fsdp
from parallel.options import ParallelizeOptions
from parallel.tensor_parallel import (
    ExpertTensorParallel,
    LocalTokensParallel,
    ReplicateParallel,
    apply_tensor_parallel,
    check_divisible,
)

if TYPE_CHECKING:
    from models.common.args import MoEArgs
    from models.common.decoder import Decoder, TransformerBlock

MOE_TP_MODES = ("etp", "local")
"""How MoE layers use the TP ranks (see ``apply_tp``)."""


def _moe_tp_plan(moe_tp: str) -> dict[str, Any]:
    if moe_tp == "local":
        # MoE folding: each TP rank keeps its sequence shard (and cuts the mask and replayed
        # choices to it); the expert layout (EP, ETP token pooling) is applied afterwards.
        # The router is replicated and its gradient summed over the TP ranks.
        return {"moe": LocalTokensParallel(), "moe.router.gate": ReplicateParallel(input_layout=Shard(0))}
    return {
        # Every TP rank routes all tokens and runs its slice of every expert's hidden dim;
        # the partial outputs are reduce-scattered back to sequence shards.  The mask and
        # replayed choices cover the whole sequence already.
        "moe": PrepareModuleInputOutput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_input=True,
            output_layouts=(Partial(),),
            desired_output_layouts=(Shard(1),),
        ),
        "moe.router.gate": ReplicateParallel(partial_output_grad=True),
        "moe.experts": ExpertTensorParallel(),
    }


def _blocks(model: nn.Module) -> list[TransformerBlock]:
    # The plan names the shared decoder's modules; the blocks are not yet wrapped (AC) here.
    return cast("list[TransformerBlock]", list(cast("Decoder", model).layers.values()))


def _tp_plan_for_block(block: nn.Module, moe_tp: str = "etp") -> dict[str, Any]:
    attention = cast("TransformerBlock", block).attention
    plan: dict[str, Any] = {
        "attention_norm": SequenceParallel(),
        # Attention's positional inputs: x, rope (cos, sin), cu_seqlens, cache, max_seqlen, segments.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None, None, None),
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    if attention.q_norm is not None:
        # q/k are [batch, seq, local_heads, head_dim]: the norm acts per head, and the weight's
        # gradient sums over the heads of every TP rank (Shard(2) input -> Partial grad).
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if cast("TransformerBlock", block).moe_enabled:
        plan.update(_moe_tp_plan(moe_tp))
    else:
        plan.update(
            {
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            }
        )
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool = True, moe_tp: str = "etp") -> None:
    """Tensor + sequence parallel for the decoder; the LM head returns vocab-sharded logits.

    ``moe_tp`` says how MoE layers use the TP ranks: ``"etp"`` (experts follow attention:
    tokens replicated over TP, every expert split on its hidden dim over TP), ``"local"``
    (MoE folding: tokens stay sequence-sharded and the experts are left to
    ``parallel.expert_parallel.apply_moe_folding``).
    """
    if moe_tp not in MOE_TP_MODES:
        raise ValueError(f"moe_tp '{moe_tp}' must be one of {', '.join(MOE_TP_MODES)}")
    decoder = cast("Decoder", model)
    args = decoder.args
    tp = tp_mesh.size()
    sizes = {"num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads}
    if moe_tp == "etp" and any(block.moe_enabled for block in _blocks(model)):
        sizes["moe_intermediate_size"] = cast("MoEArgs", args).moe_hidden_dim
    if any(not block.moe_enabled for block in _blocks(model)):
        sizes["intermediate_size"] = args.hidden_dim
    check_divisible(sizes, tp, type(model).__name__)

    top: dict[str, Any] = {"norm": SequenceParallel()}
    if decoder.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if decoder.output is not None:
        if args.is_critic:
            # A 1-wide value head cannot be split: replicate it and keep values sequence-sharded.
            top["output"] = ReplicateParallel(input_layout=Shard(1), output_layout=Replicate(), use_local_output=True)
        else:
            top["output"] = ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            )
    if decoder.norm is None:
        top.pop("norm")
    apply_tensor_parallel(model, tp_mesh, top)
    for block in _blocks(model):
        apply_tensor_parallel(block, tp_mesh, _tp_plan_for_block(block, moe_tp))
    if hasattr(model, "tie_weights"):
        # The embedding and the LM head were distributed separately; both are Shard(0) over
        # the vocabulary, so they can share one DTensor parameter again.
        decoder.tie_weights()


def _fsdp_units(model: nn.Module) -> list[Any]:
    decoder = cast("Decoder", model)
    units: list[Any] = []
    tied = decoder.embeddings_tied
    if decoder.tok_embeddings is not None and not tied:
        units.append(decoder.tok_embeddings)
    units.extend(decoder.layers.values())
    # Tied embeddings stay with the root so that the one shared parameter is in one group.
    head = [m for m in (decoder.norm, None if tied else decoder.output) if m is not None]
    if head:
        units.append(head)
    return units


def parallelize_decoder(model: nn.Module, *, parallel_dims: ParallelDims, options: ParallelizeOptions) -> nn.Module:
    """Apply TP (with SP and loss parallel) -> EP/ETP -> CP -> AC -> compile -> FSDP to a meta-device decoder.

    Under MoE folding (expert parallel or expert tensor parallel) the experts are split over
    ``[ep]``, ``[ep, etp]`` or ``[etp]``, ETP groups pool their tokens, and the experts get
    their own FSDP units over the expert mesh (see ``parallel/expert_parallel.py``).
    ``options.moe_router_dtype = "float32"`` runs every router gate in float32 (under FSDP in
    its own unit whose parameters stay float32).
    """
    # Collected before AC wraps the blocks; the wrappers keep these module objects.
    decoder = cast("Decoder", model)
    moes = [block.moe for block in _blocks(model) if block.moe_enabled]
    experts = [m.experts for m in moes]
    folding = parallel_dims.moe_folding_enabled
    if folding:
        check_expert_parallel(
            experts[0].num_experts if experts else 0,
            len(experts),
            parallel_dims.ep,
            type(model).__name__,
            etp=parallel_dims.etp,
            moe_hidden_dim=getattr(model.args, "moe_hidden_dim", 0),
        )
    router_dtype = options.router_dtype
    for m in moes:
        m.router.gate_dtype = router_dtype
    if parallel_dims.tp_enabled:
        apply_tp(
            model,
            parallel_dims.get_mesh("tp"),
            loss_parallel=parallel_dims.loss_parallel_enabled,
            moe_tp="local" if folding else "etp",
        )
    if folding:
        apply_moe_folding(moes, parallel_dims)
    if parallel_dims.cp_enabled:
        check_heads_divisible(decoder.args.n_heads, parallel_dims.tp, parallel_dims.cp, type(model).__name__)
        apply_cp(decoder.layers, parallel_dims.get_mesh("cp"), core="attention.core")
    if options.ac_enabled:
        apply_ac(
            decoder.layers,
            options.ac_mode,
            options.selective_ac_option,
            options.ac_memory_budget,
            compile_enabled=options.enable_compile,
            preserve_rng_state=options.deterministic,
            debug=options.ac_debug,
        )
    if options.enable_compile:
        # Under MoE folding the dispatch/pooling hooks break the block graph (data-dependent
        # all-to-alls), and MoE router bookkeeping runs eagerly too.
        apply_compile(decoder.layers, fullgraph=not moes)
    fsdp: dict[str, Any] = dict(
        reduce_dtype=options.reduce_dtype,
        pp_enabled=parallel_dims.pp_enabled,
        cpu_offload=options.cpu_offload,
        reshard_after_forward_policy=options.reshard_after_forward_policy,
    )
    if folding:
        # Experts first, on their own mesh, so that the block units below leave them out.
        apply_expert_fsdp(
            experts,
            expert_fsdp_mesh(parallel_dims),
            parallel_dims.fsdp_gradient_divide_factor,
            param_dtype=options.param_dtype,
            **fsdp,
        )
    if parallel_dims.fsdp_enabled:
        mesh = (
            parallel_dims.get_mesh("hsdp")
            if parallel_dims.dp_replicate_enabled
            else parallel_dims.get_mesh("dp_shard_cp")
        )
        if router_dtype is not None and to_dtype(options.param_dtype) != router_dtype:
            # Gates get their own units so that FSDP gathers them in float32, not in `param_dtype`.
            apply_fsdp(model, mesh, [m.router.gate for m in moes], param_dtype=router_dtype, shard_root=False, **fsdp)
        apply_fsdp(model, mesh, _fsdp_units(model), param_dtype=options.param_dtype, **fsdp)
    return model
