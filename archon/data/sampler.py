"""Epoch-seeded shuffling with a resumable position.

The order of epoch ``e`` is a permutation that depends only on ``(seed, e)``: never on
the rank, the world size or the allocation, so every rank draws the same global batch
and a resumed run continues with exactly the batches it would have seen.
"""

from __future__ import annotations

import random
from typing import Any

from archon.errors import DataError


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The sample order of one epoch."""
    order = list(range(n))
    if shuffle:
        # A string seed is hashed with SHA-512 by `random`, stable across Python runs and platforms.
        random.Random(f"archon-data:{seed}:{epoch}").shuffle(order)
    return order


class EpochSampler:
    """Batches of sample indices, epoch after epoch; ``state_dict()`` records (epoch, position)."""

    def __init__(self, n: int, batch_size: int, *, seed: int, shuffle: bool = True, drop_last: bool = True):
        if batch_size < 1:
            raise DataError(f"batch_size = {batch_size} must be at least 1")
        if n == 0:
            raise DataError("the dataset is empty (after filtering); check the data file and max_length")
        if drop_last and batch_size > n:
            raise DataError(
                f"batch_size = {batch_size} is larger than the dataset ({n} samples) with drop_last; "
                "lower the batch size, add data, or set drop_last = false"
            )
        self.n = n
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # samples of the current epoch already handed out
        self._order: list[int] | None = None

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.n, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            self._order = epoch_order(self.n, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)
        return self._order

    def next_batch(self) -> list[int]:
        """Indices of the next batch; moves to the next epoch when this one is used up."""
        remaining = self.n - self.position
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch += 1
            self.position = 0
            self._order = None
        order = self._epoch_order()
        batch = order[self.position : self.position + self.batch_size]
        self.position += len(batch)
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "n": self.n,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("n", self.n) != self.n:
            raise DataError(
                f"the checkpointed data sampler covered {state['n']} samples but the dataset now has "
                f"{self.n}; resume with the same data file and max_length"
            )
        if state.get("seed", self.seed) != self.seed:
            raise DataError(
                f"the checkpoint was written with seed {state['seed']} but this run uses {self.seed}; "
                "resume with the same seed"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = None


def repeat_for_group(items: list[Any], group_size: int) -> list[Any]:
    """Each item ``group_size`` times in a row: the rows of one prompt's group are consecutive."""
    if group_size < 1:
        raise DataError(f"group_size = {group_size} must be at least 1")
    return [item for item in items for _ in range(group_size)]
