"""A batched KV cache with one row per running request and per-row lengths.

Keys and values of every layer live in preallocated ``[rows, capacity, kv_heads, head_dim]``
tensors that grow geometrically (in rows and in positions), so a decode step writes one slot
per row instead of concatenating.  The rows a forward works on are always a contiguous range:
running requests occupy rows ``0..n-1``, a prefill appends rows at the end, and finished rows
are removed by compacting the survivors to the front.  That keeps every read a view (no copy)
of the cache.

Usage, around one model forward::

    cache.begin_forward(start, stop, n_new, valid)   # rows [start, stop), n_new tokens each
    logits = model(tokens, positions=cache.positions(), cache=cache)
    cache.end_forward()                              # lengths[row] += valid[row]

``update(layer_id, k, v)`` is the model-facing contract (see ``models/common/attention.py``):
it stores the new keys/values and returns all cached ones of the forward's rows (``[rows,
total, kv_heads, head_dim]`` views) together with the boolean attention mask ``[rows, 1, n_new,
total]`` (True = may attend).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _grown(current: int, needed: int, limit: int | None) -> int:
    """Geometric growth: at least double, at least ``needed``, at most ``limit`` unless needed."""
    size = max(needed, 2 * current)
    return max(needed, min(size, limit)) if limit is not None else size


@dataclass
class _Forward:
    """What the forward in progress writes and reads."""

    start: int
    """First cache row of the forward's batch."""
    stop: int
    """One past the last cache row."""
    write_index: torch.Tensor
    """``[b * kv_heads * n_new]`` slot of every new key in a store viewed as ``[-1, head_dim]``,
    in the order of ``k.transpose(1, 2)`` (row, head, token)."""
    write_pos: torch.Tensor
    """``[b, n_new]`` position (slot) of every new token."""
    total: int
    """Keys returned per row: the longest row after this forward."""
    mask: torch.Tensor
    """``[b, 1, n_new, total]`` boolean attention mask, shared by every layer."""
    valid: list[int]
    """New tokens per row that are real (the rest is right padding)."""


