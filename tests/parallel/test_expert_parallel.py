"""Expert parallel (EP, ETP, MoE parallel folding) against the single-device run.

Every layout trains the tiny Qwen3-MoE for 3 steps with the engine and is compared with
``archon:d1`` (same seed and data, float32): per-step losses and gradient norms within
1e-4, and every parameter's first-step gradient within 1e-5.  Losses alone would not do:
AdamW's update is invariant to a parameter's gradient scale, so a wrong divide factor on
the expert gradients barely moves the losses; the gradients and their norm catch it.
"""

from __future__ import annotations

from typing import cast

import pytest
import torch
from dist_utils import DistributedTestError, run_distributed
from engine_utils import (
    build_engine,
    engine_config,
    export_after_one_step,
    forward_outputs,
    make_batch,
    sft_loss,
    sft_weight,
)
from hf_fixtures import save_tiny_hf

STEPS = 3
VARIANTS: dict[str, dict] = {
    "base": {},
    "ac_full_n_mbs_3": {"gradient_checkpointing": True, "mb_spec": {"n_mbs": 3}},
    "ac_selective_op": {
        "gradient_checkpointing": True,
        "archon": {"ac_mode": "selective", "selective_ac_option": "op"},
    },
    "n_mbs_3": {"mb_spec": {"n_mbs": 3}},
    "hsdp": {"archon": {"dp_replicate": 2}},
    "reshard_never": {"archon": {"reshard_after_forward_policy": "never"}},
}
HYBRID_ETP_TP = "archon:(attn:d2t2|ffn:t2e2)"
"""Experts split over ep=2 (from dp_shard) and over the 2 TP ranks on the hidden dim (etp = tp)."""
HYBRID_ETP_1 = "archon:(attn:d2t2|ffn:t1e4)"
"""Experts split over all 4 ranks (EP borrows the dp_shard and TP ranks, etp = 1)."""
ETP_OVER_DP = "archon:(attn:d4|ffn:t2e2)"
"""Expert TP without attention TP: pairs of data-parallel ranks pool their tokens for each expert's halves."""
ETP_WIDER_THAN_TP = "archon:(attn:d2t2|ffn:t4)"
"""Expert TP 4 over attention TP 2 (two TP groups of different data pool their tokens), no EP."""
JOBS: dict[int, list[tuple[str, str]]] = {
    2: [
        ("archon:d2e2", "base"),
        ("archon:d2e2", "ac_full_n_mbs_3"),
        ("archon:d2e2", "ac_selective_op"),
        ("archon:d2e2", "reshard_never"),
        ("archon:t2e2", "base"),
        ("archon:t2e2", "ac_full_n_mbs_3"),
        # Context parallel beside EP: EP borrows the cp ranks, each routes its own chunk of the row.
        ("archon:c2e2", "base"),
        # Expert TP pooling the tokens of two data-parallel ranks.
        ("archon:(attn:d2|ffn:t2)", "base"),
    ],
    4: [
        ("archon:d4e2", "base"),
        ("archon:d4e2", "hsdp"),
        ("archon:d4e4", "base"),
        ("archon:d2t2e2", "base"),
        (HYBRID_ETP_TP, "base"),
        (HYBRID_ETP_TP, "ac_selective_op"),
        (HYBRID_ETP_TP, "n_mbs_3"),
        (HYBRID_ETP_1, "base"),
        ("archon:(attn:d2c2|ffn:e4)", "base"),
        ("archon:(attn:t2c2|ffn:t1e4)", "base"),
        (ETP_OVER_DP, "base"),
        (ETP_OVER_DP, "ac_full_n_mbs_3"),
        (ETP_WIDER_THAN_TP, "base"),
        ("archon:(attn:d2c2|ffn:t2e2)", "base"),
    ],
}
"""(allocation, variant) pairs trained per world size; the first of each allocation also checks gradients."""
FORWARD_LAYOUTS = {
    2: ["archon:d2e2", "archon:(attn:d2|ffn:t2)"],
    4: ["archon:d2t2e2", HYBRID_ETP_TP, HYBRID_ETP_1, ETP_OVER_DP, ETP_WIDER_THAN_TP],
}


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("qwen3_moe")
    save_tiny_hf(folder, "qwen3_moe", seed=5)
    return str(folder)


