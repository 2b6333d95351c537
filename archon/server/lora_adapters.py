"""LoRA adapters on the built-in server: one PEFT adapter at a time, merged into the served weights.

SGLang's ``/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``/unload_lora_adapter`` ``{"lora_name"}``, with
``/generate`` naming the adapter in ``"lora_path"``.  SGLang and vLLM keep several adapters beside the base and pick
one per request; this server keeps one, merged: loading reads the PEFT folder (``adapter_config.json`` with ``r``,
``lora_alpha``, ``use_rslora``; ``adapter_model.safetensors``), reads the adapted layers' base weights from the
server's own model folder (adapter sync never changes the base) and writes ``base + scale * B @ A`` for each of
them through the by-HF-name weight loading (``Generator.update_weights_from_tensors``), so fused and packed layouts keep
working.  Layers the previous adapter touched and this one does not get their base back; unloading restores the
base of every layer touched.  Like every weight update it runs once no request runs (``Generator.run_exclusive``).

A request naming another adapter than the loaded one is refused with HTTP 400; a request naming none gets the
weights as they are (with an adapter loaded, the merged ones).  A full weight update (disk, broadcast, tensors)
overwrites the merged weights, so it drops the adapter.  The load may carry ``weight_version`` (an Archon
extension): the served version then changes with the weights, as in a full update.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from safetensors.torch import load_file

from archon.server import protocol
from archon.server.generator import Generator
from archon.server.protocol import ProtocolError
from models.hf_checkpoint import checkpoint_key_files, open_safetensors
from models.lora import PEFT_PREFIX

ADAPTER_CONFIG = "adapter_config.json"
"""PEFT's adapter config file."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""PEFT's adapter weights file."""
_A, _B = ".lora_A.weight", ".lora_B.weight"


@dataclass
class LoadAdapterArgs:
    """The body of ``/load_lora_adapter``."""

    lora_name: str
    """Name that requests select the adapter by."""
    lora_path: str
    """PEFT adapter folder, on a disk this server reads."""
    weight_version: str | None = None
    """Served weight version once loaded (None: unchanged)."""


def parse_load(body: Any) -> LoadAdapterArgs:
    """``/load_lora_adapter``'s body; ``ProtocolError`` names what is wrong."""
    if not isinstance(body, dict):
        raise ProtocolError("the /load_lora_adapter body must be a JSON object with lora_name and lora_path.")
    name, path, version = body.get("lora_name"), body.get("lora_path"), body.get("weight_version")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ProtocolError("/load_lora_adapter needs lora_name and lora_path as non-empty strings.")
    if version is not None and not isinstance(version, str):
        raise ProtocolError(f"weight_version must be a string, got {version!r}.")
    return LoadAdapterArgs(name, path, version)


def read_peft_deltas(path: str | Path) -> dict[str, torch.Tensor]:
    """``{HF weight name: scale * B @ A}`` (float32) of the PEFT adapter folder ``path``; ``ValueError`` if it is
    unreadable."""
    folder = Path(path)
    config_file, weights_file = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(
            f"{folder} has no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}; the adapter folder must be visible to this "
            "server (a shared disk), or set rollout.lora_sync = 'merged'."
        )
    config = json.loads(config_file.read_text())
    if str(config.get("peft_type", "LORA")).upper() != "LORA" or config.get("use_dora"):
        raise ValueError(f"{folder} holds a {config.get('peft_type')} adapter; only plain LoRA can be loaded.")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = load_file(str(weights_file))
    deltas = {}
    for key, a in tensors.items():
        if not key.endswith(_A):
            continue
        module = key[: -len(_A)].removeprefix(PEFT_PREFIX)
        b = tensors.get(key[: -len(_A)] + _B)
        if b is None:
            raise ValueError(f"{weights_file} has {key} without its lora_B; export the adapter again.")
        deltas[f"{module}.weight"] = scale * (b.float() @ a.float())
    if not deltas:
        raise ValueError(f"{weights_file} holds no lora_A/lora_B pairs; is it a PEFT LoRA adapter?")
    return deltas


