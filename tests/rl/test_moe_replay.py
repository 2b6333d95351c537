"""MoE routing replay: the built-in server reports the experts it chose, the trainer replays them.

* the generator's routed experts equal the routing of a plain forward over the same tokens
  (no KV cache), in SGLang's shape ``[prompt + output - 1, layers, top_k]``, and travel as
  SGLang's base64 int32 through the HTTP server and the client;
* the engine's forward and training with replayed choices equal a single-device forward of
  the model with those choices forced, on every layout, and the router still gets gradients;
* the RL loop end to end: the server and the trainer agree to 1e-5 with replay and
  aux-loss-free balancing on (the bias reaches the server with the weights).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from dist_utils import run_distributed
from engine_utils import make_batch, sft_loss, sft_weight
from hf_fixtures import make_tiny_tokenizer, random_tokens, save_tiny_hf
from moe_refs import routing_of

import models
from archon.server.generator import GenerationRequest, Generator
from archon.server.sampling import SamplingParams

if TYPE_CHECKING:
    pass


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("qwen3_moe_replay")
    save_tiny_hf(folder, "qwen3_moe", seed=11)
    return str(folder)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_generator_reports_the_experts_of_every_token_it_ran(moe_path, batch_invariant):
    model = models.load_hf_model(moe_path)
    prompts = [random_tokens(n, seed=n) for n in (3, 7, 5)]
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=s, ignore_eos=True) for s in range(3)]
    # 2 rows: prefills and decodes interleave (batch-invariant: one forward per row, routing kept after each).
    with Generator(model, max_running_requests=2, batch_invariant=batch_invariant) as gen:
        results = gen.generate(
            [
                GenerationRequest(p, sp, return_routed_experts=True, routed_experts_start_len=s)
                for p, sp, s in zip(prompts, params, (0, 2, 0))
            ]
        )
        plain = gen.generate([GenerationRequest(prompts[0], params[0])])[0]
    reference = models.load_hf_model(moe_path)
    for prompt, result, start in zip(prompts, results, (0, 2, 0)):
        fed = prompt + result.output_ids[:-1]  # the last sampled token is never run
        expected = routing_of(reference, fed)[start:]
        assert result.routed_experts is not None
        assert result.routed_experts.dtype == torch.int32
        assert result.routed_experts.shape == (len(fed) - start, 2, 2)
        assert torch.equal(result.routed_experts, expected)
    assert plain.routed_experts is None


def test_server_returns_routed_experts_as_sglang_does(moe_path):
    from archon.rollout.client import RolloutClient
    from archon.server.app import serve_in_thread

    model = models.load_hf_model(moe_path)
    server = serve_in_thread(Generator(model, random_seed=0), model_path=moe_path)
    try:
        with RolloutClient([server.url]) as client:
            prompt = random_tokens(4, seed=3)
            result = client.generate(
                prompt, {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}, return_routed_experts=True
            )
            plain = client.generate(prompt, {"max_new_tokens": 2, "temperature": 0})
    finally:
        server.stop()
    # SGLang's decoding (sglang.srt.state_capturer.routed_experts.extract_routed_experts_from_meta_info).
    assert result.routed_experts.dtype == np.int32
    routed = torch.from_numpy(result.routed_experts.reshape(-1, 2, 2).copy())
    assert torch.equal(routed, routing_of(models.load_hf_model(moe_path), prompt + result.output_ids[:-1]))
    assert plain.routed_experts is None


def test_routed_experts_are_token_aligned_in_the_rollout_batch():
    from archon.rl.rollout_batch import Completion, build_rollout_batch, routed_experts_array

    routed = [np.arange(6 * 3 * 2, dtype=np.int32) % 4, np.arange(3 * 3 * 2, dtype=np.int32) % 3]
    completions = [
        Completion([1, 2, 3], [4, 5, 6, 7], [-0.1] * 4, "stop", routed_experts_array(routed[0], 3, 2)),
        Completion([1, 2], [4, 5], [-0.2] * 2, "length", routed_experts_array(routed[1], 3, 2)),
    ]
    batch = build_rollout_batch(completions, [1.0, 0.0])
    got = batch["routed_experts"]
    assert got.shape == (2, 7, 3, 2) and got.dtype == torch.int16
    assert torch.equal(got[0, :6], torch.from_numpy(routed[0].reshape(6, 3, 2)).short())
    assert (got[0, 6] == -1).all()  # the last token was never run by the server
    assert torch.equal(got[1, :3], torch.from_numpy(routed[1].reshape(3, 3, 2)).short())
    assert (got[1, 3:] == -1).all()  # its last token and the padding
    with pytest.raises(ValueError, match="routed experts for 5 tokens, expected 6"):
        build_rollout_batch(
            [Completion([1, 2, 3], [4, 5, 6, 7], [-0.1] * 4, "stop", routed_experts_array(routed[0][:30], 3, 2))], [1.0]
        )


# ---- the engine replays --------------------------------------------------------------------


def _replay_batch(step: int) -> dict[str, torch.Tensor]:
    """``make_batch`` plus random expert choices (distinct per token) for all but each row's last token."""
    batch = make_batch(step, n=5)
    g = torch.Generator().manual_seed(50 + step)
    b, s = batch["input_ids"].shape
    choices = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(b * s * 2)]).view(b, s, 2, 2)
    lens = batch["attention_mask"].sum(1)
    for row, n in enumerate(lens.tolist()):
        choices[row, n - 1 :] = -1
    batch["routed_experts"] = choices.short()
    return batch


