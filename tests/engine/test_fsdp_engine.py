"""The ``fsdp:`` engine: any transformers causal LM, through the same interface as ArchonEngine.

The migration story holds both ways: a qwen3 folder trains to the same losses under
``fsdp:`` and ``archon:``; a model Archon has no spec for (a tiny Gemma-2, with tied
embeddings, sliding-window layers and logit soft-capping) trains to the same losses on every
``fsdp:`` layout as on one device, whose first loss is transformers' own NLL.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from engine_utils import (
    build_engine,
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
GEMMA2: dict[str, Any] = dict(
    tie=True,
    head_dim=16,
    sliding_window=6,
    query_pre_attn_scalar=16,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=3.0,
)


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("qwen3_tied")
    # Tied embeddings: a head and an embedding that come apart would still give the same first loss.
    save_tiny_hf(folder, "qwen3", tie=True, seed=3)
    return str(folder)


@pytest.fixture(scope="module")
def gemma2_path(tmp_path_factory) -> str:
    from models import supported_model_types

    assert "gemma2" not in supported_model_types()  # the point: Archon has no spec for it
    folder = tmp_path_factory.mktemp("gemma2")
    save_tiny_hf(folder, "gemma2", seed=3, **GEMMA2)
    return str(folder)


def _train(path: str, backend: str, engine_kw: dict | None = None, padded: bool = False) -> dict | None:
    import torch.distributed as dist

    from archon.engine import build_engine as make_engine

    engine = make_engine(engine_config(path, backend, **(engine_kw or {})), total_steps=STEPS)
    if padded:
        # As for a model whose attention ignores packed position_ids.
        engine._packing_works = lambda: False  # pyright: ignore[reportAttributeAccessIssue]  # stubbing a method
    engine.initialize()
    stats = [engine.train_batch(make_batch(s), sft_loss, sft_weight) for s in range(STEPS)]
    result = {
        "loss": [s["loss"] for s in stats],
        "grad_norm": [s["grad_norm"] for s in stats],
        "packed": getattr(engine, "packed", True),
    }
    return result if dist.get_rank() == 0 else None


def _assert_same(run: dict, ref: dict, what: str) -> None:
    for key in ("loss", "grad_norm"):
        diff = max(abs(a - b) for a, b in zip(run[key], ref[key]))
        assert diff < 1e-4, f"{what} {key}: {run[key]} vs {ref[key]}"


def _hf_nll(path: str, batch: dict) -> float:
    """The token-mean NLL of ``batch``'s loss tokens under transformers' own model, one row at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    total, count = 0.0, 0.0
    for b in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][b].sum())
        ids = batch["input_ids"][b, :n]
        with torch.no_grad():
            logp = F.log_softmax(model(input_ids=ids[None]).logits[0].float(), -1)
        mask = batch["loss_mask"][b, 1:n]
        total += float(-(logp[:-1].gather(-1, ids[1:, None])[:, 0] * mask).sum())
        count += float(mask.sum())
    return total / count


def test_fsdp_and_archon_train_a_qwen3_folder_to_the_same_losses(qwen3_path):
    archon = run_distributed(_train, 2, qwen3_path, "archon:d2")[0]
    for backend, world in (("fsdp:d2", 2), ("fsdp:t2", 2), ("fsdp:c2", 2)):
        _assert_same(run_distributed(_train, world, qwen3_path, backend)[0], archon, backend)


@pytest.fixture(scope="module")
def gemma2_reference(gemma2_path) -> dict:
    return run_distributed(_train, 1, gemma2_path, "fsdp:d1")[0]


def test_reference_run_is_transformers_own_model(gemma2_path, gemma2_reference):
    assert gemma2_reference["packed"]  # Gemma-2's attention takes packed position_ids
    assert abs(gemma2_reference["loss"][0] - _hf_nll(gemma2_path, make_batch(0))) < 1e-5
    assert gemma2_reference["loss"][-1] < gemma2_reference["loss"][0]