class BatchedKVCache:
    """Keys and values for a batch of sequences of different lengths; rows are added and removed."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        initial_rows: int = 4,
        initial_length: int = 128,
        max_rows: int | None = None,
        max_length: int | None = None,
    ) -> None:
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_rows = max_rows
        self.max_length = max_length
        self.lengths: list[int] = []
        self._rows = max(1, initial_rows)
        self._capacity = max(1, initial_length if max_length is None else min(initial_length, max_length))
        self._initial = (self._rows, self._capacity)
        self.k = [self._zeros(self._rows, self._capacity) for _ in range(n_layers)]
        self.v = [self._zeros(self._rows, self._capacity) for _ in range(n_layers)]
        self._fwd: _Forward | None = None
        self._freed = False

    # ---- sizes ------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows in use (running sequences)."""
        return len(self.lengths)

    @property
    def row_capacity(self) -> int:
        """Rows allocated."""
        return self._rows

    @property
    def capacity(self) -> int:
        """Positions allocated per row."""
        return self._capacity

    @property
    def nbytes(self) -> int:
        """Bytes the key and value storage holds (in use or not)."""
        return sum(t.numel() * t.element_size() for store in (self.k, self.v) for t in store)

    def _zeros(self, rows: int, length: int) -> torch.Tensor:
        # Zeros, not empty: masked slots still enter q @ k^T, and NaN garbage would poison softmax.
        return torch.zeros(rows, self.n_kv_heads, length, self.head_dim, dtype=self.dtype, device=self.device)

    def _grow(self, rows: int, length: int) -> None:
        """Make room for ``rows`` rows of ``length`` positions, at least doubling what grows."""
        new_rows, new_cap = self._rows, self._capacity
        if rows > self._rows:
            new_rows = _grown(self._rows, rows, self.max_rows)
        if length > self._capacity:
            new_cap = _grown(self._capacity, length, self.max_length)
        if (new_rows, new_cap) == (self._rows, self._capacity):
            return
        used = self.num_rows
        used_len = max(self.lengths, default=0)
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                new = self._zeros(new_rows, new_cap)
                new[:used, :, :used_len] = old[:used, :, :used_len]
                store[i] = new
        self._rows, self._capacity = new_rows, new_cap

    # ---- rows -------------------------------------------------------------------------
    def add_rows(self, n: int) -> int:
        """Append ``n`` empty rows; returns the index of the first."""
        start = self.num_rows
        self._grow(start + n, self._capacity)
        self.lengths.extend([0] * n)
        return start

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (ascending), moved to the front in that order."""
        if keep == list(range(len(keep))):
            del self.lengths[len(keep) :]
            return
        used_len = max((self.lengths[i] for i in keep), default=0)
        if keep and used_len:
            index = torch.tensor(keep, device=self.device)
            for store in (self.k, self.v):
                for t in store:
                    # index_select makes a copy first, so overlapping source and target is safe.
                    t[: len(keep), :, :used_len] = t[:, :, :used_len].index_select(0, index)
        self.lengths = [self.lengths[i] for i in keep]

    def copy_rows(self, sources: list[int], start: int) -> None:
        """Fill rows ``start, start + 1, ...`` (in use, outside any forward) with copies of rows ``sources``."""
        if not sources:
            return
        stop = start + len(sources)
        if self._fwd is not None or not 0 <= start < stop <= self.num_rows:
            raise ValueError(
                f"cannot copy into rows [{start}, {stop}) of a cache with {self.num_rows} rows (or during a forward)."
            )
        used_len = max(self.lengths[i] for i in sources)
        if used_len:
            index = torch.tensor(sources, device=self.device)
            for store in (self.k, self.v):
                for t in store:
                    t[start:stop, :, :used_len] = t[:, :, :used_len].index_select(0, index)
        for i, src in enumerate(sources):
            self.lengths[start + i] = self.lengths[src]

    def clear(self) -> None:
        """Drop every row (the memory stays allocated for reuse)."""
        self.lengths = []
        self._fwd = None

    def release(self) -> None:
        """Drop every row and shrink the storage back to its initial size (no-op when it never grew).

        Called when the server goes idle, so a burst of long requests does not hold its peak
        memory until the next burst.
        """
        self.clear()
        if not self._freed and (self._rows, self._capacity) != self._initial:
            self._rows, self._capacity = self._initial
            self.k = [self._zeros(self._rows, self._capacity) for _ in self.k]
            self.v = [self._zeros(self._rows, self._capacity) for _ in self.v]

    @property
    def freed(self) -> bool:
        """True between ``free()`` and ``restore()``: the cache holds no storage at all."""
        return self._freed

    def free(self) -> None:
        """Drop every row and all key and value storage (zero bytes held) until ``restore()``.

        For a server that gives its memory back while the trainer trains; ``release()`` keeps it freed.
        """
        self.clear()
        self._rows = self._capacity = 0
        self.k = [self._zeros(0, 0) for _ in self.k]
        self.v = [self._zeros(0, 0) for _ in self.v]
        self._freed = True

    def restore(self) -> None:
        """Take storage again after ``free()``: the initial size, growing on demand as before."""
        if self._freed:
            self._freed = False
            self.release()

    # ---- one forward ------------------------------------------------------------------
    def begin_forward(self, start: int, stop: int, n_new: int, valid: list[int] | None = None) -> None:
        """Prepare a forward of rows ``[start, stop)`` with ``n_new`` tokens each.

        ``valid[i]`` (default ``n_new``) tokens of row ``start + i`` are real; the rest is right
        padding, whose keys are written past the row's length and never attended to.
        """
        if not 0 <= start < stop <= self.num_rows:
            raise ValueError(f"rows [{start}, {stop}) are not in use (the cache has {self.num_rows} rows).")
        b = stop - start
        valid = [n_new] * b if valid is None else list(valid)
        if len(valid) != b or any(not 0 < n <= n_new for n in valid):
            raise ValueError(f"valid must hold {b} counts in [1, {n_new}], got {valid}.")
        lengths = self.lengths[start:stop]
        self._grow(stop, max(lengths) + n_new)
        dev = self.device
        past = torch.tensor(lengths, device=dev)
        new_pos = past[:, None] + torch.arange(n_new, device=dev)[None, :]
        limit = past + torch.tensor(valid, device=dev)
        total = int(max(ln + n for ln, n in zip(lengths, valid)))
        keys = torch.arange(total, device=dev)
        mask = (keys[None, None, :] <= new_pos[:, :, None]) & (keys[None, None, :] < limit[:, None, None])
        rows = torch.arange(start, stop, device=dev)[:, None, None]
        heads = torch.arange(self.n_kv_heads, device=dev)[None, :, None]
        index = ((rows * self.n_kv_heads + heads) * self._capacity + new_pos[:, None, :]).reshape(-1)
        self._fwd = _Forward(start, stop, index, new_pos, total, mask[:, None], valid)

    def positions(self) -> torch.Tensor:
        """``[b, n_new]`` int64 RoPE positions of the forward's new tokens."""
        if self._fwd is None:
            raise RuntimeError("positions() needs begin_forward() first.")
        return self._fwd.write_pos

    def update(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store ``k, v [b, n_new, kv_heads, head_dim]``; return all keys, values and the mask."""
        f = self._fwd
        if f is None:
            raise RuntimeError("the KV cache was used by a forward without begin_forward().")
        for store, new in ((self.k[layer_id], k), (self.v[layer_id], v)):
            rows = new.to(self.dtype).transpose(1, 2).reshape(-1, self.head_dim)
            store.view(-1, self.head_dim).index_copy_(0, f.write_index, rows)
        return (
            self.k[layer_id][f.start : f.stop, :, : f.total].transpose(1, 2),
            self.v[layer_id][f.start : f.stop, :, : f.total].transpose(1, 2),
            f.mask,
        )

    def end_forward(self) -> None:
        """Count the forward's real tokens into the row lengths."""
        f = self._fwd
        if f is None:
            raise RuntimeError("end_forward() without begin_forward().")
        for i, n in enumerate(f.valid):
            self.lengths[f.start + i] += n
        self._fwd = None

    def abort_forward(self) -> None:
        """Forget a forward that failed (its writes sit past the row lengths and are ignored)."""
        self._fwd = None
