"""The trainer's client of rollout servers that speak SGLang's HTTP protocol.

The trainer is synchronous, but a batch of rollouts is many requests in flight at once, and
the weight broadcast must overlap with an HTTP call that only returns once it is done.  So
the client runs an asyncio event loop on a background thread: every public method has an
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

``RolloutClient`` composes the parts and offers their operations: the event loop,
connections and server states are a ``Transport`` (``transport.py``); generate
requests are ``GenerateRequests`` (``generate_requests.py``), batched by a ``RequestBatcher``
(``batching.py``) where the servers allow it; control operations are ``ServerControl``
(``control.py``).  How a request is spelled on the wire is the job of a ``ServerAPI``
(``server_api.py``): by default SGLang's HTTP protocol (which the built-in server speaks too);
``archon.rollout.vllm.VLLMAPI`` maps the same calls onto vLLM's OpenAI completions API and its
weight-reload endpoints.  The trainer only ever sees ``RolloutClient`` and ``GenerateResult``.

With an API key (given, or ``$ARCHON_API_KEY``) every request carries
``Authorization: Bearer <key>``, which SGLang's and vLLM's ``--api-key`` and the built-in server check.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from archon.alloc import ModelAllocation
from archon.config import ConfigError, RolloutConfig
from archon.rollout.batching import RequestBatcher
from archon.rollout.control import ServerControl
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
from archon.rollout.transport import ServerStateFailure, Transport  # noqa: F401 - ServerStateFailure is public here too
from archon.rollout.vllm import VLLMAPI
from archon.wire.auth import api_key_from_env, auth_headers

T = TypeVar("T")


def api_for_backend(backend: str) -> ServerAPI:
    """The ServerAPI of an inference backend of the allocation grammar (sglang, vllm, local)."""
    if backend == "vllm":
        return VLLMAPI()
    if backend in ("local", "inprocess"):  # the built-in server's app, over the network or in process
        return BuiltinServerAPI()
    return ServerAPI()


class RolloutClient:
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
        app: Any = None,
        serve: Callable[[concurrent.futures.Future[Any]], Any] | None = None,
    ):
        """``app``: an ASGI app that answers every address in this process instead of the network (the in-process
        rollout engine, ``archon.rl.inprocess``); None: HTTP.  ``serve``: how a blocking wait for the app's answer
        waits (the in-process engine's ``Generator.serve_until``, which runs the engine on the waiting thread);
        None: ``future.result()``."""
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
        transport = Transport(
            urls,
            api=api or ServerAPI(),
            headers=auth_headers(api_key or api_key_from_env()),
            request_timeout=request_timeout,
            retries=retries,
            backoff_s=backoff_s,
            setup_timeout=setup_timeout,
            down_after=down_after,
            app=app,
            serve=serve,
        )
        self._transport = transport
        # Requests made together go to their server as one batch where the API allows it.
        self._batcher = (
            RequestBatcher(
                lambda url, body: transport.request(transport.server(url), "POST", transport.api.generate_path, body)
            )
            if transport.api.batch_generate
            else None
        )
        self._generate = GenerateRequests(transport, self._batcher)
        self._control = ServerControl(transport)

    @classmethod
    def from_config(
        cls,
        cfg: RolloutConfig,
        addrs: Sequence[str],
        api_key: str | None = None,
        app: Any = None,
        serve: Callable[[concurrent.futures.Future[Any]], Any] | None = None,
    ) -> RolloutClient:
        """A client of ``addrs`` speaking the API of ``cfg.backend``'s servers (``app``, ``serve``: see
        ``__init__``)."""
        return cls(
            addrs,
            request_timeout=cfg.request_timeout,
            retries=cfg.request_retries,
            setup_timeout=cfg.setup_timeout,
            api=api_for_backend(ModelAllocation.from_str(cfg.backend).backend),
            api_key=api_key,
            app=app,
            serve=serve,
        )

    # ------------------------------------------------------------------ settings
    @property
    def api(self) -> ServerAPI:
        """How requests are spelled for the servers' family."""
        return self._transport.api

    @property
    def request_timeout(self) -> float:
        """Seconds a request may take before it counts as failed."""
        return self._transport.request_timeout

    @property
    def retries(self) -> int:
        """Retries of a failed request (on other servers where there are any)."""
        return self._transport.retries

    @property
    def backoff_s(self) -> float:
        """Wait before the first retry; doubled for each next one."""
        return self._transport.backoff_s

    @property
    def setup_timeout(self) -> float:
        """Seconds the servers may take to become healthy."""
        return self._transport.setup_timeout

    @property
    def down_after(self) -> int:
        """Failures in a row that mark a server down."""
        return self._transport.down_after

    # ------------------------------------------------------------------ loop plumbing
    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a coroutine (e.g. ``client.ainit_weights_update_group(...)``) on the client's loop."""
        return self._transport.submit(coro)

    def result(self, future: concurrent.futures.Future[T]) -> T:
        """Block until ``future`` (from ``submit``) is done and return its result (an in-process client runs its
        engine on this thread meanwhile: ``serve``)."""
        return self._transport.result(future)

    def close(self) -> None:
        """Close connections and stop the loop thread (idempotent)."""
        self._transport.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ servers and health
    @property
    def addrs(self) -> list[str]:
        """Every server's base URL, in the order given."""
        return [s.url for s in self._transport.servers]

    @property
    def up_addrs(self) -> list[str]:
        """Servers not marked down."""
        return [s.url for s in self._transport.servers if not s.down]

    @property
    def down_addrs(self) -> list[str]:
        """Servers marked down."""
        return [s.url for s in self._transport.servers if s.down]

    def last_error(self, url: str) -> str:
        """Why server ``url`` last failed ('' if it never did)."""
        return self._transport.server(url).last_error

    def mark_down(self, url: str, why: str) -> None:
        """Send nothing more to server ``url`` (e.g. its process exited) until ``revive(url)``."""
        self._transport.mark_down(url, why)

    def revive(self, url: str) -> None:
        """Take server ``url`` back (restarted and healthy; the caller gives it the current weights next)."""
        self._transport.revive(url)

    def check_health(self) -> list[str]:
        """Probe ``/health`` of every up server; mark the ones that do not answer down. Returns those."""
        return self._transport.wait(self._transport.check_health())

    async def await_healthy(self, timeout: float | None = None) -> None:
        """Wait until every server answers /health (default: setup_timeout); raise naming the ones that don't."""
        await self._transport.await_healthy(timeout)

    def wait_healthy(self, timeout: float | None = None) -> None:
        """Block until every server answers /health (default: setup_timeout); raise naming the ones that don't."""
        self._transport.wait(self._transport.await_healthy(timeout))

    def stats(self) -> dict[str, float]:
        """Counters for metrics: requests sent, retries, servers down."""
        return {
            "rollout_requests": float(self._generate.requests_sent),
            "rollout_retries": float(self._generate.retries_sent),
            "rollout_servers_down": float(sum(s.down for s in self._transport.servers)),
        }

    # ------------------------------------------------------------------ generate requests
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
        return await self._generate.agenerate(
            input_ids, sampling_params, return_logprob=return_logprob, return_routed_experts=return_routed_experts
        )

    def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
    ) -> GenerateResult:
        """One completion (blocking)."""
        return self._transport.wait(
            self._generate.agenerate(
                input_ids, sampling_params, return_logprob=return_logprob, return_routed_experts=return_routed_experts
            )
        )

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
        return await self._generate.agenerate_many(
            prompts,
            sampling_params,
            max_concurrency=max_concurrency,
            return_logprob=return_logprob,
            return_routed_experts=return_routed_experts,
        )

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
        return self._transport.wait(
            self._generate.agenerate_many(
                prompts,
                sampling_params,
                max_concurrency=max_concurrency,
                return_logprob=return_logprob,
                return_routed_experts=return_routed_experts,
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
        return await self._generate.agenerate_on(
            url, input_ids, sampling_params, return_logprob=return_logprob, priority=priority
        )

    def generate_on(
        self, url: str, input_ids: Sequence[int], sampling_params: dict[str, Any], *, return_logprob: bool = True
    ) -> GenerateResult:
        """One completion from the server at ``url`` (blocking)."""
        return self._transport.wait(
            self._generate.agenerate_on(url, input_ids, sampling_params, return_logprob=return_logprob)
        )

    # ------------------------------------------------------------------ control operations
    async def apause_generation(self, mode: str | None = None) -> dict[str, Any]:
        """Pause every server; ``mode`` is SGLang's ('abort', 'retract', 'in_place'; None: the server's default,
        abort)."""
        return await self._control.apause_generation(mode)

    def pause_generation(self, mode: str | None = None) -> dict[str, Any]:
        return self._transport.wait(self._control.apause_generation(mode))

    async def acontinue_generation(self) -> dict[str, Any]:
        return await self._control.acontinue_generation()

    def continue_generation(self) -> dict[str, Any]:
        return self._transport.wait(self._control.acontinue_generation())

    async def aflush_cache(self) -> dict[str, Any]:
        return await self._control.aflush_cache()

    def flush_cache(self) -> dict[str, Any]:
        return self._transport.wait(self._control.aflush_cache())

    async def aserver_info(self) -> dict[str, Any]:
        return await self._control.aserver_info()

    def server_info(self) -> dict[str, Any]:
        """Every up server's ``/get_server_info``, by URL."""
        return self._transport.wait(self._control.aserver_info())

    async def aupdate_weights_from_disk(
        self, path: str, version: int | str, *, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        return await self._control.aupdate_weights_from_disk(path, version, abort_all_requests=abort_all_requests)

    def update_weights_from_disk(
        self, path: str, version: int | str, *, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        return self._transport.wait(
            self._control.aupdate_weights_from_disk(path, version, abort_all_requests=abort_all_requests)
        )

    async def aload_lora_adapter(self, name: str, path: str, version: int | str) -> dict[str, Any]:
        """Every up server loads the PEFT adapter folder ``path`` as ``name`` and reports ``version``; later generate
        requests name it, and each server's previous adapter is unloaded (``ServerControl.aload_lora_adapter``)."""
        return await self._control.aload_lora_adapter(name, path, version)

    def load_lora_adapter(self, name: str, path: str, version: int | str) -> dict[str, Any]:
        return self._transport.wait(self._control.aload_lora_adapter(name, path, version))

    async def aunload_lora_adapter(self) -> dict[str, Any]:
        """Every up server unloads its adapter; later generate requests get the base weights."""
        return await self._control.aunload_lora_adapter()

    def unload_lora_adapter(self) -> dict[str, Any]:
        return self._transport.wait(self._control.aunload_lora_adapter())

    @property
    def lora_names(self) -> dict[str, str]:
        """The adapter that generate requests to each server name, by URL ("": none)."""
        return {s.url: s.lora_name for s in self._transport.servers}

    def weight_group_layout(self, ranks_per_server: int) -> tuple[int, list[int]]:
        """(world size, rank offset of each up server) of a weight-update group; the trainer is rank 0."""
        return self._control.weight_group_layout(ranks_per_server)

    async def ainit_weights_update_group(
        self, master_address: str, master_port: int, group_name: str, backend: str, ranks_per_server: int = 1
    ) -> dict[str, Any]:
        """Ask every up server to join ``group_name``; server i's processes are ranks 1+i*t .. t+i*t."""
        return await self._control.ainit_weights_update_group(
            master_address, master_port, group_name, backend, ranks_per_server
        )

    def init_weights_update_group(
        self, master_address: str, master_port: int, group_name: str, backend: str, ranks_per_server: int = 1
    ) -> dict[str, Any]:
        return self._transport.wait(
            self._control.ainit_weights_update_group(master_address, master_port, group_name, backend, ranks_per_server)
        )

    async def aupdate_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        version: int | str | None,
        *,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """Tell the group's servers to receive these tensors; the trainer broadcasts them meanwhile
        (``ServerControl.aupdate_weights_from_distributed`` says how ``version`` and ``load_format`` work)."""
        return await self._control.aupdate_weights_from_distributed(
            names, dtypes, shapes, group_name, version, flush_cache=flush_cache, load_format=load_format
        )

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        version: int | str | None,
        *,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        return self._transport.wait(
            self._control.aupdate_weights_from_distributed(
                names, dtypes, shapes, group_name, version, flush_cache=flush_cache, load_format=load_format
            )
        )

    async def arelease_memory_occupation(
        self, tags: Sequence[str] | None = None, addrs: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """Servers give back the memory of ``tags`` (None: all) while the trainer trains
        (``ServerControl.arelease_memory_occupation``); ``addrs`` None: every up server."""
        return await self._control.arelease_memory_occupation(tags, addrs)

    def release_memory_occupation(
        self, tags: Sequence[str] | None = None, addrs: Sequence[str] | None = None
    ) -> dict[str, Any]:
        return self._transport.wait(self._control.arelease_memory_occupation(tags, addrs))

    async def aresume_memory_occupation(
        self, tags: Sequence[str] | None = None, addrs: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """Servers take the memory of ``tags`` again (None: all); a weight update must follow a resume of 'weights'."""
        return await self._control.aresume_memory_occupation(tags, addrs)

    def resume_memory_occupation(
        self, tags: Sequence[str] | None = None, addrs: Sequence[str] | None = None
    ) -> dict[str, Any]:
        return self._transport.wait(self._control.aresume_memory_occupation(tags, addrs))

    async def aupdate_weights_from_tensor(
        self,
        named_tensors: Sequence[tuple[str, Any]],
        version: int | str | None,
        *,
        addrs: Sequence[str] | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """Servers on this machine load HF-named tensors from this process's memory, without a copy over HTTP
        (``ServerControl.aupdate_weights_from_tensor``)."""
        return await self._control.aupdate_weights_from_tensor(
            named_tensors, version, addrs=addrs, flush_cache=flush_cache, abort_all_requests=abort_all_requests
        )

    def setup_tensor_weights(self) -> dict[str, Any]:
        """Once before the first weight update from tensors (``ServerControl.asetup_tensor_weights``)."""
        return self._transport.wait(self._control.asetup_tensor_weights())

    def update_weights_from_parts(
        self,
        parts: Sequence[Sequence[Any]],
        version: int | str | None,
        *,
        first: bool,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """Server i loads the tensors behind its own ``parts[i]``, one per GPU of it
        (``ServerControl.aupdate_weights_from_parts``: the colocated trainer ranks' own tensors)."""
        return self._transport.wait(
            self._control.aupdate_weights_from_parts(
                parts, version, first=first, flush_cache=flush_cache, abort_all_requests=abort_all_requests
            )
        )

    def update_weights_from_tensor(
        self,
        named_tensors: Sequence[tuple[str, Any]],
        version: int | str | None,
        *,
        addrs: Sequence[str] | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        return self._transport.wait(
            self._control.aupdate_weights_from_tensor(
                named_tensors, version, addrs=addrs, flush_cache=flush_cache, abort_all_requests=abort_all_requests
            )
        )
