"""The invariant the engine relies on: losses of weighted microbatches add up to the full batch's."""

import itertools
from typing import Any, cast

import pytest
import torch

from archon.rl.losses import AGG_MODES, loss_weight, make_actor_loss_fn, make_critic_loss_fn
from archon.rl.rejection_sampling import RejectionSampling


def _random_rl_batch(B=6, S=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [9, 5, 7, 3, 8, 6]
    prompt = [2, 1, 3, 3, 2, 1]
    attention = torch.zeros(B, S, dtype=torch.long)
    loss_mask = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        attention[b, : lengths[b]] = 1
        if b != 3:  # row 3 has no trained token at all
            loss_mask[b, prompt[b] : lengths[b]] = 1
    return {
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "old_logprobs": -torch.rand(B, S, generator=g) * 2,
        "logprobs": -torch.rand(B, S, generator=g) * 2,
        "ref_logprobs": -torch.rand(B, S, generator=g) * 2,
        "advantages": torch.randn(B, S, generator=g),
        "old_values": torch.randn(B, S, generator=g),
        "returns": torch.randn(B, S, generator=g),
    }, {
        "logprobs": -torch.rand(B, S, generator=g) * 2,
        "entropy": torch.rand(B, S, generator=g) * 3,
        "values": torch.randn(B, S, generator=g),
    }


def _rows(tensors, idx):
    idx_t = torch.tensor(idx, dtype=torch.long)
    width = int(tensors["attention_mask"][idx_t].sum(-1).max()) if idx else 0
    return {k: v[idx_t][:, :width] for k, v in tensors.items()}


SPLITS = [
    [[0, 1, 2, 3, 4, 5]],
    [[0], [1], [2], [3], [4], [5]],
    [[0, 5], [1, 3], [2, 4]],
    [[3], [0, 1, 2, 4, 5], []],  # a microbatch with no loss tokens and an empty one
]


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("kind", ["actor", "decoupled-gspo", "critic"])
def test_weighted_microbatch_losses_equal_full_batch(mode, kind):
    batch, outputs = _random_rl_batch()
    if kind == "critic":
        loss_fn = make_critic_loss_fn(value_eps_clip=0.3, agg_mode=mode, max_response_len=9)
        out_keys = {"attention_mask": batch["attention_mask"], "values": outputs["values"]}
    else:
        extra: dict[str, Any] = (
            dict(
                use_decoupled_loss=True,
                importance_sampling_level="sequence",
                rejection_sampling=RejectionSampling(upper=1.5),
            )
            if kind == "decoupled-gspo"
            else {}
        )
        loss_fn = make_actor_loss_fn(
            eps_clip=0.2,
            eps_clip_higher=0.3,
            c_clip=2.0,
            entropy_coef=0.01,
            kl_loss_coef=0.1,
            kl_loss_type="k3",
            agg_mode=mode,
            max_response_len=9,
            **extra,
        )
        out_keys = {
            "attention_mask": batch["attention_mask"],
            "logprobs": outputs["logprobs"],
            "entropy": outputs["entropy"],
        }
    leaves = {k: v.clone().requires_grad_() for k, v in out_keys.items() if k != "attention_mask"}

    def run(split):
        total_w = sum(loss_weight(_rows(batch, mb), mode) for mb in split)
        total, stats_acc, grads = 0.0, {}, None
        for k in leaves:
            leaves[k].grad = None
        for mb in split:
            mb_batch = _rows(batch, mb)
            idx = torch.tensor(mb, dtype=torch.long)
            width = mb_batch["loss_mask"].shape[1]
            mb_out = {k: v[idx][:, :width] for k, v in leaves.items()}
            loss, stats = loss_fn(mb_out, mb_batch)
            w = loss_weight(mb_batch, mode)
            (loss * w / total_w).backward()
            total += loss.item() * w / total_w
            for k, v in stats.items():
                stats_acc[k] = stats_acc.get(k, 0.0) + v.item() * w / total_w
        grads = {k: cast(torch.Tensor, v.grad).clone() for k, v in leaves.items()}
        return total, stats_acc, grads

    ref_loss, ref_stats, ref_grads = run(SPLITS[0])
    for split in SPLITS[1:]:
        loss, stats, grads = run(split)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), split
        for k in ref_stats:
            assert stats[k] == pytest.approx(ref_stats[k], rel=1e-5, abs=1e-6), (k, split)
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k])
    # The data really exercises the non-trivial branches.
    if kind == "critic":
        assert 0 < ref_stats["value_clip_frac"] < 1
    elif kind == "actor":
        assert 0 < ref_stats["clip_frac"] < 1 and 0 < ref_stats["dual_clip_frac"] < 1
    else:
        assert 0 < ref_stats["clip_frac"] < 1 and 0 < ref_stats["behav_filtered_frac"] < 1


def test_loss_weight_counts():
    m = torch.tensor([[0, 1, 1], [0, 0, 0], [1, 0, 0]])
    assert loss_weight({"loss_mask": m}, "token-mean") == 3.0
    for mode in AGG_MODES[1:]:
        assert loss_weight({"loss_mask": m}, mode) == 2.0
    assert loss_weight({"loss_mask": m[:0]}, "token-mean") == 0.0


def test_all_splits_cover_rows():
    # Guard for the invariant test: every split uses every row exactly once.
    for split in SPLITS:
        assert sorted(itertools.chain.from_iterable(split)) == list(range(6))
