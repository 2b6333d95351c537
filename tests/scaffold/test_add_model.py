"""``scripts/add_model.py``: model packages generated from transformers, into a temporary folder.

For ``llama`` and ``mistral`` the generated package passes its own generated parity test, and
trains under ``archon:d2``, ``archon:t2`` and ``archon:p2`` to the same losses as ``archon:d1``,
loading and exporting HF folders, with no hand edits.  For ``gemma2`` and ``olmo2`` the report
names each architectural difference, and the generated parity test fails on exactly those (olmo2
from an HF folder, whose config.json names the model type).
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from engine_utils import engine_config, export_after_one_step, make_batch, sft_loss, sft_weight
from hf_fixtures import save_tiny_hf
from paths import REPO

STEPS = 3


def _script(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "add_model.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=cwd,
    )


def _parity(tests_dir: Path, models_dir: Path, *names: str) -> subprocess.CompletedProcess:
    """Run generated parity tests in a pytest process of their own (so their packages register only there)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "ARCHON_MODELS_PATH": str(models_dir)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rA",  # a PASSED or FAILED line per test: the outcome of each file's tests when several run
            "-p",
            "no:cacheprovider",
            *(str(tests_dir / f"test_{name}_parity.py") for name in names),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tests_dir,
    )


@contextmanager
def registered(models_dir: Path):
    """The generated packages in ``models_dir`` registered in this process, and unregistered afterwards."""
    import models
    from models.registry import unregister_model_spec

    models.import_model_packages(models_dir)
    names = [p.name for p in models_dir.iterdir() if (p / "spec.py").is_file()]
    try:
        yield names
    finally:
        for name in names:
            unregister_model_spec(name)
            for mod in [m for m in sys.modules if m == f"models.{name}" or m.startswith(f"models.{name}.")]:
                del sys.modules[mod]
        models.__path__.remove(str(models_dir.resolve()))


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """llama and mistral packages (and their tests) written by the script, as a user would run it."""
    root = tmp_path_factory.mktemp("generated")
    for model_type in ("llama", "mistral"):
        out = _script(model_type, "--models-dir", str(root / "models"), "--tests-dir", str(root / "tests"))
        assert out.returncode == 0, out.stderr
        assert "Differences from models/common: none" in out.stdout, out.stdout
        assert f"registered: `import models` serves model_type '{model_type}'" in out.stdout
    return root


def test_package_has_the_layout_of_every_model_package(generated):
    package = generated / "models" / "mistral"
    for rel in (
        "__init__.py",
        "spec.py",
        "model/args.py",
        "model/model.py",
        "model/state_dict_adapter.py",
        "infra/parallelize.py",
    ):
        assert (package / rel).is_file(), rel
    args = (package / "model" / "args.py").read_text()
    # Mistral's sliding window is a config value the shared attention lacks: refused, not silently ignored.
    assert 'RefusedSetting("sliding_window", None, "sliding-window attention")' in args
    assert "unimplemented: ClassVar[tuple[str, ...]] = ()" in args
    adapter = (package / "model" / "state_dict_adapter.py").read_text()
    assert '"self_attn.q_proj.weight": "attention.wq.weight"' in adapter
    assert "Differences from models/common: none" in (package / "model" / "model.py").read_text()


@pytest.fixture(scope="module")
def generated_parity(generated) -> subprocess.CompletedProcess:
    """Both generated parity tests, run in one pytest process (a process per file costs its start twice)."""
    return _parity(generated / "tests", generated / "models", "llama", "mistral")


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_generated_parity_test_passes(generated_parity, name):
    out = generated_parity
    outcomes = [line.split()[0] for line in out.stdout.splitlines() if f"test_{name}_parity.py::" in line]
    assert outcomes and set(outcomes) == {"PASSED"}, out.stdout[-3000:]
    assert out.returncode == 0 and " passed" in out.stdout and "failed" not in out.stdout, out.stdout[-3000:]


