"""Server rows: a launched rollout server, weight sync from an engine, and its logprobs.

Each check does what ``train_rl.py`` does with the server kind: the ``RolloutLauncher`` starts it
from an HF folder the engine exported, the ``RolloutClient`` talks to it, the engine trains one
step with a large learning rate (so the policy clearly moves) and ``build_weight_sync`` pushes
the new weights.  Then the server's greedy completions must carry the new weight version and
logprobs equal to the engine's own ``forward`` on the same tokens, and differ from the old
weights' (so the comparison could fail).

* ``server_local`` (any device): the built-in server (a CPU process) with the default weight
  sync (``distributed``, over gloo as the trainer picks it, buckets staged on the host when the
  actor is on a GPU) and the actor on the run's device, float32 on both sides: logprobs within 1e-4.
* ``server_sglang`` / ``server_vllm`` (CUDA, when the package is importable by this
  interpreter, which is the one the launcher starts servers with): bfloat16 as in production,
  sharing the one GPU with the trainer, weights through ``disk`` (NCCL cannot put two ranks of a
  group on one GPU): logprobs within 0.1 of the float32 engine's (the built-in server in bf16 on
  CPU measures 0.04 on this model; the trained policy moves them by ~4).
"""

from __future__ import annotations

import torch

import models
from archon.config import load_config
from archon.engine import TrainEngine
from archon.gpu_check import tiny
from archon.gpu_check.environment import package_version
from archon.gpu_check.table import Context, Outcome, judge, skip
from archon.launch.servers import RolloutLauncher
from archon.rollout.client import RolloutClient
from archon.rollout.weight_sync import weight_sync_for

NEW_TOKENS = 5
LOCAL_TOL = 1e-4
SERVER_TOL = 0.1
MOVED_MIN = 0.5
"""The trained policy's logprobs must differ from the old ones by at least this much somewhere."""


