"""``Linear``: ``nn.Linear`` whose float32 CPU matmuls run on oneDNN where that is faster.

PyTorch sends float32 CPU matmuls to its BLAS (MKL in the official wheels) and low-precision
ones to oneDNN.  On CPUs where MKL takes a slow code path (measured on one AMD EPYC host: a
2048^3 float32 matmul at ~95 GFLOP/s with MKL, ~200 with oneDNN) the same product through
oneDNN's ``mkldnn::_linear_pointwise`` (the kernel Inductor uses for CPU linears) is about
twice as fast, in training too: the backward's two products are linears as well
(``grad_x = grad_y W`` and ``grad_W = grad_y^T x``; oneDNN copies ``grad_y^T`` to make it
contiguous).  On other hosts of the same family MKL is as fast or faster (measured on another
EPYC: 2048^3 at 143 GFLOP/s with MKL, 129 with oneDNN, and ``grad_W`` 1.6x faster with MKL,
which needs no copy; on a third, forward products equal and ``grad_W`` 1.7x faster with MKL).
So by default the first use times both on a 512^3 linear's forward and backward products (best
of five each, alternating, ~0.1 s) and takes oneDNN only where it is clearly faster (by 1.25x, so
that close timings do not flip the choice from one process to the next: a forward-only probe
did flip on the third host, and its training steps then ran ~10% slower).  The choice is exported as
``$ARCHON_CPU_LINEAR`` (``onednn`` or ``blas``), which the processes started afterwards (rollout
servers, forked ranks, a test session's children) read instead of timing again, so that they
compute alike; setting it beforehand pins the kernel without timing.

Everything else stays on ``F.linear``: other devices and dtypes, autocast (its low-precision
linears already use oneDNN), DTensor parameters (tensor parallel), ``torch.compile``.  The
first use checks the kernel against ``F.linear`` and falls back for good if it is missing or
disagrees.  ``use_onednn(True)`` / ``use_onednn(False)`` force the choice (benchmarks,
debugging, tests of either path); ``use_onednn(None)`` returns to the timed choice.

``PackedLinear`` is for inference: it keeps a copy of the weight in oneDNN's blocked layout
(another ~1.5x on small batches, as in a decode step), re-packed whenever the weight has been
modified in place since (its version counter moved), so weight updates need no extra call.
"""

from __future__ import annotations

import functools
import os
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

_enabled: bool | None = None
"""True / False: oneDNN forced on / off; None: as ``cpu_linear_kernel`` chooses (the default)."""

CPU_LINEAR_ENV = "ARCHON_CPU_LINEAR"
"""Environment variable naming the float32 CPU linear kernel: ``onednn`` or ``blas`` (unset: timed, then set)."""

_KERNELS = ("onednn", "blas")

_PREFERENCE_MARGIN = 1.25
"""How much faster oneDNN must be than the BLAS path to be chosen by timing."""


def use_onednn(enabled: bool | None) -> None:
    """Force the oneDNN float32 CPU path on (where it works) or off; None: on where it is timed faster."""
    global _enabled
    _enabled = enabled


@functools.lru_cache(maxsize=1)
def _onednn_works() -> bool:
    """Whether this build has oneDNN's linear and it agrees with ``F.linear`` (checked as ``_onednn_faster``
    times: unseen by autograd and dispatch modes)."""
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.no_grad(), _disable_current_modes():
            g = torch.Generator().manual_seed(0)
            x, w, b = (torch.randn(*shape, generator=g) for shape in ((5, 3, 16), (24, 16), (24,)))
            got = op(x, w, b, "none", [], "")
            return bool(torch.allclose(got, F.linear(x, w, b), rtol=1e-4, atol=1e-5))
    except Exception:  # an op with another signature, or no kernel in this build
        return False


_probe_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _onednn_faster() -> bool:
    """Whether oneDNN does a float32 512^3 linear's training work (the forward product, ``grad_x`` and ``grad_W``
    with its copy of ``grad_y^T``) at least ``_PREFERENCE_MARGIN`` times faster than torch's BLAS path on this
    host, with the threads torch has now (best of five runs each, the two alternating so that a slow moment of
    the host does not fall on one of them only).

    The first call may come from inside a forward: the probe runs without autograd and outside any dispatch mode
    (selective activation checkpointing records the forward's ops and replays them in the recomputation, which
    does not probe again), and one thread at a time (two probes at once would time each other).
    """
    if not _onednn_works():
        return False
    with _probe_lock, torch.no_grad(), _disable_current_modes():
        g = torch.Generator().manual_seed(0)
        x, w, grad = (torch.randn(512, 512, generator=g) for _ in range(3))

        def onednn() -> None:  # what _OneDNNLinear computes
            _mm(x, w)
            _grad_input(grad, w)
            _grad_weight(grad, x)

        def blas() -> None:
            F.linear(x, w)
            torch.mm(grad, w)
            torch.mm(grad.t(), x)

        best = {onednn: float("inf"), blas: float("inf")}
        for fn in best:  # warm-up: first-call allocations and kernel selection
            fn()
        for _ in range(5):
            for fn in best:
                t0 = time.perf_counter()
                fn()
                best[fn] = min(best[fn], time.perf_counter() - t0)
        return best[onednn] * _PREFERENCE_MARGIN <= best[blas]


