"""The rollout client's generate requests: one completion, or many at once, with retries.

``RolloutClient`` (``archon.rollout.client``) inherits these from ``GenerateRequests``: an async
method (``a...``, for the client's event loop) and a blocking twin each.  A request goes to the
up server with the fewest requests in flight and is retried on other servers after a connection
error, a timeout or an HTTP 5xx.  Where the servers take SGLang's batched ``/generate`` (the
built-in server), many prompts at once go as one request per server, each taking the share of
the prompts that the least-loaded rule would give it one by one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from archon.rollout.control import ServerState, ServerStateFailure, gather_or_cancel
from archon.rollout.server_api import GenerateResult, RolloutError, ServerAPI

if TYPE_CHECKING:
    import itertools

    from archon.rollout.batching import RequestBatcher

logger = logging.getLogger("archon.rollout.client")

T = TypeVar("T")

_ABORT_TIMEOUT_S = 5.0


class GenerateRequests:
    """Generate requests of ``RolloutClient`` (a mixin: the client provides HTTP, servers and retries)."""

    api: ServerAPI
    retries: int
    _servers: list[ServerState]
    _counters: dict[str, int]
    _batcher: RequestBatcher | None
    _loop: asyncio.AbstractEventLoop
    _rid_prefix: str
    _rid_counter: itertools.count

    if TYPE_CHECKING:

        async def _http(
            self, server: ServerState, method: str, path: str, payload: Any = None, timeout: float | None = None
        ) -> Any: ...

        def _record_failure(self, server: ServerState, exc: ServerStateFailure) -> None: ...

        def _all_down_error(self) -> RolloutError: ...

        def _pick(self, avoid: set[str]) -> ServerState: ...

        def _backoff(self, attempt: int) -> float: ...

        async def _ensure_healthy(self) -> None: ...

        def _server(self, url: str) -> ServerState: ...

        def _wait(self, coro: Coroutine[Any, Any, T]) -> T: ...

    async def agenerate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
    ) -> GenerateResult:
        """One completion; retried on other servers after connection errors, timeouts and 5xx.

        ``return_routed_experts`` asks for the experts every token was routed to (MoE routing replay).
        """
        await self._ensure_healthy()
        return await self._agenerate(input_ids, sampling_params, return_logprob, return_routed_experts)

    def _new_rid(self) -> str:
        return f"{self._rid_prefix}-{next(self._rid_counter)}"

    async def _agenerate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        return_logprob: bool,
        return_routed_experts: bool,
        tried: set[str] | None = None,
        first_attempt: int = 0,
        last: str = "",
    ) -> GenerateResult:
        """``agenerate``'s attempts from ``first_attempt`` on, avoiding the servers in ``tried`` while others are up."""
        ids = [int(t) for t in input_ids]
        tried = set() if tried is None else tried
        attempts = self.retries + 1
        for attempt in range(first_attempt, attempts):
            server = self._pick(tried)
            rid = self._new_rid()
            payload = self.api.generate_payload(
                ids, sampling_params, return_logprob, rid, return_routed_experts=return_routed_experts
            )
            server.in_flight += 1
            server.sent += 1
            self._counters["requests"] += 1
            if attempt:
                self._counters["retries"] += 1
            try:
                if self._batcher is not None:
                    body = await self._batcher.post(server.url, payload)
                else:
                    body = await self._http(server, "POST", self.api.generate_path, payload)
            except ServerStateFailure as exc:
                last = self._generate_failed(server, exc, [rid], attempt)
                tried.add(server.url)
                if attempt + 1 < attempts:
                    await asyncio.sleep(self._backoff(attempt))
                continue
            finally:
                server.in_flight -= 1
            server.consecutive_failures = 0
            return self.api.parse_generate(
                body, server.url, return_logprob, server.weight_version, return_routed_experts=return_routed_experts
            )
        if all(s.down for s in self._servers):
            raise self._all_down_error()
        raise RolloutError(
            f"generate request failed after {attempts} attempt(s) on {', '.join(sorted(tried))}; "
            f"last error from {last}; check the server logs or raise rollout.request_retries"
        )

    def _generate_failed(self, server: ServerState, exc: ServerStateFailure, rids: list[str], attempt: int) -> str:
        """Count a failed generate attempt against ``server``; returns it for the final error message."""
        self._record_failure(server, exc)
        if exc.timed_out:
            # The server may still be working on them; free their slots (best effort).
            for rid in rids:
                self._loop.create_task(self._abort_quietly(server, rid))
        logger.debug("generate attempt %d/%d failed on %s: %s", attempt + 1, self.retries + 1, server.url, exc)
        return f"{server.url}: {exc}"

    def _shares(self, n: int) -> list[tuple[ServerState, int]]:
        """How many of ``n`` requests made together each up server gets: as ``_pick`` would send them one by one."""
        up = [s for s in self._servers if not s.down]
        if not up:
            raise self._all_down_error()
        if len(up) == 1:
            return [(up[0], n)]
        count = dict.fromkeys(range(len(up)), 0)
        for _ in range(n):
            j = min(range(len(up)), key=lambda j: (up[j].in_flight + count[j], up[j].sent + count[j], up[j].index))
            count[j] += 1
        return [(up[j], c) for j, c in count.items() if c]

    async def _agenerate_batched(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[dict[str, Any]],
        return_logprob: bool,
        return_routed_experts: bool,
    ) -> list[GenerateResult]:
        """``agenerate_many`` as one batched request per server, each taking its share of the prompts in order.

        Per request this costs a payload and a parsed answer, where requests made one by one cost
        a task and a future each too: about half the client's CPU time on a round of short answers.
        A share whose batch fails (connection, timeout, 5xx) is retried request by request, as
        ``agenerate`` retries, on the other servers where there are any.
        """
        shares = []
        start = 0
        for server, count in self._shares(len(prompts)):
            shares.append(
                self._agenerate_share(
                    server,
                    prompts[start : start + count],
                    params[start : start + count],
                    return_logprob,
                    return_routed_experts,
                )
            )
            start += count
        if len(shares) == 1:
            return await shares[0]
        return [r for share in await gather_or_cancel(shares) for r in share]

    async def _agenerate_share(
        self,
        server: ServerState,
        prompts: Sequence[Sequence[int]],
        params: Sequence[dict[str, Any]],
        return_logprob: bool,
        return_routed_experts: bool,
    ) -> list[GenerateResult]:
        assert self._batcher is not None
        payloads = [
            self.api.generate_payload(
                [int(t) for t in ids], p, return_logprob, self._new_rid(), return_routed_experts=return_routed_experts
            )
            for ids, p in zip(prompts, params)
        ]
        server.in_flight += len(payloads)
        server.sent += len(payloads)
        self._counters["requests"] += len(payloads)
        try:
            bodies = await self._batcher.post_many(server.url, payloads)
        except ServerStateFailure as exc:
            failure: ServerStateFailure | None = exc
        else:
            failure = None
        finally:
            server.in_flight -= len(payloads)
        if failure is not None:
            last = self._generate_failed(server, failure, [p["rid"] for p in payloads], 0)
            if self.retries:
                await asyncio.sleep(self._backoff(0))
            return await gather_or_cancel(
                self._agenerate(ids, p, return_logprob, return_routed_experts, {server.url}, 1, last)
                for ids, p in zip(prompts, params)
            )
        server.consecutive_failures = 0
        return [
            self.api.parse_generate(
                body, server.url, return_logprob, server.weight_version, return_routed_experts=return_routed_experts
            )
            for body in bodies
        ]

    async def _abort_quietly(self, server: ServerState, rid: str) -> None:
        call = self.api.abort(rid)
        if call is None:
            return
        try:
            await self._http(server, call.method, call.path, call.payload, timeout=_ABORT_TIMEOUT_S)
        except (RolloutError, ServerStateFailure):
            pass

    async def agenerate_many(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: dict[str, Any] | Sequence[dict[str, Any]],
        *,
        max_concurrency: int = 0,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
    ) -> list[GenerateResult]:
        if isinstance(sampling_params, dict):
            per_prompt = [sampling_params] * len(prompts)
        else:
            per_prompt = list(sampling_params)
            if len(per_prompt) != len(prompts):
                raise ValueError(
                    f"generate_many got {len(prompts)} prompts but {len(per_prompt)} sampling_params; "
                    "pass one dict for all prompts or one per prompt"
                )
        if not prompts:
            return []
        await self._ensure_healthy()
        # One prompt goes alone, where the batcher may still put it in a batch with others of this turn.
        if self._batcher is not None and len(prompts) > 1 and not 0 < max_concurrency < len(prompts):
            return await self._agenerate_batched(prompts, per_prompt, return_logprob, return_routed_experts)
        limit = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None

        async def one(ids: Sequence[int], params: dict[str, Any]) -> GenerateResult:
            if limit is None:
                return await self._agenerate(ids, params, return_logprob, return_routed_experts)
            async with limit:
                return await self._agenerate(ids, params, return_logprob, return_routed_experts)

        # One request lost for good stops the others rather than finish a batch nobody will use.
        return await gather_or_cancel(one(p, sp) for p, sp in zip(prompts, per_prompt))

    def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
    ) -> GenerateResult:
        """One completion (blocking)."""
        return self._wait(
            self.agenerate(
                input_ids, sampling_params, return_logprob=return_logprob, return_routed_experts=return_routed_experts
            )
        )

    async def agenerate_on(
        self,
        url: str,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        *,
        return_logprob: bool = True,
        priority: int = 0,
    ) -> GenerateResult:
        """One completion from the server at ``url`` and no other (no retry elsewhere): what that server computes.

        ``priority`` > 0 asks servers that admit by priority to take it before the queued requests.
        """
        server = self._server(url)
        payload = self.api.generate_payload(
            [int(t) for t in input_ids], sampling_params, return_logprob, self._new_rid()
        )
        if priority and self.api.priority_field:
            payload["priority"] = priority
        server.in_flight += 1
        try:
            body = await self._http(server, "POST", self.api.generate_path, payload)
        except ServerStateFailure as exc:
            raise RolloutError(f"generate request to {server.url} failed: {exc}") from None
        finally:
            server.in_flight -= 1
        return self.api.parse_generate(body, server.url, return_logprob, server.weight_version)

    def generate_on(
        self, url: str, input_ids: Sequence[int], sampling_params: dict[str, Any], *, return_logprob: bool = True
    ) -> GenerateResult:
        """One completion from the server at ``url`` (blocking)."""
        return self._wait(self.agenerate_on(url, input_ids, sampling_params, return_logprob=return_logprob))

    def generate_many(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: dict[str, Any] | Sequence[dict[str, Any]],
        *,
        max_concurrency: int = 0,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
    ) -> list[GenerateResult]:
        """Completions of many prompts, in input order; at most ``max_concurrency`` in flight (0: all)."""
        return self._wait(
            self.agenerate_many(
                prompts,
                sampling_params,
                max_concurrency=max_concurrency,
                return_logprob=return_logprob,
                return_routed_experts=return_routed_experts,
            )
        )