@pytest.mark.parametrize(
    "backend, world, engine_kw",
    [
        ("fsdp:d2", 2, {}),
        ("fsdp:d2", 2, {"gradient_checkpointing": True, "mb_spec": {"n_mbs": 2}}),
        ("fsdp:t2", 2, {}),
        ("fsdp:c2", 2, {"gradient_checkpointing": True, "archon": {"ac_mode": "selective"}}),
    ],
)
def test_a_model_without_archon_spec_trains_alike_on_every_layout(
    gemma2_path, gemma2_reference, backend, world, engine_kw
):
    _assert_same(run_distributed(_train, world, gemma2_path, backend, engine_kw)[0], gemma2_reference, backend)


def test_padded_rows_for_models_without_packing_give_the_same_losses(gemma2_path, gemma2_reference):
    run = run_distributed(_train, 2, gemma2_path, "fsdp:d2", {"mb_spec": {"n_mbs": 2}}, True)[0]
    assert not run["packed"]
    _assert_same(run, gemma2_reference, "padded fsdp:d2")


def test_forward_logprobs_equal_archons(qwen3_path):
    ref = run_distributed(forward_outputs, 1, qwen3_path, "archon:d1")[0]
    got = run_distributed(forward_outputs, 2, qwen3_path, "fsdp:t2")[0]
    mask = make_batch(7, n=5)["attention_mask"].bool()
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(got[key][mask], ref[key][mask], atol=1e-5, rtol=1e-5)
        assert torch.all(got[key][~mask] == 0)


def test_critic_value_head_trains_alike(gemma2_path):
    losses, norms, values = run_distributed(critic_losses_and_values, 1, gemma2_path, "fsdp:d1")[0]
    for backend in ("fsdp:d2", "fsdp:t2"):
        l2, n2, v2 = run_distributed(critic_losses_and_values, 2, gemma2_path, backend)[0]
        assert max(abs(a - b) for a, b in zip(losses, l2)) < 1e-4, (backend, losses, l2)
        assert max(abs(a - b) for a, b in zip(norms, n2)) < 1e-4, (backend, norms, n2)
        torch.testing.assert_close(v2, values, atol=1e-4, rtol=1e-4)
    assert losses[1] < losses[0]


