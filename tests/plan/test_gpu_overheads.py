"""The memory fit on CUDA counts what a process holds besides its tensors, against what a card really offers.

An "80 GB" card lets a process allocate 79.11 GiB (torch.cuda.mem_get_info's total on an H100);
each process holds a CUDA context, cuBLAS workspaces and the default NCCL group once, each engine
the NCCL buffers of its communicators, and the caching allocator a fragmentation margin.  The
figures are hand-computed from the constants' documented sources (archon/plan/memory.py).
"""

from __future__ import annotations

import pytest
from paths import REPO

from archon.alloc import ModelAllocation
from archon.config import load_config
from archon.plan.fit import check_fit, estimate_train_gpu
from archon.plan.memory import (
    GiB,
    MiB,
    _Layout,
    estimate_training_rank,
    nccl_communicators,
    usable_gpu_bytes,
    workload_of,
)
from archon.plan.params import read_model_config

DENSE = REPO / "configs" / "qwen3_8b_dense.toml"
PROCESS = {"CUDA context and kernels", "cuBLAS workspaces", "NCCL buffers of the default group"}


def _layout(backend: str, dp_replicate: int = 1) -> _Layout:
    return _Layout.of(ModelAllocation.from_str(backend), dp_replicate)


def test_an_80_gb_card_offers_what_cuda_reports():
    # torch reports 79.11 GiB total on an "80 GB" H100; 80 GiB would overstate it by 0.89 GiB.
    assert usable_gpu_bytes(80) == int(79.11 * GiB)
    assert usable_gpu_bytes(80) / 1e9 == pytest.approx(84.94, abs=0.01)


def test_communicators_of_each_layout():
    # (collective communicators, all-to-all / point-to-point peers)
    assert nccl_communicators(_layout("archon:d1")) == (0, 0)
    assert nccl_communicators(_layout("archon:d8")) == (1, 0)  # FSDP
    assert nccl_communicators(_layout("archon:d4", dp_replicate=2)) == (2, 0)  # HSDP: shard + replicate
    assert nccl_communicators(_layout("archon:d4p2t2")) == (2, 1)  # FSDP, TP; one pipeline neighbour
    assert nccl_communicators(_layout("archon:d2p4")) == (1, 2)  # pipeline ranks have two neighbours
    assert nccl_communicators(_layout("archon:d1c4")) == (1, 3)  # FSDP over c; Ulysses to 3 peers
    # Hybrid MoE: FSDP over c, TP; 1 Ulysses peer + 3 expert peers + 2 pipeline neighbours; efsdp = 2*2/4 = 1.
    assert nccl_communicators(_layout("archon:(attn:d1p4t2c2|ffn:d1p4t1e4)")) == (2, 6)
    assert nccl_communicators(_layout("archon:d8e4")) == (2, 3)  # FSDP, expert FSDP over 8/4 = 2; 3 EP peers


def test_hand_computed_terms_of_a_training_gpu(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(DENSE)  # archon:d4p2t2, an actor only
    hf, workload = read_model_config(cfg.actor), workload_of(cfg, "rl")
    cpu = estimate_training_rank(cfg.actor, hf, workload, device_type="cpu")
    assert not any("NCCL" in t.name or t.name in PROCESS for t in cpu.terms)  # laptops hold none of it
    gpu = estimate_train_gpu(cfg, "rl", hf)
    terms = {t.name: t.bytes for t in gpu.terms}
    nccl = terms.pop("NCCL buffers (2 collective communicators, 1 all-to-all/p2p peers)")
    assert nccl == 2 * GiB + 450 * MiB
    assert terms.pop("CUDA context and kernels") == 512 * MiB
    assert terms.pop("cuBLAS workspaces") == 64 * MiB
    assert terms.pop("NCCL buffers of the default group") == GiB
    margin = terms.pop("allocator fragmentation (10% margin)")
    tensors = sum(terms.values())  # what is left: the tensors, as the estimate counted them before
    assert margin == int(0.10 * tensors)
    assert gpu.total == tensors + margin + nccl + 512 * MiB + 64 * MiB + GiB


def test_a_layout_near_the_edge_no_longer_fits(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(DENSE, ["cluster.gpu_memory_gb=70"])
    report = check_fit(cfg)
    assert report.train is not None
    tensors = sum(t.bytes for t in report.train.terms if "NCCL" not in t.name and t.name not in PROCESS)
    tensors -= next(t.bytes for t in report.train.terms if t.name.startswith("allocator fragmentation"))
    # The tensors alone fit 70 GiB with ~4 GiB to spare: the check used to say "fits".
    assert 60 * GiB < tensors < 70 * GiB - 3 * GiB
    assert not report.fits_train()
    assert report.gpu_bytes == int(70 * 79.11 / 80 * GiB)
    assert "does not fit" in report.verdict(report.train)
    # The recipe itself, on the 80 GB cards it is written for, still fits.
    assert check_fit(load_config(DENSE)).fits_train()
