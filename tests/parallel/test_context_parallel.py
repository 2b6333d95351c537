"""Context parallel (Ulysses): the attention wrapper alone, then the engine under c > 1 against d1.

Engine cases compare per-step losses *and* gradient norms with ``archon:d1`` (same seed and
data, float32).  Losses alone would not do: AdamW's update hardly depends on the gradient's
scale, so a gradient counted once per CP rank (cp times too large) trains to the same losses;
the gradient norm shows it.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import DistributedTestError, run_distributed
from engine_utils import (
    build_engine,
    capture_log,
    critic_losses_and_values,
    engine_config,
    export_after_one_step,
    forward_outputs,
    make_batch,
    resume_losses,
    sft_loss,
    sft_weight,
)
from hf_fixtures import save_tiny_hf

STEPS = 3
VARIANTS: dict[str, dict] = {
    "base": {},
    "ac_full": {"gradient_checkpointing": True},
    # Saves the all-to-alls' outputs instead of repeating the communication in backward.
    "ac_selective_op": {
        "gradient_checkpointing": True,
        "archon": {"ac_mode": "selective", "selective_ac_option": "op"},
    },
    "n_mbs_3": {"mb_spec": {"n_mbs": 3}},
    # d2 gives each data-parallel group 3 of the 6 samples: one microbatch is padding only.
    "n_mbs_4": {"mb_spec": {"n_mbs": 4}},
}


# ---------------------------------------------------------------- the attention wrapper alone
def _ulysses_vs_plain(n_heads: int, n_kv_heads: int, cu_seqlens: list[int] | None, seqlen: int, batch: int):
    """Max |difference| of output and q/k/v gradients between UlyssesAttention on chunks and plain attention."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from models.common.attention import CoreAttention
    from parallel.context_parallel import UlyssesAttention

    cp, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    g = torch.Generator().manual_seed(0)
    head_dim = 8
    q = torch.randn(batch, seqlen, n_heads, head_dim, generator=g)
    k = torch.randn(batch, seqlen, n_kv_heads, head_dim, generator=g)
    v = torch.randn(batch, seqlen, n_kv_heads, head_dim, generator=g)
    weight = torch.randn(batch, seqlen, n_heads, head_dim, generator=g)
    cu = torch.tensor(cu_seqlens, dtype=torch.int32) if cu_seqlens is not None else None

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = CoreAttention(scale=head_dim**-0.5)(*full, cu_seqlens=cu)
    (ref * weight).sum().backward()

    chunk = slice(rank * seqlen // cp, (rank + 1) * seqlen // cp)
    local = [t[:, chunk].clone().requires_grad_() for t in (q, k, v)]
    out = UlyssesAttention(CoreAttention(scale=head_dim**-0.5), mesh)(*local, cu_seqlens=cu)
    (out * weight[:, chunk]).sum().backward()

    errors = [float((out - ref[:, chunk]).abs().max())]
    for mine, whole in zip(local, full):
        assert mine.grad is not None and whole.grad is not None
        errors.append(float((mine.grad - whole.grad[:, chunk]).abs().max()))
    return errors


# Packed rows of 24 tokens.  PACKED: sequences of 5, 9, 3 and 5 tokens and a 2-token padding
# tail; with c2 (chunks of 12) the 9-token sequence crosses the chunk border, with c4 (chunks
# of 6) it crosses two borders and the last sequence a third.  ALIGNED: boundaries exactly at
# the chunk borders 6 and 12, a sequence across the border at 18, a 4-token padding tail.
PACKED = [0, 5, 14, 17, 22]
ALIGNED = [0, 6, 12, 20]


@pytest.mark.parametrize(
    "cp, n_heads, n_kv_heads, cu_seqlens, batch",
    [
        (2, 4, 2, PACKED, 1),  # GQA, KV heads split like query heads
        (2, 4, 1, PACKED, 1),  # one local KV head (t2c2 of a 2-KV-head model): repeated for each rank
        (4, 4, 2, PACKED, 1),  # 2 KV heads over 4 ranks: each repeated twice
        (2, 4, 4, PACKED, 1),  # plain multi-head attention
        (4, 8, 2, PACKED, 1),  # 2 query heads and 1 repeated KV head per rank
        (4, 4, 2, ALIGNED, 1),
        (2, 4, 2, None, 2),  # unpacked causal rows, batch of 2
    ],
)
def test_ulysses_attention_equals_plain_attention(cp, n_heads, n_kv_heads, cu_seqlens, batch):
    for errors in run_distributed(_ulysses_vs_plain, cp, n_heads, n_kv_heads, cu_seqlens, 24, batch):
        assert max(errors) < 1e-5, errors


def _uneven_heads():
    from torch.distributed.device_mesh import init_device_mesh

    from models.common.attention import CoreAttention
    from parallel.context_parallel import UlyssesAttention

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 4, 1, 8)
    try:
        UlyssesAttention(CoreAttention(scale=1.0), mesh)(q, kv, kv)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ulysses_attention_refuses_query_heads_that_do_not_split():
    for message in run_distributed(_uneven_heads, 2):
        assert "local query heads (3, after tensor parallel) to divide by 2" in message


