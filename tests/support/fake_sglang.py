"""A small fake of an SGLang server for tests of the rollout client, launcher and weight sync.

It speaks the subset of SGLang's HTTP protocol Archon uses and behaves like SGLang 0.5.23 (read
from its source) wherever a difference would break or bias a run:

- The model is ``fake_logits``: deterministic float32 logits over ``VOCAB`` tokens for a context
  (and the number of weight updates taken).  ``fake_completion`` samples from it with SGLang's
  rules (``sglang_sample``): temperature 0 means top_k = 1, and top_k = 1 takes the greedy path,
  whose logprobs are unscaled ``log_softmax(logits)``; otherwise ``log_softmax(logits / T)``
  before filtering, top-k and top-p applied jointly to the unfiltered distribution, then min-p.
  Stop tokens are checked before the length budget (EOS as the last allowed token is ``stop``).
- ``sampling_seed`` only counts with ``--enable-deterministic-inference`` (default seed 42);
  otherwise draws come from the server's own generator, so a seed does not replay a rollout.
- ``min_new_tokens > 0`` is refused with HTTP 400 under ``--skip-tokenizer-init`` (Archon
  always starts SGLang so); with a tokenizer, stop tokens are masked before the logprobs are
  computed, so they are renormalised without them, as SGLang's penalizer does.
- ``--context-length`` above the model's own context (from ``config.json``, SGLang's rule)
  makes the server exit at startup.
- ``/health`` answers after a one-token generation, about a second (``health_delay_s``).
- Every weight update that carries a ``weight_version`` sets it, bucket by bucket.

Weight updates are real: ``/init_weights_update_group`` joins the group with
``archon.wire.weight_group`` and ``/update_weights_from_distributed`` receives the broadcast
tensors; ``/update_weights_from_disk`` reads the safetensors of the folder.  Tests read what
arrived from ``.weights`` (in-process) or ``GET /fake/weights`` (a subprocess).

Knobs (attributes, or ``POST /fake/config`` with a JSON object): ``fail_next`` (answer the
next N generate requests with HTTP 500), ``hang`` (generate never answers), ``delay_s``
(each generate takes this long), ``die_after`` (the generate request after the first N makes the
server drop every connection, in-flight requests included, and stop listening, like a
killed process), ``fail_weight_update`` (weight updates answer success=false with this
message), ``fail_after_buckets`` (N >= 0: distributed updates after the next N fail with
success=false), ``join_group`` (False: record group requests without joining).

In-process: ``FakeSGLang(...).start()`` runs it on a free port on its own thread.  As a
script: ``python tests/support/fake_sglang.py --port P [SGLang arguments] [--delay-s S] [--health-delay-s S]
[--crash-on-start MSG]``; ``as_fake(cmd)`` turns the launcher's ``sglang.launch_server`` command
line into this script's, and unknown SGLang-style arguments are accepted and ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web
from fake_model import DETERMINISTIC_DEFAULT_SEED as _DETERMINISTIC_DEFAULT_SEED
from fake_model import VOCAB, fake_completion, fake_logits, sglang_sample  # noqa: F401 - tests import them from here

KNOBS = (
    "fail_next",
    "hang",
    "delay_s",
    "die_after",
    "fail_weight_update",
    "fail_after_buckets",
    "join_group",
    "health_delay_s",
)
# SGLang's get_context_length: the first of these keys in config.json, times a rope scaling factor.
_CONTEXT_LENGTH_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)


def model_context_length(model_path: str) -> int | None:
    """The context SGLang derives from ``<model_path>/config.json`` (None without one)."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    factor = 1.0
    rope = cfg.get("rope_scaling")
    if rope and "original_max_position_embeddings" not in rope and rope.get("rope_type") != "llama3":
        factor = rope.get("factor", 1)
    for key in _CONTEXT_LENGTH_KEYS:
        if cfg.get(key) is not None:
            return int(factor * cfg[key])
    return 2048


