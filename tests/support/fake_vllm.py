"""A small fake of a vLLM OpenAI-compatible server, for tests of the vLLM launcher and client.

It speaks the requests Archon sends, as vLLM 0.33.0 answers them (read from its source):

- ``POST /v1/completions`` with the prompt as token ids: ``max_tokens`` (default 16),
  ``min_tokens``, ``temperature`` / ``top_k`` / ``top_p`` / ``min_p``, ``seed``,
  ``stop_token_ids``, ``ignore_eos`` (which leaves ``stop_token_ids`` active), ``logprobs`` (an
  int; 0 is the sampled token only), ``return_token_ids``, ``return_tokens_as_token_ids``,
  ``return_weight_versions``.  The model is ``fake_sglang.fake_logits``; sampling follows
  vLLM's ``Sampler``: the min-tokens processor masks EOS and stop tokens, temperature below
  1e-5 is greedy, then min-p, top-k and top-p (top-p on the renormalised top-k); the reported
  logprob is ``raw_logprobs`` (``log_softmax`` of the raw logits) or ``processed_logprobs``
  (after all of that) as ``--logprobs-mode`` says.  EOS and stop tokens are checked before the
  length budget; ``stop_reason`` names a stop token and is null for EOS.  A request without a
  seed draws from the server's own generator.
- ``--max-model-len`` above the model's own context (from ``config.json``) makes it exit at
  startup; a prompt plus ``max_tokens`` beyond it is an HTTP 400.
- With ``VLLM_SERVER_DEV_MODE=1`` only (as in vLLM): ``/pause?mode=abort|wait|keep`` (new
  requests get HTTP 503 while paused, except with ``keep``), ``/resume``, ``/is_paused``,
  ``/collective_rpc`` (method ``reload_weights`` with ``kwargs.weights_path``: the folder's
  safetensors are loaded and the fake model changes), ``/reset_prefix_cache``,
  ``/update_weight_version`` and ``/weight_info``.

Knobs (``POST /fake/config``): ``fail_reload`` (the next reloads answer HTTP 500 with this
message), ``delay_s``.  ``GET /fake/state`` reports what happened; ``GET /fake/weights`` the
loaded tensors.  Run as ``python tests/support/fake_vllm.py serve MODEL --port P [vLLM arguments]``;
``as_fake_vllm(cmd)`` turns the launcher's command line into this script's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from aiohttp import web

if TYPE_CHECKING:
    import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_sglang import VOCAB, fake_logits, model_context_length  # noqa: E402

_SAMPLING_EPS = 1e-5  # vllm.sampling_params._SAMPLING_EPS
KNOBS = ("fail_reload", "delay_s")


def vllm_sample(
    raw: torch.Tensor, params: dict[str, Any], masked: set[int], uniform: float, mode: str
) -> tuple[int, float]:
    """One token and the logprob vLLM reports under ``mode`` (vllm/v1/sample/sampler.py)."""
    import torch  # lazily: a launched fake answers /health without paying for it

    raw_logprobs = torch.log_softmax(raw.float(), -1)
    logits = raw.float().clone()
    if masked:
        logits[sorted(masked)] = float("-inf")  # min-tokens processor (before sampling, after raw logprobs)
    temperature = float(params["temperature"])
    if temperature < _SAMPLING_EPS:  # greedy: processed logprobs are those of the unscaled logits
        tok = int(torch.argmax(logits))
        processed = torch.log_softmax(logits, -1)
    else:
        logits = logits / temperature
        min_p = float(params["min_p"])
        if min_p > 0:
            probs = torch.softmax(logits, -1)
            logits[probs < min_p * probs.max()] = float("-inf")
        top_k = int(params["top_k"])
        if 0 < top_k < VOCAB:
            logits[logits < torch.topk(logits, top_k).values[-1]] = float("-inf")
        top_p = float(params["top_p"])
        if top_p < 1.0:  # on the renormalised top-k distribution, as apply_top_k_top_p
            sorted_logits, order = torch.sort(logits)
            cum = torch.cumsum(torch.softmax(sorted_logits, -1), -1)
            drop = cum <= 1 - top_p
            drop[-1] = False
            logits[order[drop]] = float("-inf")
        processed = torch.log_softmax(logits, -1)
        cdf = torch.cumsum(torch.softmax(logits.double(), -1), -1)
        tok = min(int(torch.searchsorted(cdf, uniform * cdf[-1], right=True)), VOCAB - 1)
    reported = raw_logprobs if mode == "raw_logprobs" else processed
    return tok, float(reported[tok])


def vllm_completion(
    prompt: list[int], body: dict[str, Any], n_updates: int = 0, *, seed: int, eos: int | None, mode: str
) -> tuple[list[int], list[float], str, int | None]:
    """(token ids, logprobs, finish_reason, stop_reason) of a completions request."""
    import torch

    # vLLM's neutral defaults (the launcher passes --generation-config vllm).
    params = {
        key: default if body.get(key) is None else body[key]
        for key, default in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))
    }
    stop_ids = set(body.get("stop_token_ids") or [])
    eos_id = None if body.get("ignore_eos") else eos
    all_stops = stop_ids | ({eos} if eos is not None else set())  # the min-tokens processor masks EOS always
    min_tokens = int(body.get("min_tokens") or 0)
    draws = torch.Generator().manual_seed(seed % 2**64)
    ids: list[int] = []
    logprobs: list[float] = []
    for _ in range(int(body["max_tokens"])):
        masked = all_stops if len(ids) < min_tokens else set()
        tok, lp = vllm_sample(
            fake_logits(prompt + ids, n_updates), params, masked, float(torch.rand(1, generator=draws)), mode
        )
        ids.append(tok)
        logprobs.append(lp)
        if tok == eos_id:  # check_stop: EOS, then stop tokens, then the length budget
            return ids, logprobs, "stop", None
        if tok in stop_ids:
            return ids, logprobs, "stop", tok
    return ids, logprobs, "length", None


def _error(message: str, status: int = 400, kind: str = "BadRequestError") -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status
    )


class FakeVLLM:
    """State and handlers of one fake vLLM server."""

    def __init__(
        self,
        model: str,
        *,
        max_model_len: int,
        logprobs_mode: str = "raw_logprobs",
        seed: int = 0,
        dev_mode: bool = False,
        eos: int | None = None,
    ):
        self.model = model
        self.max_model_len = max_model_len
        self.logprobs_mode = logprobs_mode
        self.dev_mode = dev_mode
        self.eos = eos
        self._rng = random.Random(seed)
        self.fail_reload = ""
        self.delay_s = 0.0
        self.paused: str | None = None
        self._resumed = asyncio.Event()
        self.n_updates = 0
        self.version: str | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self.events: list[str] = []
        self.completions = 0
        self.requests: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.on_startup.append(self._on_startup)
        routes = [
            web.get("/health", self.health),
            web.get("/v1/models", self.models),
            web.post("/v1/completions", self.complete),
            web.post("/fake/config", self.configure),
            web.get("/fake/state", self.state),
            web.get("/fake/weights", self.dump_weights),
        ]
        if self.dev_mode:  # vLLM registers these routers only with VLLM_SERVER_DEV_MODE=1
            routes += [
                web.post("/pause", self.pause),
                web.post("/resume", self.resume),
                web.get("/is_paused", self.is_paused),
                web.post("/collective_rpc", self.collective_rpc),
                web.post("/reset_prefix_cache", self.reset_prefix_cache),
                web.post("/update_weight_version", self.update_weight_version),
                web.get("/weight_info", self.weight_info),
            ]
        app.add_routes(routes)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._resumed = asyncio.Event()
        self._resumed.set()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "max_model_len": self.max_model_len}]}
        )

    async def complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        if self.paused in ("abort", "wait"):
            return _error("Generation is paused; retry after /resume", 503, "ServiceUnavailableError")
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt):
            return _error("prompt must be a non-empty list of token ids here")
        body.setdefault("max_tokens", 16)
        if body["max_tokens"] is None:
            body["max_tokens"] = 16
        if len(prompt) + int(body["max_tokens"]) > self.max_model_len:
            return _error(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {len(prompt) + int(body['max_tokens'])} tokens ({len(prompt)} in the "
                f"messages, {body['max_tokens']} in the completion). Please reduce the length."
            )
        top_k = body.get("top_k")
        if top_k is not None and top_k < -1:
            return _error(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
        await self._resumed.wait()  # 'keep' mode: queued until /resume
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        seed = body.get("seed")
        seed = self._rng.randrange(2**63) if seed is None else int(seed)
        ids, lps, finish, stop_reason = vllm_completion(
            prompt, body, self.n_updates, seed=seed, eos=self.eos, mode=self.logprobs_mode
        )
        self.completions += 1
        choice: dict[str, Any] = {
            "index": 0,
            "text": "".join(f"<{t}>" for t in ids),
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "logprobs": None,
        }
        if body.get("logprobs") is not None:
            tokens = [f"token_id:{t}" if body.get("return_tokens_as_token_ids") else f"<{t}>" for t in ids]
            choice["logprobs"] = {
                "text_offset": [],
                "token_logprobs": [max(lp, -9999.0) for lp in lps],
                "tokens": tokens,
                "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, lps)],
            }
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
            choice["prompt_token_ids"] = prompt
        if body.get("return_weight_versions"):
            choice["weight_versions"] = [{"version": self.version, "start": 0, "end": len(ids)}]
        return web.json_response(
            {
                "id": f"cmpl-{body.get('request_id', 'x')}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(ids),
                    "total_tokens": len(prompt) + len(ids),
                },
            }
        )

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return web.json_response({"error": f"unknown pause mode {mode}"}, status=400)
        self.paused = mode
        if mode == "keep":
            self._resumed.clear()
        self.events.append(f"pause:{mode}")
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.paused = None
        self._resumed.set()
        self.events.append("resume")
        return web.json_response({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused is not None})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        method, kwargs = body.get("method"), body.get("kwargs", {})
        self.events.append(f"rpc:{method}")
        if method != "reload_weights":
            return web.json_response({"results": [None]})
        if self.fail_reload:
            return web.json_response(
                {"error": {"message": self.fail_reload, "type": "InternalServerError", "code": 500}}, status=500
            )
        from safetensors.torch import load_file

        path = Path(kwargs.get("weights_path") or self.model)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            return web.json_response({"error": {"message": f"no safetensors in {path}", "code": 500}}, status=500)
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(str(f)))
        self.weights = weights
        self.model = str(path)  # vLLM points model_config.model at the reloaded folder
        self.n_updates += 1
        return web.json_response({"results": [None]})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.events.append("reset_prefix_cache")
        return web.json_response({"success": True})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        self.version = str((await request.json())["new_version"])
        self.events.append(f"version:{self.version}")
        return web.json_response({"success": True, "new_version": self.version})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.version})

    async def configure(self, request: web.Request) -> web.Response:
        for key, value in (await request.json()).items():
            if key not in KNOBS:
                return web.json_response({"error": {"message": f"unknown knob {key}"}}, status=400)
            setattr(self, key, value)
        return web.json_response({"success": True})

    async def state(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model": self.model,
                "version": self.version,
                "n_updates": self.n_updates,
                "events": self.events,
                "paused": self.paused,
                "completions": self.completions,
                "logprobs_mode": self.logprobs_mode,
                "max_model_len": self.max_model_len,
                "last_request": self.requests[-1] if self.requests else None,
            }
        )

    async def dump_weights(self, request: web.Request) -> web.Response:
        from safetensors.torch import save

        data = save({k: v.contiguous() for k, v in self.weights.items()}) if self.weights else b""
        return web.Response(body=data, content_type="application/octet-stream")


class InProcess:
    """A FakeVLLM served on a free port from its own thread (``with InProcess(server) as addr``)."""

    def __init__(self, server: FakeVLLM):
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)

    async def _serve(self) -> str:
        self._runner = web.AppRunner(self.server.app(), shutdown_timeout=0.05, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"127.0.0.1:{self._runner.addresses[0][1]}"

    def __exit__(self, *exc: object) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def as_fake_vllm(cmd: list[str], *extra: str) -> list[str]:
    """The launcher's ``python -m vllm.entrypoints.openai.api_server --model ...`` as this script (all args kept)."""
    assert cmd[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"], cmd
    return [sys.executable, str(Path(__file__).resolve()), *cmd[3:], *extra]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fake vLLM server for tests")
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--logprobs-mode",
        default="raw_logprobs",
        choices=["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"],
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--crash-on-start", default="")
    args, ignored = parser.parse_known_args(argv)
    print(
        f"fake vllm starting on {args.host}:{args.port} (ignored args: {ignored}; "
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})",
        flush=True,
    )
    if args.crash_on_start:
        print(args.crash_on_start, flush=True)
        return 3
    derived = model_context_length(args.model) or 4096
    if args.max_model_len is not None and args.max_model_len > derived:
        print(
            f"ValueError: User-specified max_model_len ({args.max_model_len}) is greater than the derived "
            f"max_model_len (max_position_embeddings={derived} in model's config.json). To allow overriding "
            "this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.",
            flush=True,
        )
        return 1
    eos = None
    config = Path(args.model) / "config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("eos_token_id")
        eos = cast("int | None", value[0] if isinstance(value, list) and value else value)
    server = FakeVLLM(
        args.model,
        max_model_len=args.max_model_len or derived,
        logprobs_mode=args.logprobs_mode,
        seed=args.seed,
        dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
        eos=eos,
    )
    web.run_app(server.app(), host=args.host, port=args.port, shutdown_timeout=0.5, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
