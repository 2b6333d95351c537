"""An OpenAI-compatible chat endpoint that records every request of an agent episode as exact token ids.

``RecordingProxy`` is an aiohttp server on ``127.0.0.1`` (a free port) running in the caller's event loop.  Each
episode has its own base URL, ``http://127.0.0.1:PORT/episodes/<id>/v1``, so the official ``openai`` package
(``AsyncOpenAI(base_url=...)``) and agent frameworks that take a base URL work unchanged.  For
``POST .../v1/chat/completions`` the proxy:

1. checks that ``messages`` starts with the episode's recorded conversation (the assistant messages it answered
   carry the decoded sampled ids as ``content``): history that rewrites an earlier message is refused (400);
2. renders the new messages onto the recorded ids (``start_messages`` for the first request, ``append_messages``
   after), so nothing recorded is re-tokenised and the servers need no chat template;
3. sends the ids to the rollout servers through the trainer's ``RolloutClient`` (token-level ``/generate``),
   records the turn (``Trajectory.add_turn``) and answers in OpenAI's chat shape, with the extras vLLM's chat
   endpoint gives with ``return_token_ids`` (``choices[0].token_ids``; ``prompt_token_ids`` at the top level, as
   vLLM 0.32's ``ChatCompletionResponse`` has it) and ``weight_version``.

In training (``archon.rl.agent.agent_rollout``) the proxy is given the trainer's ``sampling``: it replaces the
request's sampling fields (the behaviour logprobs must be the policy's at the trainer's temperature, whatever the
agent asks), a request's ``max_tokens`` can only lower its ``max_new_tokens``, and an episode opened with a
``seed`` samples turn ``k`` with ``episode_turn_seed(seed, k)`` (runs repeat whatever the episodes' interleaving).

Limits (``max_turns``, ``max_total_tokens`` per episode): a request that would exceed them is answered 400 with one
sentence and ends the episode with ``Trajectory.truncation`` 'max_turns' or 'max_tokens'; a turn whose generation is
cut by the remaining token budget is answered with ``finish_reason`` 'length' and ends the episode with
'max_tokens' (later requests of an ended episode get 400).  A turn the servers aborted is recorded with
finish_reason 'abort' and answered as 'length' (OpenAI has no 'abort').  Tool calls are not parsed: the assistant
``content`` is the decoded text, which the agent parses as it needs.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai
from aiohttp import web

from archon.rl.agent.chat_tokens import append_messages, start_messages
from archon.rl.agent.trajectory import Segment, Trajectory
from archon.rl.rollout_batch import Completion, routed_experts_array
from archon.rollout.client import GenerateResult, RolloutClient, RolloutError, RolloutRequestError

MAX_TURNS = "max_turns"
"""Truncation reason: the episode asked for more turns than ``max_turns``."""
MAX_TOKENS = "max_tokens"
"""Truncation reason: the episode's ids reached ``max_total_tokens``."""
SAMPLING_FIELDS = ("temperature", "top_p", "top_k")
"""OpenAI request fields passed to the servers under the same name."""
_SEED_MOD = 2**31 - 1

TurnGenerator = Callable[[list[int], dict[str, Any]], Awaitable[tuple[Completion, str]]]
"""Generates one turn in the proxy's event loop: prompt ids and the servers' sampling parameters to the
``Completion`` (per-token versions where tracked) and the weight version that finished it.  Asynchronous RL gives
the proxy one that holds requests back while new weights load (``archon.rl.agent.agent_worker``)."""


