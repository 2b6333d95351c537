"""``scripts/add_model.py`` on transformers architectures beyond llama and mistral, from tiny local configs.

The tables an analysis emits are compared with hand-written ones (transformers' own module names for
each architecture); fused projections (phi3) are never mapped, and the split the report gives is
checked by loading a phi3 folder through it and comparing logits with transformers; granite's
multipliers, set by hand in its folder, must come back as differences naming each key and value;
and the probe config keeps a folder's own values, shrinking only the sizes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_fixtures import save_tiny_hf
from paths import REPO

from models.common.decoder import Decoder
from models.hf_checkpoint import load_hf_weights, read_hf_config
from models.state_dict_adapter import HFKeyTarget
from scaffold.analysis import Analysis, adapter_class, analyze, args_class
from scaffold.render import render_test
from scaffold.source import make_tiny_config, resolve_source, tiny_config_kwargs

GRANITE_SCALINGS = dict(
    embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=8.0
)
"""Set by hand in the granite folder; the report must name each (probe sizes: hidden 64, 4 heads of 16)."""
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=2, eos_token_id=1)
"""In the tiny vocabulary, unlike every default of these model types (phi3's pad 32000, olmo2's eos 50279)."""

NORMS = {"input_layernorm.weight": "attention_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight"}
ATTENTION = {f"self_attn.{p}_proj.weight": f"attention.w{p}.weight" for p in "qkvo"}
MLP = {"mlp.gate_proj.weight": "feed_forward.w1.weight", "mlp.up_proj.weight": "feed_forward.w3.weight"}
DOWN = {"mlp.down_proj.weight": "feed_forward.w2.weight"}
TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight"}
TOP |= {"lm_head.weight": "output.weight"}
LAYER_KEYS = {
    "llama": NORMS | ATTENTION | MLP | DOWN,
    "mistral": NORMS | ATTENTION | MLP | DOWN,
    "gemma": NORMS | ATTENTION | MLP | DOWN,
    "granite": NORMS | ATTENTION | MLP | DOWN,
    "qwen2": NORMS | ATTENTION | MLP | DOWN | {f"self_attn.{p}_proj.bias": f"attention.w{p}.bias" for p in "qkv"},
    # Post-norms only and q/k norms over the whole projection: no norm has a place in the shared block.
    "olmo2": ATTENTION | MLP | DOWN,
    # qkv_proj and gate_up_proj are fused: only o_proj and down_proj fill one projection each.
    "phi3": NORMS | {"self_attn.o_proj.weight": "attention.wo.weight"} | DOWN,
}
"""HF suffix -> Archon suffix that each architecture's tables must hold, and nothing else."""


def _source(tmp_path: Path, model_type: str) -> str:
    """A folder saved by transformers (phi3, granite, olmo2: the ways users met them), else the model type."""
    if model_type not in ("phi3", "granite", "olmo2"):
        return model_type
    overrides: dict[str, Any] = {**TOKEN_IDS, **(GRANITE_SCALINGS if model_type == "granite" else {})}
    save_tiny_hf(tmp_path / model_type, model_type, seed=3, **overrides)
    return str(tmp_path / model_type)


