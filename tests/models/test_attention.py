"""The attention core on packed rows: per-sequence causal attention against a hand-written reference."""

from __future__ import annotations

import math

import pytest
import torch

from models.common.attention import CoreAttention
from models.common.packing import padded_groups, segment_lengths


def _reference(q, k, v, lengths, scale):
    """softmax(q k^T * scale) v per sequence with an explicit causal mask, in float64."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[0, start : start + n].double().transpose(0, 1) for t in (q, k, v))  # [h, n, d]
        scores = qs @ ks.transpose(1, 2) * scale
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs).unsqueeze(0)


def test_segment_lengths():
    cu = torch.tensor([0, 4, 8, 8, 11, 11], dtype=torch.int32)
    assert segment_lengths(cu, 11) == [4, 4, 3]
    assert segment_lengths(cu, 14) == [4, 4, 3, 3]  # trailing padding is one more segment


def test_padded_groups_bound_the_padding_and_map_every_token_back():
    cpu = torch.device("cpu")
    assert padded_groups([6, 6, 6], cpu) is None  # already a batch
    short = padded_groups([4, 2, 3, 4], cpu)  # short rows of mixed lengths: one call
    assert short is not None and (short.counts, short.lengths) == ([4], [4])
    # Sorted by length: [2] at 0-1, [3] at 4-6, [4] at 8-11 and 12-15; slots past a row's end repeat its last token.
    assert short.gather.tolist() == [4, 5, 5, 5, 6, 7, 8, 8, 0, 1, 2, 3, 9, 10, 11, 12]
    assert short.scatter.tolist() == [8, 9, 10, 11, 0, 1, 4, 5, 6, 12, 13, 14, 15]
    long = padded_groups([100, 130, 200, 120, 240], cpu, ratio=1.25, slack=16)
    assert long is not None and (long.counts, long.lengths) == ([2, 1, 2], [120, 130, 240])
    assert sorted(long.scatter.tolist()) == sorted(set(long.scatter.tolist()))  # one slot per token
    assert long.gather[long.scatter].tolist() == list(range(790))  # each token's slot reads that token


@pytest.mark.parametrize(
    "cu, total",
    [
        ([0, 6, 12, 18], 18),  # equal lengths: one batched call
        ([0, 5, 14, 15, 21], 24),  # mixed lengths and trailing padding
        ([0, 4, 8, 8, 8, 11], 11),  # empty sequences (pipeline padding of cu_seqlens)
        ([0, 3, 6, 13, 16, 19], 19),  # runs of equal lengths around a longer one
        ([0, 2, 9, 12, 13, 17, 42, 45, 47, 80], 83),  # short and long rows: several padded groups
    ],
)
def test_packed_attention_matches_per_sequence_reference(cu, total):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, total, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(1, total, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(1, total, 2, 8, generator=g, requires_grad=True)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    lengths = segment_lengths(cu_seqlens, total)
    core = CoreAttention(scale=8**-0.5)
    out = core(q, k, v, cu_seqlens=cu_seqlens)
    ref = _reference(q, k, v, lengths, 8**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)

    w = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w.double()).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("s", [1, 3, 6])  # 6 goes through SDPA, 1 and 3 through the matmul path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_attention_matches_masked_reference(s, dtype):
    from models.common.attention import attend_cached

    g = torch.Generator().manual_seed(1)
    b, t, h, kv, d = 3, 9, 4, 2, 8
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    # Keys as a KV cache holds them: [b, kv, capacity, d] storage, read as a [b, t, kv, d] view.
    k = torch.randn(b, kv, 16, d, generator=g).to(dtype)[:, :, :t].transpose(1, 2)
    v = torch.randn(b, kv, 16, d, generator=g).to(dtype)[:, :, :t].transpose(1, 2)
    past = torch.tensor([3, 0, 9 - s])
    pos = past[:, None] + torch.arange(s)
    mask = (torch.arange(t)[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # causal over each row's cache
    out = attend_cached(q, k, v, mask, d**-0.5)
    rep = h // kv
    scores = torch.einsum("bshd,bthd->bhst", q.double(), k.double().repeat_interleave(rep, 2)) * d**-0.5
    scores = scores.masked_fill(~mask, -math.inf)
    ref = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v.double().repeat_interleave(rep, 2))
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_varlen_call_covers_trailing_padding_without_host_reads(monkeypatch):
    # The CUDA FlashAttention path, checked on CPU with a stand-in for varlen_attn.
    import models.common.attention as attention

    seen = {}

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        seen.update(cu=cu_q.tolist(), max_q=max_q)
        assert torch.equal(cu_q, cu_k) and window_size == (-1, 0) and max(lengths) <= max_q
        return _reference(q[None], k[None], v[None], [n for n in lengths if n], scale)[0].to(q.dtype)

    monkeypatch.setattr(attention, "_VARLEN_ATTN", fake_varlen)
    monkeypatch.setattr(attention, "_VARLEN_GQA", True)
    monkeypatch.setattr(attention, "_can_use_varlen", lambda q: True)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 14, h, 8, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)
    core = CoreAttention(scale=8**-0.5)
    out = core(q, k, v, cu_seqlens=cu, max_seqlen=6)  # the decoder's max covers the 3-token tail too
    assert seen == {"cu": [0, 5, 11, 14], "max_q": 6}
    torch.testing.assert_close(out.double(), _reference(q, k, v, [5, 6, 3], 8**-0.5), atol=1e-5, rtol=1e-5)
    core(q, k, v, cu_seqlens=torch.tensor([0, 5, 14], dtype=torch.int32))  # no tail: an empty last sequence
    assert seen == {"cu": [0, 5, 14, 14], "max_q": 9}


def test_varlen_without_enable_gqa_repeats_kv_heads(monkeypatch):
    # torch 2.10-2.11's varlen_attn has no enable_gqa: grouped-query K/V reach it one head per query head.
    import models.common.attention as attention

    def old_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
        assert k.shape[1] == v.shape[1] == q.shape[1], "K/V heads must match the query heads"
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        return _reference(q[None], k[None], v[None], [n for n in lengths if n], scale)[0].to(q.dtype)

    monkeypatch.setattr(attention, "_VARLEN_ATTN", old_varlen)
    monkeypatch.setattr(attention, "_VARLEN_GQA", False)
    monkeypatch.setattr(attention, "_can_use_varlen", lambda q: True)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 12, h, 8, generator=g) for h in (6, 2, 2))
    out = CoreAttention(scale=8**-0.5)(q, k, v, cu_seqlens=torch.tensor([0, 4, 12], dtype=torch.int32), max_seqlen=8)
    torch.testing.assert_close(out.double(), _reference(q, k, v, [4, 8], 8**-0.5), atol=1e-5, rtol=1e-5)
