"""Expert parallel (EP) for grouped experts, with expert tensor parallel (ETP) and MoE parallel folding.

A grouped-experts module (``w1, w3: [E, hidden, dim]``, ``w2: [E, dim, hidden]``,
``forward(x_sorted, num_tokens_per_expert)``) is split over the ``ep`` ranks on the expert
dim: each rank holds ``E / ep`` consecutive experts.  Around its forward:

* dispatch: the ranks exchange per-expert token counts, then each rank sends every token
  copy (already sorted by global expert id) to the rank owning its expert with one
  ``all_to_all_single`` with split sizes; received copies, grouped by source rank, are
  regrouped by local expert (and, on CUDA, each expert's group is padded with zero rows
  to the grouped-GEMM alignment);
* the local experts run on the regrouped tokens; every local expert runs, even on zero
  tokens, so that each rank produces a (zero) gradient for each of its weights and the
  FSDP collectives of all ranks line up;
* combine: the outputs are put back in arrival order and sent home with the inverse
  all-to-all, so the caller sees its own copies in its own order.

Both all-to-alls are differentiable (the backward is the reverse all-to-all).

Expert tensor parallel (ETP): with ``etp > 1`` every expert's hidden dim is split over the
``etp`` ranks of an ETP group (``w1, w3`` on dim 1, ``w2`` on dim 2).  Those ranks must see the
same tokens, and in general they own different ones (their own data, context chunk or
sequence-parallel shard), so ``ExpertTensorParallelTokens`` wraps the whole MoE module: it
gathers the tokens of the ETP group (with their mask and replayed choices) before routing,
and after the experts returns to each rank the sum over the group of the partial outputs of
its own tokens.  The backward of the gather sums every rank's (partial) gradient of the
tokens, so routers and experts compute on local tensors and need no partial markers.  Any
``etp`` works that way: the TP group (the tokens are its sequence shards), part of it, or
ranks of different data-parallel groups.  Experts then live on the 2-D mesh ``[ep, etp]``
(``Shard(0)`` over ``ep``, the hidden dim over ``etp``), or on ``[etp]`` alone without EP.

MoE parallel folding (see ``parallel/dims.py``): the expert weights get their own FSDP
mesh, ``efsdp`` (the ranks left after EP took its share; ``[dp_replicate, efsdp]`` for
HSDP), while the rest of the model is sharded over ``dp_shard_cp``.  Both gradient groups
are divided by the same factor, the number of ranks whose losses sum to the global loss,
so expert and dense gradients equal the single-device ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast, overload

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from parallel.dims import ParallelDims
from parallel.errors import ParallelConfigError
from parallel.fsdp import fsdp_policies, reshard_after_forward

GROUPED_MM_ALIGNMENT = 8
"""Rows each expert group is padded to a multiple of on CUDA, for bf16 ``torch._grouped_mm`` (16-byte offsets)."""

_HIDDEN_DIM = {"w1": 1, "w3": 1, "w2": 2}


@dataclass
class _Routing:
    """How one forward's token copies were moved; kept from dispatch until combine."""

    input_splits: list[int]
    """Copies this rank sent to each EP rank."""
    output_splits: list[int]
    """Copies this rank received from each EP rank."""
    arrival_to_local: torch.Tensor
    """``[received]``: the row of each received copy in the local-expert order."""


def check_expert_parallel(
    num_experts: int, n_moe_layers: int, ep: int, model_name: str, etp: int = 1, moe_hidden_dim: int = 0
) -> None:
    """Raise a one-sentence error when ``ep`` (experts) or ``etp`` (their hidden dim) cannot split this model."""
    if n_moe_layers == 0:
        what = f"expert parallel e{ep}" if ep > 1 else f"expert tensor parallel (ffn t{etp})"
        raise ParallelConfigError(
            f"{model_name} has no MoE layers, so {what} has nothing to split; "
            "drop 'e' and the ffn section from the allocation"
        )
    if num_experts % ep:
        raise ParallelConfigError(
            f"{model_name}: num_experts={num_experts} is not divisible by the expert-parallel size "
            f"e{ep}; choose e from the divisors of {num_experts}"
        )
    if moe_hidden_dim % etp:
        raise ParallelConfigError(
            f"{model_name}: moe_intermediate_size={moe_hidden_dim} is not divisible by the expert "
            f"tensor-parallel size (ffn t{etp}); choose the ffn t from the divisors of {moe_hidden_dim}"
        )


def moe_token_replication(parallel_dims: ParallelDims) -> int:
    """How many ranks route the same tokens (so router statistics summed over all ranks count each token that often).

    Tokens are replicated over the ranks that split experts on the hidden dim: the ETP
    group under MoE folding, the TP group when experts simply follow attention's TP.
    """
    if parallel_dims.moe_folding_enabled:
        return parallel_dims.etp
    return parallel_dims.tp