class FakeSGLang:
    """State and handlers of one fake server."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        delay_s: float = 0.0,
        context_length: int = 4096,
        model_path: str = "fake-model",
        health_delay_s: float = 1.0,
        skip_tokenizer_init: bool = True,
        deterministic: bool = False,
        random_seed: int = 0,
        eos_token_ids: Sequence[int] = (),
    ):
        self.host = host
        self.port = port
        self.context_length = context_length
        self.model_path = model_path
        self.skip_tokenizer_init = skip_tokenizer_init
        self.deterministic = deterministic
        self.eos_token_ids = tuple(eos_token_ids)
        self._rng = random.Random(random_seed)
        # knobs
        self.fail_next = 0
        self.hang = False
        self.delay_s = delay_s
        self.health_delay_s = health_delay_s
        self.die_after: int | None = None
        self.fail_weight_update = ""
        self.fail_after_buckets = -1
        self.join_group = True
        # observations
        self.generate_count = 0
        self.served = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.version = "0"
        self.n_updates = 0
        self.weights: dict[str, Any] = {}
        self.update_calls: list[list[str]] = []
        self.load_formats: list[str | None] = []
        self.versions_after_update: list[str] = []
        self.group_requests: list[dict[str, Any]] = []
        self.disk_loads: list[str] = []
        self.flushes = 0
        self.pauses = 0
        self.aborts: list[dict[str, Any]] = []
        self._groups: dict[str, Any] = {}
        self._resume = asyncio.Event()
        self._resume.set()
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.dead = False

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/get_model_info", self.model_info),
                web.post("/generate", self.generate),
                web.post("/flush_cache", self.flush_cache),
                web.post("/pause_generation", self.pause),
                web.post("/continue_generation", self.resume),
                web.post("/abort_request", self.abort),
                web.post("/update_weights_from_disk", self.update_from_disk),
                web.post("/init_weights_update_group", self.init_group),
                web.post("/update_weights_from_distributed", self.update_from_distributed),
                web.post("/fake/config", self.configure),
                web.get("/fake/state", self.state),
                web.get("/fake/weights", self.dump_weights),
            ]
        )
        return app

    async def health(self, request: web.Request) -> web.Response:
        # SGLang's /health submits a one-token generation and checks for an answer after 1 s.
        await asyncio.sleep(self.health_delay_s)
        return web.Response(text="ok")

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "is_generation": True, "weight_version": self.version})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.generate_count += 1
        if self.die_after is not None and self.generate_count > self.die_after:
            asyncio.get_running_loop().create_task(self._die())
            await asyncio.sleep(3600)
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.json_response({"error": {"message": "fake internal error"}}, status=500)
        input_ids = body.get("input_ids")
        if input_ids is None:
            return web.json_response({"error": {"message": "input_ids is required"}}, status=400)
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
        # A batch lists sampling_params and rid per prompt (or gives one for all), as SGLang does.
        sampling = body.get("sampling_params") or {}
        all_params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        rids = body.get("rid")
        all_rids = rids if isinstance(rids, list) else [rids] * len(prompts)
        for params in all_params:
            min_new = int(params.get("min_new_tokens") or 0)
            if min_new > 0 and self.skip_tokenizer_init:
                msg = (
                    f"min_new_tokens={min_new} is unavailable when skip_tokenizer_init=True (requires tokenizer "
                    "for eos_token_id)."
                )
                return web.json_response({"error": {"message": msg}}, status=400)
        for p, params in zip(prompts, all_params):
            if len(p) + int(params.get("max_new_tokens", 128)) > self.context_length:
                msg = (
                    f"Requested token count exceeds the model's maximum context length of {self.context_length} tokens"
                )
                return web.json_response({"error": {"message": msg}}, status=400)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.hang:
                await asyncio.sleep(3600)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            await self._resume.wait()
            if self.dead:
                await asyncio.sleep(3600)  # a killed process answers nothing
        finally:
            self.in_flight -= 1
        self.served += 1
        outs = []
        for p, params, rid in zip(prompts, all_params, all_rids):
            if self.deterministic:
                seed = params.get("sampling_seed")
                seed = _DETERMINISTIC_DEFAULT_SEED if seed is None else int(seed)
            else:
                seed = self._rng.randrange(2**63)  # sampling_seed is ignored, as in SGLang
            ids, lps, finish = fake_completion(
                p,
                params,
                self.n_updates,
                seed=seed,
                eos_token_ids=self.eos_token_ids,
                tokenizer=not self.skip_tokenizer_init,
            )
            meta: dict[str, Any] = {
                "id": rid or "x",
                "finish_reason": finish,
                "prompt_tokens": len(p),
                "completion_tokens": len(ids),
                "weight_version": self.version,
            }
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids)]
            outs.append({"text": "", "output_ids": ids, "meta_info": meta})
        return web.json_response(outs if batched else outs[0])

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.flushes += 1
        return web.Response(text="Cache flushed.")

    async def pause(self, request: web.Request) -> web.Response:
        self.pauses += 1
        self._resume.clear()
        return web.json_response({"message": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self._resume.set()
        return web.json_response({"message": "continued"})

    async def abort(self, request: web.Request) -> web.Response:
        self.aborts.append(await request.json())
        return web.Response(text="")

    def _fail_update(self) -> web.Response | None:
        if self.fail_weight_update:
            return web.json_response({"success": False, "message": self.fail_weight_update}, status=400)
        return None

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        failed = self._fail_update()
        if failed is not None:
            return failed
        path = Path(body["model_path"])
        files = sorted(path.glob("*.safetensors"))
        if not files:
            return web.json_response({"success": False, "message": f"no safetensors in {path}"}, status=400)
        from safetensors.torch import load_file

        weights: dict[str, Any] = {}
        for f in files:
            weights.update(load_file(str(f)))
        self.weights = weights
        self.disk_loads.append(str(path))
        self._new_version(body.get("weight_version"))
        return web.json_response({"success": True, "message": "loaded", "num_paused_requests": 0})

    async def init_group(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.group_requests.append(body)
        failed = self._fail_update()
        if failed is not None:
            return failed
        if self.join_group:
            from archon.wire.weight_group import init_weight_update_group

            self._groups[body["group_name"]] = await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: init_weight_update_group(
                    body["master_address"],
                    body["master_port"],
                    body["rank_offset"],
                    body["world_size"],
                    body["group_name"],
                    body.get("backend", "gloo"),
                    60.0,
                ),
            )
        return web.json_response({"success": True, "message": "joined"})

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await request.json()
        failed = self._fail_update()
        if failed is not None:
            return failed
        if self.fail_after_buckets == 0:
            return web.json_response({"success": False, "message": "fake bucket failure"}, status=400)
        if self.fail_after_buckets > 0:
            self.fail_after_buckets -= 1
        pg = self._groups.get(body["group_name"])
        if pg is None:
            return web.json_response({"success": False, "message": f"no group {body['group_name']}"}, status=400)
        import torch

        from archon.wire.weight_group import broadcast_tensor

        def receive() -> dict[str, Any]:
            empty = [
                torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in zip(body["dtypes"], body["shapes"])
            ]
            if body.get("load_format") == "flattened_bucket":
                # SGLang's FlattenedTensorBucket: every tensor's bytes in order, one uint8 broadcast.
                flat = torch.empty(sum(t.numel() * t.element_size() for t in empty), dtype=torch.uint8)
                broadcast_tensor(flat, pg, src=0)
                start = 0
                for t in empty:
                    size = t.numel() * t.element_size()
                    t.view(-1).view(torch.uint8).copy_(flat[start : start + size])
                    start += size
            else:
                for t in empty:
                    broadcast_tensor(t, pg, src=0)
            return dict(zip(body["names"], empty))

        got = await asyncio.get_running_loop().run_in_executor(None, receive)
        self.weights.update(got)
        self.update_calls.append(list(body["names"]))
        self.load_formats.append(body.get("load_format"))
        if body.get("flush_cache", True):
            self.flushes += 1
        # SGLang (TokenizerControlMixin.update_weights_from_distributed) sets the version after every
        # successful call that carries one, whether or not it is the last bucket.
        self._new_version(body.get("weight_version"))
        self.versions_after_update.append(self.version)
        return web.json_response({"success": True, "message": "updated"})

    def _new_version(self, version: Any) -> None:
        self.n_updates += 1  # the weights changed
        if version is not None:
            self.version = str(version)

    async def configure(self, request: web.Request) -> web.Response:
        for key, value in (await request.json()).items():
            if key not in KNOBS:
                return web.json_response({"error": {"message": f"unknown knob {key}"}}, status=400)
            setattr(self, key, value)
        return web.json_response({"success": True})

    async def state(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "version": self.version,
                "n_updates": self.n_updates,
                "generate_count": self.generate_count,
                "served": self.served,
                "max_in_flight": self.max_in_flight,
                "update_calls": self.update_calls,
                "load_formats": self.load_formats,
                "versions_after_update": self.versions_after_update,
                "group_requests": self.group_requests,
                "disk_loads": self.disk_loads,
                "flushes": self.flushes,
                "pauses": self.pauses,
                "weight_names": sorted(self.weights),
            }
        )

    async def dump_weights(self, request: web.Request) -> web.Response:
        from safetensors.torch import save

        data = save({k: v.contiguous() for k, v in self.weights.items()}) if self.weights else b""
        return web.Response(body=data, content_type="application/octet-stream")

    async def _die(self) -> None:
        if self.dead:
            return
        self.dead = True
        if self._runner is not None:
            await self._runner.cleanup()

    # ------------------------------------------------------------------ in-process running
    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> FakeSGLang:
        self._loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._serve())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=f"fake-sglang-{self.port}", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("fake SGLang server did not start")
        return self

    async def _serve(self) -> None:
        # The event must belong to the server's loop.
        self._resume = asyncio.Event()
        self._resume.set()
        # A short shutdown timeout: stopping aborts hung requests, as a dying server would.
        self._runner = web.AppRunner(self.app(), shutdown_timeout=0.05, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def hold(self) -> None:
        """Keep every generate request waiting (counted in ``in_flight``) until ``release()``, as a
        paused server does; tests use it to decide when requests finish instead of timing them."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self.pause(None), self._loop).result(10)  # type: ignore[arg-type]

    def release(self) -> None:
        """Answer the held generate requests (and new ones at once)."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self.resume(None), self._loop).result(10)  # type: ignore[arg-type]

    def kill(self) -> None:
        """Drop every connection and stop listening, like a killed process (the loop keeps running)."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._die(), self._loop).result(10)

    async def _cancel_leftovers(self) -> None:
        # Handlers of dropped connections that still sleep (hang/die knobs).
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        if self._loop is None:
            return
        self.kill()
        asyncio.run_coroutine_threadsafe(self._cancel_leftovers(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(10)
        self._loop = None


def fake_command(port: int, *extra: str) -> list[str]:
    """Command line that runs this file as a server on ``port``."""
    return [sys.executable, str(Path(__file__).resolve()), "--port", str(port), *extra]


def as_fake(cmd: list[str], *extra: str) -> list[str]:
    """The launcher's ``python -m sglang.launch_server ARGS`` as ``python fake_sglang.py ARGS`` (all args kept)."""
    assert cmd[1:3] == ["-m", "sglang.launch_server"], cmd
    return [sys.executable, str(Path(__file__).resolve()), *cmd[3:], *extra]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fake SGLang server for tests")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-path", default="fake-model")
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--health-delay-s", type=float, default=1.0)
    parser.add_argument("--startup-delay-s", type=float, default=0.0)
    parser.add_argument("--crash-on-start", default="")
    args, ignored = parser.parse_known_args(argv)
    # Weight updates import archon from the repository this file lives in.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    print(f"fake sglang starting on {args.host}:{args.port} (ignored args: {ignored})", flush=True)
    time.sleep(args.startup_delay_s)
    if args.crash_on_start:
        print(args.crash_on_start, flush=True)
        return 3
    derived = model_context_length(args.model_path)
    context = args.context_length or derived or 4096
    if derived is not None and args.context_length is not None and args.context_length > derived:
        # SGLang's ModelConfig._derive_context_length refuses this unless an environment variable allows it.
        print(
            f"ValueError: User-specified context_length ({args.context_length}) is greater than the derived "
            f"context_length ({derived}). To allow overriding this maximum, set the env var "
            "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1",
            flush=True,
        )
        return 1
    eos: list[int] = []
    config = Path(args.model_path) / "config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("eos_token_id")
        eos = [value] if isinstance(value, int) else list(value or [])
    server = FakeSGLang(
        host=args.host,
        port=args.port,
        delay_s=args.delay_s,
        context_length=context,
        model_path=args.model_path,
        health_delay_s=args.health_delay_s,
        skip_tokenizer_init=args.skip_tokenizer_init,
        deterministic=args.enable_deterministic_inference,
        random_seed=args.random_seed,
        eos_token_ids=eos,
    )
    web.run_app(server.app(), host=args.host, port=args.port, shutdown_timeout=0.5, print=None, access_log=None)
    return 0


def fetch_state(addr: str) -> dict[str, Any]:
    """``GET /fake/state`` of a fake server (running anywhere)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{addr}/fake/state", timeout=10) as resp:
        return json.loads(resp.read())


def fetch_weights(addr: str) -> dict[str, Any]:
    """The tensors a fake server holds, from ``GET /fake/weights``."""
    import urllib.request

    from safetensors.torch import load

    with urllib.request.urlopen(f"http://{addr}/fake/weights", timeout=30) as resp:
        data = resp.read()
    return load(data) if data else {}


def configure(addr: str, **knobs: Any) -> None:
    """Set knobs of a fake server through ``POST /fake/config``."""
    import urllib.request

    req = urllib.request.Request(
        f"http://{addr}/fake/config",
        data=json.dumps(knobs).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10):
        pass


if __name__ == "__main__":
    sys.exit(main())