@functools.lru_cache(maxsize=1)
def cpu_linear_kernel() -> str:
    """The float32 CPU linear kernel of this process, ``onednn`` or ``blas``: ``$ARCHON_CPU_LINEAR`` where set,
    else the faster by ``_onednn_faster``, exported to ``$ARCHON_CPU_LINEAR`` for the processes started later."""
    kernel = os.environ.get(CPU_LINEAR_ENV, "").strip().lower()
    if kernel and kernel not in _KERNELS:
        raise ValueError(
            f"{CPU_LINEAR_ENV}={os.environ[CPU_LINEAR_ENV]!r} names no CPU linear kernel; set it to 'onednn' or "
            "'blas', or unset it to time both"
        )
    if not kernel:
        kernel = "onednn" if _onednn_faster() else "blas"
        os.environ[CPU_LINEAR_ENV] = kernel
    return kernel


def _onednn_chosen() -> bool:
    return _onednn_works() and (_enabled if _enabled is not None else cpu_linear_kernel() == "onednn")


def _use_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and type(x) is torch.Tensor
        and type(weight) in (torch.Tensor, nn.Parameter)
        and x.numel() > 0
        and weight.numel() > 0  # oneDNN has no empty products (an idle rank's microbatch)
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
        and _onednn_chosen()
    )


def _mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _grad_input(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad_y W`` through oneDNN, with ``W^T`` as the "weight" (a view)."""
    return _mm(grad, weight.t())


def _grad_weight(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``grad_y^T x`` over all leading dimensions through oneDNN (which copies ``grad_y^T`` to make it contiguous)."""
    return _mm(grad.reshape(-1, grad.shape[-1]).t(), x.reshape(-1, x.shape[-1]).t())


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _mm(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _grad_input(grad, weight)
        if ctx.needs_input_grad[1]:
            grad_w = _grad_weight(grad, x)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; float32 on CPU through oneDNN (see the module docstring)."""
    if not _use_onednn(x, weight):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return _OneDNNLinear.apply(x, weight, bias)
    return _mm(x, weight, bias)


def add_linear(
    h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``h + linear(x)`` without autograd (inference): the add fused into the matmul where possible."""
    if bias is None and _use_onednn(x, weight):
        return torch.ops.mkldnn._linear_pointwise.binary(x, h, weight, None, "add")
    if bias is None and h.dtype == torch.float32 and h.dim() == 2:
        return torch.addmm(h, x, weight.t())
    return h + F.linear(x, weight, bias)


class PackedLinear:
    """``linear(x, weight, bias)`` and ``add_linear`` with the weight pre-packed for oneDNN (inference only).

    ``weight`` may be a view of a larger buffer: any in-place change of that storage moves the
    shared version counter and triggers a re-pack on the next call.
    """

    _BATCH_HINT = 16
    """Rows the packing is tuned for (a decode step's batch); any batch works."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self._version = -1
        self._packed: torch.Tensor | None = None

    def __getstate__(self) -> dict:
        # The packed weight is an opaque oneDNN tensor that copy and pickle cannot handle; a copy
        # (``copy.deepcopy`` of a model that has served, say) packs its own on first use.
        return {**self.__dict__, "_version": -1, "_packed": None}

    def reset(self) -> None:
        """Re-pack on the next call: the weight changed in place without moving its version counter (fused
        optimizers, e.g. AdamW(fused=True), write parameters that way)."""
        self._packed = None

    def _weight_for(self, x: torch.Tensor) -> torch.Tensor | None:
        if not _use_onednn(x, self.weight):
            return None
        if self._packed is None or self._version != self.weight._version:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self._BATCH_HINT)
            self._version = self.weight._version
        return self._packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._weight_for(x)
        return F.linear(x, self.weight, self.bias) if packed is None else _mm(x, packed, self.bias)

    def add(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``h + self(x)``, the add fused into the matmul where the kernels allow."""
        packed = self._weight_for(x) if self.bias is None else None
        if packed is None:
            return add_linear(h, x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise.binary(x, h, packed, None, "add")


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, names and parallel plans) computed by ``linear``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)