class Analyses(dict):
    """Model type -> its analysis, made on first use (a source that fails fails only the tests that use it)."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, model_type: str) -> Analysis:
        self[model_type] = analyze(resolve_source(_source(self.root, model_type)))
        return self[model_type]


@pytest.fixture(scope="module")
def analyses(tmp_path_factory) -> Analyses:
    return Analyses(tmp_path_factory.mktemp("sources"))


@pytest.mark.parametrize("model_type", sorted(LAYER_KEYS))
def test_tables_hold_only_the_matches_of_each_role(analyses, model_type):
    a = analyses[model_type]
    assert a.layer_keys == LAYER_KEYS[model_type]
    assert a.top_keys == TOP


def test_phi3_from_its_model_type_maps_no_projection_by_shape_alone():
    # o_proj is as wide as a query projection; it writes the attention output, so it is wo and never wq.
    assert analyze(resolve_source("phi3")).layer_keys == LAYER_KEYS["phi3"]


def test_phi3_reports_its_fused_projections_and_the_parameters_they_fill(analyses, tmp_path):
    a = analyses["phi3"]
    qkv, gate_up = "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"
    unfilled = [f"layers.0.{p}.weight" for p in ("attention.wq", "attention.wk", "attention.wv")]
    unfilled += [f"layers.0.feed_forward.{p}.weight" for p in ("w1", "w3")]
    assert {p.id for p in a.points} == {f"hf_param:{qkv}", f"hf_param:{gate_up}"} | {
        f"archon_param:{n}" for n in unfilled
    }
    what = {p.id: p.what for p in a.points}
    # 4 heads of 16 rows for q, 2 of 16 each for k and v; gate and up 96 rows each.
    rows = {
        qkv: [("attention.wq", 0, 64), ("attention.wk", 64, 32), ("attention.wv", 96, 32)],
        gate_up: [("feed_forward.w1", 0, 96), ("feed_forward.w3", 96, 96)],
    }
    for key, parts in rows.items():
        line = what[f"hf_param:{key}"]
        assert "the probe computed transformers' module with this split" in line, line
        for name, start, n in parts:
            assert f"rows {start}:{start + n} -> {name}" in line, line
            assert f"splits rows {start}:{start + n} of the fused" in what[f"archon_param:layers.0.{name}.weight"]

    # The split as the report gives it, written by hand, loads the folder to transformers' logits.
    from transformers import AutoModelForCausalLM

    folder = Path(a.source.folder or "")
    fused = {k.split(".", 3)[-1]: v for k, v in rows.items()}

    class SplitAdapter(adapter_class(a)):
        def hf_key_targets(self, hf_name):
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
            if m and m.group(2) in fused:
                return [HFKeyTarget(f"layers.{m.group(1)}.{n}.weight", None, (0, s, k)) for n, s, k in fused[m[2]]]
            return super().hf_key_targets(hf_name)

    args = args_class(a).from_hf_config(read_hf_config(folder))
    model = Decoder(args)
    load_hf_weights(model, folder, SplitAdapter(args), strict=True)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_granite_multipliers_are_reported_as_differences(analyses):
    a = analyses["granite"]
    assert a.kept == GRANITE_SCALINGS
    lines = {p.id: p.what for p in a.points}
    assert set(lines) == {
        "embedding:model.layers.0",
        "attention:model.layers.0.self_attn",
        "residual:model.layers.0",
        "head:model.norm",
    }
    assert "multiplied by 12 (embedding_multiplier = 12)" in lines["embedding:model.layers.0"]
    assert "scaled by attention_multiplier = 0.0625" in lines["attention:model.layers.0.self_attn"]
    assert "1/sqrt(head_dim) = 0.25" in lines["attention:model.layers.0.self_attn"]
    assert "multiplied by 0.22 (residual_multiplier = 0.22)" in lines["residual:model.layers.0"]
    assert "divided by 8 (logits_scaling = 8)" in lines["head:model.norm"]
    # On in the source: a difference to implement, not a refusal of the very checkpoint it came from.
    assert not {s.key for s in a.refused} & set(GRANITE_SCALINGS)


def test_probe_config_keeps_the_source_values_and_shrinks_only_sizes(analyses):
    for model_type in ("phi3", "granite", "olmo2"):
        a = analyses[model_type]
        config = make_tiny_config(model_type, a.tiny_kwargs)
        for key, value in {**TOKEN_IDS, **(GRANITE_SCALINGS if model_type == "granite" else {})}.items():
            assert getattr(config, key) == value, (model_type, key)
        assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, 128)
    # From a model type: defaults stay, except ids outside the tiny vocabulary.
    kwargs = tiny_config_kwargs(resolve_source("phi3"))
    assert kwargs["pad_token_id"] is None and kwargs["eos_token_id"] is None and kwargs["bos_token_id"] == 1
    big = resolve_source("olmo2")
    big.config.hidden_size, big.config.eos_token_id = 4096, 7
    assert tiny_config_kwargs(big)["hidden_size"] == 64 and tiny_config_kwargs(big)["eos_token_id"] == 7


def test_granite_defaults_scaffold_with_the_attention_scale_as_the_difference():
    a = analyze(resolve_source("granite"))  # transformers refused this probe config before (attention_multiplier)
    assert [p.id for p in a.points] == ["attention:model.layers.0.self_attn"]
    assert "attention_multiplier = 1" in a.points[0].what
    assert {s.key for s in a.refused} >= {"embedding_multiplier", "residual_multiplier", "logits_scaling"}


@pytest.mark.slow
def test_generated_parity_tests_fail_on_exactly_the_reported_points(analyses, tmp_path):
    """phi3's and granite's written tests, run against packages that serve their model types as generated."""
    from scaffold.render import render_package, write_files

    for model_type in ("phi3", "granite"):
        write_files(tmp_path / "models" / model_type, render_package(analyses[model_type], model_type))
        write_files(tmp_path / "tests", {f"test_{model_type}_parity.py": render_test(analyses[model_type], model_type)})
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "ARCHON_MODELS_PATH": str(tmp_path / "models"),
    }
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(tmp_path / "tests")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )
    for model_type in ("phi3", "granite"):
        outcomes = {
            line.split("[", 1)[1].rsplit("]", 1)[0]: line.split()[0]
            for line in out.stdout.splitlines()
            if f"test_{model_type}_parity.py::test_difference_is_implemented[" in line
        }
        assert outcomes == {p.id: "FAILED" for p in analyses[model_type].points}, out.stdout[-3000:]
        refusals = [ln for ln in out.stdout.splitlines() if f"{model_type}_parity.py::test_refuses" in ln]
        assert refusals and all(ln.startswith("PASSED") for ln in refusals), out.stdout[-3000:]
