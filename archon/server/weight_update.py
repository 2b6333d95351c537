"""The server side of weight updates: an HF folder from disk, or tensors broadcast by the trainer.

Both run on the generator's engine thread (``Generator.run_exclusive``), so no request sees
half-updated weights.  Names are Hugging Face names, converted per tensor with the model's
state-dict adapter; a per-expert tensor fills one slice of a grouped expert tensor.  Both
check everything before touching a weight, so a bad update leaves the served model as it was.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import models
from archon.wire.weight_group import broadcast_tensor, bucket_nbytes, unflatten_bucket
from models.state_dict_adapter import UnknownKeyError

GROUP_PROBE_S = 5.0
"""How long ``probe_rendezvous`` waits for the trainer's rendezvous port to accept a connection."""


def probe_rendezvous(address: str, port: int, timeout_s: float = GROUP_PROBE_S) -> None:
    """Raise ``ValueError`` unless something accepts TCP connections on ``address:port`` within ``timeout_s``.

    Joining a group dials the trainer's store until the group timeout (minutes); a wrong address
    should fail now.  The trainer listens before it asks the servers to join (Archon's does), so a
    refusal is retried only briefly, for trainers that start their store while the request is in flight.
    """
    try:
        socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"master_address {address!r} does not resolve ({e}); send the trainer's address.") from None
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((address, port), timeout=max(deadline - time.monotonic(), 0.1)):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ValueError(
                    f"nothing accepts connections on {address}:{port} ({e}); the trainer must listen there "
                    "before asking servers to join its weight update group."
                ) from None
        time.sleep(0.05)


def read_eos_token_ids(folder: str | Path) -> list[int]:
    """EOS ids of a Hugging Face folder: ``eos_token_id`` of config.json and generation_config.json."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(folder) / name
        if not path.is_file():
            continue
        with open(path) as f:
            value = json.load(f).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return sorted(ids)


def load_weights_from_disk(model: nn.Module, path: str | Path) -> None:
    """Load the Hugging Face folder ``path`` into ``model`` in place.

    The folder's config must describe the same architecture with the same tensor shapes;
    this is checked before any weight is touched, so a mismatch leaves the model unchanged.
    """
    cfg = models.read_hf_config(path)
    spec = models.spec_for_model(model)
    if cfg.get("model_type") not in spec.supported_model_types:
        raise ValueError(
            f"{path} holds a {cfg.get('model_type')!r} model but the server runs {spec.name!r}; "
            "weights can only be updated within one architecture (restart the server for another model)."
        )
    new = models.build_model(cfg)  # meta device: shapes only
    have = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    want = {n: tuple(t.shape) for n, t in new.state_dict().items()}
    if have != want:
        diff = sorted(n for n in have.keys() | want.keys() if have.get(n) != want.get(n))
        raise ValueError(
            f"{path} has a different model shape than the served model (first differences: {diff[:3]}); "
            "weights can only be updated for the same config."
        )
    models.load_hf_weights(model, path)


def _plan_received(
    adapter: models.BaseStateDictAdapter,
    targets: dict[str, torch.Tensor],
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
) -> list[str]:
    """Problems with applying HF tensors ``names`` of ``shapes`` to ``targets`` (empty if none)."""
    problems = []
    for name, shape in zip(names, shapes):
        try:
            items = adapter.from_hf_tensor(name, torch.empty(tuple(shape), device="meta"))
        except (UnknownKeyError, ValueError, RuntimeError) as e:
            problems.append(f"{name!r}: {e}")
            continue
        for archon_name, expert, t in items:
            dst = targets.get(archon_name)
            if dst is None:
                problems.append(f"{name!r} maps to {archon_name!r}, which the model does not have")
                continue
            if expert is not None and not 0 <= expert < dst.shape[0]:
                problems.append(f"{name!r} is expert {expert}, but {archon_name!r} holds {dst.shape[0]} experts")
                continue
            want = tuple(dst.shape[1:] if expert is not None else dst.shape)
            if tuple(t.shape) != want:
                problems.append(f"{name!r} has shape {tuple(shape)}, the model expects {want} for {archon_name!r}")
    return problems


def _receive_each(
    group: dist.ProcessGroup, dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]], device: torch.device
) -> Iterator[torch.Tensor]:
    for dtype, shape in zip(dtypes, shapes):
        tensor = torch.empty(tuple(shape), dtype=dtype, device=device)
        broadcast_tensor(tensor, group, src=0)
        yield tensor


def receive_weights(
    model: nn.Module,
    group: dist.ProcessGroup,
    names: Sequence[str],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
    flattened: bool = False,
    refuse: str | None = None,
) -> list[torch.Tensor]:
    """Receive each tensor by broadcast from rank 0 of ``group``, in order, and copy it into ``model``.

    Names are Hugging Face names; a per-expert tensor fills one slice of a grouped expert
    tensor.  Every tensor is received even when the names do not fit the model (so the
    sender, which broadcasts regardless, does not hang); then nothing is applied and a
    ``ValueError`` lists the problems.  ``flattened``: the tensors come as one broadcast of
    their bytes (``weight_group.flatten_bucket``).  ``refuse``: a reason to receive everything and apply
    nothing (the model's weights are released, say).  Returns the model's tensors written.
    """
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names, dtypes and shapes must have one entry per tensor, got {len(names)}, {len(dtypes)}, {len(shapes)}."
        )
    adapter = models.adapter_for(model)
    targets = model.state_dict(keep_vars=True)
    problems = [refuse] if refuse else _plan_received(adapter, targets, names, shapes)
    device = next(model.parameters()).device
    if flattened:
        flat = torch.empty(bucket_nbytes(list(dtypes), [list(s) for s in shapes]), dtype=torch.uint8, device=device)
        broadcast_tensor(flat, group, src=0)
        received: Iterable[torch.Tensor] = unflatten_bucket(flat, list(dtypes), [list(s) for s in shapes])
    else:
        received = _receive_each(group, dtypes, shapes, device)
    written = []
    for name, tensor in zip(names, received):
        if problems:
            continue  # every tensor is still received
        for archon_name, expert, value in adapter.from_hf_tensor(name, tensor):
            dst = targets[archon_name]
            (dst if expert is None else dst[expert]).copy_(value)
            written.append(dst)
    if problems:
        raise ValueError(
            f"{len(problems)} received tensor(s) do not fit the served model, so none was applied: "
            + "; ".join(problems[:5])
            + (" ..." if len(problems) > 5 else "")
        )
    return written


def load_named_tensors(model: nn.Module, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Copy HF-named tensors (``update_weights_from_tensor``) into ``model`` in place; returns the model's
    tensors written (a grouped expert tensor counts as written by any of its experts).

    Every name and shape is checked first, so a mismatch raises ``ValueError`` and leaves the
    model unchanged.  Tensors on another device or in another dtype are converted by the copy.
    """
    names = [name for name, _ in named_tensors]
    adapter = models.adapter_for(model)
    targets = model.state_dict(keep_vars=True)
    problems = _plan_received(adapter, targets, names, [tuple(t.shape) for _, t in named_tensors])
    if problems:
        raise ValueError(
            f"{len(problems)} tensor(s) do not fit the served model, so none was applied: "
            + "; ".join(problems[:5])
            + (" ..." if len(problems) > 5 else "")
        )
    written = []
    for name, tensor in named_tensors:
        for archon_name, expert, value in adapter.from_hf_tensor(name, tensor):
            dst = targets[archon_name]
            (dst if expert is None else dst[expert]).copy_(value)
            written.append(dst)
    return written