def _actor_config(path: str, backend: str, **kw):
    from archon.config import ActorConfig, ArchonEngineConfig, MicroBatchSpec, OptimizerConfig

    archon = {"enable_compile": False, **kw.pop("archon", {})}
    return ActorConfig(
        backend=backend,
        path=path,
        dtype="float32",
        archon=ArchonEngineConfig(**archon),
        optimizer=OptimizerConfig(lr=1e-2, warmup_steps=1),
        mb_spec=MicroBatchSpec(n_mbs=2),
        moe_routing_replay=True,
        **kw,
    )


def _replayed(path: str, backend: str, kw: dict) -> dict | None:
    import torch.distributed as dist

    from archon.engine.engine import ArchonEngine

    engine = ArchonEngine(_actor_config(path, backend, **kw), total_steps=2).initialize()
    forward = engine.forward(_replay_batch(0))
    grads: list[float] = []

    def gate_grad(*_) -> None:
        from torch.distributed.tensor import DTensor

        assert engine.model is not None
        g = [p.grad for n, p in engine.model.named_parameters() if n.endswith("router.gate.weight")]
        g = [x.full_tensor() if isinstance(x, DTensor) else x for x in g if x is not None]
        grads.append(float(sum(x.norm() for x in g)) if g else 0.0)

    assert engine.optimizer is not None
    engine.optimizer.register_step_pre_hook(gate_grad)
    stats = [engine.train_batch(_replay_batch(s), sft_loss, sft_weight) for s in range(2)]
    out = {
        "forward": forward,
        "losses": [s["loss"] for s in stats],
        "norms": [s["grad_norm"] for s in stats],
        "gate_grad": grads,
    }
    return out if dist.get_rank() == 0 else None


def _jobs(path: str, jobs: list[tuple[str, dict]]) -> list | None:
    import torch.distributed as dist

    out = [_replayed(path, backend, kw) for backend, kw in jobs]
    return out if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def replay_reference(moe_path):
    return run_distributed(_jobs, 1, moe_path, [("archon:d1", {})])[0][0]


def test_engine_forward_replays_the_given_experts(moe_path, replay_reference):
    """The engine's logprobs equal a plain forward with the choices forced, and differ from free routing."""
    model = models.load_hf_model(moe_path)
    batch = _replay_batch(0)
    for row in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][row].sum())
        tokens = batch["input_ids"][row, :n][None]
        with torch.no_grad():
            replayed = model(tokens, routed_experts=batch["routed_experts"][row, :n][None].long())
            free = model(tokens)
        logp = torch.log_softmax(replayed[0, :-1], -1).gather(-1, tokens[0, 1:, None])[:, 0]
        free_logp = torch.log_softmax(free[0, :-1], -1).gather(-1, tokens[0, 1:, None])[:, 0]
        got = replay_reference["forward"]["logprobs"][row, 1:n]
        torch.testing.assert_close(got, logp, atol=1e-5, rtol=1e-5)
        assert (got - free_logp).abs().max() > 1e-3  # replay really changed the routing
    assert all(g > 0 for g in replay_reference["gate_grad"])  # router gradients flow through the scores


REPLAY_LAYOUTS = {
    2: [("archon:d2e2", {}), ("archon:c2e2", {})],
    4: [
        ("archon:(attn:d2t2|ffn:t2e2)", {}),
        ("archon:(attn:d4|ffn:t2e2)", {}),
        ("archon:(attn:p2c2|ffn:p2e2)", {"archon": {"pp_schedule": "1F1B"}}),
    ],
}