# ---------------------------------------------------------------- the engine against d1
@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name, model_type, kw in [
        ("qwen3", "qwen3", {}),
        ("qwen2", "qwen2", {}),
        ("qwen3_moe", "qwen3_moe", {}),
        ("qwen3_6_heads", "qwen3", {"num_attention_heads": 6}),
    ]:
        folder = tmp_path_factory.mktemp(name)
        save_tiny_hf(folder, model_type, seed=3, **kw)
        out[name] = str(folder)
    return out


def _train(path: str, backend: str, names: list[str]) -> dict[str, list[tuple[float, float]]] | None:
    """(loss, grad_norm) of every step, per variant."""
    import torch.distributed as dist

    from archon.engine.engine import ArchonEngine

    out = {}
    for name in names:
        engine = ArchonEngine(engine_config(path, backend, **VARIANTS[name]), total_steps=STEPS).initialize()
        stats = [engine.train_batch(make_batch(s), sft_loss, sft_weight) for s in range(STEPS)]
        out[name] = [(s["loss"], s["grad_norm"]) for s in stats]
    return out if dist.get_rank() == 0 else None


_REFERENCE: dict[str, list[tuple[float, float]]] = {}


def _reference(path: str) -> list[tuple[float, float]]:
    if path not in _REFERENCE:
        _REFERENCE[path] = run_distributed(_train, 1, path, "archon:d1", ["base"])[0]["base"]
    return _REFERENCE[path]


@pytest.mark.parametrize(
    "model, backend, world, names",
    [
        ("qwen3", "archon:c2", 2, ["base", "ac_full", "ac_selective_op", "n_mbs_3"]),
        ("qwen3", "archon:d2c2", 4, ["base", "n_mbs_4"]),
        ("qwen3", "archon:t2c2", 4, ["base", "ac_full"]),  # 1 KV head per TP rank: repeated for CP
        ("qwen3", "archon:c4", 4, ["base"]),  # 2 KV heads over 4 CP ranks
        ("qwen2", "archon:c2", 2, ["base"]),  # biases in q/k/v
        ("qwen2", "archon:t2c2", 4, ["base"]),
        ("qwen3_moe", "archon:c2", 2, ["base"]),
        ("qwen3_moe", "archon:t2c2", 4, ["base"]),
    ],
)
def test_training_under_cp_equals_single_device(folders, model, backend, world, names):
    ref = _reference(folders[model])
    for name, steps in run_distributed(_train, world, folders[model], backend, names)[0].items():
        for (loss, norm), (ref_loss, ref_norm) in zip(steps, ref):
            assert abs(loss - ref_loss) < 1e-4, f"{model} {backend} {name}: losses {steps} vs d1 {ref}"
            assert abs(norm - ref_norm) < 1e-4 * ref_norm, f"{model} {backend} {name}: grad norms {steps} vs d1 {ref}"


