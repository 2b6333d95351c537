"""Archon's torch floor: declared once (archon.engine.torch_floor), followed by pyproject and the Makefile,
and enforced when an engine starts."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from dist_utils import DistributedTestError, run_distributed
from engine_utils import engine_config
from hf_fixtures import save_tiny_hf
from paths import REPO

from archon.engine.torch_floor import (
    PACKED_ATTENTION_TORCH,
    TORCH_FLOOR,
    TorchVersionError,
    check_torch_version,
    torch_release,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # pyright: ignore[reportMissingImports]


def test_versions_below_the_floor_are_refused():
    with pytest.raises(TorchVersionError, match=r"torch 2\.9\.1 is older than 2\.10, .*install torch>=2\.10"):
        check_torch_version("2.9.1")
    with pytest.raises(TorchVersionError):
        check_torch_version("1.13.0")
    for ok in ("2.10.0", "2.10.0+cu128", "2.12.0.dev20260301", "2.13.0+cpu", "3.0.0"):
        check_torch_version(ok)
    check_torch_version()  # the torch these tests run on
    assert torch_release(str(torch.__version__)) >= TORCH_FLOOR
    assert torch_release("2.12.0a0+git1234") == (2, 12)


def test_pyproject_and_makefile_follow_the_declared_floor():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(r"torch\b", d)]
    assert spec == "torch>=" + ".".join(map(str, TORCH_FLOOR))
    line = next(line for line in (REPO / "Makefile").read_text().splitlines() if line.startswith("TORCH_SPEC"))
    gpu, cpu = re.search(r",(torch[^,]+),(torch[^)]+)\)", line).groups()  # type: ignore[union-attr]
    assert gpu == "torch>=" + ".".join(map(str, PACKED_ATTENTION_TORCH))
    assert torch_release(cpu.split("==")[1]) >= TORCH_FLOOR
    assert tuple(PACKED_ATTENTION_TORCH) >= tuple(TORCH_FLOOR)


def _start_engine_on(path: str, version: str) -> None:
    from archon.engine.engine import ArchonEngine

    torch.__version__ = version  # type: ignore[assignment]  # this forked rank only
    ArchonEngine(engine_config(path, "archon:d1")).initialize()


def test_an_engine_refuses_to_start_on_an_old_torch(tmp_path):
    save_tiny_hf(tmp_path, "qwen3", seed=3)
    with pytest.raises(DistributedTestError, match="TorchVersionError: torch 2.9.0 is older than 2.10"):
        run_distributed(_start_engine_on, 1, str(tmp_path), "2.9.0")
