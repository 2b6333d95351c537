"""Generate requests made together go to their server as one batched request.

SGLang's ``/generate`` takes a batch (``input_ids`` a list of prompts, ``sampling_params`` and
``rid`` one entry per prompt) and answers a list; the built-in server speaks the same form.  A
round of RL rollout is hundreds of small requests sent at once, and on the built-in CPU server
the HTTP handling of each (routing, parsing, a response) cost about 3x the generation itself
(256 requests of 4 tokens: 0.21 s of server CPU, 0.07 s of it in the model).  ``RequestBatcher``
collects the requests for one server made in the same turn of the client's event loop and
sends them as one request; each caller still gets its own answer, its own request id (so
``abort_request`` by id works) and its own error:

* a batch the server refuses (HTTP 4xx) is sent again one request at a time, so the 4xx
  reaches the request that caused it and the others are served;
* a failure of the connection or the server (timeout, 5xx) reaches every request of the batch,
  which the client retries as it would a single request.

The server answers a batch once every request in it has finished, which is what the callers of
a rollout round wait for anyway.

A caller that has a whole group of requests in hand (a rollout round) gives them to
``post_many`` at once: no future per request and no waiting for the loop's turn to end, which on
the trainer's core cost about as much as the rest of the client's work on a round.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from archon.rollout.aio import gather_or_cancel
from archon.rollout.server_api import RolloutError, RolloutRequestError

PER_REQUEST_FIELDS = ("input_ids", "sampling_params", "rid")
"""Fields that a batch lists per request; requests are batched only where all other fields agree."""

MAX_BATCH_REQUESTS = 256
"""Requests in one batch at most."""

MAX_BATCH_TOKENS = 1 << 18
"""Prompt tokens in one batch at most (about 1.5 MB of JSON, far below the servers' body limits)."""


class BatchRefused(Exception):
    """The server refused the batch as a whole (HTTP 4xx): send each request of it alone."""


@dataclass
class _Pending:
    key: tuple[str, str]
    payloads: list[dict[str, Any]] = field(default_factory=list)
    futures: list[asyncio.Future] = field(default_factory=list)
    tokens: int = 0


Send = Callable[[str, dict[str, Any]], Awaitable[Any]]
"""Sends one request body to a server (by URL) and returns the decoded answer."""


class RequestBatcher:
    """Coalesces generate requests per server and event-loop turn; lives on one event loop."""

    def __init__(self, send: Send, *, max_requests: int = MAX_BATCH_REQUESTS, max_tokens: int = MAX_BATCH_TOKENS):
        self.send = send
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.batches_sent = 0
        """Batched requests sent (for tests and metrics)."""
        self._pending: dict[tuple[str, str], _Pending] = {}
        self._tasks: set[asyncio.Task] = set()

    async def post(self, url: str, payload: dict[str, Any]) -> Any:
        """The server's answer to ``payload`` (one request's body), sent within a batch where others wait too."""
        try:
            return await self._enqueue(url, payload)
        except BatchRefused:
            return await self.send(url, payload)

    async def post_many(self, url: str, payloads: list[dict[str, Any]]) -> list[Any]:
        """The server's answers to ``payloads`` (one caller's requests), in order, in as few batches as the caps allow.

        Unlike ``post``, a failure (a 4xx included) is raised for the whole group: its caller gives
        up on the group or retries it as a whole.
        """
        chunks: list[list[dict[str, Any]]] = [[]]
        tokens = 0
        for payload in payloads:
            if self._full(len(chunks[-1]), tokens):
                chunks.append([])
                tokens = 0
            chunks[-1].append(payload)
            tokens += len(payload.get("input_ids") or ())
        if len(chunks) == 1:
            return await self._send_batch(url, chunks[0])
        answers = await gather_or_cancel(self._send_batch(url, chunk) for chunk in chunks)
        return [a for chunk in answers for a in chunk]

    def _full(self, n_requests: int, tokens: int) -> bool:
        """Whether a batch of this many requests and prompt tokens takes no more."""
        return n_requests >= self.max_requests or tokens >= self.max_tokens

    def _enqueue(self, url: str, payload: dict[str, Any]) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        shared = {k: v for k, v in payload.items() if k not in PER_REQUEST_FIELDS}
        key = (url, json.dumps(shared, sort_keys=True, default=str))
        batch = self._pending.get(key)
        if batch is None:
            batch = self._pending[key] = _Pending(key)
            # Runs after every callback ready now, i.e. after the other requests of this turn.
            loop.call_soon(self._flush, batch)
        future = loop.create_future()
        batch.payloads.append(payload)
        batch.futures.append(future)
        batch.tokens += len(payload.get("input_ids") or ())
        if self._full(len(batch.payloads), batch.tokens):
            self._flush(batch)
        return future

    def _flush(self, batch: _Pending) -> None:
        if self._pending.get(batch.key) is not batch:
            return  # flushed already (full)
        del self._pending[batch.key]
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

        def cancel_when_unwanted(_: asyncio.Future) -> None:
            if all(f.cancelled() for f in batch.futures):
                task.cancel()

        for f in batch.futures:
            f.add_done_callback(cancel_when_unwanted)

    async def _send_batch(self, url: str, payloads: list[dict[str, Any]]) -> list[Any]:
        """One request carrying ``payloads`` (SGLang's single form for one); the answers in order."""
        if len(payloads) == 1:
            return [await self.send(url, payloads[0])]
        payload = {k: v for k, v in payloads[0].items() if k not in PER_REQUEST_FIELDS}
        for name in PER_REQUEST_FIELDS:
            payload[name] = [p.get(name) for p in payloads]
        self.batches_sent += 1
        answer = await self.send(url, payload)
        if not isinstance(answer, list) or len(answer) != len(payloads):
            raise RolloutError(
                f"rollout server {url} answered a batch of {len(payloads)} generate requests with "
                f"{len(answer) if isinstance(answer, list) else 'no'} list entries; it does not speak "
                "SGLang's batched /generate"
            )
        return answer

    async def _send(self, batch: _Pending) -> None:
        try:
            answers = await self._send_batch(batch.key[0], batch.payloads)
        except RolloutRequestError as exc:
            error: BaseException = BatchRefused() if len(batch.payloads) > 1 else exc
            self._fail(batch, error)
        except BaseException as exc:  # noqa: BLE001  every caller of the batch gets the failure
            self._fail(batch, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            for f, a in zip(batch.futures, answers):
                if not f.done():
                    f.set_result(a)

    @staticmethod
    def _fail(batch: _Pending, exc: BaseException) -> None:
        for f in batch.futures:
            if f.done():
                continue
            if isinstance(exc, asyncio.CancelledError):
                f.cancel()
            else:
                f.set_exception(exc)
