"""Measuring the bytes of live tensors a piece of code allocates (not RSS), for memory-estimate tests.

``LiveTensorBytes`` is a TorchDispatchMode: every tensor an op returns inside it is counted
by its storage until the storage dies (a weak reference's callback), and storages resized in
place (FSDP2 frees its all-gather buffers with ``resize_(0)``) are followed.  Tensors that
existed before (parameters, optimizer state) are added with ``track``.  ``peak`` is the
largest total seen, which is what a GPU's caching allocator would have to hold at least.
"""

from __future__ import annotations

import weakref
from functools import wraps
from typing import Any

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


class LiveTensorBytes(TorchDispatchMode):
    """Current and peak bytes of the tensors created inside the mode (plus those given to ``track``)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        # storage -> [bytes it holds now]; the weak reference's callback subtracts that when it dies.
        self._sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: list[weakref.ref] = []
        self._orig_resize = torch.UntypedStorage.resize_

    def _set(self, box: list[int], size: int) -> None:
        self.current += size - box[0]
        box[0] = size
        self.peak = max(self.peak, self.current)

    def _add(self, st: torch.UntypedStorage) -> None:
        box = self._sizes.get(st)
        if box is not None:
            self._set(box, st.nbytes())
            return
        box = [0]
        self._sizes[st] = box

        def gone(_ref: weakref.ref, box: list[int] = box) -> None:
            self.current -= box[0]

        self._refs.append(weakref.ref(st, gone))
        self._set(box, st.nbytes())

    def track(self, *objs: Any) -> None:
        """Count tensors that already exist: tensors, modules (parameters, buffers), optimizers (state)."""
        for obj in objs:
            if isinstance(obj, torch.nn.Module):
                tensors = [*obj.parameters(), *obj.buffers()]
            elif isinstance(obj, torch.optim.Optimizer):
                tensors = [v for state in obj.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
            else:
                tensors = [obj]
            for t in tensors:
                for st in get_untyped_storages(t):
                    self._add(st)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for st in get_untyped_storages(t):
                    self._add(st)
        return out

    def __enter__(self) -> LiveTensorBytes:
        mode = self
        orig = self._orig_resize

        @wraps(orig)
        def resized(st: torch.UntypedStorage, size: int):
            result = orig(st, size)
            box = mode._sizes.get(st)
            if box is not None:
                mode._set(box, st.nbytes())
            return result

        torch.UntypedStorage.resize_ = resized  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        return super().__exit__(*exc)
