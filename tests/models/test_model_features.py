"""Model features beyond plain logits: MoE routing, KV cache, critic, meta init, config spellings."""

from __future__ import annotations

import json
from typing import cast

import pytest
import torch
from hf_fixtures import block_of, decoder, make_tiny_hf_model, perturb_, save_tiny_hf
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

import models
from models.common.moe import (
    GroupedExperts,
    _run_experts_grouped_mm,
    _run_experts_loop,
    _use_grouped_mm,
    count_per_expert,
)
from models.qwen3_moe import Qwen3MoeModelArgs

ATOL = 1e-4


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe")
    hf, _ = save_tiny_hf(folder, "qwen3_moe", seed=7)
    return folder, hf


def _tokens(batch: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


# ---- MoE ---------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_router_matches_transformers(norm_topk_prob, tmp_path):
    hf, _ = save_tiny_hf(tmp_path, "qwen3_moe", seed=3, norm_topk_prob=norm_topk_prob)
    model = models.load_hf_model(tmp_path)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, hf_scores, hf_idx = hf.model.layers[0].mlp.gate(x)
        probs, scores, idx = block_of(model, 0).moe.router(x)
    assert torch.equal(idx, hf_idx)
    assert torch.equal(scores, hf_scores)
    assert torch.equal(count_per_expert(idx, 8), torch.bincount(hf_idx.flatten(), minlength=8).float())
    torch.testing.assert_close(probs, torch.softmax(hf.model.layers[0].mlp.gate.weight @ x.T, 0).T)


def test_router_stats_are_exposed_per_forward(moe_folder):
    folder, hf = moe_folder
    model = models.load_hf_model(folder)
    tokens = _tokens(2, 9)
    with torch.no_grad():
        model(tokens)
        first = cast(torch.Tensor, block_of(model, 1).moe.tokens_per_expert).clone()  # a buffer: Tensor
        model(tokens)
    assert first.sum().item() == 2 * 9 * 2  # every token counted top_k times
    # Overwritten per forward, not accumulated.
    assert torch.equal(cast(torch.Tensor, block_of(model, 1).moe.tokens_per_expert), first)
    assert "tokens_per_expert" not in dict(model.state_dict())
    # The routing bias is state (checkpointed), zero for an HF checkpoint without one.
    assert torch.equal(model.state_dict()["layers.1.moe.expert_bias"], torch.zeros(8))


def test_routing_bias_stays_float32_when_the_model_is_cast():
    from models.common.moe import MoE

    moe = MoE(16, 8, num_experts=4, top_k=2, norm_topk_prob=False)
    moe.init_weights(0.1)
    moe.expert_bias.copy_(torch.tensor([0.05, -0.1, 0.001, 0.3]))
    moe.to(torch.bfloat16)
    assert moe.router.gate.weight.dtype == torch.bfloat16 and moe.expert_bias.dtype == torch.float32
    assert torch.equal(moe.expert_bias, torch.tensor([0.05, -0.1, 0.001, 0.3]))


def test_router_bias_changes_choice_not_scores():
    from models.common.moe import TokenChoiceTopKRouter

    torch.manual_seed(0)
    router = TokenChoiceTopKRouter(16, 6, 2, norm_topk_prob=False)
    x = torch.randn(30, 16)
    probs, _, plain = router(x)
    bias = torch.tensor([5.0, 0, 0, 0, 0, 4.0])  # experts 0 and 5 win every token
    _, scores, chosen = router(x, bias)
    assert torch.equal(chosen.sort(-1).values, torch.tensor([[0, 5]]).expand(30, 2))
    assert torch.equal(scores, probs.gather(1, chosen))
    assert not torch.equal(chosen, plain)


def test_router_replay_forces_choices_and_keeps_gate_gradient():
    from models.common.moe import TokenChoiceTopKRouter

    torch.manual_seed(0)
    router = TokenChoiceTopKRouter(16, 6, 2, norm_topk_prob=True)
    x = torch.randn(4, 16)
    replay = torch.tensor([[3, 1], [-1, -1], [0, 5], [2, 4]])
    probs, scores, chosen = router(x, replay=replay)
    assert chosen[0].tolist() == [3, 1] and chosen[2].tolist() == [0, 5] and chosen[3].tolist() == [2, 4]
    assert torch.equal(chosen[1], router(x)[2][1])  # -1: the router's own choice
    ref = probs.gather(1, chosen)
    torch.testing.assert_close(scores, ref / ref.sum(-1, keepdim=True))
    # Renormalised scores of a token sum to 1, so weigh them to get a non-trivial gradient.
    (scores * torch.arange(8.0).view(4, 2)).sum().backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0


def test_moe_token_mask_and_aux_loss_gradient():
    """Masked tokens are not counted; the attached aux loss adds exactly its own gradient."""
    from models.common.moe import MoE

    torch.manual_seed(0)
    moe = MoE(16, 8, num_experts=4, top_k=2, norm_topk_prob=False)
    moe.init_weights(0.3)
    x = torch.randn(1, 10, 16)
    mask = torch.tensor([[True] * 7 + [False] * 3])
    moe.count_tokens = True
    moe(x, mask)
    # Registered buffers, which pyright types as ``Tensor | Module``.
    assert cast(torch.Tensor, moe.tokens_per_expert).sum() == 7 * 2
    assert torch.equal(cast(torch.Tensor, moe.step_tokens_per_expert), cast(torch.Tensor, moe.tokens_per_expert))
    w = torch.tensor([0.5, 1.0, 2.0, 3.0])
    moe.aux_loss_weights, moe.aux_loss_grad_scale = w, 3.0
    moe.zero_grad()
    moe(x, mask).sum().backward()
    assert moe.router.gate.weight.grad is not None
    with_aux = moe.router.gate.weight.grad.clone()
    moe.aux_loss_weights = None
    moe.zero_grad()
    moe(x, mask).sum().backward()
    gate = moe.router.gate.weight.detach().requires_grad_(True)
    aux = (torch.softmax(x[0, :7] @ gate.T, -1).sum(0) * w).sum() * 3.0
    (aux_grad,) = torch.autograd.grad(aux, gate)
    assert moe.router.gate.weight.grad is not None
    torch.testing.assert_close(with_aux - moe.router.gate.weight.grad, aux_grad)
    # The step's loss value is accumulated (unscaled) once per forward.
    assert moe.step_aux_loss > 0


def test_grouped_experts_loop_and_grouped_mm_agree():
    torch.manual_seed(0)
    experts = GroupedExperts(dim=16, hidden_dim=8, num_experts=4)
    experts.init_weights(0.3)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 16)
    loop = _run_experts_loop(experts.w1, experts.w2, experts.w3, x, counts)
    # Per-token reference: token i belongs to the expert whose range holds i.
    owner = torch.repeat_interleave(torch.arange(4), counts)
    ref = torch.stack(
        [
            experts.w2[e] @ (torch.nn.functional.silu(experts.w1[e] @ x[i]) * (experts.w3[e] @ x[i]))
            for i, e in enumerate(owner.tolist())
        ]
    )
    torch.testing.assert_close(loop, ref)
    # torch._grouped_mm runs forward on CPU in float32 (its backward does not), enough to check the path.
    grouped = _run_experts_grouped_mm(experts.w1, experts.w2, experts.w3, x, counts)
    torch.testing.assert_close(grouped, ref, rtol=1e-5, atol=1e-6)
    # Automatic choice on CPU is the loop (grouped_mm has no CPU backward).
    assert experts.use_grouped_mm is None and not _use_grouped_mm(x)
    torch.testing.assert_close(experts(x, counts), loop, rtol=0, atol=0)


