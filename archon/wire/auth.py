"""A shared secret between the trainer and its rollout servers (SGLang's ``--api-key`` scheme).

Whoever reaches a rollout server's port can replace its weights (``/update_weights_*``) or
make it join a process group of their choosing, so a server reachable from other machines
must refuse strangers.  Every request carries ``Authorization: Bearer <key>``, the header
SGLang's ``--api-key`` checks, so one client serves both kinds of server.  As in SGLang,
``/health*`` stays open (liveness probes carry no secrets).

The launcher generates one key per run (``generate_api_key``), gives it to the servers it
starts (the built-in one reads ``ARCHON_API_KEY`` from its environment; SGLang gets
``--api-key``), hands it to the trainer's client in memory, and writes it to
``<run_dir>/rollout/api_key`` (owner-only) for anyone who must talk to the servers meanwhile.
The built-in server refuses to bind a non-loopback address without a key.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

API_KEY_ENV = "ARCHON_API_KEY"
"""Environment variable holding the key (read by the built-in server and by the client)."""

_OPEN_PREFIXES = ("/health",)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def generate_api_key() -> str:
    """A fresh random key (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def api_key_from_env() -> str | None:
    """``$ARCHON_API_KEY``, or None when unset or empty."""
    return os.environ.get(API_KEY_ENV) or None


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The request headers that carry ``api_key`` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to a routable address


def check_bind(host: str, api_key: str | None) -> None:
    """Raise ``ValueError`` when a server would listen on a routable ``host`` without a key."""
    if not api_key and not is_loopback(host):
        raise ValueError(
            f"--host {host} makes the server reachable from other machines, and anyone reaching it "
            f"could replace its weights; set {API_KEY_ENV} (or --api-key) to a shared secret, or bind "
            "127.0.0.1"
        )


def write_api_key(path: Path, api_key: str) -> None:
    """Write ``api_key`` to ``path``, readable by its owner only (created with that mode, never widened)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(api_key + "\n")


def read_api_key(path: Path) -> str | None:
    """The key ``write_api_key`` wrote to ``path``; None when there is no such file."""
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


class APIKeyMiddleware:
    """ASGI middleware: every request but ``/health*`` needs ``Authorization: Bearer <api_key>``.

    Plain ASGI rather than Starlette's ``BaseHTTPMiddleware``, so a client disconnect still
    reaches the handler (the generator frees the row of a request nobody waits for).
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(_OPEN_PREFIXES) or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization")
        if given is not None and hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        if given is None:
            message = (
                "this rollout server requires an API key; send the header 'Authorization: Bearer <key>' "
                "(a launched run's key is in <run_dir>/rollout/api_key)"
            )
        else:
            message = (
                "the API key in the Authorization header is wrong; send 'Authorization: Bearer <key>' with "
                "this run's key (<run_dir>/rollout/api_key)"
            )
        body = json.dumps({"error": {"message": message}}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