def episode_turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn ``turn`` (0-based) of an episode opened with ``seed``."""
    return (seed + turn * 104_729) % _SEED_MOD


class ProxyRequestError(ValueError):
    """A chat request the proxy refuses (answered 400 with the message)."""


@dataclass
class Episode:
    """One episode's recorded state."""

    id: str
    """Name in the episode's base URL."""
    max_turns: int
    """Requests allowed."""
    max_total_tokens: int
    """Ids (prompts and sampled) the episode may hold."""
    trajectory: Trajectory = field(default_factory=Trajectory)
    """Every turn recorded so far."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation as recorded: request messages, and each answer as ``{"role": "assistant", ...}``."""
    tools: list[dict[str, Any]] | None = None
    """The tool schemas of the first request (later requests must send the same)."""
    seed: int | None = None
    """Sampling seed of the episode's first turn (later turns derive theirs); None: the request's ``seed``."""
    closed: bool = False
    """Set by ``close_episode``: a generation still in flight then records nothing."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Requests of one episode are handled one at a time (each builds on the previous one's ids)."""

    def end(self, reason: str) -> None:
        """Mark the episode as cut short (the first reason wins)."""
        if self.trajectory.truncation is None:
            self.trajectory.truncation = reason


class RecordingProxy:
    """OpenAI chat endpoint per episode, recording token ids; ``await start()`` it in the loop that will use it."""

    def __init__(
        self,
        client: RolloutClient,
        tokenizer: Any,
        *,
        max_turns: int = 8,
        max_total_tokens: int = 4096,
        default_max_tokens: int = 512,
        sampling: Mapping[str, Any] | None = None,
        routed_experts: tuple[int, int] | None = None,
        generate: TurnGenerator | None = None,
        host: str = "127.0.0.1",
    ):
        """``sampling``: the servers' sampling parameters, pinned for every request (training; see the module
        docstring); None passes the request's own fields.  ``routed_experts``: the policy's ``(n_layers, top_k)``
        when each turn records the experts its tokens were routed to (MoE routing replay).  ``generate``: how a
        turn is generated (default: one request through ``client``)."""
        if max_turns < 1 or max_total_tokens < 1 or default_max_tokens < 1:
            raise ValueError(
                f"RecordingProxy limits must be positive, got max_turns={max_turns}, "
                f"max_total_tokens={max_total_tokens}, default_max_tokens={default_max_tokens}"
            )
        self.client = client
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.default_max_tokens = default_max_tokens
        self.sampling = dict(sampling) if sampling is not None else None
        self.routed_experts = routed_experts
        self.generate: TurnGenerator = generate or self._generate_with_client
        self.host = host
        self.port = 0
        self._episodes: dict[str, Episode] = {}
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        # One HTTP client for every episode's OpenAI client: building one costs ~35 ms (its SSL context).
        self._http: Any = None
        self.server_errors: list[RolloutError] = []
        """Failures of the servers (not refusals of a request) behind 502 answers: a trainer recovers lost servers."""

    async def start(self) -> RecordingProxy:
        """Serve on a free port of ``host``."""
        app = web.Application()
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._handle_chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, 0).start()
        self.port = int(self._runner.addresses[0][1])
        self._http = openai.DefaultAsyncHttpxClient()
        return self

    async def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> RecordingProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ episodes
    def open_episode(
        self, max_turns: int | None = None, max_total_tokens: int | None = None, seed: int | None = None
    ) -> str:
        """A new episode's id (limits default to the proxy's; ``seed`` pins its turns' sampling seeds)."""
        eid = f"ep{next(self._ids)}"
        limits = (max_turns or self.max_turns, max_total_tokens or self.max_total_tokens)
        self._episodes[eid] = Episode(eid, *limits, seed=seed)
        return eid

    def base_url(self, episode_id: str) -> str:
        """The OpenAI base URL of episode ``episode_id`` (for ``AsyncOpenAI(base_url=...)``)."""
        if not self.port:
            raise RuntimeError("the RecordingProxy is not serving; await proxy.start() first")
        return f"http://{self.host}:{self.port}/episodes/{episode_id}/v1"

    def openai_client(self, episode_id: str) -> openai.AsyncOpenAI:
        """An ``AsyncOpenAI`` client of episode ``episode_id``, on the proxy's shared HTTP connections (closing the
        proxy closes them; the client itself needs no closing)."""
        # No retries: a retried request would be a second turn of the same episode.
        return openai.AsyncOpenAI(
            base_url=self.base_url(episode_id), api_key="archon-agent", max_retries=0, http_client=self._http
        )

    def episode(self, episode_id: str) -> Episode:
        """The open episode ``episode_id``."""
        if episode_id not in self._episodes:
            raise KeyError(f"no open episode '{episode_id}'; open one with open_episode()")
        return self._episodes[episode_id]

    def close_episode(self, episode_id: str) -> Trajectory:
        """Stop recording episode ``episode_id`` and return its trajectory."""
        ep = self._episodes.pop(episode_id)
        ep.closed = True
        return ep.trajectory

    # ------------------------------------------------------------------ HTTP
    async def _handle_chat(self, request: web.Request) -> web.Response:
        ep = self._episodes.get(request.match_info["episode"])
        if ep is None:
            return _error(404, f"no open episode '{request.match_info['episode']}'; use the base URL run_episode gives")
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON; send an OpenAI chat completions request")
        async with ep.lock:
            try:
                answer = await self.chat(ep, body)
            except ValueError as exc:  # ProxyRequestError, or messages the chat template cannot append
                return _error(400, str(exc))
            except RolloutError as exc:
                if not isinstance(exc, RolloutRequestError):
                    self.server_errors.append(exc)
                return _error(502, f"the rollout servers failed the request: {exc}")
        return web.json_response(answer)

    async def chat(self, ep: Episode, body: Mapping[str, Any]) -> dict[str, Any]:
        """Handle one chat completions request of ``ep``: generate, record, answer (see the module docstring)."""
        if not isinstance(body, Mapping) or not isinstance(body.get("messages"), list) or not body["messages"]:
            raise ProxyRequestError("the request needs a non-empty 'messages' list, as OpenAI's chat API takes")
        if body.get("stream") or int(body.get("n") or 1) != 1:
            raise ProxyRequestError("the agent proxy answers one choice without streaming; drop 'stream' and 'n'")
        if ep.trajectory.truncation is not None:
            raise ProxyRequestError(f"the episode has ended ({ep.trajectory.truncation}); end the agent's loop")
        messages = [dict(m) for m in body["messages"]]
        tools = body.get("tools") or None
        if ep.trajectory.n_turns >= ep.max_turns:
            ep.end(MAX_TURNS)
            raise ProxyRequestError(f"the episode reached its limit of {ep.max_turns} turns; end the agent's loop")
        context = self._context(ep, messages, tools)
        prompt = ep.trajectory.ids() + [t for s in context for t in s.ids]
        budget = ep.max_total_tokens - len(prompt)
        if budget <= 0:
            ep.end(MAX_TOKENS)
            raise ProxyRequestError(
                f"the episode's {len(prompt)} ids reach its limit of {ep.max_total_tokens}; end the agent's loop"
            )
        params = self._sampling(ep, body)
        asked = int(body.get("max_completion_tokens") or body.get("max_tokens") or params["max_new_tokens"])
        asked = min(asked, params["max_new_tokens"])
        params["max_new_tokens"] = min(asked, budget)
        completion, version = await self.generate(prompt, params)
        if ep.closed:  # the workflow timed out while this turn generated: nothing more is recorded
            raise ProxyRequestError("the episode was closed while this request was generating")
        ep.trajectory.add_turn(context, completion)
        content = self.tokenizer.decode(completion.output_ids, skip_special_tokens=True)
        if ep.tools is None and tools:
            ep.tools = [dict(t) for t in tools]
        ep.messages = [*messages, {"role": "assistant", "content": content}]
        finish = "stop" if completion.finish_reason == "stop" else "length"
        if finish == "length" and params["max_new_tokens"] < asked and len(completion.output_ids) >= budget:
            ep.end(MAX_TOKENS)
        return _chat_answer(ep.id, body.get("model") or "policy", completion, version, content, finish)

    async def _generate_with_client(self, prompt: list[int], params: dict[str, Any]) -> tuple[Completion, str]:
        """One request through the trainer's ``RolloutClient`` (``TurnGenerator``)."""
        # The client's loop owns its connections: run the request there and await it from this loop.
        pending = self.client.agenerate(prompt, params, return_routed_experts=self.routed_experts is not None)
        result = await asyncio.wrap_future(self.client.submit(pending))
        return _completion(prompt, result, self.routed_experts), result.weight_version

    def _sampling(self, ep: Episode, body: Mapping[str, Any]) -> dict[str, Any]:
        """The servers' sampling parameters of ``ep``'s next turn (``max_new_tokens``: the most it may ask)."""
        if self.sampling is not None:
            params = {**self.sampling}
            params.setdefault("max_new_tokens", self.default_max_tokens)
        else:
            params = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
            params["max_new_tokens"] = int(
                body.get("max_completion_tokens") or body.get("max_tokens") or self.default_max_tokens
            )
            if body.get("seed") is not None:
                params["sampling_seed"] = int(body["seed"])
        if ep.seed is not None:
            params["sampling_seed"] = episode_turn_seed(ep.seed, ep.trajectory.n_turns)
        return params

    def _context(self, ep: Episode, messages: list[dict[str, Any]], tools: Sequence[Any] | None) -> list[Segment]:
        """The segments the request's new messages append to the episode's recorded ids."""
        if not ep.messages:
            return start_messages(self.tokenizer, messages, tools=tools)
        if (tools or None) != ep.tools:
            raise ProxyRequestError("the request's 'tools' differ from the episode's first request; keep them fixed")
        n = len(ep.messages)
        for i, (sent, kept) in enumerate(zip(messages, ep.messages)):
            if _message_key(sent) != _message_key(kept):
                raise ProxyRequestError(
                    f"message {i} ({sent.get('role')}) differs from the recorded conversation; send the recorded "
                    "history unchanged (assistant content exactly as answered) and append new messages after it"
                )
        if len(messages) <= n:
            raise ProxyRequestError(
                f"the request has {len(messages)} messages but the episode already recorded {n}; append the tool "
                "results or user reply to the recorded conversation"
            )
        return append_messages(self.tokenizer, ep.trajectory.ids(), ep.messages, messages[n:], tools=tools)


