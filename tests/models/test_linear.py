"""``models.common.linear``: the oneDNN float32 CPU path computes F.linear's function and gradients, and is
chosen by timing unless forced."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F

from models.common import linear as lin


@pytest.fixture(autouse=True)
def onednn_forced_on():
    """These tests check the oneDNN path itself, whichever path this host's timing would choose."""
    lin.use_onednn(True)
    yield
    lin.use_onednn(None)


@pytest.mark.parametrize("shape", [(7, 16), (2, 5, 16), (1, 0, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear_values_and_gradients(shape, bias):
    g = torch.Generator().manual_seed(0)
    layer = lin.Linear(16, 24, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(24, 16, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(24, generator=g))
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(*shape[:-1], 24, generator=g)
    out = layer(x)
    grads = torch.autograd.grad((out * w).sum(), [x] + list(layer.parameters()))
    x_ref = x.detach().clone().requires_grad_()
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    ref = F.linear(x_ref, *params)
    ref_grads = torch.autograd.grad((ref * w).sum(), [x_ref] + params)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the inference path (no autograd function)
        torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)
        rows = x.reshape(-1, 16)[:7]
        h = torch.randn(len(rows), 24, generator=g)
        torch.testing.assert_close(
            lin.add_linear(h, rows, layer.weight), h + F.linear(rows, layer.weight), rtol=1e-5, atol=1e-5
        )


def test_onednn_is_used_for_float32_cpu_and_not_under_autocast(monkeypatch):
    calls = []
    real = lin._mm
    monkeypatch.setattr(lin, "_mm", lambda *a: calls.append(1) or real(*a))
    layer = lin.Linear(8, 4)
    x = torch.randn(3, 8)
    layer(x)
    assert calls == [1] or not lin._onednn_works()  # oneDNN where this torch build has it
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16  # autocast's own low-precision linear
    lin.use_onednn(False)
    layer(x)
    assert calls == []


@pytest.mark.parametrize("slow", ["onednn", "blas", "blas-backward"])
def test_the_default_choice_takes_the_faster_kernel(monkeypatch, slow):
    """The probe times a linear's training work, backward products included: BLAS slow only there (as where
    oneDNN's copy of ``grad_y^T`` is cheap next to MKL's slow path) still makes oneDNN the faster."""
    if not lin._onednn_works():
        pytest.skip("this torch build has no oneDNN linear")

    def slowed(fn):
        def run(*args):
            time.sleep(0.02)  # far beyond either kernel's time on a 512^3 product
            return fn(*args)

        return run

    if slow == "onednn":
        monkeypatch.setattr(lin, "_mm", slowed(lin._mm))
    elif slow == "blas":
        monkeypatch.setattr(lin.F, "linear", slowed(F.linear))
    else:
        monkeypatch.setattr(lin.torch, "mm", slowed(torch.mm))
    lin.use_onednn(None)
    monkeypatch.delenv(lin.CPU_LINEAR_ENV, raising=False)  # restored after the test
    lin._onednn_faster.cache_clear()
    lin.cpu_linear_kernel.cache_clear()
    try:
        onednn = slow != "onednn"
        assert lin._onednn_faster() is onednn
        assert lin._use_onednn(torch.randn(2, 4), torch.randn(3, 4)) is onednn
        assert os.environ[lin.CPU_LINEAR_ENV] == ("onednn" if onednn else "blas")  # for child processes
    finally:
        lin._onednn_faster.cache_clear()  # the next use times the real kernels again
        lin.cpu_linear_kernel.cache_clear()


@pytest.mark.parametrize("kernel", ["onednn", "blas"])
def test_the_environment_pins_the_kernel_without_timing(monkeypatch, kernel):
    if not lin._onednn_works():
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.setenv(lin.CPU_LINEAR_ENV, kernel.upper())
    monkeypatch.setattr(lin, "_onednn_faster", lambda: pytest.fail("timed although the environment names a kernel"))
    lin.use_onednn(None)
    lin.cpu_linear_kernel.cache_clear()
    try:
        assert lin._use_onednn(torch.randn(2, 4), torch.randn(3, 4)) is (kernel == "onednn")
        monkeypatch.setenv(lin.CPU_LINEAR_ENV, "mkl")
        lin.cpu_linear_kernel.cache_clear()
        with pytest.raises(ValueError, match="ARCHON_CPU_LINEAR='mkl' names no CPU linear kernel"):
            lin.cpu_linear_kernel()
    finally:
        lin.cpu_linear_kernel.cache_clear()


def test_packed_linear_follows_in_place_weight_updates():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(40, 16, generator=g)
    weight = base[8:32]  # a view, as the fused projections are
    packed = lin.PackedLinear(weight)
    x, h = torch.randn(5, 16, generator=g), torch.randn(5, 24, generator=g)
    torch.testing.assert_close(packed(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    base.copy_(torch.randn(40, 16, generator=g))  # changes the view's storage in place
    torch.testing.assert_close(packed(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.add(h, x), h + F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_the_timing_probe_is_invisible_to_dispatch_modes_and_autograd(monkeypatch):
    """The first linear may run inside selective activation checkpointing, whose dispatch mode records the
    forward's ops for the recomputation: the probe's products must not be among them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    lin.use_onednn(None)
    monkeypatch.delenv(lin.CPU_LINEAR_ENV, raising=False)
    lin._onednn_works.cache_clear()
    lin._onednn_faster.cache_clear()
    lin.cpu_linear_kernel.cache_clear()
    x, layer = torch.randn(3, 8, requires_grad=True), lin.Linear(8, 4)
    try:
        with Recorder() as recorder:
            layer(x)  # the first use since the caches were cleared: it checks and times oneDNN
        assert lin._onednn_faster.cache_info().currsize == 1
    finally:
        lin._onednn_faster.cache_clear()
        lin.cpu_linear_kernel.cache_clear()
    assert len(recorder.ops) <= 3, recorder.ops  # the layer's own product (and its transpose), none of the probe's