def test_fused_transformers5_expert_keys_load(moe_folder, tmp_path):
    """transformers >= 5 keeps experts fused in memory; a checkpoint written from that state dict loads."""
    _, hf = moe_folder
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    model = models.load_hf_model(tmp_path)
    tokens = _tokens(1, 12)
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < ATOL


# ---- KV cache ------------------------------------------------------------------------------


class ReferenceCache:
    """Concatenating KV cache for tests (the contract of the rollout server's cache)."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor):
        past = self.kv[layer_id][0].shape[1] if layer_id in self.kv else 0
        if layer_id in self.kv:
            k = torch.cat([self.kv[layer_id][0], k], dim=1)
            v = torch.cat([self.kv[layer_id][1], v], dim=1)
        self.kv[layer_id] = (k, v)
        total = k.shape[1]
        new = total - past
        mask = torch.arange(total)[None, :] <= (past + torch.arange(new))[:, None]
        return k, v, mask[None, None]


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "qwen3_moe"])
def test_incremental_decoding_equals_full_forward(model_type, tmp_path):
    hf, _ = save_tiny_hf(tmp_path, model_type, seed=11)
    model = models.load_hf_model(tmp_path)
    tokens = _tokens(2, 10, seed=12)
    with torch.no_grad():
        full = model(tokens)
        cache = ReferenceCache()
        steps = [model(tokens[:, :6], positions=torch.arange(6).expand(2, -1), cache=cache)]
        for t in range(6, 10):
            steps.append(model(tokens[:, t : t + 1], positions=torch.full((2, 1), t), cache=cache))
    incremental = torch.cat(steps, dim=1)
    assert (incremental - full).abs().max().item() < ATOL
    assert (full - hf(tokens).logits).abs().max().item() < ATOL


def test_keep_computes_only_the_kept_positions(moe_folder):
    model = models.load_hf_model(moe_folder[0])
    tokens = _tokens(1, 12, seed=3)
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)
    keep = torch.tensor([1, 4, 5, 11])
    with torch.no_grad():
        full = model(tokens, cu_seqlens=cu_seqlens)
        kept = model(tokens, cu_seqlens=cu_seqlens, keep=keep)
    assert kept.shape == (1, 4, full.shape[-1])
    torch.testing.assert_close(kept, full[:, keep])


def test_cache_requires_positions(moe_folder):
    model = models.load_hf_model(moe_folder[0])
    with pytest.raises(ValueError, match="positions are required"):
        model(_tokens(1, 4), cache=ReferenceCache())


# ---- critic --------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type,tie", [("qwen3", True), ("qwen2", False), ("qwen3_moe", False)])
def test_critic_from_lm_checkpoint_and_round_trip(model_type, tie, tmp_path):
    hf, _ = save_tiny_hf(tmp_path / "lm", model_type, tie=tie, seed=5)
    critic = decoder(models.load_hf_model(tmp_path / "lm", is_critic=True))
    assert critic.output.out_features == 1
    assert critic.output.weight is not critic.tok_embeddings.weight
    assert critic.output.weight.std().item() > 0  # the value head was initialised, not left empty
    tokens = _tokens(2, 8, seed=6)
    with torch.no_grad():
        values = critic(tokens)
        hidden = hf.model(tokens).last_hidden_state
    assert values.shape == (2, 8)
    torch.testing.assert_close(values, hidden @ critic.output.weight[0], rtol=1e-4, atol=1e-5)

    # Saved as transformers' token classification with one label; loads back as a critic.
    models.save_hf(critic, tmp_path / "critic", max_shard_size="40KB")
    hf_critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic").eval()
    again = models.load_hf_model(tmp_path / "critic", is_critic=True)
    with torch.no_grad():
        torch.testing.assert_close(hf_critic(tokens).logits[..., 0], values, rtol=1e-4, atol=1e-5)
        assert torch.equal(again(tokens), values)


# ---- initialisation without HF weights ----------------------------------------------------


def test_meta_model_materialises_and_initialises():
    args = Qwen3MoeModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        vocab_size=128,
        hidden_dim=96,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=32,
        tie_word_embeddings=True,
        mlp_only_layers=[0],
    )
    model = decoder(models.build_model(args))  # meta
    assert all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device="cpu")
    assert model.output.weight is model.tok_embeddings.weight  # to_empty kept the tie
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, 16, 2).float() / 16))
    assert torch.equal(model.rope.inv_freq, inv_freq)
    # A dtype cast keeps the RoPE frequencies exact in float32.
    assert torch.equal(
        decoder(models.build_model(args).to_empty(device="cpu").to(torch.bfloat16)).rope.inv_freq, inv_freq
    )
    assert torch.equal(model.norm.weight, torch.ones(64))
    assert abs(block_of(model, 1).moe.experts.w1.std().item() - 0.02) < 0.002
    out = model(_tokens(2, 5))
    assert out.shape == (2, 5, 128) and torch.isfinite(out).all()


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "qwen3_moe"])
def test_model_from_args_saves_a_transformers_loadable_folder(model_type, tmp_path):
    spec = models.get_model_spec(model_type)
    fields = dict(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=128, hidden_dim=96, rope_theta=10000.0
    )
    if model_type == "qwen3_moe":
        fields.update(num_experts=4, top_k=2, moe_hidden_dim=32, norm_topk_prob=True)
    torch.manual_seed(1)
    model = models.build_model(spec.model_args_class(**fields), device="cpu")
    perturb_(model, seed=2)
    models.save_hf(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.model_type == model_type
    tokens = _tokens(1, 9)
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < ATOL


# ---- HF config spellings ------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3_moe"])
def test_old_config_spelling_loads_the_same_model(model_type, tmp_path):
    """transformers < 5 wrote rope_theta + rope_scaling and num_experts; Qwen2 configs lack head_dim."""
    hf, config = save_tiny_hf(tmp_path, model_type, seed=13)
    new = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in new
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "num_local_experts", "head_dim")}
    old.update(rope_theta=new["rope_parameters"]["rope_theta"], rope_scaling=None)
    if model_type == "qwen3_moe":
        old.update(num_experts=8, head_dim=new["head_dim"])  # Qwen3 configs always carry head_dim
    (tmp_path / "config.json").write_text(json.dumps(old))
    spec = models.get_model_spec(model_type)
    a_old = spec.model_args_class.from_hf_config(old)
    a_new = spec.model_args_class.from_hf_config(config)  # a transformers config object works too
    assert (a_old.head_dim, a_old.rope_theta, a_old.n_kv_heads) == (a_new.head_dim, a_new.rope_theta, 2)
    assert a_old == a_new  # hf_config is excluded from comparison
    model = models.load_hf_model(tmp_path)
    tokens = _tokens(1, 10)
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < ATOL


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
        {"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_parameters": None, "rope_theta": 1e6, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    ],
)
def test_unsupported_rope_scaling_is_rejected(rope):
    _, config = make_tiny_hf_model("qwen3")
    cfg = {**config.to_dict(), **rope}
    with pytest.raises(models.HFConfigError, match="RoPE scaling type '(yarn|linear|dynamic)'"):
        models.get_model_spec("qwen3").model_args_class.from_hf_config(cfg)


def test_sliding_window_is_rejected():
    _, config = make_tiny_hf_model("qwen2")
    cfg = {**config.to_dict(), "use_sliding_window": True, "sliding_window": 64}
    with pytest.raises(models.HFConfigError, match="sliding-window"):
        models.get_model_spec("qwen2").model_args_class.from_hf_config(cfg)


# ---- checkpoints in other shapes ------------------------------------------------------------


def test_tied_checkpoint_that_also_stores_lm_head(tmp_path):
    hf, _ = make_tiny_hf_model("qwen2", tie=True, seed=8)
    sd = {k: v.clone().contiguous() for k, v in hf.state_dict().items()}
    assert "lm_head.weight" in sd
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    model = decoder(models.load_hf_model(tmp_path))
    assert model.output.weight is model.tok_embeddings.weight
    tokens = _tokens(1, 6)
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < ATOL


def test_wrapped_blocks_load_and_save_under_clean_names(moe_folder, tmp_path):
    """Activation checkpointing / compile wrappers add path parts the checkpoint does not have."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    folder, hf = moe_folder
    model = decoder(models.build_model(models.read_hf_config(folder)))
    for key in list(model.layers.keys()):
        model.layers[key] = checkpoint_wrapper(model.layers[key])
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    models.load_hf_weights(model, folder)
    tokens = _tokens(1, 8)
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < ATOL
    models.save_hf(model, tmp_path)
    with torch.no_grad():
        assert (models.load_hf_model(tmp_path)(tokens) - hf(tokens).logits).abs().max().item() < ATOL


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "qwen3_moe"])
def test_bfloat16_follows_transformers(model_type, tmp_path):
    """Norms in float32 then cast, RoPE frequencies kept in float32: bf16 logits track transformers'."""
    save_tiny_hf(tmp_path, model_type, seed=9)
    model = decoder(models.load_hf_model(tmp_path, dtype=torch.bfloat16))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert model.rope.inv_freq.dtype == torch.float32
    assert model.output.weight.dtype == torch.bfloat16
    tokens = _tokens(2, 16)
    with torch.no_grad():
        ours, ref = model(tokens).float(), hf(tokens).logits.float()
    # Observed bit-identical on CPU; allow one bfloat16 ulp at the logits' scale.
    assert (ours - ref).abs().max().item() <= ref.abs().max().item() * 2**-7
