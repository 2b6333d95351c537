"""Running one step of a pipeline: forward+backward over all microbatches, or forward only.

A microbatch is ``(inputs, kwargs)``: ``inputs`` feeds the first stage (token ids), every
later stage receives the previous stage's hidden states instead, and ``kwargs`` (positions,
sequence boundaries) go to every stage.  All microbatches of a step must have one shape.

Stage-boundary tensors are described statically, so torch never runs a probing forward to
learn them: a hidden state of a length-``T`` microbatch is ``[1, T / seq_shards, dim]`` in the
activation dtype (``seq_shards`` = tensor parallel under sequence parallel).  The shape
changes from step to step, so stages and schedule are rebuilt per step; both are cheap
Python objects, the stage modules themselves are reused.

Training runs the torch schedule; the last stage calls ``loss_fn(output, microbatch_index)``
for each microbatch and backpropagates the scalar it returns.  Forward-only passes need no
schedule: every rank walks one global order of stage-to-stage transfers (``pipeline.p2p``,
the order NCCL needs) and computes each stage as soon as its input is there, which works for
loop and V placement alike (torch's ``eval()`` of V schedules asks stages for backward outputs
that a forward-only pass never makes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from pipeline.p2p import GroupTransport, P2PTransport, Waitable, forward_p2p_ops
from pipeline.placement import PlacementStyle, rank_of_stage
from pipeline.schedules import build_schedule

Microbatch = tuple[torch.Tensor, dict[str, torch.Tensor]]
LossFn = Callable[[torch.Tensor, int], torch.Tensor]
OutputFn = Callable[[torch.Tensor, int], None]


@dataclass(frozen=True)
class StageBoundary:
    """The hidden state that travels from one stage to the next."""

    hidden_dim: int
    """Model width (last dim of the hidden state)."""
    dtype: torch.dtype
    """Activation dtype (FSDP's compute dtype, or the parameters' dtype without FSDP)."""
    seq_shards: int = 1
    """Ranks the sequence is split over at stage boundaries (tp under sequence parallel)."""

    def shape(self, seq_len: int) -> tuple[int, int, int]:
        if seq_len % self.seq_shards:
            raise ValueError(
                f"a microbatch of {seq_len} tokens cannot be split over {self.seq_shards} sequence "
                "shards; pad it to a multiple"
            )
        return (1, seq_len // self.seq_shards, self.hidden_dim)


class PipelineRunner:
    """Drives this rank's stage modules through one pipeline step at a time."""

    def __init__(
        self,
        parts: list[nn.Module],
        stage_ids: list[int],
        n_stages: int,
        schedule_name: str,
        style: PlacementStyle,
        pp_group: dist.ProcessGroup,
        device: torch.device,
        boundary: StageBoundary,
        transport: P2PTransport | None = None,
    ) -> None:
        if len(parts) != len(stage_ids) or list(stage_ids) != sorted(stage_ids):
            raise ValueError(f"parts and stage ids must pair up in increasing stage order, got ids {stage_ids}")
        self.parts = parts
        self.stage_ids = list(stage_ids)
        self.n_stages = n_stages
        self.schedule_name = schedule_name
        self.style: PlacementStyle = style
        self.pp_group = pp_group
        self.pp_size = dist.get_world_size(pp_group)
        self.pp_rank = dist.get_rank(pp_group)
        self.transport: P2PTransport = transport if transport is not None else GroupTransport(pp_group)
        """Carries the forward-only pass's hidden states (the torch schedules of training send their own)."""
        self.device = device
        self.boundary = boundary
        self._expected: tuple[tuple[int, ...], torch.dtype] | None = None
        for part, sid in zip(parts, stage_ids):
            if sid != n_stages - 1:
                part.register_forward_hook(self._hook_checking_boundary(sid))

    def global_rank_of_stage(self, stage: int) -> int:
        """Global rank of the member of this rank's pipeline group that runs ``stage``."""
        return dist.get_global_rank(self.pp_group, rank_of_stage(stage, self.pp_size, self.n_stages, self.style))

    def _hook_checking_boundary(self, stage_id: int) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        # A wrong static description would make the next stage receive garbage, not fail.
        def check(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self._expected is None:
                return
            shape, dtype = self._expected
            if (
                isinstance(output, DTensor)
                or not isinstance(output, torch.Tensor)
                or tuple(output.shape) != shape
                or output.dtype != dtype
            ):
                got = f"{type(output).__name__} {tuple(getattr(output, 'shape', ()))} {getattr(output, 'dtype', '')}"
                raise RuntimeError(
                    f"pipeline stage {stage_id} produced a {got} hidden state, but stage "
                    f"{stage_id + 1} expects a plain tensor {shape} {dtype}; the stage boundary "
                    "description (pipeline.runner.StageBoundary) does not match the model"
                )

        return check

    def _check_microbatches(self, microbatches: list[Microbatch]) -> int:
        if not microbatches:
            raise ValueError("a pipeline step needs at least one microbatch")
        first_inputs, first_kwargs = microbatches[0]
        for i, (inputs, kwargs) in enumerate(microbatches):
            shapes = [tuple(inputs.shape)] + [tuple(kwargs[k].shape) for k in sorted(kwargs)]
            ref = [tuple(first_inputs.shape)] + [tuple(first_kwargs[k].shape) for k in sorted(first_kwargs)]
            if sorted(kwargs) != sorted(first_kwargs) or shapes != ref:
                raise ValueError(
                    f"pipeline microbatch {i} has shapes {shapes} but microbatch 0 has {ref}; "
                    "every microbatch of a step must be padded to one shape"
                )
        return first_inputs.shape[1]

    # ------------------------------------------------------------------ train
    def _build_stages(self, inputs: torch.Tensor, seq_len: int) -> list[PipelineStage]:
        hidden = torch.empty(self.boundary.shape(seq_len), dtype=self.boundary.dtype, device="meta", requires_grad=True)
        first_input = torch.empty(inputs.shape, dtype=inputs.dtype, device="meta")
        # The last stage's output never leaves the rank (the loss consumes it); only its count matters.
        last_output = torch.empty((), device="meta")
        stages = []
        for part, sid in zip(self.parts, self.stage_ids):
            stages.append(
                PipelineStage(
                    part,
                    sid,
                    self.n_stages,
                    self.device,
                    input_args=(first_input if sid == 0 else hidden,),
                    output_args=(last_output if sid == self.n_stages - 1 else hidden,),
                    group=self.pp_group,
                )
            )
        return stages

    def train_step(self, microbatches: list[Microbatch], loss_fn: LossFn) -> None:
        """Forward and backward of every microbatch; gradients accumulate in the stage modules.

        ``loss_fn(output, i)`` runs on the last stage for microbatch ``i`` and returns the scalar
        to backpropagate (already weighted: the schedule does not rescale gradients).
        """
        seq_len = self._check_microbatches(microbatches)
        self._expected = (self.boundary.shape(seq_len), self.boundary.dtype)
        stages = self._build_stages(microbatches[0][0], seq_len)
        schedule = build_schedule(
            self.schedule_name, stages, len(microbatches), loss_fn=lambda output, target: loss_fn(output, int(target))
        )
        inputs = torch.cat([mb[0] for mb in microbatches])
        kwargs = {k: torch.cat([mb[1][k] for mb in microbatches]) for k in microbatches[0][1]}
        # Microbatch indices ride along as the "target" so the loss knows which microbatch it sees.
        targets = torch.arange(len(microbatches))
        schedule.step(inputs, target=targets, return_outputs=False, **kwargs)

    # ------------------------------------------------------------------ forward only
    def forward_step(self, microbatches: list[Microbatch], output_fn: OutputFn) -> None:
        """Forward of every microbatch (call under ``torch.no_grad``); the last stage calls ``output_fn(output, i)``.

        Sends and receives follow the one global order of ``pipeline.p2p`` (NCCL deadlocks
        otherwise).  A received hidden state runs through this rank's stages at once, as far as
        they go without another rank; stage 0's work waits until its output is due to be sent,
        so the next rank starts on the first microbatch while this one computes the second.
        """
        seq_len = self._check_microbatches(microbatches)
        shape, dtype = self.boundary.shape(seq_len), self.boundary.dtype
        self._expected = (shape, dtype)
        local = {sid: part for sid, part in zip(self.stage_ids, self.parts)}
        outgoing: dict[tuple[int, int], torch.Tensor] = {}  # (stage, microbatch) -> output due to be sent
        started: set[int] = set()  # microbatches whose stage-0 chain ran here

        def run_from(sid: int, i: int, x: torch.Tensor) -> None:
            # Local stages from ``sid`` on, until the last stage or a stage held by another rank.
            kwargs = microbatches[i][1]
            while True:
                out = local[sid](x, **kwargs)
                if sid == self.n_stages - 1:
                    output_fn(out, i)
                    return
                if sid + 1 not in local:
                    outgoing[(sid, i)] = out.contiguous()
                    return
                sid, x = sid + 1, out

        def start(i: int) -> None:
            started.add(i)
            run_from(0, i, microbatches[i][0])

        ops = forward_p2p_ops(self.pp_rank, self.pp_size, self.n_stages, len(microbatches), self.style)
        sends: list[tuple[Waitable, torch.Tensor]] = []
        try:
            for op in ops:
                key = (op.stage, op.microbatch)
                if op.kind == "send":
                    if key not in outgoing:
                        start(op.microbatch)  # nothing upstream is received: the chain begins at stage 0
                    out = outgoing.pop(key)
                    sends.append((self.transport.isend(out, op.peer), out))
                else:
                    x = torch.empty(shape, dtype=dtype, device=self.device)
                    self.transport.recv(x, op.peer)
                    run_from(op.stage + 1, op.microbatch, x)
            if 0 in local:
                for i in range(len(microbatches)):
                    if i not in started:
                        start(i)  # every stage is on this rank (no transfer ever asked for stage 0's work)
            assert not outgoing, f"stage outputs {sorted(outgoing)} were computed but never sent"
            for work, _ in sends:
                work.wait()
        finally:
            self._reshard()

    def _reshard(self) -> None:
        # Under pipeline parallel FSDP keeps parameters unsharded after forward (the schedule
        # reshards after backward); a forward-only pass has no backward, so free them here.
        for part in self.parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
