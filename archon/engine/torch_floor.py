"""The oldest torch Archon runs on, declared once (pyproject.toml and the Makefile follow it; a test checks).

* 2.10: ``DeviceMesh._unflatten(..., backend_override=...)``, which builds every mesh of an engine
  (``parallel/dims.py``), arrived with DeviceMesh's layout rewrite after 2.9 (pytorch/pytorch#161224);
  ``torch.nn.attention.varlen`` is also new in 2.10.
* 2.12: ``varlen_attn(..., enable_gqa=...)`` (pytorch/pytorch#179468), which packed attention on CUDA
  uses for grouped-query models.  On 2.10-2.11 the same kernel gets the K/V heads repeated to one per
  query head (``models/common/attention.py``: a copy per layer); the Makefile installs at least 2.12 on
  GPU machines.
"""

from __future__ import annotations

import re

import torch

from archon.errors import ArchonError

TORCH_FLOOR: tuple[int, int] = (2, 10)
"""The oldest torch (major, minor) an engine starts on."""
PACKED_ATTENTION_TORCH: tuple[int, int] = (2, 12)
"""The oldest torch whose varlen attention reads grouped-query K/V as they are (the GPU install's floor)."""


class TorchVersionError(ArchonError, RuntimeError):
    """The installed torch is older than Archon's floor."""


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: ``2.10.0+cu128`` and ``2.12.0.dev20260301`` alike."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"cannot read a torch version from {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch_version(version: str | None = None) -> None:
    """Refuse a torch (the installed one by default) older than ``TORCH_FLOOR`` with one sentence."""
    version = version if version is not None else str(torch.__version__)
    if torch_release(version) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise TorchVersionError(
            f"torch {version} is older than {floor}, whose DeviceMesh._unflatten Archon builds its device "
            f"meshes with; install torch>={floor} (pip install 'torch>={floor}')"
        )