def test_resume_across_fsdp_allocations(gemma2_path, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full = run_distributed(resume_losses, 1, gemma2_path, ckpt, "full", "fsdp:d1")[0]
    first = run_distributed(resume_losses, 2, gemma2_path, ckpt, "first", "fsdp:t2")[0]
    second = run_distributed(resume_losses, 2, gemma2_path, ckpt, "second", "fsdp:d2")[0]
    assert max(abs(a - b) for a, b in zip(full, first + second)) < 1e-5, (full, first + second)


def test_export_hf_loads_in_transformers(gemma2_path, tmp_path):
    from transformers import AutoModelForCausalLM

    run_distributed(export_after_one_step, 1, gemma2_path, "fsdp:d1", str(tmp_path / "d1"))
    run_distributed(export_after_one_step, 2, gemma2_path, "fsdp:t2", str(tmp_path / "t2"))
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "d1", dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "t2", dtype=torch.float32).eval()
    source = AutoModelForCausalLM.from_pretrained(gemma2_path, dtype=torch.float32).eval()
    assert b.config.sliding_window == 6 and b.config.tie_word_embeddings  # the source's config travels
    assert b.lm_head.weight is b.model.embed_tokens.weight
    ids = make_batch(1)["input_ids"][:1]
    with torch.no_grad():
        torch.testing.assert_close(b(input_ids=ids).logits, a(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(b(input_ids=ids).logits, source(input_ids=ids).logits)  # it trained


def test_fsdp_refuses_pipeline_and_expert_parallel_and_megatron_is_not_bundled():
    from archon.config import ConfigError, load_config
    from archon.engine import EngineError, engine_class

    for bad, dim in (("fsdp:d2p2", "pipeline"), ("fsdp:d2e2", "expert")):
        with pytest.raises(
            ConfigError,
            match=f"{dim} parallel '.' is not supported by backend 'fsdp'; fsdp accepts "
            "d, t, c; use 'archon:' for pipeline or expert parallel",
        ):
            load_config(None, [f"actor.backend={bad}", "cluster.n_gpus_per_node=8"])
    with pytest.raises(
        ConfigError,
        match="ref.backend = 'megatron:d2p2t2' asks for Megatron-Core, which Archon "
        "does not bundle; write 'archon:d2p2t2'.*'fsdp:'",
    ):
        load_config(None, ["ref.backend=megatron:d2t2p2", "cluster.n_gpus_per_node=8"])
    with pytest.raises(EngineError, match="Megatron-Core"):
        engine_class("megatron:d2")
    cfg = load_config(None, ["actor.backend=fsdp:d2c2", "cluster.n_gpus_per_node=8"])
    assert cfg.critic.backend == "fsdp:d2c2"  # inherited like every engine field


def test_fsdp_refuses_what_the_model_cannot_split(gemma2_path):
    from dist_utils import DistributedTestError

    # The tiny model has 2 KV heads: tensor parallel over 4 ranks would split a head.
    with pytest.raises(
        DistributedTestError, match="num_key_value_heads=2 is not divisible by the tensor-parallel size t4"
    ):
        run_distributed(build_engine, 4, gemma2_path, "fsdp:t4")


def _sft(model: str, data: str, out: str, backend: str) -> list[float] | None:
    import torch.distributed as dist

    from archon.config import load_config
    from archon.sft import run_sft

    cfg = load_config(
        None,
        [
            f"actor.backend={backend}",
            f"actor.path={model}",
            "actor.dtype=float32",
            "actor.archon.enable_compile=false",
            "actor.optimizer.lr=1e-2",
            f"train_dataset.path={data}",
            "train_dataset.batch_size=8",
            "total_train_steps=3",
            f"output_dir={out}",
            "cluster.n_gpus_per_node=3",
            "seed=7",
        ],
    )
    history = run_sft(cfg)
    return [h["loss"] for h in history] if dist.get_rank() == 0 else None


def test_sft_trains_a_llama_on_the_fsdp_engine(tmp_path):
    import json

    from hf_fixtures import make_tiny_tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = tmp_path / "llama"
    tok = make_tiny_tokenizer(model)
    save_tiny_hf(
        model,
        "llama",
        seed=4,
        vocab_size=len(tok),
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    rows = [{"prompt": f"what is {a} + {b} ?", "completion": f"{a + b}"} for a in range(6) for b in range(4)]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    d1 = run_distributed(_sft, 1, str(model), str(data), str(tmp_path / "d1"), "fsdp:d1")[0]
    d2 = run_distributed(_sft, 2, str(model), str(data), str(tmp_path / "d2"), "fsdp:d2")[0]
    assert max(abs(a - b) for a, b in zip(d1, d2)) < 1e-4, (d1, d2)
    assert d1[-1] < d1[0]
    exported = tmp_path / "d2" / "hf"
    assert AutoTokenizer.from_pretrained(exported).eos_token == tok.eos_token
    assert AutoModelForCausalLM.from_pretrained(exported).config.model_type == "llama"


def test_the_engines_are_siblings_behind_train_engine():
    from archon.engine import ArchonEngine, FSDPEngine, TrainEngine, engine_class

    assert engine_class("archon:d2") is ArchonEngine and engine_class("fsdp:d2") is FSDPEngine
    for cls in (ArchonEngine, FSDPEngine):
        # Every method of the interface is implemented: the class can be instantiated.
        assert issubclass(cls, TrainEngine) and not cls.__abstractmethods__, cls
    # Neither inherits the other's behaviour; what they share is composed, not overridden.
    assert not issubclass(FSDPEngine, ArchonEngine) and not issubclass(ArchonEngine, FSDPEngine)
