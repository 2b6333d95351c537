"""Mixture of experts: top-k router, grouped experts, token reordering (Qwen3-MoE semantics).

Data flow of ``MoE.forward`` for ``N`` tokens and ``top_k`` experts per token:
route (softmax over all experts in float32; top-k of the probabilities plus a per-expert bias,
or the replayed choices; the chosen probabilities, optionally renormalised, are the scores) ->
copy every token once per chosen expert and sort the copies by expert id ->
``experts(x_sorted, num_tokens_per_expert)`` -> weight each copy by its router score ->
add the copies back to their tokens.  ``GroupedExperts`` keeps torchtitan's interface so an
expert-parallel wrapper can move the sorted tokens between ranks around it.

Load balancing (the auxiliary loss, the bias of aux-loss-free balancing) needs counts over
every rank; this module only counts its own tokens and takes the global quantities it is
given (see ``MoE``); ``archon.engine.moe_balance`` does the reductions.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _local(t: torch.Tensor) -> torch.Tensor:
    # Expert parallel shards the expert dim; each rank computes with its own experts.
    return t.to_local() if hasattr(t, "to_local") else t  # pyright: ignore[reportAttributeAccessIssue]


class TokenChoiceTopKRouter(nn.Module):
    """Chooses ``top_k`` experts per token; ``gate`` is ``Linear(dim, num_experts, bias=False)``.

    ``gate_dtype`` (None: the compute dtype) runs the gate matmul in that dtype with autocast
    off, e.g. float32 under bfloat16 training; the softmax is always float32.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        # nn.Linear (BLAS), as transformers: the scores, hence the chosen experts, match bit for bit.
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.gate_dtype: torch.dtype | None = None

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_dtype is None:
            return self.gate(x)
        with torch.autocast(x.device.type, enabled=False):
            return self.gate(x.to(self.gate_dtype))

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, replay: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [N, dim]`` -> ``(probs [N, E] float32, top_scores [N, k] in x's dtype, selected [N, k] int64)``.

        ``bias [E]`` is added to the probabilities for choosing experts only (aux-loss-free
        balancing); the scores stay the probabilities of the chosen experts.  ``replay [N, k]``
        forces the choice of every token whose row is not negative (routing replay); its scores
        are still the router's probabilities, so the gate keeps its gradient.
        """
        logits = self._logits(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        choice = probs if bias is None else probs + bias.to(probs.dtype)
        selected = torch.topk(choice, self.top_k, dim=-1).indices
        if replay is not None:
            replay = replay.to(selected.device, torch.int64)
            selected = torch.where((replay[:, :1] >= 0), replay, selected)
        top_scores = probs.gather(-1, selected)
        if self.norm_topk_prob:
            top_scores = top_scores / top_scores.sum(dim=-1, keepdim=True)
        return probs, top_scores.to(x.dtype), selected

    def init_weights(self, init_std: float) -> None:
        nn.init.normal_(self.gate.weight, mean=0.0, std=init_std)


def count_per_expert(selected: torch.Tensor, num_experts: int, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[E]`` float32: how many of the ``selected [N, k]`` choices went to each expert (masked tokens left out).

    ``histc`` avoids a device-to-host sync (float input: CPU histc needs it).
    """
    flat = selected.float()
    if token_mask is not None:
        # Masked-out tokens are moved past the last bin, which histc ignores.
        flat = torch.where(token_mask.reshape(-1, 1).bool(), flat, float(num_experts + 1))
    return torch.histc(flat.reshape(-1), bins=num_experts, min=0, max=num_experts)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's where it is on (F.linear's rule), else ``x``'s.

    Without FSDP, mixed precision is autocast over float32 parameters and activations, so the
    activations' own dtype would say float32 and miss the grouped GEMM.
    """
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def grouped_mm_fits(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` has its fast kernel for ``dtype`` on ``device``: bfloat16 on sm90+.

    Elsewhere it is missing, slow (a syncing fallback) or lacks a CPU backward, so the loop runs.
    """
    if device.type != "cuda" or dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _use_grouped_mm(x: torch.Tensor) -> bool:
    return x.is_cuda and grouped_mm_fits(x.device, compute_dtype(x))


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
    # Autocast does not cast for torch._grouped_mm, which needs one dtype: cast as F.linear would
    # (to autocast's dtype), or without autocast to the weights' (FSDP's compute dtype).
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else w1.dtype
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
    # (torch._grouped_mm is private to pyright: torch does not export it)
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))  # pyright: ignore[reportPrivateImportUsage]
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)  # pyright: ignore[reportPrivateImportUsage]
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets).type_as(x)  # pyright: ignore[reportPrivateImportUsage]


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; the backward also hands ``grad_scale`` to ``aux_loss`` as its gradient.

    So a layer adds its load-balancing loss to the training loss without the loss function
    (or the last pipeline stage) ever seeing it, as Megatron's ``MoEAuxLossAutoScaler`` does.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor, grad_scale: float) -> torch.Tensor:
        ctx.grad_scale = grad_scale
        ctx.save_for_backward(aux_loss)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_out, torch.full_like(aux_loss, ctx.grad_scale), None