def expert_parallel_mesh(parallel_dims: ParallelDims) -> DeviceMesh:
    """The mesh experts are split over: ``[ep]``, ``[ep, etp]``, or ``[etp]`` (hidden dim only)."""
    if parallel_dims.ep_enabled and parallel_dims.etp_enabled:
        sparse = parallel_dims.sparse_mesh
        assert sparse is not None, "ep and etp over 1 make MoE folding, which builds the sparse mesh"
        return sparse["ep", "etp"]
    if parallel_dims.ep_enabled:
        return parallel_dims.get_mesh("ep")
    return parallel_dims.get_mesh("etp")


def expert_fsdp_mesh(parallel_dims: ParallelDims) -> DeviceMesh:
    """The FSDP mesh of expert weights: ``[efsdp]`` or, for HSDP, ``[dp_replicate, efsdp]``.

    Kept even when its size is 1: an FSDP unit over one rank still divides the expert
    gradients by the right factor and keeps the experts out of the dense FSDP units.
    """
    sparse = parallel_dims.sparse_mesh
    assert sparse is not None, "expert FSDP runs under MoE folding, which builds the sparse mesh"
    return sparse["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else sparse["efsdp"]


def local_expert_order(received: torch.Tensor, alignment: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Regroup copies that arrived grouped by source rank so that they are grouped by local expert.

    ``received[s, l]`` is how many copies source rank ``s`` sent for local expert ``l``; in
    the receive buffer they lie in row-major ``(s, l)`` order.  Returns
    ``(gather, arrival_to_local, counts)``: ``local = cat(buffer, zero_row)[gather]`` is
    grouped by expert (source order kept inside each group, each group padded with the
    zero row to a multiple of ``alignment``, and to at least ``alignment`` rows when
    ``alignment > 1``), ``buffer = local[arrival_to_local]`` undoes it, and ``counts[l]``
    is the (padded) size of group ``l``.
    """
    received = received.to("cpu", torch.int64)
    ep, n_local = received.shape
    n = int(received.sum())
    per_expert = received.sum(0)
    if alignment > 1:
        counts = torch.clamp_min((per_expert + alignment - 1) // alignment * alignment, alignment)
    else:
        counts = per_expert
    group_start = torch.cumsum(counts, 0) - counts
    # Chunk (s, l) starts after the chunks of earlier sources inside expert l's group.
    dst_start = group_start[None, :] + torch.cumsum(received, 0) - received
    sizes = received.reshape(-1)
    src_start = torch.cumsum(sizes, 0) - sizes
    chunk = torch.repeat_interleave(torch.arange(ep * n_local), sizes)
    arrival_to_local = dst_start.reshape(-1)[chunk] + torch.arange(n) - src_start[chunk]
    gather = torch.full((int(counts.sum()),), n, dtype=torch.int64)
    gather[arrival_to_local] = torch.arange(n)
    return gather, arrival_to_local, counts


class ExpertParallel(ParallelStyle):
    """Split grouped experts over EP (and over ETP on the hidden dim) and move tokens to their owners.

    Apply to a 1-D ``[ep]`` mesh or a 2-D ``[ep, etp]`` mesh; under ETP the caller brings
    the ETP group's tokens (``ExpertTensorParallelTokens``) and sums the partial outputs.  ``token_group_alignment``
    pads each local expert's token group to a multiple of it; None chooses
    ``GROUPED_MM_ALIGNMENT`` for CUDA tokens (the grouped GEMM) and 1 elsewhere (the loop).
    """

    def __init__(self, token_group_alignment: int | None = None) -> None:
        super().__init__()
        self.token_group_alignment = token_group_alignment
        self._routing: _Routing | None = None
        # (ep mesh, etp mesh or None), split once when the style is applied.
        self._meshes: tuple[DeviceMesh, DeviceMesh | None] | None = None

    def _alignment(self, x: torch.Tensor) -> int:
        if self.token_group_alignment is not None:
            return self.token_group_alignment
        return GROUPED_MM_ALIGNMENT if x.is_cuda else 1

    @staticmethod
    def _split_meshes(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh | None]:
        if mesh.ndim == 1:
            return mesh, None
        if mesh.ndim == 2:
            names = mesh.mesh_dim_names
            assert names is not None, "the [ep, etp] mesh is a named slice of the sparse mesh"
            return mesh[names[0]], mesh[names[1]]
        raise ValueError(
            f"expert parallel needs a 1-D [ep] or 2-D [ep, etp] mesh, got {mesh.ndim} dims {mesh.mesh_dim_names}"
        )

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            placements = [Shard(0)]
            if mesh.ndim == 2:
                placements.append(Shard(_HIDDEN_DIM[pname]) if pname in _HIDDEN_DIM else Replicate())
            module.register_parameter(
                pname, nn.Parameter(distribute_tensor(param, mesh, placements), requires_grad=param.requires_grad)
            )

    # Under torch.compile the hooks run eagerly (one graph break each): their all-to-alls
    # have data-dependent split sizes that a graph cannot hold.
    @torch.compiler.disable
    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x, num_tokens_per_expert = inputs[0], inputs[1]
        assert self._meshes is not None, "dispatch before the style was applied"
        ep_mesh, _ = self._meshes
        group = ep_mesh.get_group()
        ep = ep_mesh.size()
        counts = num_tokens_per_expert.to(torch.int64)
        with torch.no_grad():
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=group)
        received = received.view(ep, -1).cpu()
        input_splits = counts.view(ep, -1).sum(1).tolist()
        output_splits = received.sum(1).tolist()
        arrived = all_to_all_single_autograd(x, output_splits, input_splits, group)
        gather, arrival_to_local, local_counts = local_expert_order(received, self._alignment(x))
        self._routing = _Routing(input_splits, output_splits, arrival_to_local.to(x.device))
        if gather.numel() > arrived.shape[0]:  # padding rows read an appended zero row
            arrived = torch.cat([arrived, arrived.new_zeros(1, arrived.shape[1])])
        local = arrived[gather.to(x.device)]
        return (local, local_counts.to(num_tokens_per_expert.device), *inputs[2:])

    @torch.compiler.disable
    def _combine(self, module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        routing = self._routing
        assert routing is not None, "combine without a dispatch"
        self._routing = None
        assert self._meshes is not None, "combine before the style was applied"
        ep_mesh, _ = self._meshes
        arrived = output[routing.arrival_to_local]
        return all_to_all_single_autograd(arrived, routing.input_splits, routing.output_splits, ep_mesh.get_group())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._meshes = self._split_meshes(device_mesh)
        # (torch.compiler.disable is untyped: pyright loses the decorated hooks)
        dispatch, combine = self._dispatch, self._combine  # pyright: ignore[reportAttributeAccessIssue]
        return distribute_module(module, device_mesh, self._partition, input_fn=dispatch, output_fn=combine)


def _exchange(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any, autograd: bool
) -> torch.Tensor:
    """``all_to_all_single`` of rows (the backward is the reverse exchange when ``autograd``)."""
    if autograd:
        return all_to_all_single_autograd(x, output_splits, input_splits, group)
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class ExpertTensorParallelTokens(ParallelStyle):
    """Pool the tokens of each ETP group around a MoE module (``forward(x, token_mask, replay)``).

    Before the forward, every rank of the ``[etp]`` mesh gets the rows of all of them (its own
    first in group order, uneven counts allowed) for ``x [1, n, dim]``, ``token_mask [1, n]``
    and ``replay [1, n, k]``; after it, each rank gets back, for its own rows, the sum over the
    group of the (partial) outputs.  Gathering is an all-to-all of the rows repeated ``etp``
    times, so its backward sums the group's gradients of each rank's tokens; returning is the
    reverse all-to-all, whose backward hands every rank the full gradient of the pooled rows.
    """

    def __init__(self) -> None:
        super().__init__()
        self._sizes: list[int] | None = None

    @overload
    @staticmethod
    def _pool(t: torch.Tensor, sizes: list[int], group: Any, autograd: bool) -> torch.Tensor: ...
    @overload
    @staticmethod
    def _pool(t: torch.Tensor | None, sizes: list[int], group: Any, autograd: bool) -> torch.Tensor | None: ...
    @staticmethod
    def _pool(t: torch.Tensor | None, sizes: list[int], group: Any, autograd: bool) -> torch.Tensor | None:
        if t is None:
            return None
        rows = t.reshape(t.shape[1], *t.shape[2:])  # [1, n, ...] -> [n, ...]
        etp = len(sizes)
        send = rows.repeat(etp, *([1] * (rows.dim() - 1)))
        pooled = _exchange(send, sizes, [rows.shape[0]] * etp, group, autograd)
        return pooled.unsqueeze(0)

    @torch.compiler.disable
    def _gather(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x, rest = inputs[0], list(inputs[1:])
        if x.shape[0] != 1:
            raise ValueError(
                f"expert tensor parallel pools packed rows, so the batch must be one row, got {x.shape[0]}"
            )
        group = mesh.get_group()
        n = torch.tensor([x.shape[1]], dtype=torch.int64, device=x.device)
        sizes = [torch.empty_like(n) for _ in range(mesh.size())]
        dist.all_gather(sizes, n, group=group)
        self._sizes = [int(t) for t in sizes]
        pooled = [self._pool(x, self._sizes, group, autograd=True)]
        for extra in rest:
            if isinstance(extra, torch.Tensor) and extra.dtype == torch.bool:
                extra = self._pool(extra.to(torch.uint8), self._sizes, group, autograd=False).bool()
            elif isinstance(extra, torch.Tensor):
                extra = self._pool(extra, self._sizes, group, autograd=False)
            pooled.append(extra)
        return tuple(pooled)

    @torch.compiler.disable
    def _return(self, module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        sizes, self._sizes = self._sizes, None
        assert sizes is not None, "ETP output without a gather"
        mine = sizes[mesh.get_local_rank()]
        rows = output.reshape(-1, output.shape[-1])
        parts = _exchange(rows, [mine] * len(sizes), sizes, mesh.get_group(), autograd=True)
        return parts.view(len(sizes), mine, -1).sum(0).unsqueeze(0)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Hooks only (distribute_module would replicate every parameter over the mesh): the
        # router and the experts have their own layouts.
        # (torch.compiler.disable is untyped: pyright loses the decorated hooks)
        gather, ret = self._gather, self._return  # pyright: ignore[reportAttributeAccessIssue]
        module.register_forward_pre_hook(lambda mod, inputs: gather(mod, inputs, device_mesh))
        module.register_forward_hook(lambda mod, inputs, output: ret(mod, output, device_mesh))
        return module


class ExpertHiddenParallel(ParallelStyle):
    """Split grouped experts over an ``[etp]`` mesh on the hidden dim only (no expert parallel).

    Tokens come pooled by ``ExpertTensorParallelTokens``; each rank's output is a partial sum
    that the pooling style adds up.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                placement = Shard(_HIDDEN_DIM[pname]) if pname in _HIDDEN_DIM else Replicate()
                mod.register_parameter(
                    pname, nn.Parameter(distribute_tensor(param, mesh, [placement]), requires_grad=param.requires_grad)
                )

        return distribute_module(module, device_mesh, partition)


def apply_ep(experts: Iterable[nn.Module], mesh: DeviceMesh, token_group_alignment: int | None = None) -> None:
    """Make every grouped-experts module expert-parallel over ``mesh`` (``[ep]`` or ``[ep, etp]``), in place.

    Each module gets its own style instance: the routing of one forward is kept between
    its dispatch and combine hooks.
    """
    for module in experts:
        ExpertParallel(token_group_alignment)._apply(module, mesh)


def apply_moe_folding(
    moes: Iterable[nn.Module], parallel_dims: ParallelDims, token_group_alignment: int | None = None
) -> None:
    """Lay MoE modules (``router``, ``experts``) on the sparse mesh: ETP token pooling, then EP and/or ETP experts."""
    moes = list(moes)
    mesh = expert_parallel_mesh(parallel_dims)
    if parallel_dims.ep_enabled:
        apply_ep([cast(nn.Module, m.experts) for m in moes], mesh, token_group_alignment)
    else:
        for m in moes:
            ExpertHiddenParallel()._apply(cast(nn.Module, m.experts), mesh)
    if parallel_dims.etp_enabled:
        etp_mesh = parallel_dims.get_mesh("etp")
        for m in moes:
            ExpertTensorParallelTokens()._apply(m, etp_mesh)


def apply_expert_fsdp(
    experts: Iterable[nn.Module],
    mesh: DeviceMesh,
    gradient_divide_factor: float,
    *,
    param_dtype: str | torch.dtype = torch.float32,
    reduce_dtype: str | torch.dtype = torch.float32,
    pp_enabled: bool = False,
    cpu_offload: bool = False,
    reshard_after_forward_policy: str = "default",
) -> None:
    """One FSDP unit per expert module over the expert FSDP mesh (before the dense units are made).

    ``gradient_divide_factor`` replaces FSDP's default (the mesh size): expert gradients
    must be divided by the number of ranks whose losses sum to the global loss, the same
    factor as the dense gradients, not by the (smaller) number of ranks sharing an expert.
    The other options mean what they mean for ``apply_fsdp``.
    """
    mp, offload = fsdp_policies(param_dtype, reduce_dtype, cpu_offload)
    reshard = reshard_after_forward(reshard_after_forward_policy, pp_enabled)
    for module in experts:
        sharded = fully_shard(module, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
        sharded.set_gradient_divide_factor(float(gradient_divide_factor))
        if mesh.device_type == "cpu" and mesh.size(-1) > 1:
            # A divide factor other than the mesh size becomes NCCL's PREMUL_SUM, which gloo
            # lacks; summing and dividing afterwards gives the same gradients.  (Not over one
            # rank: FSDP's copy path already divides there, and would divide twice.)
            sharded.set_force_sum_reduction_for_comms(True)
