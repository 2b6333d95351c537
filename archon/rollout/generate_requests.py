"""The rollout client's generate requests: one completion, or many at once, with retries and failover.

``GenerateRequests`` holds a reference to the client's ``Transport`` (and its ``RequestBatcher``
where the servers take batches).  A request goes to the up server with the fewest requests in
flight and is retried on other servers after a connection error, a timeout or an HTTP 5xx.
Where the servers take SGLang's batched ``/generate`` (the built-in server), many prompts at
once go as one request per server, each taking the share of the prompts that the least-loaded
rule would give it one by one.  ``RolloutClient`` offers each request as an async method
(``a...``, for the client's event loop) and a blocking twin.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from archon.rollout.aio import gather_or_cancel
from archon.rollout.batching import RequestBatcher
from archon.rollout.server_api import GenerateResult, RolloutError
from archon.rollout.transport import ServerState, ServerStateFailure, Transport

logger = logging.getLogger("archon.rollout.client")

_ABORT_TIMEOUT_S = 5.0


class GenerateRequests:
    """Generate requests to the servers of a ``Transport``; runs on its event loop."""

    def __init__(self, transport: Transport, batcher: RequestBatcher | None):
        self.transport = transport
        self.batcher = batcher
        """Sends requests made together to their server as one batch (None: the API takes no batches)."""
        self.requests_sent = 0
        """Generate requests sent, retries included (for metrics)."""
        self.retries_sent = 0
        """Generate requests sent again after a failure (for metrics)."""
        # Request ids: a counter behind a random prefix per client, as unique as a uuid4 per
        # request and cheaper (a uuid4 reads the OS's random source: ~0.8 ms a round of 256).
        self._rid_prefix = uuid.uuid4().hex[:16]
        self._rid_counter = itertools.count()

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
        await self.transport.ensure_healthy()
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
        transport, api = self.transport, self.transport.api
        ids = [int(t) for t in input_ids]
        tried = set() if tried is None else tried
        attempts = transport.retries + 1
        for attempt in range(first_attempt, attempts):
            server = transport.pick(tried)
            rid = self._new_rid()
            payload = api.generate_payload(
                ids,
                sampling_params,
                return_logprob,
                rid,
                return_routed_experts=return_routed_experts,
                lora_name=server.lora_name,
            )
            server.in_flight += 1
            server.sent += 1
            self.requests_sent += 1
            if attempt:
                self.retries_sent += 1
            try:
                if self.batcher is not None:
                    body = await self.batcher.post(server.url, payload)
                else:
                    body = await transport.request(server, "POST", api.generate_path, payload)
            except ServerStateFailure as exc:
                last = self._generate_failed(server, exc, [rid], attempt)
                tried.add(server.url)
                if attempt + 1 < attempts:
                    await asyncio.sleep(transport.backoff(attempt))
                continue
            finally:
                server.in_flight -= 1
            server.consecutive_failures = 0
            return api.parse_generate(
                body, server.url, return_logprob, server.weight_version, return_routed_experts=return_routed_experts
            )
        if all(s.down for s in transport.servers):
            raise transport.all_down_error()
        raise RolloutError(
            f"generate request failed after {attempts} attempt(s) on {', '.join(sorted(tried))}; "
            f"last error from {last}; check the server logs or raise rollout.request_retries"
        )

    def _generate_failed(self, server: ServerState, exc: ServerStateFailure, rids: list[str], attempt: int) -> str:
        """Count a failed generate attempt against ``server``; returns it for the final error message."""
        self.transport.record_failure(server, exc)
        if exc.timed_out:
            # The server may still be working on them; free their slots (best effort).
            for rid in rids:
                self.transport.loop.create_task(self._abort_quietly(server, rid))
        logger.debug(
            "generate attempt %d/%d failed on %s: %s", attempt + 1, self.transport.retries + 1, server.url, exc
        )
        return f"{server.url}: {exc}"

    def _shares(self, n: int) -> list[tuple[ServerState, int]]:
        """How many of ``n`` requests made together each up server gets: as ``pick`` would send them one by one."""
        up = self.transport.up_servers()
        if not up:
            raise self.transport.all_down_error()
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
        assert self.batcher is not None
        api = self.transport.api
        payloads = [
            api.generate_payload(
                [int(t) for t in ids],
                p,
                return_logprob,
                self._new_rid(),
                return_routed_experts=return_routed_experts,
                lora_name=server.lora_name,
            )
            for ids, p in zip(prompts, params)
        ]
        server.in_flight += len(payloads)
        server.sent += len(payloads)
        self.requests_sent += len(payloads)
        try:
            bodies = await self.batcher.post_many(server.url, payloads)
        except ServerStateFailure as exc:
            failure: ServerStateFailure | None = exc
        else:
            failure = None
        finally:
            server.in_flight -= len(payloads)
        if failure is not None:
            last = self._generate_failed(server, failure, [p["rid"] for p in payloads], 0)
            if self.transport.retries:
                await asyncio.sleep(self.transport.backoff(0))
            return await gather_or_cancel(
                self._agenerate(ids, p, return_logprob, return_routed_experts, {server.url}, 1, last)
                for ids, p in zip(prompts, params)
            )
        server.consecutive_failures = 0
        return [
            api.parse_generate(
                body, server.url, return_logprob, server.weight_version, return_routed_experts=return_routed_experts
            )
            for body in bodies
        ]

    async def _abort_quietly(self, server: ServerState, rid: str) -> None:
        call = self.transport.api.abort(rid)
        if call is None:
            return
        try:
            await self.transport.request(server, call.method, call.path, call.payload, timeout=_ABORT_TIMEOUT_S)
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
        """Completions of many prompts, in input order; at most ``max_concurrency`` in flight (0: all)."""
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
        await self.transport.ensure_healthy()
        # One prompt goes alone, where the batcher may still put it in a batch with others of this turn.
        if self.batcher is not None and len(prompts) > 1 and not 0 < max_concurrency < len(prompts):
            return await self._agenerate_batched(prompts, per_prompt, return_logprob, return_routed_experts)
        limit = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None

        async def one(ids: Sequence[int], params: dict[str, Any]) -> GenerateResult:
            if limit is None:
                return await self._agenerate(ids, params, return_logprob, return_routed_experts)
            async with limit:
                return await self._agenerate(ids, params, return_logprob, return_routed_experts)

        # One request lost for good stops the others rather than finish a batch nobody will use.
        return await gather_or_cancel(one(p, sp) for p, sp in zip(prompts, per_prompt))

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
        transport, api = self.transport, self.transport.api
        server = transport.server(url)
        payload = api.generate_payload(
            [int(t) for t in input_ids], sampling_params, return_logprob, self._new_rid(), lora_name=server.lora_name
        )
        if priority and api.priority_field:
            payload["priority"] = priority
        server.in_flight += 1
        try:
            body = await transport.request(server, "POST", api.generate_path, payload)
        except ServerStateFailure as exc:
            raise RolloutError(f"generate request to {server.url} failed: {exc}") from None
        finally:
            server.in_flight -= 1
        return api.parse_generate(body, server.url, return_logprob, server.weight_version)
