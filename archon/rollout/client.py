"""The trainer's client of rollout servers that speak SGLang's HTTP protocol.

The trainer is synchronous, but a batch of rollouts is many requests in flight at once, and
the weight broadcast must overlap with an HTTP call that only returns once it is done.  So
the client owns an asyncio event loop on a background thread: every public method has an
async core (``a...``), a blocking wrapper, and ``submit(coro)`` hands back a
``concurrent.futures.Future`` for calls that must run while the caller does other work.

Requests go to the up server with the fewest requests in flight (ties: fewest requests
sent so far, then the lowest index, so the spread is deterministic).  A connection error,
a timeout or an HTTP 5xx is retried with exponential backoff, preferring servers the request
has not failed on yet; a 4xx is the caller's mistake and is raised at once with the
server's message.  A server that refuses connections, or fails ``down_after`` times in a
row, is marked down: it would miss weight updates, so it never silently comes back with
stale weights; only ``revive(url)`` takes it back, once the caller restarted it and is about
to give it the current weights (``archon.launch.recovery``).

Control calls (pause, flush, weight updates) fan out to every server that is up, and any
server that fails or answers ``success: false`` is an error that names it.

How a request is spelled on the wire is the job of a ``ServerAPI`` (``server_api.py``): by
default SGLang's HTTP protocol (which the built-in server speaks too); ``archon.rollout.vllm.VLLMAPI``
maps the same calls onto vLLM's OpenAI completions API and its weight-reload endpoints.  The
trainer only ever sees ``RolloutClient`` and ``GenerateResult``.

With an API key (given, or ``$ARCHON_API_KEY``) every request carries
``Authorization: Bearer <key>``, which SGLang's and vLLM's ``--api-key`` and the built-in server check.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import aiohttp

from archon.alloc import ModelAllocation
from archon.config import ConfigError, RolloutConfig
from archon.rollout import json_codec
from archon.rollout.batching import RequestBatcher
from archon.rollout.control import ServerControl, ServerState, ServerStateFailure, cancel_on_first_error  # noqa: F401 - ServerStateFailure is public here too
from archon.rollout.generate_requests import GenerateRequests
from archon.rollout.server_api import (  # noqa: F401 - errors, results and helpers are public here too
    HEALTH_PROBE_TIMEOUT_S,
    BuiltinServerAPI,
    Call,
    GenerateResult,
    RolloutError,
    RolloutRequestError,
    ServerAPI,
    error_message,
    normalize_addr,
)
from archon.rollout.vllm import VLLMAPI
from archon.wire.auth import api_key_from_env, auth_headers

logger = logging.getLogger("archon.rollout.client")

T = TypeVar("T")

_MAX_BACKOFF_S = 30.0
_KEEPALIVE_S = 2.0


def api_for_backend(backend: str) -> ServerAPI:
    """The ServerAPI of an inference backend of the allocation grammar (sglang, vllm, local)."""
    if backend == "vllm":
        return VLLMAPI()
    if backend == "local":
        return BuiltinServerAPI()
    return ServerAPI()


class RolloutClient(GenerateRequests, ServerControl):
    """Sends generate and control requests to a fixed set of rollout servers."""

    def __init__(
        self,
        addrs: Sequence[str],
        *,
        request_timeout: float = 3600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        setup_timeout: float = 300.0,
        down_after: int = 3,
        api: ServerAPI | None = None,
        api_key: str | None = None,
    ):
        if not addrs:
            raise ConfigError(
                "RolloutClient needs at least one server address (host:port); launch servers with "
                "RolloutLauncher or set rollout.server_addrs"
            )
        if retries < 0:
            raise ConfigError(f"rollout.request_retries = {retries} must be 0 or more")
        urls = [normalize_addr(a) for a in addrs]
        dupes = sorted({u for u in urls if urls.count(u) > 1})
        if dupes:
            raise ConfigError(
                f"rollout server address(es) {', '.join(dupes)} listed more than once; list each server once"
            )
        self._servers = [ServerState(i, u) for i, u in enumerate(urls)]
        self.api = api or ServerAPI()
        self.request_timeout = request_timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.setup_timeout = setup_timeout
        self.down_after = max(1, down_after)
        self._headers = auth_headers(api_key or api_key_from_env())
        self._healthy = False
        self._group_members: dict[str, list[ServerState]] = {}
        self._counters = {"requests": 0, "retries": 0}
        # Request ids: a counter behind a random prefix per client, as unique as a uuid4 per
        # request and cheaper (a uuid4 reads the OS's random source: ~0.8 ms a round of 256).
        self._rid_prefix = uuid.uuid4().hex[:16]
        self._rid_counter = itertools.count()
        # Requests made together go to their server as one batch where the API allows it.
        self._batcher = (
            RequestBatcher(lambda url, body: self._http(self._server(url), "POST", self.api.generate_path, body))
            if self.api.batch_generate
            else None
        )

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="archon-rollout-client", daemon=True)
        self._thread.start()
        self._session: aiohttp.ClientSession | None = None
        self._health_lock: asyncio.Lock | None = None
        self._closed = False
        self.submit(self._open()).result()

    @classmethod
    def from_config(cls, cfg: RolloutConfig, addrs: Sequence[str], api_key: str | None = None) -> RolloutClient:
        """A client of ``addrs`` speaking the API of ``cfg.backend``'s servers."""
        return cls(
            addrs,
            request_timeout=cfg.request_timeout,
            retries=cfg.request_retries,
            setup_timeout=cfg.setup_timeout,
            api=api_for_backend(ModelAllocation.from_str(cfg.backend).backend),
            api_key=api_key,
        )

    # ------------------------------------------------------------------ loop plumbing
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

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a coroutine (e.g. ``client.ainit_weights_update_group(...)``) on the client's loop."""
        if self._closed:
            coro.close()
            raise RuntimeError("this RolloutClient is closed; create a new one")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _wait(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                "a blocking RolloutClient method was called on the client's own event loop; "
                "await the async variant (a...) instead"
            )
        return self.submit(coro).result()

    def close(self) -> None:
        """Close connections and stop the loop thread (idempotent)."""
        if getattr(self, "_closed", True):
            return
        if self._session is not None:
            asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result()
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ introspection
    @property
    def addrs(self) -> list[str]:
        """Every server's base URL, in the order given."""
        return [s.url for s in self._servers]

    @property
    def up_addrs(self) -> list[str]:
        """Servers not marked down."""
        return [s.url for s in self._servers if not s.down]

    @property
    def down_addrs(self) -> list[str]:
        """Servers marked down."""
        return [s.url for s in self._servers if s.down]

    def last_error(self, url: str) -> str:
        """Why server ``url`` last failed ('' if it never did)."""
        return self._server(url).last_error

    def mark_down(self, url: str, why: str) -> None:
        """Send nothing more to server ``url`` (e.g. its process exited) until ``revive(url)``."""
        server = self._server(url)
        if not server.down:
            logger.warning("rollout server %s marked down (%s)", url, why)
        server.down, server.last_error = True, why

    def revive(self, url: str) -> None:
        """Take server ``url`` back (restarted and healthy; the caller gives it the current weights next)."""
        server = self._server(url)
        server.down, server.consecutive_failures, server.last_error = False, 0, ""

    def check_health(self) -> list[str]:
        """Probe ``/health`` of every up server; mark the ones that do not answer down. Returns those."""
        return self._wait(self._acheck_health())

    async def _acheck_health(self) -> list[str]:
        up = [s for s in self._servers if not s.down]
        reasons = await asyncio.gather(*(self._probe(s, HEALTH_PROBE_TIMEOUT_S) for s in up))
        for server, why in zip(up, reasons):
            if why is not None:
                self.mark_down(server.url, f"/health failed: {why}")
        return [s.url for s, why in zip(up, reasons) if why is not None]

    def _server(self, url: str) -> ServerState:
        url = normalize_addr(url)
        for server in self._servers:
            if server.url == url:
                return server
        raise KeyError(f"{url} is not one of this client's servers ({', '.join(self.addrs)})")

    def stats(self) -> dict[str, float]:
        """Counters for metrics: requests sent, retries, servers down."""
        return {
            "rollout_requests": float(self._counters["requests"]),
            "rollout_retries": float(self._counters["retries"]),
            "rollout_servers_down": float(sum(s.down for s in self._servers)),
        }

    # ------------------------------------------------------------------ HTTP
    async def _http(
        self, server: ServerState, method: str, path: str, payload: Any = None, timeout: float | None = None
    ) -> Any:
        """One HTTP call; 4xx -> RolloutRequestError, retryable failures -> ServerStateFailure."""
        assert self._session is not None
        timeout_s = self.request_timeout if timeout is None else timeout
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

    def _record_failure(self, server: ServerState, exc: ServerStateFailure) -> None:
        if exc.recorded:
            return
        exc.recorded = True
        server.consecutive_failures += 1
        server.last_error = str(exc)
        if not server.down and (exc.refused or server.consecutive_failures >= self.down_after):
            server.down = True
            left = sum(not s.down for s in self._servers)
            logger.warning(
                "rollout server %s marked down after %d failure(s) (last: %s); %d server(s) left",
                server.url,
                server.consecutive_failures,
                exc,
                left,
            )

    def _all_down_error(self) -> RolloutError:
        detail = "; ".join(f"{s.url} (last error: {s.last_error or 'unknown'})" for s in self._servers)
        return RolloutError(f"all rollout servers are down: {detail}; check their logs, restart them and the run")

    def _pick(self, avoid: set[str]) -> ServerState:
        up = [s for s in self._servers if not s.down]
        if not up:
            raise self._all_down_error()
        fresh = [s for s in up if s.url not in avoid]
        return min(fresh or up, key=lambda s: (s.in_flight, s.sent, s.index))

    def _backoff(self, attempt: int) -> float:
        return min(self.backoff_s * (2**attempt), _MAX_BACKOFF_S)

    # ------------------------------------------------------------------ health
    async def _probe(self, server: ServerState, timeout: float) -> str | None:
        """None if /health answers 200 within ``timeout`` s, else why not."""
        try:
            await self._http(server, "GET", "/health", timeout=timeout)
            return None
        except (ServerStateFailure, RolloutRequestError) as exc:
            return str(exc)

    async def await_healthy(self, timeout: float | None = None) -> None:
        timeout = self.setup_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        pending = [s for s in self._servers if not s.down]
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

    def wait_healthy(self, timeout: float | None = None) -> None:
        """Block until every server answers /health (default: setup_timeout); raise naming the ones that don't."""
        self._wait(self.await_healthy(timeout))

    async def _ensure_healthy(self) -> None:
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
                    body = await self._http(server, call.method, call.path, call.payload, timeout)
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
                    await asyncio.sleep(self._backoff(attempt))
            if isinstance(body, dict) and body.get("success") is False:
                raise RolloutError(
                    f"rollout server {server.url} answered {call.path} with success=false: "
                    f"{body.get('message', '(no message)')}"
                )
        return body

    async def _fan_out(
        self,
        calls: Sequence[Call] = (),
        *,
        retry: bool = False,
        servers: Sequence[ServerState] | None = None,
        per_server: Sequence[Sequence[Call]] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        targets = list(servers) if servers is not None else [s for s in self._servers if not s.down]
        if not targets:
            raise self._all_down_error()
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