@pytest.mark.parametrize("world", [2, 4])
def test_replay_is_allocation_invariant(moe_path, replay_reference, world):
    results = run_distributed(_jobs, world, moe_path, REPLAY_LAYOUTS[world])[0]
    mask = make_batch(0, n=5)["attention_mask"].bool()
    for (backend, _), got in zip(REPLAY_LAYOUTS[world], results):
        torch.testing.assert_close(
            got["forward"]["logprobs"][mask],
            replay_reference["forward"]["logprobs"][mask],
            atol=1e-5,
            rtol=1e-5,
            msg=lambda m, backend=backend: f"{backend}: {m}",
        )
        for key in ("losses", "norms"):
            diff = max(abs(a - b) for a, b in zip(got[key], replay_reference[key]))
            assert diff < 1e-4, f"{backend} {key}: {got[key]} vs d1 {replay_reference[key]}"


def test_replay_needs_an_moe_model(tmp_path):
    from dist_utils import DistributedTestError

    save_tiny_hf(tmp_path / "dense", "qwen3", seed=1)
    with pytest.raises(DistributedTestError, match="has no MoE layers to replay"):
        run_distributed(_replayed, 1, str(tmp_path / "dense"), "archon:d1", {})


# ---- end to end ------------------------------------------------------------------------------


def _train(args: list[str]) -> list[dict] | None:
    import torch.distributed as dist

    from archon.config import load_config
    from archon.rl.trainer import RLTrainer

    history = RLTrainer(load_config(None, args)).run()
    return history if dist.get_rank() == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("replay", [False, True])
def test_rl_with_aux_free_balancing_keeps_server_and_trainer_equal(tmp_path, replay):
    """The bias moves every step and reaches the server with the weights, so both route alike
    (without replay a stale bias on the server would show as a mismatch); with replay too."""
    model = tmp_path / "model"
    tok = make_tiny_tokenizer(model)
    save_tiny_hf(model, "qwen3_moe", seed=4, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    rows = [{"prompt": f"what is {a} + {b} ?", "answer": str(a + b)} for a in range(4) for b in range(4)]
    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = {
        "actor.backend": "archon:d2e2",
        "actor.path": str(model),
        "actor.dtype": "float32",
        "actor.archon.enable_compile": False,
        "actor.optimizer.lr": 1e-2,
        "actor.recompute_logprob": True,
        "actor.moe_routing_replay": replay,
        "actor.archon.moe_load_balance": "aux_free",
        "actor.archon.moe_bias_update_rate": 0.05,
        "train_dataset.path": str(data),
        "train_dataset.batch_size": 4,
        "gconfig.n_samples": 2,
        "gconfig.max_new_tokens": 5,
        "total_train_steps": 3,
        "output_dir": str(tmp_path / "o"),
        "reward.fn": "reward_fns:length_reward",
        "reward.n_workers": 0,
        "cluster.n_gpus_per_node": 8,
        "saver.export_hf": False,
        "seed": 3,
    }
    args = [
        f"{k}={json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}"
        for k, v in settings.items()
    ]
    history = run_distributed(_train, 2, args, timeout=600)[0]
    for record in history:
        assert record["behav_prox_logprob_diff"] < 1e-5, record
        assert record["actor/moe/load_imbalance_max"] >= 1.0
    assert history[-1]["actor/moe/expert_bias_abs_max"] > 0.05  # moved more than one step
    logged = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert "actor/moe/zero_load_expert_frac" in logged[-1] and "actor/moe/load_imbalance/layer_1" in logged[-1]


def test_protocol_checks_the_routed_experts_fields():
    from archon.server.protocol import ProtocolError, parse_generate

    def parse(**extra):
        return parse_generate({"input_ids": [[1, 2, 3], [4, 5]], **extra}, lambda r: None).requests

    flags = parse(return_routed_experts=[True, False], routed_experts_start_len=[2, 0])
    assert [(r.return_routed_experts, r.routed_experts_start_len) for r in flags] == [(True, 2), (False, 0)]
    with pytest.raises(ProtocolError, match="return_routed_experts must be true or false"):
        parse(return_routed_experts="yes")
    with pytest.raises(ProtocolError, match=r"routed_experts_start_len = 3 must be an integer in \[0"):
        parse(return_routed_experts=True, routed_experts_start_len=3)  # the second prompt has 2 tokens
