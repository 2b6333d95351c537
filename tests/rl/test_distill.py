"""On-policy distillation: the teacher engine and the actor's reverse-KL term (``actor.kd_coef``)."""

from __future__ import annotations

import json

import pytest
import torch
from dist_utils import run_distributed
from hf_fixtures import make_tiny_tokenizer, save_tiny_hf
from paths import REPO
from rl_runs import _run, overrides


def _rows(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(3, 6, generator=g) * 3
    teacher = -torch.rand(3, 6, generator=g) * 3
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    return logprobs, teacher, mask


def test_k2_term_is_half_squared_log_ratio_and_its_gradient_the_reverse_kl_one():
    from archon.rl.distill import distillation_loss

    logprobs, teacher, mask = _rows()
    lp = logprobs.clone().requires_grad_(True)
    term, stat = distillation_loss(lp, teacher, mask, estimator="k2", agg_mode="token-mean")
    on = mask > 0
    expected = 0.5 * ((logprobs - teacher)[on] ** 2).sum() / on.sum()
    torch.testing.assert_close(term.detach(), expected)
    torch.testing.assert_close(stat, expected)
    term.backward()
    # d/dlogp of the token mean: (logp - logp_teacher) / n on loss tokens, 0 elsewhere.
    torch.testing.assert_close(lp.grad, torch.where(on, (logprobs - teacher) / on.sum(), 0.0))


def test_term_follows_the_aggregation_and_estimator():
    from archon.rl.distill import distillation_loss

    logprobs, teacher, mask = _rows(1)
    term, _ = distillation_loss(logprobs, teacher, mask, estimator="k1", agg_mode="seq-mean-token-mean")
    rows = [((logprobs - teacher)[b][mask[b] > 0]).mean() for b in range(2)]  # row 2 has no loss token
    torch.testing.assert_close(term, sum(rows) / 2)


def _actor(kd_coef: float):
    from archon.config import ActorConfig
    from archon.rl.actor import PPOActor

    # Only the loss is used: no engine.
    return PPOActor(None, ActorConfig(kd_coef=kd_coef, kd_estimator="k3"), max_new_tokens=6)  # pyright: ignore[reportArgumentType]


def test_actor_loss_adds_kd_coef_times_the_term_and_nothing_without_it():
    from archon.rl.distill import distillation_loss

    logprobs, teacher, mask = _rows(2)
    mb = {
        "logprobs": logprobs + 0.1,
        "advantages": torch.randn(3, 6, generator=torch.Generator().manual_seed(3)),
        "loss_mask": mask,
    }
    outputs = {"logprobs": logprobs, "entropy": torch.ones(3, 6)}
    plain, stats = _actor(0.0)._loss_with_mismatch(outputs, mb)  # no teacher_logprobs needed
    assert "kd_loss" not in stats
    torch.testing.assert_close(plain, _actor(0.0).loss_fn(outputs, mb)[0])
    with_kd, kd_stats = _actor(0.5)._loss_with_mismatch(outputs, {**mb, "teacher_logprobs": teacher})
    term, _ = distillation_loss(logprobs, teacher, mask, estimator="k3")
    torch.testing.assert_close(with_kd, plain + 0.5 * term)
    torch.testing.assert_close(kd_stats["loss"], with_kd)


def test_teacher_inherits_actor_engine_fields():
    from archon.config import load_config

    cfg = load_config(
        None,
        [
            "actor.backend=archon:d2",
            "actor.path=/models/student",
            "teacher.path=/models/big",
            "teacher.backend=fsdp:t2",
            "cluster.n_gpus_per_node=8",
            "actor.dtype=float32",
        ],
    )
    assert cfg.teacher.path == "/models/big" and cfg.teacher.backend == "fsdp:t2" and cfg.teacher.dtype == "float32"
    cfg = load_config(None, ["actor.backend=archon:d2", "actor.path=/models/student", "cluster.n_gpus_per_node=8"])
    assert cfg.teacher.backend == "archon:d2" and cfg.teacher.path == "/models/student"


@pytest.fixture(scope="module")
def kd_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("kd")
    student, teacher = root / "student", root / "teacher"
    tok = make_tiny_tokenizer(student)
    make_tiny_tokenizer(teacher)
    save_tiny_hf(student, "qwen3", seed=4, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    save_tiny_hf(teacher, "qwen3", seed=9, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    rows = [{"prompt": f"what is {a} + {b} ?", "answer": str(a + b)} for a in range(6) for b in range(4)]
    data = root / "rl.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return student, teacher, data, root


def test_distillation_does_not_depend_on_the_allocation(kd_setup):
    student, teacher, data, root = kd_setup
    extra = {"actor.kd_coef": 0.5, "teacher.path": str(teacher), "actor.ppo_n_minibatches": 2, "total_train_steps": 2}
    d1 = _run(1, overrides(student, data, root / "kd_d1", **extra))
    assert all(r["kl_teacher"] > 0 for r in d1) and all("actor/kd_loss" in r for r in d1)
    # The teacher on another backend and layout than the actor, and the fsdp: engine as the actor.
    for actor, other in [("archon:d2", "fsdp:t2"), ("fsdp:d2", "archon:t2")]:
        out = root / f"kd_{actor.replace(':', '_')}"
        run = _run(2, overrides(student, data, out, actor, **{**extra, "teacher.backend": other}))
        for key in ("actor/loss", "actor/kd_loss", "kl_teacher", "reward_mean", "actor/grad_norm"):
            a, b = [r[key] for r in d1], [r[key] for r in run]
            assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (actor, other, key, a, b)


def _demo_kl(overrides_: list[str]) -> list[float] | None:
    import torch.distributed as dist

    from archon.config import load_config
    from archon.rl.trainer import RLTrainer

    history = RLTrainer(load_config(REPO / "configs" / "cpu_demo.toml", overrides_)).run()
    return [r["kl_teacher"] for r in history] if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_on_policy_distillation_moves_the_student_toward_the_teacher(tmp_path):
    """On the demo task, with a reward that teaches nothing (every answer earns 1, so GRPO's
    advantages are 0), the distillation term alone pulls the student's distribution over its
    answers toward a differently initialised teacher's: the KL on sampled answers falls."""
    from transformers import AutoModelForCausalLM

    from archon.demos.first_letter import TinyQwen3, make_assets

    student = make_assets(tmp_path / "student")
    teacher = make_assets(tmp_path / "teacher", spec=TinyQwen3(seed=7))
    # A confident teacher: scaling the final norm sharpens its answer distribution, so the two
    # models start far apart (random tiny models alone are both close to uniform).
    model = AutoModelForCausalLM.from_pretrained(teacher.model)
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)
    model.save_pretrained(teacher.model)
    args = [
        f"actor.path={student.model}",
        f"teacher.path={teacher.model}",
        f"train_dataset.path={student.train}",
        f"output_dir={tmp_path / 'run'}",
        "actor.backend=archon:d1",
        "total_train_steps=12",
        "saver.export_hf=false",
        "reward.n_workers=0",
        "reward.fn=reward_fns:one",
        "actor.kd_coef=1.0",
        "actor.optimizer.lr=1e-2",
    ]
    kl = run_distributed(_demo_kl, 1, args, timeout=900)[0]
    assert kl[0] > 0.5, kl  # the student starts far from the teacher
    assert sum(kl[-3:]) / 3 < 0.3 * kl[0], kl