@pytest.fixture(scope="module")
def six_experts_path(tmp_path_factory) -> str:
    """6 experts: under d4e2 each EP rank holds 3, which FSDP splits unevenly (2 + 1) over efsdp=2."""
    folder = tmp_path_factory.mktemp("qwen3_moe_6")
    save_tiny_hf(folder, "qwen3_moe", seed=6, num_experts=6)
    return str(folder)


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    from parallel.fqn import clean_fqn

    return {
        clean_fqn(n): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _train(path: str, backend: str, variant: str, with_grads: bool) -> dict:
    """Losses and grad norms of STEPS steps; with ``with_grads``, every full gradient of the first step."""
    from archon.engine.engine import ArchonEngine

    engine = ArchonEngine(engine_config(path, backend, **VARIANTS[variant]), total_steps=STEPS).initialize()
    grads: dict[str, torch.Tensor] = {}

    def keep_first_grads(*_) -> None:
        # Runs after clipping, right before the update: a collective every rank reaches.
        if engine.step == 0:
            assert engine.model is not None
            grads.update(_full_grads(engine.model))

    if with_grads:
        assert engine.optimizer is not None
        engine.optimizer.register_step_pre_hook(keep_first_grads)
    stats = [engine.train_batch(make_batch(s), sft_loss, sft_weight) for s in range(STEPS)]
    return {
        "losses": [s["loss"] for s in stats],
        "grad_norms": [s["grad_norm"] for s in stats],
        "grads": grads,
        "with_grads": with_grads,
    }


def _run_jobs(path: str, jobs: list[tuple[str, str]], forward_layouts: list[str]):
    import torch.distributed as dist

    seen: set[str] = set()
    trained = []
    for backend, variant in jobs:
        trained.append(_train(path, backend, variant, with_grads=backend not in seen))
        seen.add(backend)
    forwards = [forward_outputs(path, backend) for backend in forward_layouts]
    return (trained, forwards) if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def reference(moe_path) -> tuple[dict, dict[str, torch.Tensor]]:
    (trained,), (forward,) = run_distributed(_run_jobs, 1, moe_path, [("archon:d1", "base")], ["archon:d1"])[0]
    return trained, forward


def _assert_matches(got: dict, ref: dict, what: str) -> None:
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
    assert loss_diff < 1e-4, f"{what}: losses {got['losses']} vs d1 {ref['losses']}"
    norm_diff = max(abs(a - b) for a, b in zip(got["grad_norms"], ref["grad_norms"]))
    assert norm_diff < 1e-4, f"{what}: grad norms {got['grad_norms']} vs d1 {ref['grad_norms']}"
    if got["with_grads"]:
        assert got["grads"], f"{what}: no first-step gradients were recorded"
        assert got["grads"].keys() == ref["grads"].keys(), what
        for name, grad in got["grads"].items():
            torch.testing.assert_close(
                grad,
                ref["grads"][name],
                atol=1e-5,
                rtol=1e-4,
                msg=lambda m, name=name: f"{what}: gradient of {name}: {m}",
            )


@pytest.mark.parametrize("world", [2, 4])
def test_layouts_match_single_device(moe_path, reference, world):
    """Losses, grad norms, first-step gradients and forward logprobs of every EP layout equal d1's.

    The first loss is computed with the HF weights as loaded into the EP layout, so it also
    checks loading.
    """
    ref, ref_forward = reference
    trained, forwards = run_distributed(_run_jobs, world, moe_path, JOBS[world], FORWARD_LAYOUTS[world])[0]
    for (backend, variant), got in zip(JOBS[world], trained):
        _assert_matches(got, ref, f"{backend} {variant}")
    mask = make_batch(7, n=5)["attention_mask"].bool()
    for backend, got in zip(FORWARD_LAYOUTS[world], forwards):
        for key in ("logprobs", "entropy"):
            torch.testing.assert_close(
                got[key][mask],
                ref_forward[key][mask],
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m, backend=backend, key=key: f"{backend} forward {key}: {m}",
            )


def test_uneven_expert_shards_match_single_device(six_experts_path):
    ref = run_distributed(_run_jobs, 1, six_experts_path, [("archon:d1", "base")], [])[0][0][0]
    (got,), _ = run_distributed(_run_jobs, 4, six_experts_path, [("archon:d4e2", "base")], [])[0]
    _assert_matches(got, ref, "6 experts, archon:d4e2")


# ---- dispatch and combine alone -----------------------------------------------------------

_COUNTS = {
    # Per rank, per global expert (8 experts, ep=2: rank 0 owns 0-3, rank 1 owns 4-7).  Rank 1
    # sends nothing to rank 0; experts 1 and 6 get no token from anyone.
    0: [3, 0, 2, 1, 4, 1, 0, 2],
    1: [0, 0, 0, 0, 5, 2, 0, 1],
}


def _dispatch_combine(etp: int, alignment: int | None, compiled: bool) -> list[str]:
    """EP (x ETP) experts against the unsharded experts on the same tokens: outputs and gradients.

    ``compiled`` runs the EP module under torch.compile (aot_eager: dynamo and autograd
    tracing without inductor's slow codegen) to check the hooks' graph breaks.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    from models.common.moe import GroupedExperts
    from parallel.expert_parallel import ExpertParallel

    dim, hidden, n_experts = 16, 8, 8
    rank = dist.get_rank()
    ep_rank = rank // etp
    torch.manual_seed(0)
    full = GroupedExperts(dim, hidden, n_experts)
    full.init_weights(0.3)
    sharded = GroupedExperts(dim, hidden, n_experts)
    sharded.load_state_dict(full.state_dict())
    mesh = (
        init_device_mesh("cpu", (2, etp), mesh_dim_names=("ep", "etp"))
        if etp > 1
        else init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    )
    ExpertParallel(token_group_alignment=alignment)._apply(sharded, mesh)

    counts = torch.tensor(_COUNTS[ep_rank])
    gen = torch.Generator().manual_seed(10 + ep_rank)  # ETP ranks of one EP rank share their tokens
    x = torch.randn(int(counts.sum()), dim, generator=gen)
    out_grad = torch.randn(x.shape, generator=gen)

    x_ref = x.clone().requires_grad_(True)
    out_ref = full(x_ref, counts)
    (out_ref * out_grad).sum().backward()
    for p in full.parameters():  # expert weights see the tokens of every EP rank
        assert p.grad is not None
        p.grad /= etp
        dist.all_reduce(p.grad)

    x_ep = x.clone().requires_grad_(True)
    run = torch.compile(sharded, backend="aot_eager") if compiled else sharded
    out = run(x_ep, counts)
    (out * out_grad).sum().backward()
    if etp > 1:  # each ETP rank holds a hidden slice: its output is a partial sum
        out = out.detach().clone()
        dist.all_reduce(out, group=mesh["etp"].get_group())

    failures = []
    if not torch.allclose(out, out_ref, atol=1e-5):
        failures.append(f"rank {rank}: outputs differ by {(out - out_ref).abs().max():.2e}")
    x_grad = x_ep.grad
    assert x_grad is not None and x_ref.grad is not None
    if etp > 1:  # each ETP rank's token gradient covers its hidden slice; the pooling style sums them
        x_grad = x_grad.clone()
        dist.all_reduce(x_grad, group=mesh["etp"].get_group())
    if not torch.allclose(x_grad, x_ref.grad, atol=1e-5):
        failures.append(f"rank {rank}: token gradients differ by {(x_grad - x_ref.grad).abs().max():.2e}")
    for name, p in sharded.named_parameters():
        dp = cast(DTensor, p)  # ExpertParallel made every parameter a DTensor
        ref_grad = distribute_tensor(
            getattr(full, name).grad, dp.device_mesh, dp.placements, src_data_rank=None
        ).to_local()
        if p.grad is None or not torch.allclose(cast(DTensor, p.grad).to_local(), ref_grad, atol=1e-5):
            failures.append(f"rank {rank}: gradient of {name} differs")
    return failures


@pytest.mark.parametrize(
    "etp, alignment, compiled", [(1, None, False), (1, 8, False), (2, None, False), (1, None, True)]
)
def test_dispatch_and_combine_match_unsharded_experts(etp, alignment, compiled):
    """Uneven counts, a rank sending nothing to another, experts without tokens; padding; ETP; compile."""
    for failures in run_distributed(_dispatch_combine, 2 * etp, etp, alignment, compiled):
        assert not failures, failures


def test_local_expert_order_regroups_and_pads():
    from parallel.expert_parallel import local_expert_order

    received = torch.tensor([[2, 0, 1], [1, 3, 0]])  # 2 source ranks x 3 local experts
    buffer = torch.arange(int(received.sum()))  # arrival order: (s0: e0 e0 e2) (s1: e0 e1 e1 e1)
    gather, back, counts = local_expert_order(received)
    local = buffer[gather]
    assert local.tolist() == [0, 1, 3, 4, 5, 6, 2] and counts.tolist() == [3, 3, 1]
    assert torch.equal(local[back], buffer)
    gather, back, counts = local_expert_order(received, alignment=4)
    padded = torch.cat([buffer, torch.tensor([-1])])[gather]
    assert counts.tolist() == [4, 4, 4]
    assert padded.tolist() == [0, 1, 3, -1, 4, 5, 6, -1, 2, -1, -1, -1]
    assert torch.equal(padded[back], buffer)


# ---- weights in and out ----------------------------------------------------------------------


def _hf_reads(path: str, backend: str) -> dict[str, set[int]]:
    """Which experts of layer 0 this rank read from the HF checkpoint, per projection."""
    import re

    from archon.engine.engine import ArchonEngine
    from models import hf_checkpoint

    read: dict[str, set[int]] = {}
    reader = hf_checkpoint._TensorReader
    original_read, original_full = reader.read, reader.full

    def note(key: str) -> None:
        m = re.match(r"model\.layers\.0\.mlp\.experts\.(\d+)\.(\w+)\.weight", key)
        if m:
            read.setdefault(m.group(2), set()).add(int(m.group(1)))

    reader.read = lambda self, index: (note(self._key), original_read(self, index))[1]
    reader.full = lambda self: (note(self._key), original_full(self))[1]
    try:
        ArchonEngine(engine_config(path, backend)).initialize()
    finally:
        reader.read, reader.full = original_read, original_full
    return read


# Experts each rank holds, from the sparse mesh [efsdp, ep, etp] (etp fastest): EP takes
# consecutive blocks of E/ep experts, FSDP splits a block further over efsdp (unevenly: 3 -> 2 + 1).
_LOCAL_EXPERTS = {
    ("archon:d4e2", 8): {0: {0, 1}, 1: {4, 5}, 2: {2, 3}, 3: {6, 7}},  # rank = 2*efsdp + ep
    ("archon:d4e2", 6): {0: {0, 1}, 1: {3, 4}, 2: {2}, 3: {5}},
    (HYBRID_ETP_TP, 8): {0: {0, 1, 2, 3}, 1: {0, 1, 2, 3}, 2: {4, 5, 6, 7}, 3: {4, 5, 6, 7}},  # rank = 2*ep + etp
    (ETP_OVER_DP, 8): {0: {0, 1, 2, 3}, 1: {0, 1, 2, 3}, 2: {4, 5, 6, 7}, 3: {4, 5, 6, 7}},
    (ETP_WIDER_THAN_TP, 8): {r: set(range(8)) for r in range(4)},  # no EP: every rank a quarter of each expert
}


@pytest.mark.parametrize("layout, n_experts", list(_LOCAL_EXPERTS))
def test_hf_load_reads_only_local_experts(moe_path, six_experts_path, layout, n_experts):
    path = moe_path if n_experts == 8 else six_experts_path
    for rank, read in enumerate(run_distributed(_hf_reads, 4, path, layout)):
        assert set(read) == {"gate_proj", "up_proj", "down_proj"}
        for proj, experts in read.items():
            assert experts == _LOCAL_EXPERTS[layout, n_experts][rank], (
                f"{layout} ({n_experts} experts) rank {rank} read {proj} of experts {experts}"
            )


def _resume(path: str, ckpt: str, phase: str, backends: list[str]) -> list[list[float]] | None:
    import torch.distributed as dist

    from archon.engine.engine import ArchonEngine

    steps = 4
    out = []
    for backend in backends:
        engine = ArchonEngine(engine_config(path, backend), total_steps=steps).initialize()
        if phase == "save":
            out.append([engine.train_batch(make_batch(s), sft_loss, sft_weight)["loss"] for s in range(2)])
            engine.save(ckpt, extra_state={"data_position": 2})
        elif phase == "load":
            assert engine.load(ckpt) == {"data_position": 2} and engine.step == 2
            out.append([engine.train_batch(make_batch(s), sft_loss, sft_weight)["loss"] for s in range(2, steps)])
        else:
            out.append([engine.train_batch(make_batch(s), sft_loss, sft_weight)["loss"] for s in range(steps)])
    return out if dist.get_rank() == 0 else None


def test_checkpoint_saved_under_ep_resumes_under_other_layouts(moe_path, tmp_path):
    """Saved with experts over [efsdp, ep, etp]; loaded under d4, d4e4 and d1: the uninterrupted losses."""
    ckpt = str(tmp_path / "ckpt")
    (full,) = run_distributed(_resume, 1, moe_path, ckpt, "full", ["archon:d1"])[0]
    (first,) = run_distributed(_resume, 4, moe_path, ckpt, "save", [HYBRID_ETP_TP])[0]
    resumed = run_distributed(_resume, 4, moe_path, ckpt, "load", ["archon:d4", "archon:d4e4"])[0]
    resumed += run_distributed(_resume, 1, moe_path, ckpt, "load", ["archon:d1"])[0]
    for backend, second in zip(["archon:d4", "archon:d4e4", "archon:d1"], resumed):
        diff = max(abs(a - b) for a, b in zip(full, first + second))
        assert diff < 1e-5, f"{HYBRID_ETP_TP} -> {backend}: {first + second} vs uninterrupted {full}"


def test_export_hf_from_ep_equals_single_device(moe_path, tmp_path):
    import models

    run_distributed(export_after_one_step, 1, moe_path, "archon:d1", str(tmp_path / "d1"))
    run_distributed(export_after_one_step, 4, moe_path, HYBRID_ETP_TP, str(tmp_path / "ep"))
    a = models.load_hf_model(tmp_path / "d1").state_dict()
    b = models.load_hf_model(tmp_path / "ep").state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-4, rtol=1e-4)


# ---- what is refused -----------------------------------------------------------------------


def test_unsupported_expert_layouts_are_refused_clearly(six_experts_path, tmp_path):
    with pytest.raises(DistributedTestError, match="num_experts=6 is not divisible by the expert-parallel size e4"):
        run_distributed(build_engine, 4, six_experts_path, "archon:d4e4")
    dense = tmp_path / "dense"
    save_tiny_hf(dense, "qwen3", seed=1)
    with pytest.raises(DistributedTestError, match="has no MoE layers, so expert parallel e2 has nothing to split"):
        run_distributed(build_engine, 2, str(dense), "archon:d2e2")
