import pytest
import torch

from archon.engine.microbatch import balanced_partition, pack, plan_microbatches, rows_of, seqlens_of, unpack


def make_batch(lengths: list[int], width: int | None = None) -> dict[str, torch.Tensor]:
    width = width or max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.arange(100 * (b + 1), 100 * (b + 1) + n)
        mask[b, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "rewards": torch.arange(len(lengths), dtype=torch.float)}


def test_balanced_partition_is_deterministic_and_balanced():
    sizes = [9, 1, 5, 5, 3, 7]
    parts = balanced_partition(sizes, list(range(6)), 2)
    # Longest-first greedy by hand: 9->A, 7->B, 5->B(7<9), 5->A(9<12), 3->A(14 vs 12 -> B)...
    # loads: A=9, B=7 ; 5 -> B (12) ; 5 -> A (14) ; 3 -> B (15) ; 1 -> A (15)
    assert parts == [[0, 1, 3], [2, 4, 5]]
    assert sum(sizes[i] for i in parts[0]) == sum(sizes[i] for i in parts[1]) == 15


def test_plan_covers_every_sample_once_with_equal_microbatch_counts():
    lens = [5, 12, 3, 8, 8, 2, 11, 4, 9]
    plan = plan_microbatches(lens, dp_size=3, n_mbs=2, max_tokens_per_mb=12)
    counts = {len(r) for r in plan.per_rank}
    assert len(counts) == 1  # every dp rank runs the same number of microbatches
    seen = sorted(i for rank in plan.per_rank for mb in rank for i in mb)
    assert seen == list(range(len(lens)))
    for rank in plan.per_rank:
        for mb in rank:
            assert sum(lens[i] for i in mb) <= 12
    with pytest.raises(ValueError, match="max_tokens_per_mb=10"):
        plan_microbatches(lens, dp_size=1, max_tokens_per_mb=10)


def test_grouped_samples_stay_in_one_microbatch_counted_with_their_shared_tokens_once():
    # Two groups of 4 samples sharing 10 tokens (sizes 10 + 4 * 3 = 22 each) and two lone samples.
    lens = [13, 13, 13, 13, 13, 13, 13, 13, 20, 2]
    groups = [([0, 2, 4, 6], 10), ([1, 3, 5, 7], 10)]
    plan = plan_microbatches(lens, dp_size=2, n_mbs=1, max_tokens_per_mb=24, groups=groups)
    mbs = [mb for rank in plan.per_rank for mb in rank]
    assert sorted(i for mb in mbs for i in mb) == list(range(10))
    for members, _ in groups:
        assert any(set(members) <= set(mb) for mb in mbs), (members, mbs)
    # Balanced by shared size: 22 + 2 on one rank, 22 and 20 on the other (two microbatches there).
    assert plan.n_microbatches == 2
    # A group larger than max_tokens_per_mb is planned sample by sample.
    split = plan_microbatches(lens, dp_size=1, n_mbs=1, max_tokens_per_mb=20, groups=groups)
    assert all(sum(lens[i] for i in mb) <= 20 for mb in split.per_rank[0])
    # Without groups the plan is the per-sample one.
    assert plan_microbatches(lens, 2, 1, 24, groups=[]).per_rank == plan_microbatches(lens, 2, 1, 24).per_rank


def test_more_ranks_than_samples_gives_empty_microbatches():
    plan = plan_microbatches([4, 6], dp_size=4, n_mbs=1)
    assert sorted(map(len, (mb for r in plan.per_rank for mb in r))) == [0, 0, 1, 1]


def test_pack_positions_cu_seqlens_and_padding():
    batch = make_batch([3, 5, 2])
    mb = pack(batch, [0, 2], multiple_of=4)
    assert mb.tokens.tolist() == [[100, 101, 102, 300, 301, 0, 0, 0]]
    assert mb.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert mb.cu_seqlens.tolist() == [0, 3, 5, 8]
    assert mb.n_real_tokens == 5
    fixed = pack(batch, [1], pad_to=8)
    assert fixed.total_len == 8 and fixed.cu_seqlens.tolist() == [0, 5, 8]
    empty = pack(batch, [], multiple_of=2)
    assert empty.total_len == 2 and empty.n_real_tokens == 0


def test_unpack_inverts_pack_and_rows_of_trims():
    batch = make_batch([3, 5, 2], width=7)
    mb = pack(batch, [1, 2], multiple_of=4)
    rows = unpack(mb.tokens[0].float(), mb)
    sub = rows_of(batch, [1, 2])
    assert sub["input_ids"].shape == (2, 5) and sub["rewards"].tolist() == [1.0, 2.0]
    assert torch.equal(rows.long() * sub["attention_mask"], sub["input_ids"] * sub["attention_mask"])
    assert seqlens_of(sub) == [5, 2]


def test_unpack_is_differentiable():
    batch = make_batch([2, 3])
    mb = pack(batch, [0, 1], multiple_of=8)
    values = torch.randn(mb.total_len, requires_grad=True)
    unpack(values, mb).sum().backward()
    assert values.grad is not None and values.grad.tolist() == [1.0] * 5 + [0.0] * 3
