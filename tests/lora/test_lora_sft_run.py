"""An SFT run with ``actor.lora`` ends with both exports: the merged HF folder and a PEFT adapter folder that the
real ``peft`` loads onto the base model with the merged folder's logits."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from dist_utils import run_distributed
from hf_fixtures import make_tiny_tokenizer, save_tiny_hf


def _sft(model: str, data: str, out: str) -> None:
    from archon.config import load_config
    from archon.sft import run_sft

    overrides = [
        "actor.backend=archon:d1",
        f"actor.path={model}",
        "actor.dtype=float32",
        "actor.archon.enable_compile=false",
        "actor.optimizer.lr=3e-2",
        "actor.lora.enabled=true",
        "actor.lora.rank=4",
        "actor.lora.alpha=8",
        f"train_dataset.path={data}",
        "train_dataset.batch_size=8",
        "total_train_steps=3",
        f"output_dir={out}",
        "cluster.n_gpus_per_node=1",
    ]
    run_sft(load_config(None, overrides, job="sft"))


def test_sft_with_lora_exports_a_peft_folder_equal_to_the_merged_weights(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = tmp_path / "model"
    tok = make_tiny_tokenizer(model)
    save_tiny_hf(model, "qwen3", seed=4, vocab_size=len(tok))
    rows = [{"prompt": f"what is {a} + {b} ?", "completion": f"{a + b}"} for a in range(6) for b in range(4)]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    run_distributed(_sft, 1, str(model), str(data), str(out))

    assert (out / "lora_adapter" / "adapter_config.json").is_file()
    ids = torch.tensor([tok.encode("what is 3 + 2 ? 5")])
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(ids).logits
        merged_logits = merged(ids).logits
        peft_logits = PeftModel.from_pretrained(base, str(Path(out) / "lora_adapter"))(ids).logits
    assert (merged_logits - base_logits).abs().max() > 1e-3  # the adapters were trained and merged
    torch.testing.assert_close(peft_logits, merged_logits, atol=1e-4, rtol=1e-4)