def _message_key(message: Mapping[str, Any]) -> tuple[str, str]:
    """A message's role and text (content parts joined), what the recorded ids depend on."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(message.get("role")), content or ""


def _completion(prompt: list[int], result: GenerateResult, routed_experts: tuple[int, int] | None) -> Completion:
    """The server's answer as a ``Completion`` (per-token versions kept when they are integers)."""
    versions = result.output_versions
    ints = [int(v) for v in versions] if versions and all(v.isdecimal() for v in versions) else None
    routed = routed_experts_array(result.routed_experts, *routed_experts) if routed_experts is not None else None
    return Completion(prompt, list(result.output_ids), list(result.output_logprobs), result.finish_reason, routed, ints)


def _chat_answer(
    episode_id: str, model: str, completion: Completion, version: str, content: str, finish: str
) -> dict[str, Any]:
    """OpenAI's chat completion object, with the token-level extras."""
    prompt = completion.prompt_ids
    n_out = len(completion.output_ids)
    return {
        "id": f"chatcmpl-{episode_id}-{time.monotonic_ns()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": finish,
                "token_ids": list(completion.output_ids),
            }
        ],
        "prompt_token_ids": list(prompt),
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_out, "total_tokens": len(prompt) + n_out},
        "weight_version": version,
    }


def _error(status: int, message: str) -> web.Response:
    """OpenAI's error shape."""
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}}, status=status
    )
