"""A small fake of an SGLang server for tests of the rollout client, launcher and weight sync.

It speaks the subset of SGLang's HTTP protocol Archon uses.  ``/generate`` is deterministic
(``fake_completion``: tokens and logprobs are a function of the prompt and of how many
weight updates the server has taken), so tests can predict every answer.  Weight updates are
real: ``/init_weights_update_group`` joins the group with ``archon.rollout.weight_group``
and ``/update_weights_from_distributed`` receives the broadcast tensors;
``/update_weights_from_disk`` reads the safetensors of the folder.  Tests read what arrived
from ``.weights`` (in-process) or ``GET /fake/weights`` (a subprocess).

Knobs (attributes, or ``POST /fake/config`` with a JSON object): ``fail_next`` (answer the
next N generate requests with HTTP 500), ``hang`` (generate never answers), ``delay_s``
(each generate takes this long), ``die_after`` (the generate request after the first N makes the
server drop every connection, in-flight requests included, and stop listening, like a
killed process), ``fail_weight_update``
(weight updates answer success=false with this message), ``join_group`` (False: record
group requests without joining).

In-process: ``FakeSGLang(...).start()`` runs it on a free port on its own thread.  As a
script: ``python tests/fake_sglang.py --port P [--delay-s S] [--crash-on-start MSG]``;
unknown SGLang-style arguments are accepted and ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web

VOCAB = 1000
KNOBS = ("fail_next", "hang", "delay_s", "die_after", "fail_weight_update", "join_group")


def fake_completion(input_ids: list[int], params: dict[str, Any], n_updates: int = 0,
                    vocab: int = VOCAB) -> tuple[list[int], list[float], dict[str, Any]]:
    """(output ids, logprobs, finish_reason) the fake answers for a prompt after ``n_updates`` weight updates."""
    n = int(params.get("max_new_tokens", 16))
    stops = set(params.get("stop_token_ids") or [])
    base = sum(input_ids) * 31 + len(input_ids) + n_updates * 1009
    ids: list[int] = []
    logprobs: list[float] = []
    for j in range(n):
        tok = (base + 7 * j * j + 3 * j) % vocab
        ids.append(tok)
        logprobs.append(-0.01 * (tok % 97 + 1))
        if tok in stops and not params.get("ignore_eos", False) and j + 1 >= int(params.get("min_new_tokens", 0)):
            return ids, logprobs, {"type": "stop", "matched": tok}
    return ids, logprobs, {"type": "length", "length": n}


class FakeSGLang:
    """State and handlers of one fake server."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, delay_s: float = 0.0,
                 context_length: int = 4096, model_path: str = "fake-model"):
        self.host = host
        self.port = port
        self.context_length = context_length
        self.model_path = model_path
        # knobs
        self.fail_next = 0
        self.hang = False
        self.delay_s = delay_s
        self.die_after: int | None = None
        self.fail_weight_update = ""
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
        self.group_requests: list[dict[str, Any]] = []
        self.disk_loads: list[str] = []
        self.flushes = 0
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
        app.add_routes([
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
        ])
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "is_generation": True,
                                  "weight_version": self.version})

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
        params = body.get("sampling_params") or {}
        for p in prompts:
            if len(p) + int(params.get("max_new_tokens", 16)) > self.context_length:
                msg = (f"Requested token count exceeds the model's maximum context length of "
                       f"{self.context_length} tokens")
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
        for p in prompts:
            ids, lps, finish = fake_completion(p, params, self.n_updates)
            meta: dict[str, Any] = {"id": body.get("rid") or "x", "finish_reason": finish,
                                    "prompt_tokens": len(p), "completion_tokens": len(ids),
                                    "weight_version": self.version}
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids)]
            outs.append({"text": "", "output_ids": ids, "meta_info": meta})
        return web.json_response(outs if batched else outs[0])

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.flushes += 1
        return web.Response(text="Cache flushed.")

    async def pause(self, request: web.Request) -> web.Response:
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
            from archon.rollout.weight_group import init_weight_update_group

            self._groups[body["group_name"]] = await asyncio.get_running_loop().run_in_executor(
                None, lambda: init_weight_update_group(body["master_address"], body["master_port"],
                                                       body["rank_offset"], body["world_size"],
                                                       body["group_name"], body.get("backend", "gloo"), 60.0))
        return web.json_response({"success": True, "message": "joined"})

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body = await request.json()
        failed = self._fail_update()
        if failed is not None:
            return failed
        pg = self._groups.get(body["group_name"])
        if pg is None:
            return web.json_response({"success": False, "message": f"no group {body['group_name']}"}, status=400)
        import torch

        from archon.rollout.weight_group import broadcast_tensor

        def receive() -> dict[str, Any]:
            got = {}
            for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                broadcast_tensor(t, pg, src=0)
                got[name] = t
            return got

        got = await asyncio.get_running_loop().run_in_executor(None, receive)
        self.weights.update(got)
        self.update_calls.append(list(body["names"]))
        if body.get("flush_cache", True):
            self.flushes += 1
            self._new_version(body.get("weight_version"))
        return web.json_response({"success": True, "message": "updated"})

    def _new_version(self, version: Any) -> None:
        self.n_updates += 1
        self.version = str(version) if version is not None else str(self.n_updates)

    async def configure(self, request: web.Request) -> web.Response:
        for key, value in (await request.json()).items():
            if key not in KNOBS:
                return web.json_response({"error": {"message": f"unknown knob {key}"}}, status=400)
            setattr(self, key, value)
        return web.json_response({"success": True})

    async def state(self, request: web.Request) -> web.Response:
        return web.json_response({
            "version": self.version, "n_updates": self.n_updates, "generate_count": self.generate_count,
            "served": self.served, "max_in_flight": self.max_in_flight, "update_calls": self.update_calls,
            "group_requests": self.group_requests, "disk_loads": self.disk_loads, "flushes": self.flushes,
            "weight_names": sorted(self.weights)})

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

    def start(self) -> "FakeSGLang":
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fake SGLang server for tests")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-path", default="fake-model")
    parser.add_argument("--context-length", type=int, default=4096)
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--startup-delay-s", type=float, default=0.0)
    parser.add_argument("--crash-on-start", default="")
    args, ignored = parser.parse_known_args(argv)
    # Weight updates import archon from the repository this file lives in.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print(f"fake sglang starting on {args.host}:{args.port} (ignored args: {ignored})", flush=True)
    time.sleep(args.startup_delay_s)
    if args.crash_on_start:
        print(args.crash_on_start, flush=True)
        return 3
    server = FakeSGLang(host=args.host, port=args.port, delay_s=args.delay_s, context_length=args.context_length,
                        model_path=args.model_path)
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

    req = urllib.request.Request(f"http://{addr}/fake/config", data=json.dumps(knobs).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10):
        pass


if __name__ == "__main__":
    sys.exit(main())
