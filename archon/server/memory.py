"""Giving the engine's memory back while a colocated trainer trains, and taking it again (SGLang's
``release_memory_occupation`` / ``resume_memory_occupation``).

Tags, as SGLang names them (no tags: all of them):

* ``kv_cache``: the KV cache's storage is freed (``BatchedKVCache.free``, zero bytes); resuming takes
  its initial size again, and it grows on demand as before.
* ``weights``: the storage of every Parameter is freed (``untyped_storage().resize_(0)``: views, such
  as the module Parameters that view the lean forward's fused projections, keep their shapes and
  follow the storage), and what the lean forward derived from the weights (oneDNN-packed copies,
  the q/k norm rows) is dropped.  Resuming allocates the same storages again with undefined
  contents, as SGLang does without a CPU backup: weight updates fill them, and until every
  Parameter has been written (by one update or by several buckets; a grouped expert tensor counts
  once any of its experts is) no request is admitted.  Buffers (the RoPE tables) are small and computed, so they stay.
  No CPU copy is kept (vLLM's sleep level 1 keeps one): on a CPU server it would hold the very
  memory the release is meant to give back.
* ``cuda_graph``: accepted for SGLang compatibility; the built-in server captures no CUDA graphs.

While any tag is released, or while resumed weights await their update, requests queue (the
generator admits none), so generation never reads freed or undefined weights.  Everything here
runs on the generator's engine thread (``Generator.run_exclusive``), once no request runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn

from archon.server.kv_cache import BatchedKVCache

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""Memory regions a release or resume names (SGLang's ``GPU_MEMORY_ALL_TYPES``)."""


def check_tags(tags: Sequence[str] | None) -> list[str]:
    """The tags a request names (None or empty: all); ``ValueError`` for an unknown one."""
    if not tags:
        return list(MEMORY_TAGS)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}; use any of {list(MEMORY_TAGS)} (none: all of them).")
    return list(dict.fromkeys(tags))


def _distinct_storages(model: nn.Module) -> list[torch.UntypedStorage]:
    """The storages behind ``model``'s Parameters, each once (tied and fused weights share one)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for p in model.parameters():
        storage = p.untyped_storage()
        seen.setdefault(storage._cdata, storage)
    return list(seen.values())


class EngineMemory:
    """Which memory of a generator is released, and the bytes its weights and KV cache hold.

    ``lean`` is the generator's ``InferenceForward`` (None: it calls the model), whose derived copies
    of the weights are dropped on release; ``shared_weights``: the weights belong to a trainer in
    this process, so they cannot be released here.
    """

    def __init__(self, model: nn.Module, cache: BatchedKVCache, lean: Any, shared_weights: bool) -> None:
        self.model = model
        self.cache = cache
        self.lean = lean
        self.shared_weights = shared_weights
        self.released: set[str] = set()
        """Tags released and not resumed."""
        self._unwritten: set[int] = set()
        """ids of the Parameters resumed and not written since (undefined contents)."""
        self._freed: list[tuple[torch.UntypedStorage, int]] = []

    @property
    def awaiting_weights(self) -> bool:
        """Resumed weights are not all written yet; requests wait for the updates that write them."""
        return bool(self._unwritten)

    @property
    def holds_requests(self) -> bool:
        """Requests must not be admitted: memory is released, or the weights have no contents yet."""
        return bool(self.released) or self.awaiting_weights

    def weight_bytes(self) -> int:
        """Bytes the Parameters' storages hold (0 while the weights are released)."""
        return sum(s.nbytes() for s in _distinct_storages(self.model))

    def stats(self) -> dict[str, Any]:
        return {
            "weight_bytes": self.weight_bytes(),
            "kv_cache_bytes": self.cache.nbytes,
            "memory_released": sorted(self.released),
            "awaiting_weights": self.awaiting_weights,
        }

    def weight_update(self, load: Callable[[nn.Module], Iterable[torch.Tensor] | None]) -> Callable[[nn.Module], None]:
        """``load`` as a weight update: refused while the weights are released; the tensors it returns as written
        (None: all of them) end a resume's wait for them."""

        def update(model: nn.Module) -> None:
            if "weights" in self.released:
                raise RuntimeError(
                    "the server's weights are released; call /resume_memory_occupation (tag 'weights') "
                    "before updating them."
                )
            written = load(model)
            self.weights_written(written)

        return update

    def weights_written(self, written: Iterable[torch.Tensor] | None) -> None:
        """A weight update wrote ``written`` (None: every weight): they have contents again."""
        if written is None:
            self._unwritten.clear()
        else:
            self._unwritten.difference_update(id(t) for t in written)

    def release(self, tags: Sequence[str] | None) -> list[str]:
        """Free the memory of ``tags`` (engine thread, no request running); returns the tags released now."""
        tags = check_tags(tags)
        if "weights" in tags and self.shared_weights and "weights" not in self.released:
            raise ValueError(
                "this generator serves the trainer's own weights (the in-process engine), which only their owner "
                "can move; release 'kv_cache' alone."
            )
        done = [t for t in tags if t not in self.released]
        if "kv_cache" in done:
            self.cache.free()
        if "weights" in done:
            storages = _distinct_storages(self.model)
            if self.lean is not None:
                self.lean.reset()  # its packed copies are weights too
            self._freed = [(s, s.nbytes()) for s in storages]
            for s, _ in self._freed:
                s.resize_(0)
        self.released.update(done)
        return done

    def resume(self, tags: Sequence[str] | None) -> list[str]:
        """Take the memory of ``tags`` again (engine thread); returns the tags resumed now."""
        done = [t for t in check_tags(tags) if t in self.released]
        if "weights" in done:
            for s, nbytes in self._freed:
                s.resize_(nbytes)
            self._freed = []
            if self.lean is not None:
                self.lean.reset()  # pack again from the new contents
            self._unwritten = {id(p) for p in self.model.parameters()}
        if "kv_cache" in done:
            self.cache.restore()
        self.released.difference_update(done)
        return done
