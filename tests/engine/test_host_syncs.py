"""One host read per training step: what a GPU run would wait for, counted on CPU.

On a GPU every ``.item()``, ``float()``, ``bool()`` or ``.tolist()`` of a device tensor makes the
host wait until the GPU has caught up.  On CPU nothing waits, so a ``TorchFunctionMode`` marks
the values that live on the device in a GPU run (the parameters, the microbatch rows the engine
moves there, and everything computed from them: outputs, losses, stats, gradients, their norm)
and counts the reads of marked values.  The host batch, its plan, packing and loss weights are
not marked: they stay on the host.  The losses and gradient norm of the counted runs are
checked against transformers' model on the same weights and batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from engine_utils import engine_config, make_batch, sft_loss, sft_weight
from hf_fixtures import save_tiny_hf
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

READS = {
    torch.Tensor.item,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
}
"""Tensor methods that bring a value to the host (on a GPU: wait for it)."""


class _Propagate(TorchDispatchMode):
    """Marks every aten op's outputs when one of its inputs is marked (inside autograd Functions,
    collectives and backward too, which a function mode does not see)."""

    def __init__(self, marked: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.marked = marked

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and id(t) in self.marked for t in tree_leaves((args, kwargs))):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.marked[id(t)] = t
        return out


class DeviceReads(TorchFunctionMode):
    """Marks device values (see the module docstring) and records each host read of one."""

    def __init__(self) -> None:
        super().__init__()
        self.marked: dict[int, torch.Tensor] = {}  # strong references: an id is never reused while counted
        self.reads: list[str] = []
        self.propagate = _Propagate(self.marked)

    def mark(self, tensors: Any) -> None:
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self.marked[id(t)] = t
                if isinstance(t, DTensor):
                    self.marked[id(t._local_tensor)] = t._local_tensor

    def is_marked(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        return id(t) in self.marked or (isinstance(t, DTensor) and id(t._local_tensor) in self.marked)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(self.is_marked(t) for t in tree_leaves((args, kwargs))):
            if func in READS:
                self.reads.append(func.__name__)
            self.mark(out)
        return out

    def __enter__(self):
        super().__enter__()
        self.propagate.__enter__()
        return self

    def __exit__(self, *exc):
        self.propagate.__exit__(*exc)
        return super().__exit__(*exc)


def _counted_step(path: str, backend: str, kw: dict):
    import torch.distributed as dist

    import archon.engine.microbatch_loop as engine_module
    from archon.engine import build_engine

    engine = build_engine(engine_config(path, backend, **kw), total_steps=2).initialize()
    assert engine.model is not None
    engine.train_batch(make_batch(0), sft_loss, sft_weight)  # warm-up (lazy initialisation, AdamW state)
    counter = DeviceReads()
    counter.mark(list(engine.model.parameters()) + list(engine.model.buffers()))
    real_to_device = engine_module.to_device

    def to_device(value, device):
        moved = real_to_device(value, device)
        if isinstance(moved, dict):  # a microbatch's rows for the loss: a copy on the device
            moved = {k: v.clone() for k, v in moved.items()}
            counter.mark(moved)
        return moved

    engine_module.to_device = to_device
    try:
        with counter:
            stats = engine.train_batch(make_batch(1), sft_loss, sft_weight)
    finally:
        engine_module.to_device = real_to_device
    return counter.reads, stats, dist.get_rank()


def _reference_step(path: str) -> tuple[float, float]:
    """Loss and gradient norm of the second step's batch, from transformers, after one AdamW step like the engine's."""
    from transformers import AutoModelForCausalLM

    from archon.engine import build_engine

    # The engine's first step changes the weights; take them from an engine, then compute with transformers.
    engine = build_engine(engine_config(path, "archon:d1"), total_steps=2).initialize()
    engine.train_batch(make_batch(0), sft_loss, sft_weight)
    folder = f"{path}/after_one_step"
    engine.export_hf(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    batch = make_batch(1)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["loss_mask"][:, 1:]
    loss = -(logp * mask).sum() / mask.sum()
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return float(loss), float(norm)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("qwen3")
    save_tiny_hf(folder, "qwen3", seed=3)
    return str(folder)


@pytest.fixture(scope="module")
def reference(tiny) -> tuple[float, float]:
    return run_distributed(_reference_step, 1, tiny)[0]


@pytest.mark.parametrize(
    ("backend", "world", "kw"),
    [
        ("archon:d1", 1, {"mb_spec": {"n_mbs": 3}}),
        ("archon:d2", 2, {"mb_spec": {"n_mbs": 2}}),
        ("archon:p2", 2, {"mb_spec": {"n_mbs": 2}, "archon": {"pp_schedule": "1F1B"}}),
    ],
)
def test_one_host_read_per_training_step(tiny, reference, backend, world, kw):
    ref_loss, ref_norm = reference
    for reads, stats, rank in run_distributed(_counted_step, world, tiny, backend, kw):
        assert reads == ["tolist"], (backend, rank, reads)
        assert stats["loss"] == pytest.approx(ref_loss, abs=1e-5), (backend, rank)
        assert stats["grad_norm"] == pytest.approx(ref_norm, rel=1e-4), (backend, rank)


def _reference_logprobs(path: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = make_batch(1)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return float((logp * batch["attention_mask"][:, 1:]).sum())


@pytest.mark.parametrize(("backend", "world"), [("archon:d1", 1), ("archon:d2", 2)])
def test_one_host_read_per_forward(tiny, backend, world):
    # A fresh engine's first forward: the weights are the folder's, as transformers loads them.
    ref = _reference_logprobs(tiny)
    kw = {"mb_spec": {"n_mbs": 3}}
    for reads, stats, rank in run_distributed(_counted_forward, world, tiny, backend, kw):
        assert reads == ["cpu"], (backend, rank, reads)
        assert stats["logprobs_sum"] == pytest.approx(ref, rel=1e-5)


def _counted_forward(path: str, backend: str, kw: dict):
    import torch.distributed as dist

    from archon.engine import build_engine

    engine = build_engine(engine_config(path, backend, **kw), total_steps=1).initialize()
    assert engine.model is not None
    counter = DeviceReads()
    counter.mark(list(engine.model.parameters()) + list(engine.model.buffers()))
    with counter:
        logprobs = engine.forward(make_batch(1))["logprobs"]
    return counter.reads, {"logprobs_sum": float(logprobs.sum())}, dist.get_rank()
