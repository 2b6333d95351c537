"""The contracts between layers: typed parallelize options, keyword-only model-spec functions,
checkpoints made of Stateful parts, one source for generation defaults, and which errors
become one-line messages."""

from __future__ import annotations

import dataclasses
import inspect
import random

import pytest
import torch
from dist_utils import run_distributed
from paths import REPO

# ---- parallelize options ---------------------------------------------------------------------------


def test_parallelize_options_are_built_from_the_engine_config():
    from archon.config import ArchonEngineConfig, TrainEngineConfig
    from archon.engine.options import parallelize_options, pipeline_options
    from parallel.options import ParallelizeOptions

    archon = ArchonEngineConfig(
        ac_mode="full",
        selective_ac_option="2",
        ac_memory_budget=0.3,
        ac_debug=True,
        enable_compile=False,
        offload_params=True,
        reshard_after_forward_policy="never",
        use_deterministic_algorithms=True,
        moe_router_dtype="float32",
        pp_schedule="ZBVZeroBubble",
        pp_layers_per_stage=3,
    )
    cfg = TrainEngineConfig(dtype="bfloat16", grad_reduce_dtype="bfloat16", gradient_checkpointing=True, archon=archon)
    assert parallelize_options(cfg) == ParallelizeOptions(
        param_dtype="bfloat16",
        reduce_dtype="bfloat16",
        ac_mode="full",
        selective_ac_option="2",
        ac_memory_budget=0.3,
        ac_debug=True,
        enable_compile=False,
        cpu_offload=True,
        reshard_after_forward_policy="never",
        deterministic=True,
        moe_router_dtype="float32",
    )
    pipe = pipeline_options(cfg)
    assert (pipe.schedule, pipe.layers_per_stage) == ("ZBVZeroBubble", 3)
    # Without gradient_checkpointing the AC mode does not apply at all.
    off = parallelize_options(dataclasses.replace(cfg, gradient_checkpointing=False))
    assert off.ac_mode == "none" and not off.ac_enabled
    assert parallelize_options(cfg).router_dtype == torch.float32
    assert ParallelizeOptions().router_dtype is None


def test_without_compile_copies_and_leaves_the_engine_options_alone():
    from parallel.options import ParallelizeOptions

    options = ParallelizeOptions(enable_compile=True, ac_mode="full")
    stage = options.without_compile()
    assert not stage.enable_compile and stage.ac_mode == "full" and options.enable_compile
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.enable_compile = False  # type: ignore[misc]


def test_model_spec_functions_take_keyword_arguments():
    import models
    from models.registry import _SPECS

    for name in ("qwen2", "qwen3", "qwen3_moe"):
        spec = models.get_model_spec(name)
        params = inspect.signature(spec.parallelize_fn).parameters
        assert [p.kind for n, p in params.items() if n != "model"] == [inspect.Parameter.KEYWORD_ONLY] * 2, name
        assert set(params) == {"model", "parallel_dims", "options"}
        assert spec.pipelining_fn is not None, name
        pipe = inspect.signature(spec.pipelining_fn).parameters
        assert set(pipe) == {"model", "parallel_dims", "options", "pipeline", "parallelize_fn", "device"}
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for n, p in pipe.items() if n != "model")
    assert len(_SPECS) >= 3


def test_layout_description_names_hsdp_replicas():
    from parallel.dims import ParallelDims

    hsdp = ParallelDims(dp_shard=2, dp_replicate=2, cp=1, tp=2, pp=1, ep=1, etp=1, world_size=8)
    assert hsdp.describe() == "pp=1, dp_replicate=2, dp_shard=2, tp=2, cp=1, ep=1, etp=1"


def test_layout_errors_are_their_own_class_and_user_errors():
    from archon.errors import user_error_types
    from parallel.dims import ParallelDims
    from parallel.errors import ParallelConfigError

    with pytest.raises(ParallelConfigError, match="does not equal world_size=8"):
        ParallelDims(dp_shard=2, dp_replicate=1, cp=1, tp=2, pp=1, ep=1, etp=1, world_size=8)
    assert ParallelConfigError in user_error_types()


# ---- checkpoints hold states -----------------------------------------------------------------------


def test_train_state_restores_step_and_every_generator():
    from archon.checkpoint.state import TrainState

    state = TrainState(step=7)
    saved = state.state_dict()
    expected_py, expected_torch = random.random(), torch.rand(3)
    _ = random.random(), torch.rand(3)  # move both generators on
    other = TrainState()
    other.load_state_dict(saved)
    assert other.step == 7
    assert random.random() == expected_py
    torch.testing.assert_close(torch.rand(3), expected_torch)


