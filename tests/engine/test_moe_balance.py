"""MoE load balancing (aux loss, aux-loss-free bias) and router statistics, against references.

* single device: the loss of a step with the aux loss equals the SFT loss plus
  ``coef * sum_l L_l``, ``L_l`` computed by transformers' ``load_balancing_loss_func`` over the
  whole batch (one layer at a time, divided by top_k: Megatron's normalisation); the bias
  after a step equals ``rate * sign(mean - counts)`` with counts from transformers' routers;
* every layout (data, context, tensor, expert, pipeline parallel, several microbatches,
  activation checkpointing) gives d1's losses, gradient norms, router statistics and biases.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from engine_utils import engine_config, make_batch, sft_loss, sft_weight
from hf_fixtures import block_of, save_tiny_hf

STEPS = 3
AUX = {"moe_load_balance": "aux_loss", "moe_aux_loss_coef": 0.5}
FREE = {"moe_load_balance": "aux_free", "moe_bias_update_rate": 0.05}


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("qwen3_moe_balance")
    save_tiny_hf(folder, "qwen3_moe", seed=7)
    return str(folder)


def _biases(engine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.named_full_tensors(extras=True) if n.endswith("correction_bias")}


def _train(path: str, backend: str, archon: dict, kw: dict) -> dict | None:
    import torch.distributed as dist

    from archon.engine.engine import ArchonEngine

    cfg = engine_config(path, backend, archon=dict(archon), **kw)
    engine = ArchonEngine(cfg, total_steps=STEPS).initialize()
    stats = [engine.train_batch(make_batch(s), sft_loss, sft_weight) for s in range(STEPS)]
    biases = _biases(engine)
    return {"stats": stats, "biases": biases} if dist.get_rank() == 0 else None


def _jobs(path: str, jobs: list[tuple[str, dict, dict]]) -> list | None:
    import torch.distributed as dist

    out = [_train(path, backend, archon, kw) for backend, archon, kw in jobs]
    return out if dist.get_rank() == 0 else None


def _assert_same(got: dict, ref: dict, what: str) -> None:
    for step, (a, b) in enumerate(zip(got["stats"], ref["stats"])):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) < 1e-4, f"{what} step {step}: {key} {a[key]} vs d1 {b[key]}"
        moe_keys = sorted(k for k in b if k.startswith("moe/"))
        assert moe_keys and sorted(k for k in a if k.startswith("moe/")) == moe_keys, what
        for key in moe_keys:
            assert abs(a[key] - b[key]) < 1e-5, f"{what} step {step}: {key} {a[key]} vs d1 {b[key]}"
    assert got["biases"].keys() == ref["biases"].keys() and got["biases"], what
    for name, bias in got["biases"].items():
        assert torch.equal(bias, ref["biases"][name]), f"{what}: {name} {bias} vs d1 {ref['biases'][name]}"


# ---- single device against transformers ---------------------------------------------------


def _hf_router_reference(path: str, batch: dict[str, torch.Tensor]) -> tuple[float, list[float], torch.Tensor]:
    """(SFT loss, per-layer L_l, per-layer counts [layers, E]) of transformers' model on ``batch``."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    cfg = hf.config
    with torch.no_grad():
        out = hf(batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["loss_mask"][:, 1:]
    sft = float(-(logp * mask).sum() / mask.sum())
    per_layer, counts = [], []
    attn = batch["attention_mask"]
    for logits in out.router_logits:
        hf_loss = load_balancing_loss_func((logits,), cfg.num_experts, cfg.num_experts_per_tok, attn)
        per_layer.append(float(hf_loss) / cfg.num_experts_per_tok)
        chosen = torch.topk(torch.softmax(logits, -1), cfg.num_experts_per_tok, -1).indices
        chosen = chosen.view(*attn.shape, -1)[attn.bool()]
        counts.append(torch.bincount(chosen.flatten(), minlength=cfg.num_experts).float())
    return sft, per_layer, torch.stack(counts)


def _first_step(path: str, archon: dict, n_mbs: int) -> dict:
    from archon.engine.engine import ArchonEngine

    engine = ArchonEngine(
        engine_config(path, "archon:d1", archon=dict(archon), mb_spec={"n_mbs": n_mbs}), total_steps=1
    ).initialize()
    stats = engine.train_batch(make_batch(0), sft_loss, sft_weight)
    return {"stats": stats, "biases": _biases(engine)}


@pytest.mark.parametrize("n_mbs", [1, 3])
def test_aux_loss_is_the_global_batch_switch_loss(moe_path, n_mbs):
    """Microbatches change nothing: the counts are the step's, not a microbatch's."""
    sft, per_layer, counts = _hf_router_reference(moe_path, make_batch(0))
    (got,) = run_distributed(_first_step, 1, moe_path, AUX, n_mbs)
    stats = got["stats"]
    expected = sft + AUX["moe_aux_loss_coef"] * sum(per_layer)
    assert abs(stats["loss"] - expected) < 1e-5, (stats["loss"], expected)
    assert abs(stats["moe/aux_loss"] - sum(per_layer) / len(per_layer)) < 1e-5
    imbalance = [float(c.max() / c.mean()) for c in counts]
    assert abs(stats["moe/load_imbalance_max"] - max(imbalance)) < 1e-6
    for layer, value in enumerate(imbalance):
        assert abs(stats[f"moe/load_imbalance/layer_{layer}"] - value) < 1e-6
    assert stats["moe/zero_load_expert_frac"] == float((counts == 0).float().mean())
    assert per_layer[0] > 1.0  # a real imbalance to balance


def test_aux_free_bias_moves_against_the_load(moe_path):
    _, _, counts = _hf_router_reference(moe_path, make_batch(0))
    (got,) = run_distributed(_first_step, 1, moe_path, FREE, 1)
    rate = FREE["moe_bias_update_rate"]
    for layer, c in enumerate(counts):
        expected = rate * torch.sign(c.mean() - c)
        torch.testing.assert_close(
            got["biases"][f"model.layers.{layer}.mlp.gate.e_score_correction_bias"], expected, rtol=0, atol=0
        )
    assert got["stats"]["moe/expert_bias_abs_max"] == pytest.approx(rate)
    # No aux loss is added in this mode.
    assert "moe/aux_loss" not in got["stats"]


def test_balancing_off_keeps_zero_bias_and_reports_statistics(moe_path):
    (got,) = run_distributed(_first_step, 1, moe_path, {}, 1)
    assert all(float(b.abs().max()) == 0.0 for b in got["biases"].values())
    assert got["stats"]["moe/load_imbalance_max"] >= 1.0 and "moe/aux_loss" not in got["stats"]


# ---- every layout against d1 -----------------------------------------------------------------

JOBS = {
    2: [
        ("archon:d2e2", AUX, {}),
        ("archon:d2e2", FREE, {}),
        ("archon:c2e2", AUX, {}),
        ("archon:c2e2", FREE, {}),
        # Several microbatches and recomputation (activation checkpointing must not count twice).
        ("archon:d2e2", AUX, {"mb_spec": {"n_mbs": 2}, "gradient_checkpointing": True}),
        ("archon:d2e2", FREE, {"mb_spec": {"n_mbs": 2}, "gradient_checkpointing": True}),
    ],
    4: [
        ("archon:(attn:d2t2|ffn:t2e2)", AUX, {}),
        ("archon:(attn:d2t2|ffn:t2e2)", FREE, {}),
        ("archon:(attn:p2c2|ffn:p2e2)", AUX, {"archon": {"pp_schedule": "1F1B"}}),
        ("archon:(attn:p2c2|ffn:p2e2)", FREE, {"archon": {"pp_schedule": "1F1B"}}),
    ],
}


def _merge(archon: dict, kw: dict) -> tuple[dict, dict]:
    kw = dict(kw)
    return {**archon, **kw.pop("archon", {})}, kw


@pytest.fixture(scope="module")
def references(moe_path) -> dict[str, dict]:
    got = run_distributed(_jobs, 1, moe_path, [("archon:d1", AUX, {}), ("archon:d1", FREE, {})])[0]
    return {"aux_loss": got[0], "aux_free": got[1]}


@pytest.mark.parametrize("world", [2, 4])
def test_balancing_is_allocation_invariant(moe_path, references, world):
    jobs = [(backend, *_merge(archon, kw)) for backend, archon, kw in JOBS[world]]
    results = run_distributed(_jobs, world, moe_path, jobs)[0]
    for (backend, archon, kw), got in zip(jobs, results):
        _assert_same(got, references[archon["moe_load_balance"]], f"{backend} {archon} {kw}")


# ---- router dtype ----------------------------------------------------------------------------


def _gate_dtypes(path: str, backend: str, router_dtype: str) -> list[tuple] | None:
    """(input, weight, output) dtypes of every gate call during one bf16 training step, and whether the
    output equals a float32 matmul of the float32 master weight."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from archon.engine.engine import ArchonEngine

    cfg = engine_config(path, backend, archon={"moe_router_dtype": router_dtype})
    cfg.dtype = "bfloat16"
    engine = ArchonEngine(cfg, total_steps=1).initialize()
    seen = []
    weights = []

    def keep_weight(module, inputs):
        # After FSDP's pre-forward hook: the unsharded weight the matmul uses.
        w = module.weight.to_local() if isinstance(module.weight, DTensor) else module.weight
        weights.append(w.detach().clone())

    def record(module, inputs, output):
        weight = weights.pop()
        x = inputs[0].to_local() if isinstance(inputs[0], DTensor) else inputs[0]
        out = output.to_local() if isinstance(output, DTensor) else output
        exact = torch.equal(out.float(), F.linear(x.float(), weight.float())) if out.dtype == torch.float32 else None
        seen.append((x.dtype, weight.dtype, out.dtype, exact))

    assert engine.model is not None
    for name, module in engine.model.named_modules():
        if name.endswith("router.gate"):
            module.register_forward_pre_hook(keep_weight)
            module.register_forward_hook(record)
    engine.train_batch(make_batch(0), sft_loss, sft_weight)
    return seen if dist.get_rank() == 0 else None


@pytest.mark.parametrize("backend, world", [("archon:d1", 1), ("archon:d2", 2)])
def test_router_dtype_float32_keeps_the_gate_in_float32_under_bf16(moe_path, backend, world):
    """d1 computes under autocast, d2 under FSDP mixed precision (the gate gets its own float32 unit)."""
    fp32 = run_distributed(_gate_dtypes, world, moe_path, backend, "float32")[0]
    assert fp32 and all(s[:3] == (torch.float32,) * 3 and s[3] for s in fp32), fp32
    auto = run_distributed(_gate_dtypes, world, moe_path, backend, "auto")[0]
    assert auto and all(s[2] == torch.bfloat16 for s in auto), auto


# ---- the bias in checkpoints and exports ----------------------------------------------------


def _resume_free(path: str, ckpt: str, phase: str, backend: str) -> dict | None:
    """aux_free training split in two phases (``full`` runs all 4 steps); losses and final biases."""
    import torch.distributed as dist

    from archon.engine.engine import ArchonEngine

    archon = {**FREE, "pp_schedule": "1F1B"}
    engine = ArchonEngine(engine_config(path, backend, archon=archon), total_steps=4).initialize()
    if phase == "second":
        engine.load(ckpt)
    todo = {"full": range(4), "first": range(2), "second": range(2, 4)}[phase]
    losses = [engine.train_batch(make_batch(s), sft_loss, sft_weight)["loss"] for s in todo]
    if phase == "first":
        engine.save(ckpt)
    result = {"losses": losses, "biases": _biases(engine)}
    return result if dist.get_rank() == 0 else None


def test_bias_is_checkpointed_and_resharded(moe_path, tmp_path):
    """Saved under EP x ETP, resumed under pipeline x context parallel: the uninterrupted run."""
    ckpt = str(tmp_path / "ckpt")
    (full,) = run_distributed(_resume_free, 1, moe_path, ckpt, "full", "archon:d1")[:1]
    first = run_distributed(_resume_free, 4, moe_path, ckpt, "first", "archon:(attn:d2t2|ffn:t2e2)")[0]
    assert any(float(b.abs().max()) > 0 for b in first["biases"].values())
    second = run_distributed(_resume_free, 4, moe_path, ckpt, "second", "archon:(attn:p2c2|ffn:p2e2)")[0]
    diff = max(abs(a - b) for a, b in zip(full["losses"], first["losses"] + second["losses"]))
    assert diff < 1e-5, (full["losses"], first["losses"] + second["losses"])
    for name, bias in full["biases"].items():
        assert torch.equal(second["biases"][name], bias), name


def _export(path: str, out: str, extras: bool) -> None:
    from archon.engine.engine import ArchonEngine

    engine = ArchonEngine(engine_config(path, "archon:d1", archon=dict(FREE)), total_steps=1).initialize()
    engine.train_batch(make_batch(0), sft_loss, sft_weight)
    engine.export_hf(out, extras=extras)


def test_hf_export_leaves_the_bias_out_and_sync_folders_carry_it(moe_path, tmp_path):
    from safetensors import safe_open

    import models

    def keys(folder) -> set[str]:
        found = set()
        for shard in folder.glob("*.safetensors"):
            with safe_open(shard, framework="pt") as f:
                found.update(f.keys())
        return found

    run_distributed(_export, 1, moe_path, str(tmp_path / "hf"), False)
    run_distributed(_export, 1, moe_path, str(tmp_path / "sync"), True)
    assert not [k for k in keys(tmp_path / "hf") if "correction_bias" in k]  # Qwen's HF format has no field
    assert len([k for k in keys(tmp_path / "sync") if "correction_bias" in k]) == 2
    served = models.load_hf_model(tmp_path / "sync", dtype=torch.bfloat16)  # as the built-in server loads it
    bias = block_of(served, 0).moe.expert_bias
    assert bias.dtype == torch.float32 and float(bias.abs().max()) == pytest.approx(FREE["moe_bias_update_rate"])
    assert float(block_of(models.load_hf_model(tmp_path / "hf"), 0).moe.expert_bias.abs().max()) == 0.0
