"""Per-token log-probabilities and entropy from logits sharded over the vocabulary.

Under tensor parallel the LM head is column-wise, so every TP rank holds the logits of a
slice of the vocabulary.  Gathering them would cost ``tokens x vocab`` memory per rank; the
function here reduces over the TP group instead (max, sum of exponentials, target logit and
expected logit are all-reduced: four ``[tokens]`` vectors), as Megatron's vocab-parallel
cross entropy does.  It also works on an unsharded tensor (no group), so single-device and
sharded runs share one code path and agree to rounding.

The backward is written by hand so that only the softmax (float32) is kept for it:
``d logp_t / d z = onehot(t) - p`` and ``d H / d z = -p * (z - E_p[z])``.  Gradients are
not materialised for an output the loss does not use: a loss without an entropy term skips
the entropy backward (a full ``tokens x vocab`` pass).  On one device (no group) the forward
is one fused ``log_softmax`` (the function the rollout servers report), not the reduction
sequence the sharded case needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def _row_chunks(logits: torch.Tensor) -> list[tuple[int, int]]:
    """Row ranges to process together.

    Single-threaded CPU: about 512 KiB of float32 per range, so the several passes over a range
    hit the cache instead of memory (~1.5x here).  Elsewhere one range: on accelerators nothing
    is gained, and with several CPU threads every op is a parallel region whose barrier stalls
    whenever another process holds a core (measured: 6x slower with 2 threads on a busy machine).
    """
    n, vocab = logits.shape
    step = n
    if logits.device.type == "cpu" and torch.get_num_threads() == 1:
        step = max(8, (1 << 17) // max(1, vocab))
    return [(s, min(n, s + step)) for s in range(0, n, step)]


class _LogprobEntropy(torch.autograd.Function):
    """The unsharded case: ``log_softmax`` once per row, entropy from its exponential.

    Only the softmax is kept as a ``[rows, vocab]`` buffer (one allocation of that size per
    call: on CPU each one costs page faults); ``log p``, which only the entropy's backward
    needs, is recomputed there from the saved logits and log-sum-exp.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float):
        n = logits.shape[0]
        probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        logprobs, entropy, lse = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
        for s, e in _row_chunks(logits):
            z = logits[s:e].float()
            if temperature != 1.0:
                z = z / temperature
            lp = torch.log_softmax(z, dim=-1)
            p = torch.exp(lp, out=probs[s:e])
            logprobs[s:e] = lp.gather(-1, targets[s:e].unsqueeze(-1)).squeeze(-1)
            lse[s:e] = z[:, 0] - lp[:, 0]
            # In place: log p is not needed any more.  (A batched-matmul dot product would need
            # no temporary at all but sums less accurately.)
            entropy[s:e] = lp.mul_(p).sum(-1)
        entropy.neg_()
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(probs, logits, lse, entropy, targets)
        ctx.temperature = temperature
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None
        probs, logits, lse, entropy, targets = ctx.saved_tensors
        t = ctx.temperature
        # d H / d z = -p * (log p + H); d logp_t / d z = onehot(t) - p; both over T.
        weight = torch.zeros_like(entropy)
        if grad_logprobs is not None:
            weight -= grad_logprobs
        if grad_entropy is not None:
            weight -= grad_entropy * entropy
        if t != 1.0:
            weight /= t
        grad_out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for s, e in _row_chunks(probs):
            p = probs[s:e]
            grad = p * weight[s:e].unsqueeze(-1)
            if grad_entropy is not None:
                z = logits[s:e].float()
                logp = (z / t if t != 1.0 else z) - lse[s:e].unsqueeze(-1)
                grad.addcmul_(p * logp, (grad_entropy[s:e] / t).unsqueeze(-1), value=-1.0)
            if grad_logprobs is not None:
                grad.scatter_add_(-1, targets[s:e].unsqueeze(-1), (grad_logprobs[s:e] / t).unsqueeze(-1))
            grad_out[s:e] = grad
        return grad_out, None, None


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        group: dist.ProcessGroup | None,
        temperature: float,
    ):
        z = logits.float()
        if temperature != 1.0:
            z = z / temperature
        local_max = z.max(dim=-1).values
        if group is not None:
            dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        z = z - local_max.unsqueeze(-1)
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        local_vocab = z.shape[-1]
        in_range = (targets >= vocab_start) & (targets < vocab_start + local_vocab)
        local_idx = (targets - vocab_start).clamp(0, local_vocab - 1)
        target_z = z.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1) * in_range
        weighted = (exp * z).sum(dim=-1)
        if group is not None:
            stacked = torch.stack([sum_exp, target_z, weighted])
            dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
            sum_exp, target_z, weighted = stacked.unbind(0)
        log_sum = sum_exp.log()
        logprobs = target_z - log_sum
        mean_z = weighted / sum_exp
        entropy = log_sum - mean_z
        probs = exp.div_(sum_exp.unsqueeze(-1))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(probs, z, mean_z, local_idx, in_range)
        ctx.temperature = temperature
        ctx.input_dtype = logits.dtype
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None
        probs, z, mean_z, local_idx, in_range = ctx.saved_tensors
        grad = torch.zeros_like(probs)
        if grad_logprobs is not None:
            grad -= probs * grad_logprobs.unsqueeze(-1)
            grad.scatter_add_(-1, local_idx.unsqueeze(-1), (grad_logprobs * in_range).unsqueeze(-1))
        if grad_entropy is not None:
            grad -= probs * (z - mean_z.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        if ctx.temperature != 1.0:
            grad /= ctx.temperature
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(logits / T)[target]`` and the entropy of ``softmax(logits / T)``, per token.

    ``logits``: ``[..., V]`` full, or a DTensor sharded on the last dim (its mesh is the TP
    mesh), or a local shard with ``group``/``vocab_start`` given.  ``targets``: ``[...]``
    global token ids.  Returns two float32 tensors shaped like ``targets``.
    """
    if isinstance(logits, DTensor):
        placement = logits.placements[0]
        if logits.device_mesh.ndim != 1:
            raise ValueError("vocab-parallel logprobs expect logits on a 1-D (tensor-parallel) mesh")
        if isinstance(placement, Shard) and placement.dim in (-1, logits.ndim - 1):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, offset = compute_local_shape_and_global_offset(logits.shape, logits.device_mesh, logits.placements)
            vocab_start = offset[-1]
            group = logits.device_mesh.get_group()
            logits = logits.to_local()
        else:
            logits = logits.full_tensor()
            group, vocab_start = None, 0
    if isinstance(targets, DTensor):
        targets = targets.full_tensor()
    shape = targets.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    if group is None and vocab_start == 0:
        logprobs, entropy = _LogprobEntropy.apply(flat_logits, targets.reshape(-1), float(temperature))
    else:
        logprobs, entropy = _VocabParallelLogprobEntropy.apply(
            flat_logits, targets.reshape(-1), vocab_start, group, float(temperature)
        )
    return logprobs.view(shape), entropy.view(shape)