def _in_backward() -> bool:
    """True while autograd's engine runs this code: the recomputation of activation checkpointing."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """Routed experts of a Qwen3-MoE layer (no shared expert).

    ``forward(x, token_mask=None, replay=None)``: ``token_mask [bs, seq]`` marks real tokens
    (padding is left out of every statistic and of the load-balancing loss; it is still
    computed); ``replay [bs, seq, top_k]`` forces expert choices (rows of -1 route freely).

    State the trainer reads or sets (single-device semantics; the engine reduces over ranks):

    * ``expert_bias [E]`` (persistent, float32): added to the router probabilities when choosing
      experts (aux-loss-free balancing); zero unless a trainer updates it.
    * ``tokens_per_expert [E]``: real-token choices per expert of the last forward (overwritten).
    * ``count_tokens``: when True, every forward outside autograd's backward (so not the
      recomputation of activation checkpointing) adds its counts to ``step_tokens_per_expert``
      and its load-balancing loss to ``step_aux_loss``.
    * ``aux_loss_weights [E]`` (None: off): the forward adds ``sum_e w_e * sum_t p[t, e]`` over
      real tokens ``t`` to the loss (through the gradient, scaled by ``aux_loss_grad_scale``).
    * ``record_routing``: keep the last forward's choices in ``selected_experts [bs, seq, k]``.
    """

    expert_bias: torch.Tensor
    tokens_per_expert: torch.Tensor
    step_tokens_per_expert: torch.Tensor
    step_aux_loss: torch.Tensor

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k, norm_topk_prob)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
        self.register_buffer("step_tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
        self.register_buffer("step_aux_loss", torch.zeros((), dtype=torch.float32), persistent=False)
        self.count_tokens = False
        self.aux_loss_weights: torch.Tensor | None = None
        self.aux_loss_grad_scale = 1.0
        self.record_routing = False
        self.selected_experts: torch.Tensor | None = None

    def _apply(self, fn, recurse: bool = True):
        # ``model.to(bfloat16)`` must not round the routing bias: the server and the trainer
        # would then choose different experts near ties.  Redo a cast from the original.
        bias = self.expert_bias
        module = super()._apply(fn, recurse)
        if self.expert_bias.dtype != torch.float32:
            self.expert_bias = bias.to(device=self.expert_bias.device, dtype=torch.float32)
        return module

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None, replay: torch.Tensor | None = None
    ) -> torch.Tensor:
        bs, seqlen, dim = x.shape
        x = x.reshape(-1, dim)
        mask = token_mask.reshape(-1) if token_mask is not None else None
        probs, top_scores, selected = self.router(
            x, self.expert_bias, replay.reshape(-1, self.top_k) if replay is not None else None
        )
        if self.record_routing:
            self.selected_experts = selected.view(bs, seqlen, self.top_k)
        all_counts = count_per_expert(selected, self.num_experts)
        aux_loss = self._aux_loss(probs, mask)
        self._record(selected, mask, aux_loss)  # pyright: ignore[reportCallIssue]  (torch.compiler.disable hides self)

        # Sort token copies by expert; a stable sort keeps token order inside each expert.
        order = torch.argsort(selected.reshape(-1), stable=True)
        token_idx = order // self.top_k
        x_sorted = x[token_idx]
        out_sorted = self.experts(x_sorted, all_counts.to(torch.int64))
        # Like transformers: scale each expert's output by its router score, then sum per token.
        out_sorted = out_sorted * top_scores.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(x).index_add(0, token_idx, out_sorted.to(x.dtype))
        if aux_loss is not None:
            out = _AttachAuxLoss.apply(out, aux_loss, self.aux_loss_grad_scale)  # pyright: ignore[reportCallIssue]
        return out.reshape(bs, seqlen, dim)

    def _aux_loss(self, probs: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
        if self.aux_loss_weights is None or not torch.is_grad_enabled():
            return None
        per_token = probs if mask is None else probs * mask.reshape(-1, 1).to(probs.dtype)
        return (per_token.sum(0) * self.aux_loss_weights.to(probs.device)).sum()

    @torch.compiler.disable
    @torch.no_grad()
    def _record(self, selected: torch.Tensor, mask: torch.Tensor | None, aux_loss: torch.Tensor | None) -> None:
        counts = count_per_expert(selected, self.num_experts, mask)
        self.tokens_per_expert.copy_(counts)
        if self.count_tokens and not _in_backward():
            self.step_tokens_per_expert.add_(counts)
            if aux_loss is not None:
                self.step_aux_loss.add_(aux_loss.detach().float())

    def init_weights(self, init_std: float) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Zero the routing bias and the statistics (a checkpoint that has a bias overwrites it)."""
        device = device if device is not None else self.router.gate.weight.device
        if getattr(device, "type", device) == "meta":
            return
        for name in ("expert_bias", "tokens_per_expert", "step_tokens_per_expert"):
            setattr(self, name, torch.zeros(self.num_experts, dtype=torch.float32, device=device))
        self.step_aux_loss = torch.zeros((), dtype=torch.float32, device=device)
