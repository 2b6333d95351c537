import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_distributed

from parallel.loss_parallel import vocab_parallel_logprobs_entropy


def reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _data(seed: int = 0, tokens: int = 7, vocab: int = 10):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, vocab, generator=g) * 3
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    w_lp = torch.randn(tokens, generator=g)
    w_ent = torch.randn(tokens, generator=g)
    return logits, targets, w_lp, w_ent


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_log_softmax_values_and_grads(temperature):
    logits, targets, w_lp, w_ent = _data()
    a = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs_entropy(a, targets, temperature)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    b = logits.clone().requires_grad_()
    rlp, rent = reference(b, targets, temperature)
    ((rlp * w_lp).sum() + (rent * w_ent).sum()).backward()
    torch.testing.assert_close(lp, rlp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, rent, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-6)


def test_many_rows_are_processed_in_cache_sized_chunks_with_the_same_result(one_torch_thread):
    # 16384 columns: 8 rows per chunk on one CPU thread, so 21 rows take three chunks (the last one short).
    logits, targets, w_lp, w_ent = _data(tokens=21, vocab=16384)
    a = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs_entropy(a, targets, 0.7)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    b = logits.clone().requires_grad_()
    rlp, rent = reference(b, targets, 0.7)
    ((rlp * w_lp).sum() + (rent * w_ent).sum()).backward()
    torch.testing.assert_close(lp, rlp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, rent, atol=1e-4, rtol=1e-4)  # a float32 sum over 16384 terms
    torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unused_entropy_gets_no_gradient_work(dtype):
    # A loss of the logprobs alone: the entropy backward is skipped, the gradient is unchanged.
    logits, targets, w_lp, _ = _data()
    a = logits.to(dtype).requires_grad_()
    lp, _ = vocab_parallel_logprobs_entropy(a, targets, 0.7)
    (lp * w_lp).sum().backward()
    b = logits.to(dtype).requires_grad_()
    rlp, _ = reference(b, targets, 0.7)
    (rlp * w_lp).sum().backward()
    assert a.grad is not None and a.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the gradient apart
    torch.testing.assert_close(a.grad, b.grad, atol=tol, rtol=tol)


def _sharded_worker(use_dtensor: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    logits, targets, w_lp, w_ent = _data(vocab=10)
    # Uneven split on purpose: 10 = 5 + 5 for 2 ranks, 4 + 3 + 3 for 3 ranks (DTensor's chunking).
    chunks = list(torch.chunk(torch.arange(10), world))
    start = int(chunks[rank][0])
    local = logits[:, chunks[rank]].clone().requires_grad_()
    if use_dtensor:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world,))
        full = logits.clone().requires_grad_()
        dt = DTensor.from_local(full[:, chunks[rank]], mesh, [Shard(1)], shape=full.shape, stride=full.stride())
        lp, ent = vocab_parallel_logprobs_entropy(dt, targets, 0.9)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        assert full.grad is not None
        grad = full.grad[:, chunks[rank]]
    else:
        lp, ent = vocab_parallel_logprobs_entropy(local, targets, 0.9, group=dist.group.WORLD, vocab_start=start)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        grad = local.grad
    ref = logits.clone().requires_grad_()
    rlp, rent = reference(ref, targets, 0.9)
    ((rlp * w_lp).sum() + (rent * w_ent).sum()).backward()
    assert grad is not None and ref.grad is not None
    return [
        float((lp - rlp).abs().max()),
        float((ent - rent).abs().max()),
        float((grad - ref.grad[:, chunks[rank]]).abs().max()),
    ]


@pytest.mark.parametrize("world, use_dtensor", [(2, False), (3, False), (2, True), (3, True)])
def test_vocab_sharded_matches_full(world, use_dtensor):
    for errs in run_distributed(_sharded_worker, world, use_dtensor):
        assert max(errs) < 1e-5, errs
