"""The built-in server's endpoints for colocated training: SGLang's ``/release_memory_occupation``,
``/resume_memory_occupation`` and ``/update_weights_from_tensor``, in SGLang's request and answer shapes.

Release and resume take ``{"tags": [...]}`` ('weights', 'kv_cache', 'cuda_graph'; none: all) and answer
200 with a JSON ``null``, as SGLang does, or 400 with ``{"error": {"message"}}``.  SGLang asserts that no
request runs; here the release waits for running requests to finish, and requests that arrive while
memory is released queue until it is resumed and, for the weights, until the next weight update
(``archon.server.memory``).  ``/update_weights_from_tensor`` takes ``serialized_named_tensors`` (one
entry, ``archon.wire.tensor_ipc``), ``weight_version``, ``abort_all_requests`` and ``flush_cache``, and
answers ``{"success", "message"}`` with 200 or 400.  Its entries are unpickled (restricted to torch's
tensor rebuilders) only past the server's API-key check, which every route shares.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from archon.server import protocol
from archon.server.generator import Generator
from archon.server.protocol import ProtocolError
from archon.wire.tensor_ipc import deserialize_named_tensors


def _error(message: str) -> JSONResponse:
    return JSONResponse(protocol.error_body(message), status_code=400)


def _outcome(success: bool, message: str) -> JSONResponse:
    return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)


async def _body(request: Request) -> Any:
    return protocol.parse_json(await request.body())


def add_memory_routes(app: FastAPI, gen: Generator, on_weights_loaded: Callable[[], None] = lambda: None) -> None:
    """Serve the memory and in-place weight endpoints of ``gen`` on ``app``; ``on_weights_loaded`` runs after every
    successful ``/update_weights_from_tensor``."""

    async def change_memory(request: Request, endpoint: str, change: Any) -> JSONResponse:
        try:
            tags = protocol.parse_memory_tags(await _body(request), endpoint)
            await asyncio.wrap_future(change(tags))
        except (ValueError, RuntimeError) as e:  # ProtocolError, an unknown tag, or the engine refused
            return _error(str(e))
        return JSONResponse(None)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request) -> JSONResponse:
        return await change_memory(request, "/release_memory_occupation", gen.release_memory)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request) -> JSONResponse:
        return await change_memory(request, "/resume_memory_occupation", gen.resume_memory)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        try:
            args = protocol.parse_update_from_tensor(await _body(request))
            named = await asyncio.to_thread(deserialize_named_tensors, args.serialized)
        except (ProtocolError, ValueError) as e:
            return _outcome(False, str(e))
        n = len(named)
        try:
            await asyncio.wrap_future(
                gen.update_weights_from_tensors(named, args.weight_version, args.abort_all_requests)
            )
        except Exception as e:  # noqa: BLE001  reported to the trainer, the server keeps serving
            return _outcome(False, f"updating weights from tensors failed: {e}")
        finally:
            del named  # the sender's memory: drop our mapping before answering, after which it may be freed
        on_weights_loaded()
        return _outcome(True, f"updated {n} tensor(s); weight_version {gen.weight_version}.")
