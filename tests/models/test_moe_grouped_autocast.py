"""MoE experts take the grouped GEMM under autocast (mixed precision without FSDP), in autocast's dtype.

Without FSDP the parameters and activations are float32 and autocast supplies bfloat16; the
experts used to judge by the activations' dtype, so a bf16 run fell back to the per-expert loop.
``torch._grouped_mm`` runs forward on CPU, so the grouped path is checked against the loop
under CPU autocast (both in bfloat16, as F.linear computes there); the CUDA-only part of the
decision (sm90+) is checked with the capability patched.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models.common.moe import GroupedExperts, compute_dtype, grouped_mm_fits

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")

DIM, HIDDEN, EXPERTS = 16, 32, 4


class GroupedCalls(TorchDispatchMode):
    """Input dtypes of every ``aten._grouped_mm`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: Counter[torch.dtype] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._grouped_mm.default:
            self.dtypes[args[0].dtype] += 1
        return func(*args, **(kwargs or {}))


def test_autocast_decides_the_experts_dtype(monkeypatch):
    x = torch.randn(4, DIM)  # float32 activations, as without FSDP
    assert compute_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype(x) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert grouped_mm_fits(torch.device("cuda", 0), torch.bfloat16)
    assert not grouped_mm_fits(torch.device("cuda", 0), torch.float32)
    assert not grouped_mm_fits(torch.device("cpu"), torch.bfloat16)  # CPU: no grouped backward
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not grouped_mm_fits(torch.device("cuda", 0), torch.bfloat16)  # A100: the loop


def test_grouped_path_under_autocast_matches_the_loop():
    torch.manual_seed(0)
    grouped = GroupedExperts(DIM, HIDDEN, EXPERTS, use_grouped_mm=True)
    grouped.init_weights(0.2)
    loop = GroupedExperts(DIM, HIDDEN, EXPERTS, use_grouped_mm=False)
    loop.load_state_dict(grouped.state_dict())
    counts = torch.tensor([3, 0, 5, 4])
    x = torch.randn(int(counts.sum()), DIM)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with GroupedCalls() as calls:
            got = grouped(x, counts)
        want = loop(x, counts)
    assert calls.dtypes == Counter({torch.bfloat16: 3})  # gate, up and down projections, in bfloat16
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    # The float32 computation is the reference both approximate.
    exact = loop(x, counts)
    assert exact.dtype == torch.float32
    torch.testing.assert_close(got.float(), exact, atol=5e-2, rtol=5e-2)
