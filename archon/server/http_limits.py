"""Guards of the built-in server's HTTP surface: a cap on request bodies, one-sentence 404/405.

A body is read whole before it is parsed, so without a cap one oversized request (by mistake
or not) takes the server's memory with it.  ``BodyLimitMiddleware`` answers 413 as soon as
the declared or received size passes ``max_bytes`` and never hands the body on; below the
cap it replays the body to the app and then passes the connection through untouched, so a
client disconnect still reaches the handler.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from archon.wire.auth import ASGIApp, Receive, Scope, Send


def _error_response(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


class BodyLimitMiddleware:
    """ASGI middleware: HTTP 413 with one sentence for a request body over ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, scope: Scope, size: str) -> JSONResponse:
        mib = self.max_bytes / 2**20
        return _error_response(
            f"the body of this {scope['method']} {scope['path']} request is {size}, more than the "
            f"server's limit of {mib:g} MiB; send fewer prompts per request or raise "
            "--max-request-mb",
            413,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, f"{int(declared)} bytes")(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                await self.app(scope, _replay([], message, receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope, f"over {self.max_bytes} bytes")(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], None, receive), send)


def _replay(messages: list[dict[str, Any]], last: dict[str, Any] | None, receive: Receive) -> Receive:
    """A ``receive`` that first returns ``messages`` (then ``last``), then defers to the real one."""
    queue = list(messages) + ([last] if last is not None else [])

    async def replay() -> dict[str, Any]:
        return queue.pop(0) if queue else await receive()

    return replay


def add_error_handlers(app: Any) -> None:
    """Unknown paths (404) and methods (405) answer in SGLang's error shape with one sentence."""

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        path, method = request.url.path, request.method
        routes = {r.path: sorted(r.methods or ()) for r in app.routes if getattr(r, "include_in_schema", False)}
        if exc.status_code == 404:
            return _error_response(
                f"there is no endpoint {path} on this server; it serves {', '.join(sorted(routes))}", 404
            )
        if exc.status_code == 405:
            allowed = " or ".join(routes.get(path, [])) or "another method"
            return _error_response(f"{path} does not accept {method} requests; use {allowed}", 405)
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return _error_response(f"{method} {path} failed: {detail}", exc.status_code)

    app.add_exception_handler(HTTPException, http_error)
