"""``make gpu-check``: what a CUDA device must confirm that the CPU test suite cannot.

One module per group of checks (``environment``, ``kernels``, ``training``, ``memory``,
``servers``); ``table`` runs them, one row each, and ``cli`` is ``scripts/gpu_check.py``.
On a machine without CUDA the CPU-runnable checks run and the CUDA-only ones are reported
as skipped, never as passed.
"""

from archon.gpu_check.registry import CHECKS, Check
from archon.gpu_check.table import Outcome, Row, run_checks

__all__ = ["CHECKS", "Check", "Outcome", "Row", "run_checks"]
