"""The rollout client's core: an HTTP session on a background event loop, the servers' states, and calls to them.

The trainer is synchronous, but a batch of rollouts is many requests in flight at once, and
the weight broadcast must overlap with an HTTP call that only returns once it is done.  So
``Transport`` runs an asyncio event loop on a background thread: ``submit(coro)`` hands back
a ``concurrent.futures.Future``, ``wait(coro)`` blocks on it.  On that loop it keeps one
``aiohttp`` session, the load and health of every server (``ServerState``), and the
primitives that the client's operations are built from: one HTTP call (``request``), the
choice of a server (``pick``), failure accounting (``record_failure``), health probes, and
``fan_out`` of control calls to every server that is up, failing fast on the first one that fails.
Given an ASGI ``app`` (the in-process rollout engine), the same calls go to it directly through
httpx's ASGI transport: same bodies, answers and failure kinds, without a socket or a process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import httpx

from archon.rollout import json_codec
from archon.rollout.aio import cancel_on_first_error
from archon.rollout.server_api import (
    HEALTH_PROBE_TIMEOUT_S,
    Call,
    RolloutError,
    RolloutRequestError,
    ServerAPI,
    error_message,
    normalize_addr,
)

logger = logging.getLogger("archon.rollout.client")

T = TypeVar("T")

_MAX_BACKOFF_S = 30.0
_KEEPALIVE_S = 2.0


@dataclass
class ServerState:
    """Load and health of one server, touched only on the client's event loop."""

    index: int
    """Position in the client's address list (tie-breaker)."""
    url: str
    """Base URL, e.g. http://127.0.0.1:30000."""
    in_flight: int = 0
    """Generate requests currently waiting on this server."""
    sent: int = 0
    """Generate requests sent so far."""
    consecutive_failures: int = 0
    """Failures since the last success."""
    down: bool = False
    """Marked down: receives no more requests."""
    last_error: str = ""
    """Most recent failure, for error messages."""
    weight_version: str = ""
    """Version of the last weight update this client made on the server ("" before any)."""
    lora_name: str = ""
    """LoRA adapter that generate requests to the server name ("" none: the server's own weights)."""


class ServerStateFailure(Exception):
    """A failure worth retrying elsewhere: connection error, timeout or 5xx."""

    def __init__(self, message: str, *, refused: bool = False, timed_out: bool = False):
        super().__init__(message)
        self.refused = refused
        self.timed_out = timed_out
        self.recorded = False
        """Counted against its server already (a batch's failure reaches each of its requests)."""


