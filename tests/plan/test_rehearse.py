"""Rehearsing a layout: the shrunken model, a 4-rank rehearsal against one device, and failures."""

from __future__ import annotations

import pytest
from paths import REPO

from archon.alloc import ModelAllocation
from archon.config import load_config
from archon.plan.params import model_args_of, read_model_config
from archon.plan.rehearse import RehearsalError, _first_difference, rehearse, shrink

DENSE = REPO / "configs" / "qwen3_8b_dense.toml"
MOE = REPO / "configs" / "qwen3_30b_a3b_moe.toml"
# The MoE recipe's kind of layout in 4 ranks: pipeline, attention TP, experts EP borrowing the TP ranks.
MOE_4 = "actor.backend=archon:(attn:d1p2t2|ffn:d1p2t1e2)"


@pytest.mark.parametrize(
    "path, layers, heads, kv, experts",
    [
        (DENSE, 4, 4, 2, 0),  # d4p2t2, Interleaved1F1B: 2 stages per rank -> 4 layers; t2 -> 2 kv heads, GQA kept
        (MOE, 8, 4, 2, 4),  # p4 x 2 stages; t2 x c2 = 4 query heads; e4 -> 4 experts
    ],
)
def test_shrunken_model_is_the_smallest_the_allocation_splits(monkeypatch, path, layers, heads, kv, experts):
    monkeypatch.chdir(REPO)
    cfg = load_config(path)
    plan = shrink(read_model_config(cfg.actor), cfg.actor)
    hf = plan.hf_config
    assert hf["model_type"] == read_model_config(cfg.actor)["model_type"]
    assert (hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"]) == (layers, heads, kv)
    assert hf.get("num_experts", 0) == experts
    p = ModelAllocation.from_str(cfg.actor.backend).parallel
    assert hf["num_attention_heads"] % (p.tp_size * p.cp_size) == 0 and hf["intermediate_size"] % p.tp_size == 0
    _, args = model_args_of(hf)  # the model reads the shrunken config
    assert args.n_layers == layers
    assert plan.engine.dtype == "float32" and not plan.engine.archon.enable_compile
    assert plan.engine.archon.pp_schedule == cfg.actor.archon.pp_schedule  # the schedule is what is rehearsed
    changed = "\n".join(plan.changes)
    assert f"mb_spec.n_mbs = {2 * p.pp_size} (was {cfg.actor.mb_spec.n_mbs})" in changed
    assert "dtype = float32 (was bfloat16)" in changed and "enable_compile = false" in changed


def test_four_rank_moe_layout_trains_like_one_device(monkeypatch):
    monkeypatch.chdir(REPO)
    plan, result = rehearse(load_config(MOE, [MOE_4], job="sft"), steps=2)
    assert result.ok, result.first_difference
    assert len(result.layout) == len(result.reference) == 2
    assert result.layout[1]["loss"] != result.layout[0]["loss"]  # the update changed the model


def test_first_difference_names_the_step_and_values():
    ref = [{"loss": 2.0, "grad_norm": 1.0}, {"loss": 1.5, "grad_norm": 0.9}]
    assert _first_difference([dict(r) for r in ref], ref) is None
    bad = [dict(ref[0]), {"loss": 1.5, "grad_norm": 0.95}]
    diff = _first_difference(bad, ref)
    assert diff is not None and diff.startswith("step 2: grad_norm 0.95 under the layout but 0.9 on one device")


def test_a_layout_that_cannot_train_is_one_line(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(MOE, ["actor.backend=archon:d1p2", "actor.archon.pp_schedule=InterleavedZeroBubble"], job="sft")
    with pytest.raises(RehearsalError, match=r"rank \d failed: .*op-level selective AC") as info:
        rehearse(cfg, steps=1)
    assert "\n" not in str(info.value) and "Traceback" in info.value.details


@pytest.mark.slow
def test_dense_recipe_full_16_rank_layout_trains_like_one_device(monkeypatch):
    # archon:d4p2t2 with Interleaved1F1B: FSDP x pipeline x tensor parallel, ~1 minute on 2 cores.
    monkeypatch.chdir(REPO)
    _, result = rehearse(load_config(DENSE, job="sft"), steps=2)
    assert result.ok, result.first_difference
