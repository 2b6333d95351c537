"""ParallelDims: validation, and every mesh's groups for many layouts (fake process group, up to 64 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from parallel.dims import ParallelDims


def dims(world, dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1) -> ParallelDims:
    return ParallelDims(
        dp_shard=dp_shard, dp_replicate=dp_replicate, cp=cp, tp=tp, pp=pp, ep=ep, etp=etp, world_size=world
    )


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(world=8, dp_shard=2, tp=2), "does not equal world_size=8"),
        (dict(world=4, dp_shard=0, tp=2), "dp_shard=0 must be at least 1"),
        (dict(world=4, dp_shard=2, tp=2, ep=3), "ep*etp = 3*1 must divide dp_shard*cp*tp = 4"),
        (dict(world=4, dp_shard=2, tp=2, ep=4, etp=2), "ep*etp = 4*2 must divide dp_shard*cp*tp = 4"),
        (dict(world=4, dp_shard=4, etp=3), "ep*etp = 1*3 must divide dp_shard*cp*tp = 4"),
        (dict(world=6, dp_shard=-1, tp=4), "not divisible by dp_replicate*cp*tp*pp=4"),
    ],
)
def test_validation_errors(kw, fragment):
    with pytest.raises(ValueError, match=None) as info:
        dims(**kw)
    assert fragment in str(info.value)


def test_from_allocation_duck_typed_and_fill():
    from archon.alloc import ModelAllocation

    pd = ParallelDims.from_allocation(ModelAllocation.from_str("archon:(attn:d1p4t2c2|ffn:d1p4t1e4)"))
    assert (pd.pp, pd.dp_shard, pd.cp, pd.tp, pd.ep, pd.etp, pd.world_size) == (4, 1, 2, 2, 4, 1, 16)
    assert pd.describe() == "pp=4, dp_shard=1, tp=2, cp=2, ep=4, etp=1"
    hsdp = ParallelDims.from_allocation(ModelAllocation.from_str("archon:d8"), dp_replicate=2)
    assert (hsdp.dp_replicate, hsdp.dp_shard) == (2, 4)
    assert dims(16, dp_shard=-1, tp=2, pp=2).dp_shard == 4
    with pytest.raises(ValueError, match="needs 4 ranks"):
        ParallelDims.from_allocation(ModelAllocation.from_str("archon:d4"), world_size=8)
    assert dims(8, dp_shard=2, cp=2, tp=2).fsdp_gradient_divide_factor == 4
    assert dims(8, dp_shard=2, cp=2, tp=2).seq_len_divisor == 4


def expected_groups(world: int, pd: ParallelDims) -> dict[str, list[list[int]]]:
    """Rank groups of every mesh, computed independently with tensor reshapes of arange(world)."""
    r = torch.arange(world).reshape(pd.pp, pd.dp_replicate, pd.dp_shard, pd.cp, pd.tp)

    def groups(keep: list[int]) -> list[list[int]]:
        # Move the kept dims last and flatten them: each row is one group.
        other = [d for d in range(5) if d not in keep]
        t = r.permute(*other, *keep).reshape(-1, int(torch.tensor([r.shape[d] for d in keep]).prod()))
        return [sorted(row.tolist()) for row in t]

    out = {
        "pp": groups([0]),
        "dp_replicate": groups([1]),
        "dp_shard": groups([2]),
        "cp": groups([3]),
        "tp": groups([4]),
        "dp": groups([1, 2]),
        "dp_shard_cp": groups([2, 3]),
        "dp_cp": groups([1, 2, 3]),
    }
    if pd.ep > 1 or pd.etp > 1:
        # Inside one (pp, dp_replicate) block the ranks (dp_shard, cp, tp) are consecutive; EP takes
        # consecutive chunks of ep*etp ranks' worth with etp fastest.
        s = r.reshape(pd.pp, pd.dp_replicate, pd.efsdp, pd.ep, pd.etp)

        def sub(keep: list[int]) -> list[list[int]]:
            return [
                sorted(row.tolist())
                for row in s.permute(*[d for d in range(5) if d not in keep], *keep).reshape(
                    -1, int(torch.tensor([s.shape[d] for d in keep]).prod())
                )
            ]

        out.update(ep=sub([3]), etp=sub([4]), efsdp=sub([2]))
    return out


LAYOUTS = [
    dict(world=8, dp_shard=8),
    dict(world=8, tp=8),
    dict(world=8, dp_shard=2, tp=4),
    dict(world=16, dp_shard=4, pp=2, tp=2),
    dict(world=16, dp_shard=2, pp=2, tp=2, cp=2),
    dict(world=8, pp=4, dp_shard=1, dp_replicate=2),
    dict(world=8, pp=2, dp_shard=2, dp_replicate=2),
    dict(world=8, dp_shard=8, ep=4, etp=1),
    dict(world=4, dp_shard=2, tp=2, ep=4, etp=1),
    dict(world=8, dp_shard=2, cp=2, tp=2, ep=2, etp=2),
    dict(world=16, pp=4, dp_shard=1, cp=2, tp=2, ep=4, etp=1),
    dict(world=64, dp_shard=4, pp=2, tp=2, cp=2, dp_replicate=2, ep=4, etp=1),
    dict(world=64, dp_shard=8, pp=2, tp=2, cp=2, ep=8, etp=2),
    # Expert TP unlike attention's: larger than tp, smaller than tp, without tp, without ep.
    dict(world=8, dp_shard=2, tp=4, ep=2, etp=2),
    dict(world=8, dp_shard=4, tp=2, ep=1, etp=4),
    dict(world=4, dp_shard=4, ep=2, etp=2),
    dict(world=16, pp=2, dp_shard=2, tp=2, cp=2, ep=2, etp=4),
]


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank: int, world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "-".join(f"{k}{v}" for k, v in lay.items()))
def test_mesh_groups_match_hand_computed(fake_world, layout):
    world = layout["world"]
    for rank in sorted({0, world // 2 + 1, world - 1}):
        fake_world(rank, world)
        pd = dims(**layout)
        pd.build_meshes("cpu")
        expected = expected_groups(world, pd)
        for name, groups in expected.items():
            mine = next(g for g in groups if rank in g)
            mesh = pd.get_optional_mesh(name)
            if len(mine) == 1:
                assert mesh is None, name
                with pytest.raises(ValueError, match="has size 1"):
                    pd.get_mesh(name)
                continue
            assert mesh is not None and mesh.ndim == 1, name
            assert sorted(mesh.mesh.flatten().tolist()) == mine, (name, rank)
            assert sorted(dist.get_process_group_ranks(mesh.get_group())) == mine, (name, rank)
        assert pd.world_mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        if pd.dp_replicate > 1 and pd.dp_shard * pd.cp > 1:
            assert pd.get_mesh("hsdp").mesh_dim_names == ("dp_replicate", "dp_shard_cp")
        if pd.etp == pd.tp > 1:  # experts keep the TP layout
            assert pd.get_mesh("etp").mesh.tolist() == pd.get_mesh("tp").mesh.tolist()
        assert (pd.sparse_mesh is not None) == (pd.ep > 1 or pd.etp > 1)


def _real_groups(layout: dict) -> dict[str, float]:
    pd = dims(**layout)
    pd.build_meshes("cpu")
    out = {}
    for name in ("tp", "dp", "dp_shard_cp", "dp_cp", "cp", "pp", "ep", "etp", "efsdp"):
        mesh = pd.get_optional_mesh(name)
        if mesh is None:
            continue
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=mesh.get_group())
        out[name] = t.item()
    return out


@pytest.mark.parametrize(
    "layout",
    [
        dict(world=2, tp=2),
        dict(world=4, dp_shard=2, tp=2, ep=2, etp=1),
        dict(world=4, dp_shard=2, cp=2, ep=2, etp=1),
        dict(world=4, dp_replicate=2, dp_shard=1, pp=2),
    ],
)
def test_real_gloo_groups_reduce_over_the_right_ranks(layout):
    world = layout["world"]
    results = run_distributed(_real_groups, world, layout)
    pd = dims(**layout)
    expected = expected_groups(world, pd)
    for rank, got in enumerate(results):
        for name, value in got.items():
            group = next(g for g in expected[name] if rank in g)
            assert value == float(sum(group)), (name, rank)
