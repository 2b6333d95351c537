"""The lean generation forward (``models.common.inference``) against ``Decoder.forward`` with the same cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hf_fixtures import MODEL_TYPES, block_of, decoder, save_tiny_hf

import models
from archon.server.kv_cache import BatchedKVCache
from models.common.inference import InferenceForward


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lean")
    for model_type in MODEL_TYPES:
        save_tiny_hf(root / model_type, model_type, seed=5)
    save_tiny_hf(root / "donor", "qwen3", seed=6)
    return root


def _run(forward, model: nn.Module, dtype: torch.dtype, steps: int = 4) -> torch.Tensor:
    """A right-padded prefill of 3 rows, then ``steps`` decode steps on fixed tokens; logits of each step."""
    a = decoder(model).args
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, a.vocab_size, (3, 7), generator=g)
    lengths = [7, 4, 2]
    cache = BatchedKVCache(a.n_layers, a.n_kv_heads, a.head_dim, dtype=dtype, initial_length=8)
    cache.add_rows(3)
    cache.begin_forward(0, 3, 7, valid=lengths)
    last = torch.tensor(lengths) - 1
    out = [forward(prompts, cache, last)]
    cache.end_forward()
    for _ in range(steps):  # grows the cache past its initial length
        cache.begin_forward(0, 3, 1)
        out.append(forward(torch.randint(0, a.vocab_size, (3, 1), generator=g), cache, None))
        cache.end_forward()
    return torch.stack(out)


def _reference(model):
    @torch.no_grad()
    def forward(tokens, cache, last):
        logits = model(tokens, positions=cache.positions(), cache=cache)
        return logits[:, -1] if last is None else logits[torch.arange(len(tokens)), last]

    return forward


def _lean(model):
    lean = InferenceForward.for_model(model)
    assert lean is not None
    return lambda tokens, cache, last: lean(tokens, cache.positions(), cache, last)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_forward_equals_decoder_forward(folders, model_type, dtype):
    ref_model = models.load_hf_model(folders / model_type, dtype=dtype)
    model = models.load_hf_model(folders / model_type, dtype=dtype)
    ref = _run(_reference(ref_model), ref_model, dtype)
    got = _run(_lean(model), model, dtype)
    if dtype == torch.float32:  # one fused matmul per projection group rounds differently
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:  # low precision keeps the model's order of roundings exactly
        assert torch.equal(got, ref)
    # The model itself still computes the same function on its fused (view) Parameters.
    torch.testing.assert_close(_run(_reference(model), model, dtype), ref, atol=1e-5, rtol=1e-5)


def test_fused_weights_follow_updates(folders):
    model = models.load_hf_model(folders / "qwen3")
    lean = InferenceForward.for_model(model)
    assert InferenceForward.for_model(model) is lean
    assert lean is not None
    donor = models.load_hf_model(folders / "donor")  # same shapes, other values
    block, other = block_of(model, 0), block_of(donor, 0)
    with torch.no_grad():
        # In place, as weight updates do: the fused buffer follows.
        block.attention.wk.weight.copy_(other.attention.wk.weight)
        block.feed_forward.w3.weight.copy_(other.feed_forward.w3.weight)
    torch.testing.assert_close(
        _run(_lean(model), model, torch.float32), _run(_reference(model), model, torch.float32), atol=1e-5, rtol=1e-5
    )
    # A replaced Parameter is picked up by refresh().
    block.attention.wv.weight = nn.Parameter(other.attention.wv.weight.detach().clone(), requires_grad=False)
    lean.refresh()
    torch.testing.assert_close(
        _run(_lean(model), model, torch.float32), _run(_reference(model), model, torch.float32), atol=1e-5, rtol=1e-5
    )


def test_unfused_forward_leaves_a_trained_model_alone_and_follows_its_optimizer(folders):
    model = models.load_hf_model(folders / "qwen3")
    params = dict(model.named_parameters())
    lean = InferenceForward.for_model(model, fuse=False)
    assert lean is not None and InferenceForward.for_model(model, fuse=False) is lean
    # Nothing re-pointed: an optimizer built before still steps the tensors the lean forward reads.
    assert all(p is params[n] for n, p in model.named_parameters())
    ref = _run(_reference(model), model, torch.float32)
    torch.testing.assert_close(_run(lambda t, c, last: lean(t, c.positions(), c, last), model, torch.float32), ref)
    # A fused AdamW step writes the Parameters without moving their version counters: reset() picks it up.
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    new_ref = _run(_reference(model), model, torch.float32)
    assert not torch.allclose(new_ref, ref)
    lean.reset()
    torch.testing.assert_close(_run(lambda t, c, last: lean(t, c.positions(), c, last), model, torch.float32), new_ref)


def test_models_it_cannot_run_are_left_to_their_forward(folders):
    model = models.load_hf_model(folders / "qwen3")
    block_of(model, 1).attention.register_forward_hook(lambda *args: None)
    assert InferenceForward.for_model(model) is None
    critic = models.load_hf_model(folders / "qwen3", is_critic=True)
    assert InferenceForward.for_model(critic) is None
