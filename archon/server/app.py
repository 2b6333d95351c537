"""Archon's built-in rollout server: any Archon model, served over SGLang's HTTP protocol.

SGLang does not run on CPU; this server does, and speaks the same protocol, so one rollout
client drives either (inference backend ``local``)::

    python -m archon.server.app --model-path /path/to/hf_folder --host 127.0.0.1 --port 30000

Endpoints: ``/generate``, ``/health``, ``/health_generate``, ``/get_model_info``,
``/get_server_info``, ``/flush_cache``, ``/pause_generation``, ``/continue_generation``,
``/abort_request``, ``/update_weights_from_disk``, ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/destroy_weights_update_group``, ``/release_memory_occupation``,
``/resume_memory_occupation`` and ``/update_weights_from_tensor`` (``archon.server.memory_routes``),
``/load_lora_adapter`` and ``/unload_lora_adapter`` (``archon.server.lora_adapters``), and OpenAI's
``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` (``archon.server.openai_api``; text
needs the tokenizer of the model folder, loaded unless ``--skip-tokenizer-init``).  Generation runs in
the ``Generator`` thread (see ``archon.server.generator`` for the exact semantics of pause,
abort and weight updates); handlers only parse, enqueue and await, so the event loop stays
free.  ``serve_in_thread`` runs the whole server inside the calling process (tests, notebooks).

It listens on 127.0.0.1 unless told otherwise, and refuses to listen anywhere else without an
API key (``ARCHON_API_KEY`` or ``--api-key``; see ``archon.wire.auth``).  A bad request gets
one sentence in SGLang's error shape: 400 for a bad body, 401 without the key, 404/405 for an
unknown endpoint or method, 413 for a body over ``--max-request-mb``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from archon.field_docs import field_docs
from archon.runtime.cpu_pinning import parse_core_list, pin_process
from archon.runtime.gc_freeze import freeze_startup_objects
from archon.server import openai_api, protocol
from archon.server.generator import PAUSE_MODES, GenerationRequest, Generator
from archon.server.http_limits import BodyLimitMiddleware, add_error_handlers
from archon.server.lora_adapters import ServedAdapter, add_lora_routes
from archon.server.memory_routes import add_memory_routes
from archon.server.protocol import ProtocolError
from archon.server.sampling import SamplingParams
from archon.server.weight_update import probe_rendezvous
from archon.wire.auth import APIKeyMiddleware, api_key_from_env, check_bind
from archon.wire.weight_group import destroy_weight_update_group, init_weight_update_group
from parallel.dtypes import DTYPE_NAMES, to_dtype

logger = logging.getLogger(__name__)


@dataclass
class ServerArgs:
    """Command-line options (SGLang's flag names)."""

    model_path: str
    """Hugging Face folder of the model to serve."""
    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = 30000
    """Port to listen on (0: any free port)."""
    dtype: str = "auto"
    """Weight dtype: float32, bfloat16, float16, or auto (float32 on CPU, bfloat16 on GPU)."""
    device: str = "cpu"
    """Device to run the model on."""
    random_seed: int | None = None
    """Seeds requests without sampling_seed; None picks one at random."""
    context_length: int | None = None
    """Longest prompt + max_new_tokens; default the model's max_position_embeddings."""
    max_running_requests: int = 64
    """Requests decoded together at most."""
    enable_deterministic_inference: bool = False
    """One request per forward, so a request's tokens and logprobs do not depend on the traffic beside it (slower)."""
    log_level: str = "info"
    """Python and uvicorn log level."""
    weight_version: str = "default"
    """Initial weight version reported in responses."""
    skip_tokenizer_init: bool = False
    """Do not load the model folder's tokenizer: token ids only (text prompts and chat answer 400)."""
    tp_size: int = 1
    """Accepted for SGLang compatibility; the built-in server runs one device per process."""
    api_key: str | None = None
    """Key requests must carry as 'Authorization: Bearer <key>' (default $ARCHON_API_KEY); required off loopback."""
    max_request_mb: float = 64.0
    """Largest request body accepted, in MiB (HTTP 413 above)."""
    cpu_cores: str | None = None
    """Pin the server to these CPU cores, comma-separated (the trainer passes its share under cluster.pin_cpu_cores)."""

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32
        return to_dtype(self.dtype)


class _OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit code 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def check_server_args(args: ServerArgs) -> None:
    """Raise ``ValueError`` naming the first option out of its range."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a TCP port; pick one in [0, 65535] (0: any free port)")
    if args.context_length is not None and args.context_length < 1:
        raise ValueError(f"--context-length must be >= 1, got {args.context_length}")
    if args.max_running_requests < 1:
        raise ValueError(f"--max-running-requests must be >= 1, got {args.max_running_requests}")
    if args.tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {args.tp_size}")
    if not 0 < args.max_request_mb < float("inf"):
        raise ValueError(f"--max-request-mb must be a positive number of MiB, got {args.max_request_mb}")
    if not args.host:
        raise ValueError("--host is empty; give an interface such as 127.0.0.1")


def parse_args(argv: Sequence[str] | None = None) -> ServerArgs:
    """``ServerArgs`` from the command line; a bad option is one line on stderr and exit code 2."""
    p = _OneLineParser(prog="python -m archon.server.app", description=(__doc__ or "").split("\n\n")[0])
    docs = field_docs(ServerArgs)
    defaults = ServerArgs(model_path="")

    def add(name: str, **kw: Any) -> None:
        flag = "--" + name.replace("_", "-")
        if "action" not in kw and "required" not in kw:
            kw.setdefault("default", getattr(defaults, name))
        p.add_argument(flag, help=docs[name], **kw)

    add("model_path", required=True)
    add("host")
    add("port", type=int)
    add("dtype", choices=["auto", *DTYPE_NAMES])
    add("device")
    add("random_seed", type=int)
    add("context_length", type=int)
    add("max_running_requests", type=int)
    add("enable_deterministic_inference", action="store_true")
    add("log_level", choices=["debug", "info", "warning", "error", "critical"])
    add("weight_version")
    add("skip_tokenizer_init", action="store_true")
    add("tp_size", type=int)
    add("api_key")
    add("max_request_mb", type=float)
    add("cpu_cores")
    ns = p.parse_args(argv)
    args = ServerArgs(**vars(ns))
    try:
        check_server_args(args)
    except ValueError as e:
        p.error(str(e))
    return args


def use_one_thread_here(device: str) -> int | None:
    """On CPU, compute on this (the HTTP) thread with one intra-op thread from now on and return the count it had,
    for the generation thread: one OpenMP team per process (``Generator``'s ``compute_threads``; measured on 2
    cores: a decode step of 64 rows 18.5 -> 14.5 ms).  Elsewhere nothing changes (None)."""
    if torch.device(device).type != "cpu":
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads


def build_generator(args: ServerArgs, compute_threads: int | None = None) -> Generator:
    """Load the model of ``args`` and start its generation thread (``compute_threads``: as ``Generator``'s)."""
    if args.tp_size != 1:
        logger.warning(
            "--tp-size %d is ignored: the built-in server runs one device per process "
            "(start several servers for data parallel).",
            args.tp_size,
        )
    seed = args.random_seed if args.random_seed is not None else random.randrange(2**31)
    generator = Generator.from_hf(
        args.model_path,
        dtype=args.torch_dtype(),
        device=args.device,
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        random_seed=seed,
        weight_version=args.weight_version,
        batch_invariant=args.enable_deterministic_inference,
        compute_threads=compute_threads,
    )
    trained = getattr(generator.model.args, "max_seq_len", None)
    if trained is not None and generator.context_length > trained:
        logger.warning(
            "--context-length %d exceeds the model's max_position_embeddings %d; quality past it is not guaranteed.",
            generator.context_length,
            trained,
        )
    logger.info(
        "serving %s (%s, %s) with random seed %d, context length %d",
        args.model_path,
        args.torch_dtype(),
        args.device,
        seed,
        generator.context_length,
    )
    return generator


class RolloutServer:
    """The state behind the HTTP endpoints: the generator and the weight-update groups."""

    def __init__(self, generator: Generator, args: ServerArgs, tokenizer: Any = None) -> None:
        self.generator = generator
        self.args = args
        self.tokenizer = tokenizer
        """Hugging Face tokenizer for the OpenAI endpoints' text; None: token ids only."""
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.lora = ServedAdapter(args.model_path)
        """The LoRA adapter merged into the served weights (``archon.server.lora_adapters``)."""
        self.app = create_app(self)


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse(protocol.error_body(message), status_code=status)


def _outcome(success: bool, message: str) -> JSONResponse:
    # SGLang answers a failed control request with 400 and the same body shape.
    return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)


async def _body(request: Request) -> Any:
    return protocol.parse_json(await request.body())


def create_app(server: RolloutServer) -> FastAPI:
    """The FastAPI app serving SGLang's endpoints for ``server``."""
    app = FastAPI(title="Archon rollout server", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    # The last middleware added runs first: refuse strangers before buffering their bodies.
    app.add_middleware(BodyLimitMiddleware, max_bytes=int(server.args.max_request_mb * 2**20))
    if server.args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server.args.api_key)
    gen = server.generator

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/health_generate")
    async def health_generate() -> PlainTextResponse:
        # Bypasses a pause: health checks must not hang while the trainer holds generation.
        request = GenerationRequest([0], SamplingParams(max_new_tokens=1, temperature=0.0))
        if gen.paused or gen.memory_held:
            return PlainTextResponse("ok (paused)")
        await asyncio.wrap_future(gen.submit(request))
        return PlainTextResponse("ok")

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {
            "model_path": server.args.model_path,
            "tokenizer_path": server.args.model_path,
            "is_generation": True,
            "weight_version": gen.weight_version,
            "max_context_length": gen.context_length,
            "vocab_size": gen.vocab_size,
            "max_running_requests": gen.max_running_requests,
            "eos_token_ids": sorted(gen.eos_token_ids),
            "preferred_sampling_params": None,
        }

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        args = {k: v for k, v in asdict(server.args).items() if k != "api_key"}  # never echo the secret
        return {
            **args,
            "weight_version": gen.weight_version,
            "paused": gen.paused,
            "max_context_length": gen.context_length,
            "random_seed": gen.random_seed,
            **gen.stats(),
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        # No prefix cache is kept across requests, so there is nothing to flush.
        return PlainTextResponse("Cache flushed.")

    @app.post("/generate")
    async def generate(request: Request) -> JSONResponse:
        try:
            body = await _body(request)
            server.lora.check_request(body)
            call = protocol.parse_generate(body, gen.check_request, gen.context_length)
            futures = [gen.submit(r) for r in call.requests]
        except ValueError as e:  # ProtocolError, or a request the generator refuses
            return _error(str(e))
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except Exception as e:  # noqa: BLE001  a failed forward; the server keeps serving
            return _error(str(e), status=500)
        bodies = [protocol.generate_response(r) for r in results]
        return JSONResponse(bodies if call.is_batch else bodies[0])

    async def openai_call(request: Request, parse: Any, respond: Any) -> JSONResponse:
        try:
            call = parse(await _body(request), server.tokenizer, gen.context_length, gen.check_request)
            futures = [gen.submit(r) for r in call.requests]
        except ValueError as e:  # ProtocolError, or a request the generator refuses
            return _error(str(e))
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except Exception as e:  # noqa: BLE001  a failed forward; the server keeps serving
            return _error(str(e), status=500)
        return JSONResponse(respond(call, results, server.tokenizer))

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        return await openai_call(request, openai_api.parse_completion, openai_api.completion_response)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        return await openai_call(request, openai_api.parse_chat, openai_api.chat_response)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        model = {"id": server.args.model_path, "object": "model", "created": 0, "owned_by": "archon"}
        return {"object": "list", "data": [model]}

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        try:
            body = await _body(request) or {}
            mode = body.get("mode", "abort") if isinstance(body, dict) else None
        except ProtocolError as e:
            return _error(str(e))
        if mode not in PAUSE_MODES:
            return _error(
                f"pause_generation mode {mode!r} is not supported; the built-in server aborts running "
                "requests (mode 'abort') or puts them back in its queue to continue later (mode 'retract')."
            )
        await asyncio.wrap_future(gen.pause(mode))
        done = "aborted" if mode == "abort" else "retracted (they continue after /continue_generation)"
        return JSONResponse({"success": True, "message": f"Generation paused; running requests were {done}."})

    @app.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        gen.resume()
        return JSONResponse({"success": True, "message": "Generation continued."})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> JSONResponse:
        try:
            args = protocol.parse_abort(await _body(request))
        except ProtocolError as e:
            return _error(str(e))
        if args.abort_all:
            gen.abort_all()
        for rid in args.rids:
            gen.abort(rid)
        return JSONResponse({"success": True, "message": "Abort requested."})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        try:
            args = protocol.parse_update_from_disk(await _body(request))
        except ProtocolError as e:
            return _outcome(False, str(e))
        try:
            await asyncio.wrap_future(
                gen.update_weights_from_disk(args.model_path, args.weight_version, args.abort_all_requests)
            )
        except Exception as e:  # noqa: BLE001  reported to the trainer, the server keeps serving
            return _outcome(False, f"loading weights from {args.model_path} failed: {e}")
        server.lora.drop()
        return _outcome(True, f"loaded weights from {args.model_path}; weight_version {gen.weight_version}.")

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        try:
            args = protocol.parse_init_group(await _body(request))
        except ProtocolError as e:
            return _outcome(False, str(e))
        if args.group_name in server.groups:
            return _outcome(
                False,
                f"a weight update group named {args.group_name!r} already exists; destroy it "
                "first or pick another name.",
            )
        try:
            await asyncio.to_thread(probe_rendezvous, args.master_address, args.master_port)
        except ValueError as e:
            return _outcome(False, f"cannot join weight update group {args.group_name!r}: {e}")
        try:
            # The rendezvous blocks until the trainer joins too: never on the event loop.
            group = await asyncio.to_thread(
                init_weight_update_group,
                args.master_address,
                args.master_port,
                args.rank_offset,
                args.world_size,
                args.group_name,
                args.backend,
            )
        except Exception as e:  # noqa: BLE001
            return _outcome(
                False,
                f"joining weight update group {args.group_name!r} at "
                f"{args.master_address}:{args.master_port} failed: {e}",
            )
        server.groups[args.group_name] = group
        return _outcome(True, f"joined weight update group {args.group_name!r} as rank {args.rank_offset}.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        try:
            args = protocol.parse_update_from_distributed(await _body(request))
        except ProtocolError as e:
            return _outcome(False, str(e))
        group = server.groups.get(args.group_name)
        if group is None:
            return _outcome(
                False, f"no weight update group named {args.group_name!r}; call /init_weights_update_group first."
            )
        try:
            await asyncio.wrap_future(
                gen.update_weights_from_group(
                    group,
                    args.names,
                    args.dtypes,
                    args.shapes,
                    args.weight_version,
                    args.abort_all_requests,
                    flattened=args.flattened,
                )
            )
        except Exception as e:  # noqa: BLE001
            return _outcome(False, f"updating weights from group {args.group_name!r} failed: {e}")
        server.lora.drop()
        return _outcome(True, f"updated {len(args.names)} tensor(s); weight_version {gen.weight_version}.")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        try:
            name = protocol.parse_group_name(await _body(request), "/destroy_weights_update_group")
        except ProtocolError as e:
            return _outcome(False, str(e))
        group = server.groups.pop(name, None)
        if group is None:
            return _outcome(False, f"no weight update group named {name!r}.")
        await asyncio.to_thread(destroy_weight_update_group, group)
        return _outcome(True, f"destroyed weight update group {name!r}.")

    add_memory_routes(app, gen, on_weights_loaded=server.lora.drop)
    add_lora_routes(app, gen, server.lora)
    return app


@dataclass
class RunningServer:
    """A server running in a background thread of this process."""

    url: str
    """Base URL, e.g. ``http://127.0.0.1:41234``."""
    server: RolloutServer
    """Its state (``server.generator`` is the engine)."""
    _uvicorn: uvicorn.Server
    _thread: threading.Thread

    def stop(self, close_generator: bool = True) -> None:
        """Stop serving HTTP (and the generator thread unless ``close_generator`` is False)."""
        self._uvicorn.should_exit = True
        self._thread.join(timeout=30)
        if close_generator:
            self.server.generator.close()


def serve_in_thread(
    generator: Generator,
    model_path: str = "",
    host: str = "127.0.0.1",
    port: int = 0,
    startup_timeout_s: float = 30.0,
    api_key: str | None = None,
    max_request_mb: float = ServerArgs.max_request_mb,
    tokenizer: Any = None,
) -> RunningServer:
    """Serve ``generator`` over HTTP from a background thread; ``port=0`` picks a free port.

    ``model_path`` is what ``/get_model_info`` reports; ``tokenizer`` serves text on the OpenAI endpoints.
    """
    check_bind(host, api_key)
    args = ServerArgs(
        model_path=str(model_path),
        host=host,
        port=port,
        max_running_requests=generator.max_running_requests,
        context_length=generator.context_length,
        random_seed=generator.random_seed,
        weight_version=generator.weight_version,
        api_key=api_key,
        max_request_mb=max_request_mb,
    )
    state = RolloutServer(generator, args, tokenizer)
    config = uvicorn.Config(state.app, host=host, port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="archon-rollout-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not server.started:
        server.should_exit = True
        raise RuntimeError(f"the rollout server did not start on {host}:{port} within {startup_timeout_s} s.")
    bound = server.servers[0].sockets[0].getsockname()[1]
    return RunningServer(f"http://{host}:{bound}", state, server, thread)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m archon.server.app``."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.api_key = args.api_key or api_key_from_env()
    try:
        check_bind(args.host, args.api_key)
    except ValueError as e:
        raise SystemExit(f"archon.server.app: {e}") from None
    try:
        if args.cpu_cores:
            # Before the generation thread starts: it inherits them.
            pin_process(parse_core_list(args.cpu_cores), "the rollout server")
        tokenizer = None if args.skip_tokenizer_init else openai_api.load_tokenizer(args.model_path)
        generator = build_generator(args, compute_threads=use_one_thread_here(args.device))
    except ValueError as e:  # a bad folder, config or option: one line, not a traceback
        raise SystemExit(f"archon.server.app: cannot serve {args.model_path}: {e}") from None
    state = RolloutServer(generator, args, tokenizer)
    freeze_startup_objects()
    try:
        logger.info("starting the HTTP server on http://%s:%d", args.host, args.port)
        # Requests held by a pause would keep a graceful shutdown waiting forever: bound it.
        # One access-log line per request would bury what a log tail is read for (why it died): debug only.
        uvicorn.run(
            state.app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
            access_log=args.log_level == "debug",
        )
    finally:
        generator.close()


if __name__ == "__main__":
    main()