def _round_trip_plain_states(folder: str) -> dict:
    """A checkpoint of Stateful parts around a plain module: no engine, no model spec."""
    from pathlib import Path

    from archon.checkpoint.dcp import load_checkpoint, save_checkpoint
    from archon.checkpoint.state import TrainState, engine_states

    def parts(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        return model, optimizer, scheduler

    model, optimizer, scheduler = parts(0)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    save_checkpoint(
        engine_states(model, optimizer, scheduler, TrainState(step=1)),
        Path(folder),
        {"at": 1},
        name="probe",
        allocation="archon:d1",
    )
    fresh, fresh_opt, fresh_sched = parts(1)
    train = TrainState()
    extra = load_checkpoint(engine_states(fresh, fresh_opt, fresh_sched, train), Path(folder), name="probe")
    moments = [fresh_opt.state[p]["exp_avg"].clone() for p in fresh.parameters()]
    return {
        "extra": extra,
        "step": train.step,
        "lr": fresh_opt.param_groups[0]["lr"],
        "equal_weights": all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters())),
        "equal_moments": all(
            torch.equal(a, optimizer.state[p]["exp_avg"]) for a, p in zip(moments, model.parameters())
        ),
    }


def test_checkpoint_code_works_on_a_dict_of_states(tmp_path):
    out = run_distributed(_round_trip_plain_states, 1, str(tmp_path / "ckpt"), timeout=120)[0]
    assert out == {
        "extra": {"at": 1},
        "step": 1,
        "lr": pytest.approx(0.05),
        "equal_weights": True,
        "equal_moments": True,
    }


def test_the_moe_routing_bias_is_part_of_the_model_state(tmp_path):
    from hf_fixtures import block_of, save_tiny_hf

    import models
    from archon.checkpoint.state import ModelState

    save_tiny_hf(tmp_path / "moe", "qwen3_moe", seed=3)
    model = models.load_hf_model(tmp_path / "moe")
    state = ModelState(model).state_dict()
    assert {"layers.0.moe.expert_bias", "layers.1.moe.expert_bias"} <= set(state)
    # Aux-free balancing moves the bias every step; loading puts a checkpoint's bias back.
    saved = {k: v.clone() + 0.5 for k, v in state.items()}
    ModelState(model).load_state_dict(saved)
    torch.testing.assert_close(block_of(model, 1).moe.expert_bias, saved["layers.1.moe.expert_bias"])


def test_checkpoint_code_does_not_import_the_engine():
    import ast

    root = REPO / "archon" / "checkpoint"
    for name in ("dcp.py", "manager.py", "state.py"):
        tree = ast.parse((root / name).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "archon.engine.engine" not in imported, name


# ---- generation defaults -----------------------------------------------------------------------------


def test_request_sampling_derives_from_the_generation_config():
    from archon.config import SGLANG_DEFAULT_MAX_NEW_TOKENS, GenerationConfig
    from archon.rollout.server_api import sampling_params
    from archon.server.protocol import parse_sampling_params
    from archon.server.sampling import SamplingParams

    g = GenerationConfig()
    # What the trainer sends is the config, field by field; the server's defaults never apply.
    parsed = parse_sampling_params(sampling_params(g))
    shared = {f.name for f in dataclasses.fields(GenerationConfig)} - {"n_samples"}
    assert shared <= {f.name for f in dataclasses.fields(SamplingParams)}
    assert {k: getattr(parsed, k) for k in shared} == {k: getattr(g, k) for k in shared}
    # A request without max_new_tokens gets SGLang's default, named once in the config module.
    assert SamplingParams().max_new_tokens == parse_sampling_params({}).max_new_tokens == SGLANG_DEFAULT_MAX_NEW_TOKENS
    defaults = SamplingParams()
    assert {k: getattr(defaults, k) for k in shared - {"max_new_tokens"}} == {
        k: getattr(g, k) for k in shared - {"max_new_tokens"}
    }


# ---- which errors become one-line messages -----------------------------------------------------------


def test_plan_cli_keeps_the_traceback_of_a_bug(monkeypatch, capsys):
    import archon.plan.layout
    from archon.plan.show import main

    assert main(["actor.backend=archon:d3t3", "cluster.n_gpus_per_node=4"]) == 2  # a user error: one line
    assert "error:" in capsys.readouterr().err

    def bug(*args, **kwargs):
        raise ValueError("an internal bug")

    monkeypatch.setattr(archon.plan.layout, "plan_for_config", bug)
    with pytest.raises(ValueError, match="an internal bug"):
        main(["cluster.n_gpus_per_node=8"])


def test_plot_cli_keeps_the_traceback_of_a_bug(tmp_path, monkeypatch):
    import archon.tools.plot

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')

    def bug(*args, **kwargs):
        raise ValueError("an internal bug")

    monkeypatch.setattr(archon.tools.plot, "plot_run", bug)
    with pytest.raises(ValueError, match="an internal bug"):
        archon.tools.plot.main([str(tmp_path)])