def prompts(vocab: int, n: int = 4) -> list[list[int]]:
    """``n`` short prompts of token ids below ``vocab`` (deterministic)."""
    g = torch.Generator().manual_seed(5)
    return [
        torch.randint(2, vocab, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def engine_logprobs(engine: TrainEngine, rows: list[list[int]]) -> list[list[float]]:
    """``engine.forward`` token logprobs of every row (position i: log p(row[i] | row[:i]))."""
    width = max(map(len, rows))
    batch = {
        "input_ids": torch.zeros(len(rows), width, dtype=torch.long),
        "attention_mask": torch.zeros(len(rows), width, dtype=torch.long),
    }
    for b, row in enumerate(rows):
        batch["input_ids"][b, : len(row)] = torch.tensor(row)
        batch["attention_mask"][b, : len(row)] = 1
    out = engine.forward(batch)["logprobs"]
    return [out[b, : len(row)].tolist() for b, row in enumerate(rows)]


@torch.no_grad()
def model_logprobs(model: torch.nn.Module, rows: list[list[int]]) -> list[list[float]]:
    """The same from a plain single-device model, one row at a time."""
    result = []
    for row in rows:
        logp = torch.log_softmax(model(torch.tensor([row]))[0].float(), -1)
        result.append([0.0] + logp[:-1].gather(-1, torch.tensor(row[1:])[:, None])[:, 0].tolist())
    return result


def serve_and_sync(ctx: Context, kind: str, overrides: list[str], dtype: str, tol: float, note: str) -> Outcome:
    """Launch the server ``overrides`` describe (serving ``dtype``), sync a trained float32 engine into it,
    compare logprobs."""
    if ctx.cuda:
        torch.cuda.empty_cache()  # the server sizes its memory pool from what the GPU has free
    run_dir = ctx.workdir / f"serve_{kind}_{overrides[0].split('=')[1].split(':')[0]}"
    model_dir = run_dir / "model"
    device = ctx.device.type
    config = tiny.engine_config(tiny.model_folder(ctx, kind), optimizer={"lr": 5e-2, "warmup_steps": 0})
    engine = tiny.new_engine(ctx, config, device, total_steps=1)
    engine.export_hf(model_dir)
    asked = prompts(tiny.MODELS[kind]["vocab_size"])
    cfg = load_config(
        None,
        [
            *overrides,
            f"actor.path={model_dir}",
            "actor.backend=archon:d1",
            f"actor.dtype={dtype}",  # the built-in server serves in the actor's dtype
            f"output_dir={run_dir}",
            "rollout.setup_timeout=300",
        ],
    )
    with RolloutLauncher.from_config(cfg, run_dir) as launcher:  # started on entry
        with RolloutClient.from_config(cfg.rollout, launcher.addrs, api_key=launcher.api_key) as client:
            client.wait_healthy(cfg.rollout.setup_timeout)
            sync = weight_sync_for(cfg, engine, client, engine.device_type)  # as archon.rl.trainer builds it
            sync.setup()
            tiny.train(engine, 1)
            stats = sync.sync("1")
            results = client.generate_many(
                asked, {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
            )
            sync.close()
    rows = [p + list(r.output_ids) for p, r in zip(asked, results)]
    mine = engine_logprobs(engine, rows)
    old = model_logprobs(models.load_hf_model(model_dir), rows)
    gap = moved = 0.0
    for p, r, new_lp, old_lp in zip(asked, results, mine, old):
        server_lp = list(r.output_logprobs or [])
        n = len(server_lp)
        gap = max([gap, *(abs(a - b) for a, b in zip(server_lp, new_lp[len(p) : len(p) + n]))])
        moved = max([moved, *(abs(a - b) for a, b in zip(server_lp, old_lp[len(p) : len(p) + n]))])
    versions = sorted({str(r.weight_version) for r in results})
    lengths = sorted({len(r.output_ids) for r in results} | {len(r.output_logprobs or []) for r in results})
    measured = {
        "logprob_gap": gap,
        "moved_from_old": moved,
        "versions": versions,
        "sync_s": round(stats["weight_sync_time_s"], 3),
        "sync_mode": cfg.rollout.weight_sync,
    }
    problems = []
    if versions != ["1"] or lengths != [NEW_TOKENS]:
        problems.append(f"versions {versions}, token/logprob counts {lengths}")
    if gap > tol:
        problems.append(f"server logprobs differ from the engine's by {gap:.3g}")
    if moved < MOVED_MIN:
        problems.append(f"server logprobs moved only {moved:.3g} from the old weights: the sync did not land")
    tolerance = f"logprobs vs engine <= {tol:g}; vs old weights >= {MOVED_MIN:g}; version '1'"
    return judge(not problems, measured, tolerance, "; ".join(problems), note=f"{note}; actor on {device}")


def check_server_local(ctx: Context) -> Outcome:
    overrides = ["rollout.backend=local:d1", "cluster.n_gpus_per_node=2"]  # a slot each
    return serve_and_sync(ctx, "dense", overrides, "float32", LOCAL_TOL, "built-in server, default weight sync")


def check_server_sglang(ctx: Context) -> Outcome:
    if package_version("sglang") is None:
        return skip("sglang is not importable by this interpreter")
    overrides = [
        "rollout.backend=sglang:d1t1",
        "cluster.n_gpus_per_node=2",  # the plan wants a GPU each; both share GPU 0 here
        "sglang.dtype=bfloat16",
        "sglang.mem_fraction_static=0.3",
        "sglang.context_length=512",
        "sglang.disable_cuda_graph=true",
        "rollout.weight_sync=disk",
    ]
    return serve_and_sync(ctx, "serve", overrides, "bfloat16", SERVER_TOL, f"sglang {package_version('sglang')}, bf16")


def check_server_vllm(ctx: Context) -> Outcome:
    if package_version("vllm") is None:
        return skip("vllm is not importable by this interpreter")
    overrides = [
        "rollout.backend=vllm:d1t1",
        "cluster.n_gpus_per_node=2",
        "vllm.dtype=bfloat16",
        "vllm.gpu_memory_utilization=0.3",
        "vllm.max_model_len=512",
        "vllm.enforce_eager=true",
        "rollout.weight_sync=disk",
    ]
    return serve_and_sync(ctx, "serve", overrides, "bfloat16", SERVER_TOL, f"vllm {package_version('vllm')}, bf16")