def _sac_decisions(path: str) -> list[str]:
    from archon.engine.engine import ArchonEngine

    records = capture_log("archon.parallel.ac")
    kw = {
        "gradient_checkpointing": True,
        "archon": {"ac_mode": "selective", "selective_ac_option": "op", "ac_debug": True},
    }
    engine = ArchonEngine(engine_config(path, "archon:c2", **kw), total_steps=2).initialize()
    for step in range(2):  # a block logs its decisions when it is checkpointed again
        engine.train_batch(make_batch(step), sft_loss, sft_weight)
    return [r for r in records if r.startswith("AC block")]


def test_selective_ac_keeps_the_all_to_alls(folders):
    """Op-level AC saves the all-to-alls' outputs, so backward does not communicate them again."""
    decisions = run_distributed(_sac_decisions, 2, folders["qwen3"])[0]
    assert decisions
    for line in decisions:
        saved, recomputed = line.split("; recomputed ")
        assert "'all_to_all_single': 4" in saved and "all_to_all" not in recomputed, line


def test_forward_logprobs_under_cp_equal_single_device(folders):
    path = folders["qwen3"]
    ref = run_distributed(forward_outputs, 1, path, "archon:d1")[0]
    mask = make_batch(7, n=5)["attention_mask"].bool()
    for backend, world in [("archon:c2", 2), ("archon:t2c2", 4)]:
        got = run_distributed(forward_outputs, world, path, backend)[0]
        for key in ("logprobs", "entropy"):
            torch.testing.assert_close(got[key][mask], ref[key][mask], atol=1e-5, rtol=1e-5)


def test_critic_values_under_cp(folders):
    ref_losses, ref_norms, ref_values = run_distributed(critic_losses_and_values, 1, folders["qwen3"], "archon:d1")[0]
    losses, norms, values = run_distributed(critic_losses_and_values, 2, folders["qwen3"], "archon:c2")[0]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-4, (losses, ref_losses)
    assert max(abs(a - b) for a, b in zip(norms, ref_norms)) < 1e-4, (norms, ref_norms)
    torch.testing.assert_close(values, ref_values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("first, second", [("archon:d2c2", "archon:d4"), ("archon:d4", "archon:d2c2")])
def test_checkpoint_resumes_across_cp_and_dp(folders, tmp_path, first, second):
    path, ckpt = folders["qwen3"], str(tmp_path / "ckpt")
    full = run_distributed(resume_losses, 4, path, ckpt, "full", first)[0]
    resumed = run_distributed(resume_losses, 4, path, ckpt, "first", first)[0]
    resumed += run_distributed(resume_losses, 4, path, ckpt, "second", second)[0]
    assert max(abs(a - b) for a, b in zip(full, resumed)) < 1e-5, (full, resumed)


def test_export_hf_from_cp_equals_single_device(folders, tmp_path):
    import models

    path = folders["qwen3"]
    run_distributed(export_after_one_step, 1, path, "archon:d1", str(tmp_path / "d1"))
    run_distributed(export_after_one_step, 2, path, "archon:c2", str(tmp_path / "c2"))
    a = models.load_hf_model(tmp_path / "d1").state_dict()
    b = models.load_hf_model(tmp_path / "c2").state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-4, rtol=1e-4)


def test_query_heads_must_split_over_tp_times_cp(folders):
    # 6 query heads and 2 KV heads: t2 alone is fine, t2 x c2 = 4 does not divide 6.
    with pytest.raises(
        DistributedTestError,
        match=r"num_attention_heads=6 is not divisible by tensor x context "
        r"parallel t2 x c2 = 4",
    ):
        run_distributed(build_engine, 4, folders["qwen3_6_heads"], "archon:t2c2")
