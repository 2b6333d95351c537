"""Op-level selective AC keeps attention's output, so backward never runs the attention forward again.

Packed CUDA attention goes through ``torch.nn.attention.varlen.varlen_attn``, a custom op that
selective AC sees by its own name.  Its fake kernels let it run on the meta device, so the
recomputation is counted here without a GPU: a dispatch mode counts the op's calls over forward
and backward of a checkpointed block (1 when saved, 2 when recomputed; full AC is the control
that shows the count sees a recomputation).  The CPU SDPA kernel gets the same check on real
tensors.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from models.common.attention import CoreAttention
from parallel.activation_checkpoint import apply_ac, save_list

T, HEADS, HEAD_DIM = 16, 2, 8
VARLEN = getattr(getattr(torch.ops, "torch_attn", None), "_varlen_attn", None)


class CountOps(TorchDispatchMode):
    """Calls of every op while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


class PackedAttention(nn.Module):
    """A projection and packed causal attention over a row of two sequences, the varlen kernel or SDPA's."""

    def __init__(self, varlen: bool) -> None:
        super().__init__()
        self.varlen = varlen
        self.proj = nn.Linear(HEADS * HEAD_DIM, 3 * HEADS * HEAD_DIM)
        self.core = CoreAttention(scale=HEAD_DIM**-0.5)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).view(1, T, 3, HEADS, HEAD_DIM).unbind(2)
        if self.varlen:  # the path CoreAttention takes for bf16 on CUDA
            out = self.core._varlen(q, k, v, cu_seqlens, T // 2, False)
        else:
            out = self.core(q, k, v, cu_seqlens=cu_seqlens)
        return out.sin()


def _attention_calls(device: str, dtype: torch.dtype, varlen: bool, ac_mode: str, op: str) -> int:
    torch.manual_seed(0)
    with torch.device(device):
        blocks = nn.ModuleDict({"0": PackedAttention(varlen).to(dtype)})
        x = torch.randn(1, T, HEADS * HEAD_DIM, dtype=dtype, requires_grad=True)
        cu = torch.tensor([0, T // 2, T], dtype=torch.int32)
    apply_ac(blocks, ac_mode, "op")
    with CountOps() as counter:
        blocks["0"](x, cu).sum().backward()
    assert x.grad is not None
    return counter.calls[op]


def test_the_save_list_holds_every_attention_kernel():
    ops = save_list()
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in ops
    assert torch.ops.aten._scaled_dot_product_flash_attention.default in ops
    assert torch.ops.aten._flash_attention_forward.default in ops
    assert VARLEN is not None and VARLEN.default in ops


@pytest.mark.skipif(VARLEN is None, reason="this torch has no varlen attention op")
def test_varlen_attention_is_not_recomputed():
    op = "torch_attn._varlen_attn.default"
    assert _attention_calls("meta", torch.bfloat16, True, "full", op) == 2  # control: full AC recomputes it
    assert _attention_calls("meta", torch.bfloat16, True, "selective", op) == 1


def test_cpu_sdpa_is_not_recomputed():
    op = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert _attention_calls("cpu", torch.float32, False, "full", op) == 2
    assert _attention_calls("cpu", torch.float32, False, "selective", op) == 1