def read_base_tensors(model_path: str | Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The HF tensors ``names`` of the checkpoint in ``model_path``; ``ValueError`` names one it lacks."""
    files = checkpoint_key_files(model_path)
    missing = sorted(names - files.keys())
    if missing:
        raise ValueError(
            f"the adapter changes {missing[0]}, which the server's model {model_path} does not have; the adapter "
            "was trained on another model."
        )
    out: dict[str, torch.Tensor] = {}
    for fname in sorted({files[n] for n in names}):
        with open_safetensors(Path(model_path) / fname) as f:
            out.update((n, f.get_tensor(n)) for n in names if files[n] == fname)
    return out


class ServedAdapter:
    """Which adapter the served weights hold merged, and the layers it touched."""

    def __init__(self, base_path: str):
        self.base_path = base_path
        """The server's model folder: the base the adapters were trained on."""
        self.name: str | None = None
        """The loaded adapter's name (None: none)."""
        self.touched: set[str] = set()
        """HF weight names that hold a merged adapter (their base must come back when it goes)."""

    def check_request(self, body: Any) -> None:
        """Refuse a ``/generate`` body naming another adapter than the loaded one; clears the name it carries."""
        if not isinstance(body, dict) or body.get("lora_path") is None:
            return
        value = body["lora_path"]
        names = set(value) if isinstance(value, list) else {value}
        names.discard(None)
        wrong = sorted(str(n) for n in names if n != self.name)
        if wrong:
            have = f"only adapter {self.name!r} is loaded" if self.name else "no adapter is loaded"
            raise ProtocolError(
                f"lora_path names adapter {wrong[0]!r}, but {have}; load it with /load_lora_adapter first."
            )
        body["lora_path"] = None

    def merged_tensors(self, path: str) -> tuple[list[tuple[str, torch.Tensor]], set[str]]:
        """The HF tensors that make the served weights base + the adapter at ``path`` (reads disk; any thread)."""
        deltas = read_peft_deltas(path) if path else {}
        names = set(deltas) | self.touched
        base = read_base_tensors(self.base_path, names) if names else {}
        named = [(n, base[n].float() + deltas[n] if n in deltas else base[n]) for n in sorted(names)]
        return named, set(deltas)

    async def load(self, gen: Generator, args: LoadAdapterArgs) -> None:
        named, touched = await asyncio.to_thread(self.merged_tensors, args.lora_path)
        await asyncio.wrap_future(gen.update_weights_from_tensors(named, args.weight_version))
        self.name, self.touched = args.lora_name, touched

    async def unload(self, gen: Generator) -> None:
        named, _ = await asyncio.to_thread(self.merged_tensors, "")
        if named:
            await asyncio.wrap_future(gen.update_weights_from_tensors(named))
        self.name, self.touched = None, set()

    def drop(self) -> None:
        """A full weight update overwrote the merged weights: no adapter is loaded any more."""
        self.name, self.touched = None, set()


def _outcome(success: bool, message: str) -> JSONResponse:
    return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)


def add_lora_routes(app: FastAPI, gen: Generator, adapter: ServedAdapter) -> None:
    """Serve ``/load_lora_adapter`` and ``/unload_lora_adapter`` for ``adapter`` on ``app``."""

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        try:
            args = parse_load(protocol.parse_json(await request.body()))
        except ProtocolError as e:
            return _outcome(False, str(e))
        try:
            await adapter.load(gen, args)
        except Exception as e:  # noqa: BLE001  reported to the trainer, the server keeps serving
            return _outcome(False, f"loading LoRA adapter {args.lora_name!r} from {args.lora_path} failed: {e}")
        return _outcome(True, f"loaded LoRA adapter {args.lora_name!r}; weight_version {gen.weight_version}.")

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        try:
            body = protocol.parse_json(await request.body())
        except ProtocolError as e:
            return _outcome(False, str(e))
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            return _outcome(False, "/unload_lora_adapter needs lora_name as a non-empty string.")
        if name != adapter.name:
            # Loading another adapter replaced it already (one at a time): nothing is left to unload.
            return _outcome(True, f"LoRA adapter {name!r} is not loaded; nothing to unload.")
        try:
            await adapter.unload(gen)
        except Exception as e:  # noqa: BLE001  reported to the trainer, the server keeps serving
            return _outcome(False, f"unloading LoRA adapter {name!r} failed: {e}")
        return _outcome(True, f"unloaded LoRA adapter {name!r}; the base weights are served.")
