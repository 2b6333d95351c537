"""Bad input gives one clear error naming the tensor, file or type; the registry contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_fixtures import save_tiny_hf
from safetensors.torch import load_file, save_file

import models
from models.registry import ModelRegistryError, unregister_model_spec


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3")
    save_tiny_hf(folder, "qwen3", max_shard_size="10MB")  # one file: easy to edit
    assert (folder / "model.safetensors").is_file()
    return folder


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3_moe")
    save_tiny_hf(folder, "qwen3_moe", max_shard_size="10MB")
    return folder


def _copy_with(src: Path, dst: Path, edit) -> Path:
    """Copy a single-file checkpoint, editing its tensors dict with ``edit(sd)``."""
    dst.mkdir(parents=True, exist_ok=True)
    sd = load_file(src / "model.safetensors")
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(models.HFCheckpointError, match=r"config\.json does not exist"):
        models.load_hf_model(tmp_path)


def test_not_a_folder(tmp_path):
    with pytest.raises(models.HFCheckpointError, match="is not a directory"):
        models.load_hf_model(tmp_path / "nope")


def test_folder_without_weights(tmp_path, dense_folder):
    (tmp_path / "config.json").write_text((dense_folder / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(models.HFCheckpointError, match="no model.safetensors.*convert them to safetensors"):
        models.load_hf_model(tmp_path)


def test_unsupported_model_type(tmp_path, dense_folder):
    cfg = json.loads((dense_folder / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelRegistryError,
        match=r"'llama' has no Archon model spec.*\['qwen2', 'qwen3', 'qwen3_moe'\]"
        r".*add_model.py llama.*'fsdp:'",
    ):
        models.load_hf_model(tmp_path)


def test_missing_tensor(tmp_path, dense_folder):
    folder = _copy_with(dense_folder, tmp_path, lambda sd: sd.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(
        models.HFCheckpointError,
        match=r"lacks 1 tensor.*'layers\.1\.attention\.wk\.weight' \(checkpoint key "
        r"'model\.layers\.1\.self_attn\.k_proj\.weight'\)",
    ):
        models.load_hf_model(folder)


def test_extra_tensor(tmp_path, dense_folder):
    def add(sd):
        sd["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)

    folder = _copy_with(dense_folder, tmp_path, add)
    with pytest.raises(
        models.HFCheckpointError,
        match=r"does not use: 'model\.layers\.0\.mlp\.extra_proj\.weight' \(in model\.safetensors\)",
    ):
        models.load_hf_model(folder)


def test_tensor_of_a_layer_the_config_does_not_have(tmp_path, dense_folder):
    def add(sd):
        sd["model.layers.7.input_layernorm.weight"] = torch.ones(64)

    folder = _copy_with(dense_folder, tmp_path, add)
    with pytest.raises(
        models.HFCheckpointError,
        match=r"'model\.layers\.7\.input_layernorm\.weight'.*"
        r"maps to 'layers\.7\.attention_norm\.weight'",
    ):
        models.load_hf_model(folder)


def test_shape_mismatch(tmp_path, dense_folder):
    def shrink(sd):
        sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:90]

    folder = _copy_with(dense_folder, tmp_path, shrink)
    with pytest.raises(
        models.HFCheckpointError,
        match=r"'model\.layers\.0\.mlp\.up_proj\.weight' \(in .*model\.safetensors\) has shape "
        r"\(90, 64\), but model tensor 'layers\.0\.feed_forward\.w3\.weight' expects \(96, 64\)",
    ):
        models.load_hf_model(folder)


def test_missing_expert(tmp_path, moe_folder):
    folder = _copy_with(moe_folder, tmp_path, lambda sd: sd.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(models.HFCheckpointError, match=r"'layers\.1\.moe\.experts\.w3' \(experts \[3\] absent\)"):
        models.load_hf_model(folder)


def test_expert_index_out_of_range(tmp_path, moe_folder):
    def add(sd):
        sd["model.layers.0.mlp.experts.8.gate_proj.weight"] = torch.zeros(32, 64)

    folder = _copy_with(moe_folder, tmp_path, add)
    with pytest.raises(models.HFCheckpointError, match=r"experts\.8\.gate_proj.*layers\.0\.moe\.experts\.w1\[8\]"):
        models.load_hf_model(folder)


def test_index_naming_a_missing_shard(tmp_path):
    save_tiny_hf(tmp_path, "qwen2", max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(models.HFCheckpointError, match=f"lists shard {shard.name}, which is missing"):
        models.load_hf_model(tmp_path)


def test_not_strict_reports_instead_of_raising(tmp_path, dense_folder):
    def edit(sd):
        sd.pop("model.norm.weight")
        sd["bogus.weight"] = torch.zeros(1)

    folder = _copy_with(dense_folder, tmp_path, edit)
    model = models.build_model(models.read_hf_config(folder), device="cpu")
    result = models.load_hf_weights(model, folder, strict=False)
    assert result.missing == ["'norm.weight' (checkpoint key 'model.norm.weight')"]
    assert result.unexpected == ["'bogus.weight' (in model.safetensors)"]


def test_loading_into_a_meta_model_is_an_error(dense_folder):
    model = models.build_model(models.read_hf_config(dense_folder))
    with pytest.raises(models.HFCheckpointError, match="meta device; materialise"):
        models.load_hf_weights(model, dense_folder)


# ---- registry -------------------------------------------------------------------------------


def test_registry_contents():
    assert models.supported_model_types() == ["qwen2", "qwen3", "qwen3_moe"]
    spec = models.get_model_spec("qwen3_moe")
    assert spec.name == "qwen3_moe" and spec.supported_model_types == frozenset({"qwen3_moe"})
    from pipeline import pipeline_decoder

    assert spec.pipelining_fn is pipeline_decoder
    for model_type in models.supported_model_types():
        s = models.get_model_spec(model_type)
        assert issubclass(s.model_args_class, models.BaseModelArgs)
        assert issubclass(s.state_dict_adapter_class, models.BaseStateDictAdapter)


def test_duplicate_registration_is_an_error():
    spec = models.get_model_spec("qwen3")
    with pytest.raises(ModelRegistryError, match="already registered"):
        models.register_model_spec(spec)
    from dataclasses import replace

    clash = replace(spec, name="my_qwen3")
    with pytest.raises(ModelRegistryError, match="already served"):
        models.register_model_spec(clash)


def test_registering_a_user_model_type():
    from dataclasses import replace

    spec = replace(models.get_model_spec("qwen3"), name="my_model", supported_model_types=frozenset({"my_model"}))
    models.register_model_spec(spec)
    try:
        assert models.get_model_spec("my_model") is spec
        assert "my_model" in models.supported_model_types()
    finally:
        unregister_model_spec("my_model")
    assert "my_model" not in models.supported_model_types()