class Transport:
    """Connections, event loop and server states that the client's generate and control requests share."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        api: ServerAPI,
        headers: dict[str, str],
        request_timeout: float,
        retries: int,
        backoff_s: float,
        setup_timeout: float,
        down_after: int,
        app: Any = None,
        serve: Callable[[concurrent.futures.Future[Any]], Any] | None = None,
    ):
        assert urls, "a Transport needs at least one server"
        self.servers = [ServerState(i, u) for i, u in enumerate(urls)]
        """Every server, in the order given."""
        self.api = api
        self.request_timeout = request_timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.setup_timeout = setup_timeout
        self.down_after = max(1, down_after)
        self._headers = headers
        self._healthy = False
        # An ASGI app (the in-process rollout engine's built-in server) is called directly: no socket, no process.
        self._app = app
        self._asgi: httpx.AsyncClient | None = None
        # The in-process engine's serve_until: a blocking wait runs the engine on the waiting thread.
        self._serve = serve

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="archon-rollout-client", daemon=True)
        self._thread.start()
        self._session: aiohttp.ClientSession | None = None
        self._health_lock: asyncio.Lock | None = None
        self._closed = False
        self.submit(self._open()).result()

    # ------------------------------------------------------------------ loop plumbing
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop every request runs on (on a thread of its own)."""
        return self._loop

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _open(self) -> None:
        # limit=0: concurrency is bounded by the caller (max_concurrency), not by the pool.  SGLang
        # and uvicorn close a keep-alive connection after 5 idle seconds; reusing one the server
        # just closed fails the request, so idle connections are dropped here well before that.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_S), headers=self._headers
        )
        self._health_lock = asyncio.Lock()
        if self._app is not None:
            self._asgi = httpx.AsyncClient(transport=httpx.ASGITransport(app=self._app), headers=self._headers)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a coroutine on the loop; the future holds its result."""
        if self._closed:
            coro.close()
            raise RuntimeError("this RolloutClient is closed; create a new one")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def wait(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the loop and block until it is done (never from the loop itself)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                "a blocking RolloutClient method was called on the client's own event loop; "
                "await the async variant (a...) instead"
            )
        return self.result(self.submit(coro))

    def result(self, future: concurrent.futures.Future[T]) -> T:
        """``future.result()``; with an in-process engine (``serve``) the waiting thread runs the engine meanwhile."""
        return future.result() if self._serve is None else self._serve(future)

    def close(self) -> None:
        """Close connections and stop the loop thread (idempotent)."""
        if self._closed:
            return
        if self._session is not None:
            asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result()
        if self._asgi is not None:
            asyncio.run_coroutine_threadsafe(self._asgi.aclose(), self._loop).result()
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    # ------------------------------------------------------------------ servers
    def server(self, url: str) -> ServerState:
        """The state of server ``url``; KeyError if it is not one of the client's."""
        url = normalize_addr(url)
        for server in self.servers:
            if server.url == url:
                return server
        raise KeyError(f"{url} is not one of this client's servers ({', '.join(s.url for s in self.servers)})")

    def up_servers(self) -> list[ServerState]:
        """Servers not marked down, in the order given."""
        return [s for s in self.servers if not s.down]

    def mark_down(self, url: str, why: str) -> None:
        """Send nothing more to server ``url`` until ``revive(url)``."""
        server = self.server(url)
        if not server.down:
            logger.warning("rollout server %s marked down (%s)", url, why)
        server.down, server.last_error = True, why

    def revive(self, url: str) -> None:
        """Take server ``url`` back, with a clean failure record."""
        server = self.server(url)
        server.down, server.consecutive_failures, server.last_error = False, 0, ""
        server.lora_name = ""  # a restarted server holds no adapter until the next sync loads one

    def record_failure(self, server: ServerState, exc: ServerStateFailure) -> None:
        """Count ``exc`` against ``server`` (once); a refusal or ``down_after`` failures in a row mark it down."""
        if exc.recorded:
            return
        exc.recorded = True
        server.consecutive_failures += 1
        server.last_error = str(exc)
        if not server.down and (exc.refused or server.consecutive_failures >= self.down_after):
            server.down = True
            left = sum(not s.down for s in self.servers)
            logger.warning(
                "rollout server %s marked down after %d failure(s) (last: %s); %d server(s) left",
                server.url,
                server.consecutive_failures,
                exc,
                left,
            )

    def all_down_error(self) -> RolloutError:
        """The error to raise when no server is up, with each one's last failure."""
        detail = "; ".join(f"{s.url} (last error: {s.last_error or 'unknown'})" for s in self.servers)
        return RolloutError(f"all rollout servers are down: {detail}; check their logs, restart them and the run")

    def pick(self, avoid: set[str]) -> ServerState:
        """The up server with the fewest requests in flight (then fewest sent, lowest index), outside ``avoid``
        while any other is up."""
        up = self.up_servers()
        if not up:
            raise self.all_down_error()
        fresh = [s for s in up if s.url not in avoid]
        return min(fresh or up, key=lambda s: (s.in_flight, s.sent, s.index))

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt + 1``: exponential, capped."""
        return min(self.backoff_s * (2**attempt), _MAX_BACKOFF_S)

    # ------------------------------------------------------------------ HTTP
    async def request(
        self, server: ServerState, method: str, path: str, payload: Any = None, timeout: float | None = None
    ) -> Any:
        """One HTTP call; 4xx -> RolloutRequestError, retryable failures -> ServerStateFailure."""
        assert self._session is not None
        timeout_s = self.request_timeout if timeout is None else timeout
        if self._asgi is not None:
            status, raw = await self._call_app(server, method, path, payload, timeout_s)
            return self._answer(server, path, status, raw)
        try:
            async with self._session.request(
                method,
                server.url + path,
                data=None if payload is None else json_codec.dumps(payload),
                headers=None if payload is None else json_codec.JSON_HEADERS,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except asyncio.TimeoutError:
            raise ServerStateFailure(f"no answer to {path} within {timeout_s:g} s", timed_out=True) from None
        except aiohttp.ClientConnectorError as exc:
            raise ServerStateFailure(f"cannot connect ({exc.os_error or exc})", refused=True) from None
        except aiohttp.ClientError as exc:
            raise ServerStateFailure(f"{type(exc).__name__}: {exc or 'connection lost'}") from None
        return self._answer(server, path, status, raw)

    async def _call_app(
        self, server: ServerState, method: str, path: str, payload: Any, timeout_s: float
    ) -> tuple[int, bytes]:
        """One call of the in-process app, with the same timeout and failure kinds as over the network."""
        assert self._asgi is not None
        try:
            resp = await asyncio.wait_for(
                self._asgi.request(
                    method,
                    server.url + path,
                    content=None if payload is None else json_codec.dumps(payload),
                    headers=None if payload is None else json_codec.JSON_HEADERS,
                ),
                timeout_s,
            )
        except asyncio.TimeoutError:
            raise ServerStateFailure(f"no answer to {path} within {timeout_s:g} s", timed_out=True) from None
        except httpx.HTTPError as exc:
            raise ServerStateFailure(f"{type(exc).__name__}: {exc or 'in-process call failed'}") from None
        return resp.status_code, resp.content

    def _answer(self, server: ServerState, path: str, status: int, raw: bytes) -> Any:
        """The parsed body of an answer; 4xx -> RolloutRequestError, 5xx -> ServerStateFailure."""
        text = raw.decode(errors="replace") if status >= 400 else ""
        try:
            body: Any = json_codec.loads(raw) if raw else None
        except ValueError:
            body = text or raw.decode(errors="replace")
        if status >= 500:
            raise ServerStateFailure(f"HTTP {status} on {path}: {error_message(body, text)}")
        if status >= 400:
            raise RolloutRequestError(server.url, status, error_message(body, text))
        return body

    # ------------------------------------------------------------------ health
    async def _probe(self, server: ServerState, timeout: float) -> str | None:
        """None if /health answers 200 within ``timeout`` s, else why not."""
        try:
            await self.request(server, "GET", "/health", timeout=timeout)
            return None
        except (ServerStateFailure, RolloutRequestError) as exc:
            return str(exc)

    async def check_health(self) -> list[str]:
        """Probe ``/health`` of every up server; mark the ones that do not answer down. Returns those."""
        up = self.up_servers()
        reasons = await asyncio.gather(*(self._probe(s, HEALTH_PROBE_TIMEOUT_S) for s in up))
        for server, why in zip(up, reasons):
            if why is not None:
                self.mark_down(server.url, f"/health failed: {why}")
        return [s.url for s, why in zip(up, reasons) if why is not None]

    async def await_healthy(self, timeout: float | None = None) -> None:
        """Wait until every up server answers /health (default: setup_timeout); raise naming the ones that don't."""
        timeout = self.setup_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        pending = self.up_servers()
        delay = 0.05
        while True:
            probe_s = min(HEALTH_PROBE_TIMEOUT_S, max(deadline - time.monotonic(), 0.1))
            reasons = await asyncio.gather(*(self._probe(s, probe_s) for s in pending))
            pending, why = (
                [s for s, r in zip(pending, reasons) if r is not None],
                [r for r in reasons if r is not None],
            )
            if not pending:
                self._healthy = True
                return
            if time.monotonic() + delay > deadline:
                detail = "; ".join(f"{s.url} ({r})" for s, r in zip(pending, why))
                raise RolloutError(
                    f"rollout server(s) not healthy after {timeout:g} s: {detail}; check that they "
                    "are running and reachable (logs under <run_dir>/rollout/ for launched servers), "
                    "fix rollout.server_addrs, or raise rollout.setup_timeout"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def ensure_healthy(self) -> None:
        """``await_healthy`` once, before the first generate request; later calls return at once."""
        if self._healthy:
            return
        assert self._health_lock is not None
        async with self._health_lock:
            if not self._healthy:
                await self.await_healthy()

    # ------------------------------------------------------------------ control fan-out
    async def _control_one(self, server: ServerState, calls: Sequence[Call], retry: bool, timeout: float | None) -> Any:
        """Make ``calls`` in order on one server; returns the last answer."""
        attempts = self.retries + 1 if retry else 1
        body: Any = None
        for call in calls:
            for attempt in range(attempts):
                try:
                    body = await self.request(server, call.method, call.path, call.payload, timeout)
                    break
                except RolloutRequestError as exc:
                    if exc.status == 404:
                        raise RolloutError(
                            f"rollout server {server.url} has no {call.path.split('?')[0]} "
                            f"(HTTP 404){self.api.missing_endpoint_hint}"
                        ) from None
                    raise
                except ServerStateFailure as exc:
                    if attempt + 1 == attempts:
                        raise RolloutError(f"rollout server {server.url} failed {call.path}: {exc}") from None
                    await asyncio.sleep(self.backoff(attempt))
            if isinstance(body, dict) and body.get("success") is False:
                raise RolloutError(
                    f"rollout server {server.url} answered {call.path} with success=false: "
                    f"{body.get('message', '(no message)')}"
                )
        return body

    async def fan_out(
        self,
        calls: Sequence[Call] = (),
        *,
        retry: bool = False,
        servers: Sequence[ServerState] | None = None,
        per_server: Sequence[Sequence[Call]] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Make ``calls`` (or each server's ``per_server`` plan) on ``servers`` (default: every up one) at once.

        Returns each server's last answer by URL; the first server that fails, or answers
        ``success: false``, cancels the others and is raised, named.
        """
        targets = list(servers) if servers is not None else self.up_servers()
        if not targets:
            raise self.all_down_error()
        plans = per_server if per_server is not None else [calls] * len(targets)
        tasks = [self._loop.create_task(self._control_one(s, plan, retry, timeout)) for s, plan in zip(targets, plans)]
        # Fail fast: during a weight update the other servers may wait forever for a broadcast
        # that the trainer abandons because of this failure.
        errors = await cancel_on_first_error(tasks)
        if errors:
            if len(errors) == 1:
                raise errors[0]  # type: ignore[misc]
            raise RolloutError(f"{len(errors)} rollout servers failed: " + "; ".join(map(str, errors)))
        return {s.url: t.result() for s, t in zip(targets, tasks)}
