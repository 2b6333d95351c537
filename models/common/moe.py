"""Mixture of experts: top-k router, grouped experts, token reordering (Qwen3-MoE semantics).

Data flow of ``MoE.forward`` for ``N`` tokens and ``top_k`` experts per token:
route (softmax over all experts in float32, top-k, optional renormalisation) ->
copy every token once per chosen expert and sort the copies by expert id ->
``experts(x_sorted, num_tokens_per_expert)`` -> weight each copy by its router score ->
add the copies back to their tokens.  ``GroupedExperts`` keeps torchtitan's interface so an
expert-parallel wrapper can move the sorted tokens between ranks around it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _local(t: torch.Tensor) -> torch.Tensor:
    # Expert parallel shards the expert dim; each rank computes with its own experts.
    return t.to_local() if hasattr(t, "to_local") else t


class TokenChoiceTopKRouter(nn.Module):
    """Chooses ``top_k`` experts per token; ``gate`` is ``Linear(dim, num_experts, bias=False)``."""

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        # nn.Linear (BLAS), as transformers: the scores, hence the chosen experts, match bit for bit.
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [N, dim]`` -> ``(top_scores [N, k] in x's dtype, selected [N, k] int64, tokens_per_expert [E])``."""
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        top_scores, selected = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_scores = top_scores / top_scores.sum(dim=-1, keepdim=True)
        top_scores = top_scores.to(logits.dtype)
        # histc avoids a device-to-host sync; float input because CPU histc needs it.
        tokens_per_expert = torch.histc(
            selected.reshape(-1).float(), bins=self.num_experts, min=0, max=self.num_experts
        )
        return top_scores, selected, tokens_per_expert

    def init_weights(self, init_std: float) -> None:
        nn.init.normal_(self.gate.weight, mean=0.0, std=init_std)


def _use_grouped_mm(x: torch.Tensor) -> bool:
    # torch._grouped_mm's fast kernel is bfloat16 on Hopper and newer; elsewhere it is
    # either missing, slow (a syncing fallback) or lacks a CPU backward, so use the loop.
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    return torch.cuda.get_device_capability(x.device)[0] >= 9


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stored as 3-D tensors.

    ``w1`` (gate) and ``w3`` (up) are ``[E, hidden, dim]``, ``w2`` (down) is ``[E, dim, hidden]``:
    expert ``e`` computes ``w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))``, the layout of the
    per-expert ``gate_proj/up_proj/down_proj`` weights of Hugging Face checkpoints.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        # None: pick by device and dtype; True/False forces the grouped GEMM or the loop.
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x [N, dim]`` sorted by expert, ``num_tokens_per_expert [E_local]`` -> ``[N, dim]``.

        With DTensor weights (expert parallel) the local shard is used: the number of local
        experts is ``w1.to_local().shape[0]`` and ``num_tokens_per_expert`` has that many entries.
        """
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        assert num_tokens_per_expert.numel() == w1.shape[0], (
            f"got token counts for {num_tokens_per_expert.numel()} experts, hold {w1.shape[0]}"
        )
        use_grouped = _use_grouped_mm(x) if self.use_grouped_mm is None else self.use_grouped_mm
        if use_grouped:
            return _run_experts_grouped_mm(w1, w2, w3, x, num_tokens_per_expert)
        return _run_experts_loop(w1, w2, w3, x, num_tokens_per_expert)

    def extra_repr(self) -> str:
        e, hidden, dim = self.w1.shape
        return f"num_experts={e}, dim={dim}, hidden_dim={hidden}"

    def init_weights(self, init_std: float) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, mean=0.0, std=init_std)


def _run_experts_loop(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, num_tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    counts = [int(c) for c in num_tokens_per_expert.tolist()]
    # Tokens past sum(counts) (alignment padding from an expert-parallel wrapper) stay zero.
    used = sum(counts)
    outs = []
    for e, x_e in enumerate(torch.split(x[:used], counts, dim=0)):
        # Every expert runs, even on zero tokens, so each weight gets a (zero) gradient.
        h = F.silu(F.linear(x_e, w1[e])) * F.linear(x_e, w3[e])
        outs.append(F.linear(h, w2[e]))
    out = torch.cat(outs, dim=0)
    if used < x.shape[0]:
        out = torch.cat([out, out.new_zeros(x.shape[0] - used, out.shape[1])], dim=0)
    return out


def _run_experts_grouped_mm(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, num_tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    x = x.to(w1.dtype)
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets).type_as(x)


class MoE(nn.Module):
    """Routed experts of a Qwen3-MoE layer (no shared expert).

    Router statistics: after every forward, the non-persistent buffer ``tokens_per_expert``
    ``[num_experts]`` (float32) holds how many token copies each expert received in that
    forward (all ``top_k`` choices counted), for load-balancing losses and logging.  It is
    overwritten, not accumulated, so recomputation under activation checkpointing does not
    double count.
    """

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k, norm_topk_prob)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, dim = x.shape
        x = x.reshape(-1, dim)
        top_scores, selected, tokens_per_expert = self.router(x)
        with torch.no_grad():
            self.tokens_per_expert.copy_(tokens_per_expert)

        # Sort token copies by expert; a stable sort keeps token order inside each expert.
        order = torch.argsort(selected.reshape(-1), stable=True)
        token_idx = order // self.top_k
        x_sorted = x[token_idx]
        out_sorted = self.experts(x_sorted, tokens_per_expert.to(torch.int64))
        # Like transformers: scale each expert's output by its router score, then sum per token.
        out_sorted = out_sorted * top_scores.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(x).index_add(0, token_idx, out_sorted.to(x.dtype))
        return out.reshape(bs, seqlen, dim)

    def init_weights(self, init_std: float) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        nn.init.zeros_(self.tokens_per_expert)
