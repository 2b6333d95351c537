"""Loading HF weights into models that are sharded (DTensor) or split into pipeline stages."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, cast

import pytest
import torch
import torch.nn as nn
from dist_utils import run_distributed
from hf_fixtures import block_of, decoder, make_tiny_hf_model, save_tiny_hf
from safetensors.torch import save_file

import models
import models.hf_checkpoint as hf_checkpoint

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe")
    save_tiny_hf(folder, "qwen3_moe", seed=21, max_shard_size="40KB")
    return folder


@pytest.fixture(scope="module")
def fused_moe_folder(tmp_path_factory):
    """The same kind of model written with transformers-5 fused expert keys (gate_up_proj)."""
    folder = tmp_path_factory.mktemp("moe_fused")
    hf, _ = make_tiny_hf_model("qwen3_moe", seed=22)
    save_file(
        {k: v.contiguous() for k, v in hf.state_dict().items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (folder / "config.json").write_text(json.dumps(hf.config.to_dict()))
    return folder


def _placement_for(name: str, p: torch.Tensor):
    from torch.distributed.tensor import Replicate, Shard

    if p.dim() == 1:
        return Replicate()
    if p.dim() == 3:
        return Shard(0)  # expert parallel: experts split across ranks
    if name.endswith(("wo.weight", "w2.weight")):
        return Shard(1)  # row-wise
    return Shard(0)  # column-wise (also the vocab-sharded embedding / head)


def _load_all(cases: list[tuple[str, bool]]) -> list[dict]:
    return [_load_into_dtensors(folder, read_slices) for folder, read_slices in cases]


def _load_into_dtensors(folder: str, read_slices: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    ref = models.load_hf_model(folder)
    full_reads = []
    original_full, original_box = hf_checkpoint._TensorReader.full, hf_checkpoint._local_box

    def counting_full(self):
        full_reads.append(self._key)
        return original_full(self)

    hf_checkpoint._TensorReader.full = counting_full
    if not read_slices:  # exercise the distribute_tensor path other placements take
        hf_checkpoint._local_box = lambda dst: None
    mesh = init_device_mesh("cpu", (2,))
    model = decoder(models.build_model(models.read_hf_config(folder)))
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    for mod_name, mod in model.named_modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            full_name = f"{mod_name}.{pname}" if mod_name else pname
            dt = distribute_tensor(torch.zeros_like(p), mesh, [_placement_for(full_name, p)])
            mod.register_parameter(pname, nn.Parameter(dt))
    try:
        models.load_hf_weights(model, folder)
    finally:
        hf_checkpoint._TensorReader.full, hf_checkpoint._local_box = original_full, original_box

    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        worst = max(worst, (cast("DTensor", p).full_tensor() - ref_params[name]).abs().max().item())

    # Expert parallel forward: each rank runs its own experts on the tokens routed to them.
    experts = block_of(model, 0).moe.experts
    local_e = cast("DTensor", experts.w1).to_local().shape[0]
    first = dist.get_rank() * local_e
    counts = torch.tensor([3, 1, 0, 2, 4, 2, 1, 3])
    x = torch.randn(int(counts.sum()), 64, generator=torch.Generator().manual_seed(0))
    starts = torch.cumsum(counts, 0) - counts
    lo, hi = int(starts[first]), int(starts[first] + counts[first : first + local_e].sum())
    with torch.no_grad():
        local_out = experts(x[lo:hi], counts[first : first + local_e])
        ref_out = block_of(ref, 0).moe.experts(x, counts)[lo:hi]
    return {
        "worst": worst,
        "local_experts": local_e,
        "expert_diff": (local_out - ref_out).abs().max().item(),
        "wq_local_rows": cast("DTensor", block_of(model, 0).attention.wq.weight).to_local().shape[0],
        "full_reads": len(full_reads),
    }


def test_load_hf_weights_into_dtensor_parameters(moe_folder, fused_moe_folder):
    cases = [(str(f), read_slices) for f in (moe_folder, fused_moe_folder) for read_slices in (True, False)]
    per_rank = run_distributed(_load_all, 2, cases, timeout=300)
    for results in per_rank:
        for (folder, read_slices), r in zip(cases, results):
            assert r["worst"] == 0.0, (folder, read_slices)  # exact copies of the single-device load
            assert r["local_experts"] == 4
            assert r["wq_local_rows"] == 48  # 4 heads * 24 / 2 ranks
            assert r["expert_diff"] < 1e-6
            # Shard/Replicate placements read only their slice, never a whole tensor.
            assert (r["full_reads"] == 0) == read_slices


def test_pipeline_stage_loads_only_what_it_holds(moe_folder):
    full = decoder(models.load_hf_model(moe_folder))
    stage = decoder(models.build_model(models.read_hf_config(moe_folder)))
    del stage.layers["0"]  # a last stage: layer 1, norm, output
    stage.tok_embeddings = None  # pyright: ignore[reportAttributeAccessIssue]  # Decoder types it non-Optional
    stage.to_empty(device="cpu")
    stage.init_buffers("cpu")
    result = models.load_hf_weights(stage, moe_folder)  # strict: other stages' tensors are skipped, not errors
    assert result.missing == [] and result.unexpected == []
    for name, p in stage.named_parameters():
        assert torch.equal(p, dict(full.named_parameters())[name]), name
    # The stage computes the tail of the full model from the hidden state of layer 0.
    tokens = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = full.tok_embeddings(tokens)
        rope = full.rope(torch.arange(7).unsqueeze(0), h.dtype)
        h = block_of(full, 0)(h, rope)
        torch.testing.assert_close(stage(h), full(tokens), rtol=0, atol=1e-6)
