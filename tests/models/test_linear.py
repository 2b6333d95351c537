"""``models.common.linear``: the oneDNN float32 CPU path computes F.linear's function and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.common import linear as lin


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
    try:
        layer(x)
    finally:
        lin.use_onednn(True)
    assert calls == []


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
