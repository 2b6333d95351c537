"""Bytes of AdamW's state (its two moments) for each ``optimizer.type``, for the memory-fit estimate.

torch's AdamW keeps both moments in the parameters' dtype (float32 master weights: 8 bytes per element).
torchao's low-bit AdamW (``adamw_8bit``, ``adamw_fp8``) quantises a moment tensor in blocks of 256 elements:
1 byte per element plus a float32 scale per block, and the 8-bit one a 256-entry float32 code map per tensor;
tensors under 4096 elements, or whose element count is not a multiple of 256, keep float32 moments
(torchao's rule, after bitsandbytes).  Each rank quantises its local shard, so the rule applies to local sizes.
"""

from __future__ import annotations

from collections.abc import Iterable

LOW_BIT_BLOCK = 256
"""Elements per quantisation block (torchao's default ``block_size`` for 8-bit and fp8 AdamW)."""
LOW_BIT_MIN_NUMEL = 4096
"""Smaller moment tensors stay float32."""
QMAP_BYTES = 256 * 4
"""The 8-bit state's float32 code map, one per moment tensor."""
OPTIMIZER_LABELS = {"adamw": "AdamW, float32", "adamw_8bit": "torchao AdamW8bit", "adamw_fp8": "torchao AdamWFp8"}
"""How the estimate names the optimizer state of each ``optimizer.type``."""


def moment_bytes(optimizer_type: str, numel: int) -> int:
    """Bytes of one moment tensor of ``numel`` (local) float32 elements under ``optimizer_type``."""
    quantised = optimizer_type != "adamw" and numel >= LOW_BIT_MIN_NUMEL and numel % LOW_BIT_BLOCK == 0
    if not quantised:
        return 4 * numel
    scales = 4 * (numel // LOW_BIT_BLOCK)
    return numel + scales + (QMAP_BYTES if optimizer_type == "adamw_8bit" else 0)


def adamw_state_bytes(optimizer_type: str, local_numels: Iterable[float]) -> int:
    """Bytes of AdamW's two moments over tensors of these local element counts (fractions of an average
    shard: rounded down per tensor for the low-bit size rule, once on the total for float32 state)."""
    numels = list(local_numels)
    if optimizer_type == "adamw":
        return int(8 * sum(numels))
    return sum(2 * moment_bytes(optimizer_type, int(n)) for n in numels)
