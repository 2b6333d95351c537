"""Archon's qwen2 / qwen3 / qwen3_moe are the same function as transformers' in float32."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hf_fixtures import MODEL_TYPES, save_tiny_hf
from transformers import AutoModelForCausalLM

import models

CASES = [(mt, tie) for mt in MODEL_TYPES for tie in (False, True)]
IDS = [f"{mt}-{'tied' if tie else 'untied'}" for mt, tie in CASES]
ATOL = 1e-4


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def case(request, tmp_path_factory):
    """A sharded tiny HF checkpoint, the HF model it came from, and Archon's load of it."""
    model_type, tie = request.param
    folder = tmp_path_factory.mktemp(f"{model_type}_{tie}")
    overrides: dict[str, Any] = {}
    if model_type == "qwen3_moe" and not tie:
        # One dense block inside an MoE model, and plain (unnormalised) top-k weights.
        overrides = dict(mlp_only_layers=[1], norm_topk_prob=False)
    hf_model, config = save_tiny_hf(folder, model_type, tie=tie, seed=CASES.index((model_type, tie)), **overrides)
    model = models.load_hf_model(folder)
    return dict(model_type=model_type, tie=tie, folder=folder, hf=hf_model, config=config, model=model)


def _tokens(batch: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def test_sharded_checkpoint_really_is_sharded(case):
    assert (case["folder"] / "model.safetensors.index.json").is_file()
    assert len(list(case["folder"].glob("model-*.safetensors"))) > 2


def test_logits_match_transformers(case):
    tokens = _tokens(2, 17)
    with torch.no_grad():
        ours = case["model"](tokens)
        ref = case["hf"](tokens).logits
    assert ours.shape == ref.shape == (2, 17, 128)
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero numbers
    assert (ours - ref).abs().max().item() < ATOL


def test_structure_and_tying(case):
    model = case["model"]
    assert list(model.layers.keys()) == ["0", "1"]
    assert (model.output.weight is model.tok_embeddings.weight) == case["tie"]
    attn = model.layers["0"].attention
    assert (attn.wq.bias is not None) == (case["model_type"] == "qwen2")
    assert (attn.q_norm is not None) == (case["model_type"] != "qwen2")
    moe_layers = [k for k, b in model.layers.items() if b.moe_enabled]
    if case["model_type"] == "qwen3_moe":
        assert moe_layers == (["0"] if not case["tie"] else ["0", "1"])
        assert model.layers["0"].moe.experts.w1.shape == (8, 32, 64)
        assert model.layers["0"].moe.experts.w2.shape == (8, 64, 32)
    else:
        assert moe_layers == []


def test_packed_sequences_equal_per_sequence_logits(case):
    lengths = [5, 9, 1, 6]
    seqs = [_tokens(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    packed = torch.cat(seqs, dim=1)
    cu_seqlens = torch.tensor([0, 5, 14, 15, 21], dtype=torch.int32)
    with torch.no_grad():
        ours = case["model"](packed, cu_seqlens=cu_seqlens)
        ref = torch.cat([case["hf"](s).logits for s in seqs], dim=1)
        # Explicit positions that restart at 0 give the same result as the default.
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        ours_pos = case["model"](packed, positions=positions, cu_seqlens=cu_seqlens)
    assert (ours - ref).abs().max().item() < ATOL
    assert torch.equal(ours, ours_pos)


def test_packed_row_with_trailing_padding(case):
    seqs = [_tokens(1, 7, seed=1), _tokens(1, 4, seed=2)]
    pad = torch.zeros(1, 3, dtype=torch.long)
    packed = torch.cat(seqs + [pad], dim=1)
    cu_seqlens = torch.tensor([0, 7, 11], dtype=torch.int32)
    with torch.no_grad():
        ours = case["model"](packed, cu_seqlens=cu_seqlens)[:, :11]
        ref = torch.cat([case["hf"](s).logits for s in seqs], dim=1)
    assert (ours - ref).abs().max().item() < ATOL


def test_backward_matches_transformers_gradients(case):
    tokens = _tokens(2, 11, seed=3)
    labels = _tokens(2, 11, seed=4)
    model, hf = case["model"], case["hf"]
    model.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(hf(tokens).logits.flatten(0, 1), labels.flatten()).backward()

    adapter = models.get_model_spec(case["model_type"]).state_dict_adapter_class(model.args)
    ours = dict(model.named_parameters())
    compared = 0
    for hf_name, p in hf.named_parameters():
        assert p.grad is not None, hf_name
        for name, expert, ref_grad in adapter.from_hf_tensor(hf_name, p.grad):
            grad = ours[name].grad if expert is None else ours[name].grad[expert]
            torch.testing.assert_close(
                grad, ref_grad, rtol=1e-4, atol=1e-6, msg=lambda m, hf_name=hf_name: f"{hf_name}: {m}"
            )
            compared += 1
    assert compared >= len(ours)
    model.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)


def test_state_dict_adapter_round_trip_is_exact(case):
    model = case["model"]
    adapter = models.get_model_spec(case["model_type"]).state_dict_adapter_class(model.args)
    sd = model.state_dict()
    hf_sd = adapter.to_hf(sd)
    # The HF side is what save_pretrained writes: per-expert keys, no lm_head when tied.
    assert ("lm_head.weight" in hf_sd) != case["tie"]
    if case["model_type"] == "qwen3_moe":
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in hf_sd
    back = adapter.from_hf(hf_sd)
    expected = {k: v for k, v in sd.items() if not (case["tie"] and k == "output.weight")}
    assert set(back) == set(expected)
    for k, v in expected.items():
        assert torch.equal(back[k], v), k
    # One tensor at a time gives the same pairs.
    streamed = [pair for name, t in sd.items() for pair in adapter.to_hf_tensors(name, t)]
    assert [k for k, _ in streamed] == list(hf_sd)


def test_save_hf_then_from_pretrained(case, tmp_path):
    model = case["model"]
    models.save_hf(model, tmp_path, max_shard_size="30KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(reloaded) is type(case["hf"])
    tokens = _tokens(2, 13, seed=5)
    with torch.no_grad():
        ours = model(tokens)
        ref = reloaded(tokens).logits
    assert (ours - ref).abs().max().item() < ATOL
    # And back into Archon, bit for bit.
    again = models.load_hf_model(tmp_path)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
