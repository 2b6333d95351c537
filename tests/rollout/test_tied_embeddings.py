"""Tied word embeddings served untied (vLLM): the view and the untied export compute what the tied model computes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_fixtures import save_tiny_hf
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from archon.rollout.tied_embeddings import (
    INDEX_FILE,
    LM_HEAD,
    LM_HEAD_FILE,
    main,
    ties_word_embeddings,
    untie_in_place,
    untied_view,
)

TOKENS = torch.tensor([[3, 9, 4, 12, 7, 1]])


def _logits(folder) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return model(TOKENS).logits


def _check_untied(folder, original) -> None:
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and not ties_word_embeddings(folder)
    weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    assert weight_map[LM_HEAD] == LM_HEAD_FILE
    embed_file = weight_map["model.embed_tokens.weight"]
    assert not (folder / "model.safetensors").exists()  # transformers would read it alone, without the LM head
    with safe_open(str(folder / LM_HEAD_FILE), "pt") as head, safe_open(str(folder / embed_file), "pt") as body:
        assert torch.equal(head.get_tensor(LM_HEAD), body.get_tensor("model.embed_tokens.weight"))
    # transformers builds the model untied and loads lm_head.weight from the new file: the same function.
    untied = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(_logits(folder), _logits(original), rtol=0, atol=0)


@pytest.mark.parametrize("shard", ["40KB", "10MB"], ids=["sharded", "one-file"])
def test_an_untied_view_computes_what_the_tied_model_computes(tmp_path, shard):
    tied = tmp_path / "tied"
    save_tiny_hf(tied, "qwen3", tie=True, seed=2, max_shard_size=shard)
    assert ties_word_embeddings(tied)
    view = untied_view(tied, tmp_path / "run" / "rollout" / "vllm_model")
    _check_untied(view, tied)
    # Every other file is the original's, linked; the original is untouched.
    for file in tied.glob("*.safetensors"):
        linked = view / ("model-00001-of-00001.safetensors" if file.name == "model.safetensors" else file.name)
        assert linked.is_symlink() and linked.resolve() == file.resolve()
    assert ties_word_embeddings(tied) and not (tied / LM_HEAD_FILE).exists()
    # Made again for the same model: reused; for another model: replaced.
    stamp = (view / "config.json").stat().st_mtime_ns
    assert untied_view(tied, view) == view and (view / "config.json").stat().st_mtime_ns == stamp
    other = tmp_path / "other"
    save_tiny_hf(other, "qwen3", tie=True, seed=5, max_shard_size=shard)
    _check_untied(untied_view(other, view), other)


def test_an_export_is_untied_in_place(tmp_path):
    tied = tmp_path / "tied"
    save_tiny_hf(tied, "qwen3", tie=True, seed=3)
    export = tmp_path / "export"
    shutil.copytree(tied, export)
    untie_in_place(export)
    _check_untied(export, tied)


def test_untied_models_and_folders_without_a_config_are_left_alone(tmp_path):
    save_tiny_hf(tmp_path / "untied", "qwen3", tie=False, seed=1)
    assert not ties_word_embeddings(tmp_path / "untied")
    assert not ties_word_embeddings(tmp_path / "nothing-here")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "no-such-type", "tie_word_embeddings": 1}))
    assert ties_word_embeddings(tmp_path / "odd")  # a type transformers does not know: the file says it


def test_the_command_line_makes_a_view_for_servers_started_by_hand(tmp_path, capsys):
    save_tiny_hf(tmp_path / "tied", "qwen3", tie=True, seed=6)
    assert main([str(tmp_path / "tied"), str(tmp_path / "view")]) == 0
    assert capsys.readouterr().out.strip() == f"serve {tmp_path / 'view'}"
    _check_untied(tmp_path / "view", tmp_path / "tied")
    save_tiny_hf(tmp_path / "untied", "qwen3", tie=False, seed=6)
    assert main([str(tmp_path / "untied"), str(tmp_path / "view2")]) == 0
    assert "serve it as it is" in capsys.readouterr().out and not (tmp_path / "view2").exists()