def _train(path: str, backend: str) -> dict | None:
    import torch.distributed as dist

    from archon.engine import build_engine

    engine = build_engine(engine_config(path, backend, archon={"pp_schedule": "1F1B"}), total_steps=STEPS)
    engine.initialize()
    stats = [engine.train_batch(make_batch(s), sft_loss, sft_weight) for s in range(STEPS)]
    return (
        {
            "loss": [s["loss"] for s in stats],
            "grad_norm": [s["grad_norm"] for s in stats],
            "model": type(engine.model).__name__,
        }
        if dist.get_rank() == 0
        else None
    )


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_generated_package_trains_on_every_layout_and_round_trips_hf(generated, tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    import models

    folder = tmp_path / "hf"
    overrides: dict[str, Any] = {"sliding_window": None} if model_type == "mistral" else {}
    save_tiny_hf(folder, model_type, seed=5, **overrides)
    with registered(generated / "models"):
        ref = run_distributed(_train, 1, str(folder), "archon:d1")[0]
        assert ref["model"] == f"{model_type.capitalize()}Model"  # Archon's generated model, not transformers'
        for backend in ("archon:d2", "archon:t2", "archon:p2"):
            run = run_distributed(_train, 2, str(folder), backend)[0]
            for key in ("loss", "grad_norm"):
                diff = max(abs(a - b) for a, b in zip(run[key], ref[key]))
                assert diff < 1e-4, (backend, key, run[key], ref[key])
        run_distributed(export_after_one_step, 2, str(folder), "archon:d2", str(tmp_path / "out"))
        ours = models.load_hf_model(tmp_path / "out")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = make_batch(1)["input_ids"][:1]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    assert theirs.config.model_type == model_type


# ------------------------------------------------------------------------------ differences
EXPECTED = {
    "gemma2": {
        "differences": {
            "hf_param:model.layers.0.post_attention_layernorm.weight": "post-attention norm",
            "hf_param:model.layers.0.post_feedforward_layernorm.weight": "post-MLP norm",
            "norm:layers.0.attention_norm": "(1 + weight)",
            "norm:layers.0.ffn_norm": "(1 + weight)",
            "norm:norm": "(1 + weight)",
            "embedding:model.layers.0": "multiplied by 8 (sqrt(hidden_size) = 8)",
            "mlp:model.layers.0.mlp": "activation 'gelu_pytorch_tanh'",
        },
        "refused": {"attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"},
        "report": [
            "sliding-window layers (layer_types with 'sliding_attention')",
            "soft-capping of attention logits",
            "soft-capping of the final logits",
        ],
    },
    "olmo2": {
        "differences": {
            "hf_param:model.layers.0.post_attention_layernorm.weight": "post-attention norm",
            "hf_param:model.layers.0.post_feedforward_layernorm.weight": "post-MLP norm",
            "hf_param:model.layers.0.self_attn.q_norm.weight": "over 64 features (the whole projection)",
            "hf_param:model.layers.0.self_attn.k_norm.weight": "over 32 features (the whole projection)",
            "archon_param:layers.0.attention_norm.weight": "no norm before attention",
            "archon_param:layers.0.ffn_norm.weight": "no norm before the MLP",
        },
        "refused": set(),
        "report": [],
    },
}


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_report_names_each_difference_and_the_parity_test_fails_on_exactly_those(tmp_path, model_type):
    from scaffold import scaffold_model

    expected = EXPECTED[model_type]
    models_dir, tests_dir = tmp_path / "models", tmp_path / "tests"
    source = model_type
    if model_type == "olmo2":  # from an HF folder: its config.json names the model type
        save_tiny_hf(tmp_path / "olmo2_hf", "olmo2", eos_token_id=1, pad_token_id=0)
        source = str(tmp_path / "olmo2_hf")
    try:
        result = scaffold_model(source, models_dir=models_dir, tests_dir=tests_dir)
    finally:
        with registered(models_dir):
            pass  # scaffold_model registered it here; leave this process as it was
    assert set(result.differences) == set(expected["differences"]), result.report
    for point, phrase in expected["differences"].items():
        line = next(line for line in result.report.splitlines() if f"[{point}]" in line)
        assert phrase in line, line
    assert set(result.refused) == expected["refused"]
    for phrase in expected["report"]:
        assert phrase in result.report
    model_py = (models_dir / model_type / "model" / "model.py").read_text()
    assert all(f"[{point}]" in model_py for point in expected["differences"])  # the report heads model.py

    out = _parity(tests_dir, models_dir, model_type)
    failed = {
        line.split("[", 1)[1].rsplit("]", 1)[0]
        for line in out.stdout.splitlines()
        if line.startswith("FAILED") and "test_difference_is_implemented[" in line
    }
    assert failed == set(expected["differences"]), out.stdout[-3000:]
    assert "test_refuses_unsupported_settings" not in "".join(
        ln for ln in out.stdout.splitlines() if ln.startswith("FAILED")
    )


def test_refusals(tmp_path):
    from scaffold import ScaffoldError, scaffold_model

    out = _script("llamma")  # the script itself: one clear line and exit status 2
    assert out.returncode == 2 and out.stderr.startswith("error: unknown model type 'llamma'")
    assert "did you mean 'llama'" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "weights").mkdir()
    cases = [
        (dict(source=str(tmp_path / "weights")), "is not a Hugging Face model folder (no config.json"),
        (dict(source="llama", name="qwen3"), "models/qwen3' exists already; pick another --name"),
        (dict(source="qwen3", name="my_qwen3"), "model_type 'qwen3' is served already by the registered spec"),
        (dict(source="llama", name="Llama-3"), "is not a lower-case Python identifier; pick one such as 'llama_3'"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ScaffoldError, match=message.replace("(", r"\(").replace(".", r"\.")):
            scaffold_model(**kwargs, models_dir=kwargs.get("models_dir", REPO / "models"), tests_dir=tmp_path)
    assert not list(tmp_path.glob("test_*"))  # nothing was written
