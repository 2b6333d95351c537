"""The generation engine of the built-in rollout server: continuous batching in one thread.

One thread at a time runs the engine: its own generation thread, or a caller waiting in ``serve_until`` (the
in-process engine's trainer, whose thread then computes both phases).  Callers (HTTP handlers, tests, scripts)
``submit`` requests and get ``concurrent.futures.Future`` objects back (``asyncio.wrap_future`` makes them awaitable).
Between two decode steps the engine thread admits queued requests (one batched, right-padded
prefill), then runs one decode forward over every running row, samples, and retires the rows
that finished; the KV cache (``kv_cache.BatchedKVCache``) keeps one row per running request.
The forwards themselves are ``forward_steps.ForwardSteps``'s (one row each when ``batch_invariant``).

Logprobs follow the contract in ``archon.server.sampling``: ``log_softmax(logits / T)`` of
the sampled token, in float32, from the raw logits (before stop-token suppression and before
top-k / top-p / min-p), with T = 1 for greedy requests (temperature 0, or top_k = 1 as in SGLang).
A stop token (EOS or ``stop_token_ids``) finishes a request with reason ``stop`` even when it
is the last token ``max_new_tokens`` allows, as in SGLang.

Control semantics (the server's endpoints map onto these one to one):

* ``pause()``: running requests finish at once with reason ``abort``; queued and new requests
  wait (are not admitted) until ``resume()``.  Weight updates still run while paused.
* ``pause(mode="retract")`` (SGLang's retract mode): running requests go back to the head of
  the queue with the tokens they have; after ``resume()`` each is prefilled again (prompt and
  its tokens so far, under the weights loaded by then) and continues with its own random
  generator.  A weight update between the two makes a partial rollout: the request's tokens
  come from two versions, which ``GenerationResult.weight_versions`` reports per token span.
* ``abort(rid)`` / ``abort_all()``: the matching queued or running requests finish with
  reason ``abort`` and the tokens generated so far.
* Weight updates (``run_exclusive`` and the ``update_weights_*`` helpers): admission stops,
  running requests finish normally (or are aborted when ``abort_running``), then the update
  runs on the engine thread, ``weight_version`` changes, and admission resumes.  So without a
  retract no request mixes two weight versions.
* ``release_memory(tags)`` / ``resume_memory(tags)`` (``archon.server.memory``) run the same way; while
  memory is released, or resumed weights await their next update, requests queue (as when paused).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.nn as nn

import models
from archon.server.forward_steps import ForwardSteps
from archon.server.generation_types import (  # noqa: F401 - GenerationResult is public here
    PAUSE_MODES,
    ActiveSequence,
    ExclusiveOp,
    GenerationRequest,
    GenerationResult,
    fail_future,
    resolve_future,
)
from archon.server.kv_cache import BatchedKVCache
from archon.server.memory import EngineMemory
from archon.server.sampling import sample_tokens, suppress_tokens, token_logprobs
from archon.server.weight_update import load_named_tensors, load_weights_from_disk, read_eos_token_ids, receive_weights
from models.common.inference import InferenceForward

logger = logging.getLogger(__name__)

T = TypeVar("T")

# ---- engine-internal state ----------------------------------------------------------------


class Generator:
    """Serves generation requests on ``model`` from a dedicated thread (started on construction).

    Args:
        model: an Archon causal LM taking ``(tokens, positions=, cache=)``; its ``args`` give
            the layer count, KV heads, head dim, vocab size and default context length.
        eos_token_ids: tokens that finish a request unless it sets ``ignore_eos``.
        context_length: longest ``prompt + max_new_tokens``; default the model's ``max_seq_len``.
        max_running_requests: rows decoded together at most.
        random_seed: seeds requests without ``sampling_seed`` (with a request counter).
        weight_version: initial version string reported in results.
        max_prefill_tokens: padded prompt tokens per prefill forward (at least one request).
        shared_weights: ``model`` is also trained in this process (the in-process rollout engine): its
            Parameters are left as they are (no fused projections, no ``requires_grad_(False)``, no ``eval()``),
            so the optimizer keeps stepping the very tensors generation reads.
        compute: a context manager factory every forward runs under (e.g. the trainer's autocast, so that
            generation computes in the training dtype); None: none.
        cache_dtype: the KV cache's dtype; default the parameters' (set it to the compute dtype under autocast).
        batch_invariant: one row per forward, so that a request's logprobs do not depend on the requests computed
            beside it (``archon.server.forward_steps``); slower.
        compute_threads: intra-op (OpenMP) threads of the generation thread; None: the constructing thread's.
            Only one thread of a process should compute with several: libgomp keeps a team of workers for every
            thread that has run a parallel kernel, and once a process holds more of them than it has cores it
            stops spin-waiting between kernels, so every parallel kernel of every thread then pays a wake-up.
            The built-in server computes on this thread only (``archon.server.app`` keeps its HTTP thread at
            one); the in-process engine shares the trainer's process and takes one (``archon.rl.inprocess``).
            The thread count of threads started later is left as the constructing thread found it.
    """

    def __init__(
        self,
        model: nn.Module,
        eos_token_ids: Sequence[int] = (),
        context_length: int | None = None,
        max_running_requests: int = 64,
        random_seed: int = 0,
        weight_version: str = "default",
        max_prefill_tokens: int = 8192,
        shared_weights: bool = False,
        compute: Callable[[], AbstractContextManager[Any]] | None = None,
        cache_dtype: torch.dtype | None = None,
        batch_invariant: bool = False,
        compute_threads: int | None = None,
    ) -> None:
        args: Any = getattr(model, "args", None)
        missing = [a for a in ("n_layers", "n_kv_heads", "head_dim", "vocab_size") if not hasattr(args, a)]
        if missing:
            raise ValueError(
                f"{type(model).__name__}.args lacks {missing}; the generator sizes its KV cache from "
                "them (use a model built by models.load_hf_model)."
            )
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}.")
        if compute_threads is not None and compute_threads < 1:
            raise ValueError(f"compute_threads must be >= 1 (or None for this thread's count), got {compute_threads}.")
        self.model = model if shared_weights else model.eval().requires_grad_(False)
        # The lean forward of a stock Decoder (fused projections, few kernels); None: call the model.  Shared weights
        # are not fused (fusing re-points the Parameters, which the optimizer holds), and a compute context (autocast)
        # gets the model's own forward, whose casts it was written for.
        self._lean = None if compute is not None else InferenceForward.for_model(self.model, fuse=not shared_weights)
        self._compute = compute or nullcontext
        # A tensor the model caches during an inference-mode forward (a longer RoPE table, say) would be an inference
        # tensor, which training's autograd refuses: a shared model generates under no_grad only.
        self._no_grad = torch.no_grad if shared_weights else torch.inference_mode
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.vocab_size = int(args.vocab_size)
        self.context_length = int(context_length if context_length is not None else args.max_seq_len)
        self.max_running_requests = max_running_requests
        self.random_seed = int(random_seed)
        self.max_prefill_tokens = max_prefill_tokens
        param = next(model.parameters())
        self.device = param.device
        self.cache = BatchedKVCache(
            int(args.n_layers),
            int(args.n_kv_heads),
            int(args.head_dim),
            dtype=cache_dtype or param.dtype,
            device=param.device,
            initial_rows=min(8, max_running_requests),
            max_rows=max_running_requests,
            max_length=self.context_length,
        )
        # Released memory and resumed-but-empty weights hold admission (archon.server.memory).
        self._memory = EngineMemory(self.model, self.cache, self._lean, shared_weights)
        self._weight_version = weight_version
        self._request_counter = 0
        # MoE blocks keep their last routing, which requests may ask for (routing replay).
        self._n_layers = int(args.n_layers)
        self._moe = {
            int(i): layer.moe
            for i, layer in getattr(model, "layers", {}).items()
            if getattr(layer, "moe_enabled", False)
        }
        for moe in self._moe.values():
            moe.record_routing = True
        self._steps = ForwardSteps(self.model, self._lean, self.cache, self._moe, self._n_layers, batch_invariant)

        # Held by whichever thread runs the engine: the generation thread, or a caller in serve_until.
        self._engine = threading.Lock()
        self._callers_serving = 0
        """Callers in serve_until (guarded by _cond): while any is, the generation thread leaves the work to it."""
        # Shared with caller threads, guarded by _cond's lock.
        self._cond = threading.Condition()
        self._inbox: list[ActiveSequence] = []
        self._abort_rids: set[str] = set()
        self._abort_everything = False
        self._pause_waiters: list[tuple[Future, str]] = []
        self._paused = False
        self._exclusive: deque[ExclusiveOp] = deque()
        self._stopping = False

        # Owned by the thread holding _engine.
        self._waiting: deque[ActiveSequence] = deque()
        self._running: list[ActiveSequence] = []

        own_threads = torch.get_num_threads()
        self._compute_threads = compute_threads or own_threads
        threads_set = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(threads_set,), name="archon-generator", daemon=True)
        self._thread.start()
        # torch.set_num_threads also sets the count threads started later begin with: put back this thread's.
        threads_set.wait()
        torch.set_num_threads(own_threads)

    @classmethod
    def from_hf(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", **kwargs: Any
    ) -> Generator:
        """Load the Hugging Face folder ``path`` and serve it (EOS ids read from the folder)."""
        model = models.load_hf_model(path, dtype=dtype, device=device)
        kwargs.setdefault("eos_token_ids", read_eos_token_ids(path))
        return cls(model, **kwargs)

    # ---- public API (any thread) ------------------------------------------------------
    @property
    def weight_version(self) -> str:
        """Version of the weights new requests will be generated with."""
        return self._weight_version

    @property
    def paused(self) -> bool:
        """True between ``pause()`` and ``resume()``."""
        return self._paused

    @property
    def memory_held(self) -> bool:
        """True while requests wait for memory: some is released, or resumed weights await their update."""
        return self._memory.holds_requests

    def stats(self) -> dict[str, Any]:
        """Requests running and queued, KV-cache rows in use, bytes the weights and KV cache hold, and the memory
        released (a snapshot, for monitoring and tests)."""
        with self._cond:
            queued = len(self._inbox) + len(self._waiting)
            running = len(self.progress())
            return {
                "num_running_reqs": running,
                "num_queued_reqs": queued,
                "kv_cache_rows": self.cache.num_rows,
                **self._memory.stats(),
            }

    def progress(self) -> dict[str, int]:
        """Tokens generated so far by each running request, by rid (a snapshot, for monitoring and tests).

        A request whose result is already out counts as finished, even in the moment before the
        engine thread drops its row.
        """
        running = list(self._running)  # one atomic copy; the engine thread changes the list meanwhile
        return {cast(str, s.request.rid): len(s.output_ids) for s in running if not s.future.done()}

    def check_request(self, request: GenerationRequest) -> None:
        """Raise ``ValueError`` (one sentence: what and how to fix) if the request cannot be served."""
        request.check(self.vocab_size, self.context_length)

    def submit(self, request: GenerationRequest) -> Future:
        """Queue ``request``; the future resolves to a ``GenerationResult``.

        Raises ``ValueError`` for an invalid request and ``RuntimeError`` after ``close()``.
        """
        self.check_request(request)
        if request.rid is None:
            request.rid = uuid.uuid4().hex
        params = request.sampling_params
        if params.top_k == 1 and params.temperature != 0.0:
            # SGLang samples top_k = 1 on its greedy path, whose logprobs are unscaled (T = 1).
            params = request.sampling_params = dataclasses.replace(params, temperature=0.0)
        # As in SGLang, ignore_eos switches off stop_token_ids too.
        stop_ids = set() if params.ignore_eos else set(params.stop_token_ids) | self.eos_token_ids
        future: Future = Future()
        with self._cond:
            if self._stopping:
                raise RuntimeError("the generator is closed; create a new one.")
            seed = params.sampling_seed
            if seed is None:
                seed = (self.random_seed * 1_000_003 + self._request_counter) % (2**63)
            self._request_counter += 1
            # Any JSON integer is a valid seed; torch takes 64 bits.
            rng = torch.Generator(device="cpu").manual_seed(int(seed) % 2**64)
            self._inbox.append(ActiveSequence(request, future, rng, frozenset(stop_ids), time.perf_counter()))
            self._cond.notify_all()
        return future

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Submit ``requests`` together and wait for all of them (results in the same order)."""
        futures = [self.submit(r) for r in requests]
        return [f.result() for f in futures]

    def abort(self, rid: str) -> None:
        """Finish the queued or running requests with id ``rid`` (reason ``abort``); unknown ids are ignored."""
        with self._cond:
            self._abort_rids.add(rid)
            self._cond.notify_all()

    def abort_all(self) -> None:
        """Finish every queued and running request with reason ``abort``."""
        with self._cond:
            self._abort_everything = True
            self._cond.notify_all()

    def pause(self, mode: str = "abort") -> Future:
        """Stop running requests and hold queued and new ones until ``resume()``.

        ``mode`` 'abort' finishes the running requests (reason ``abort``); 'retract' puts them
        back in the queue with their tokens, to continue after ``resume()``.  The future
        resolves once no request is running.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not supported; use one of {', '.join(PAUSE_MODES)}.")
        future: Future = Future()
        with self._cond:
            self._paused = True
            self._pause_waiters.append((future, mode))
            self._cond.notify_all()
        return future

    def resume(self) -> None:
        """Admit requests again after ``pause()``."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def run_exclusive(
        self, fn: Callable[[nn.Module], T], weight_version: str | None = None, abort_running: bool = False
    ) -> Future:
        """Run ``fn(model)`` on the engine thread once no request is running (see module docstring).

        On success ``weight_version`` (if given) becomes the reported version; the future
        resolves to ``fn``'s return value or its exception.
        """
        future: Future = Future()
        with self._cond:
            if self._stopping:
                raise RuntimeError("the generator is closed; create a new one.")
            self._exclusive.append(ExclusiveOp(fn, future, weight_version, abort_running))
            self._cond.notify_all()
        return future

    def publish_weights(self, weight_version: str) -> Future:
        """The model's weights were changed in place by their owner (the in-process engine's optimizer): once no
        request runs, drop what the lean forward derived from them and report ``weight_version``."""
        lean = self._lean
        return self.run_exclusive(lambda model: lean.reset() if lean is not None else None, weight_version)

    def release_memory(self, tags: Sequence[str] | None = None) -> Future:
        """Once no request runs, free the memory of ``tags`` ('weights', 'kv_cache', 'cuda_graph'; None: all) and
        hold new requests until it is resumed (``archon.server.memory``); resolves to the tags released now."""
        return self.run_exclusive(lambda model: self._memory.release(tags))

    def resume_memory(self, tags: Sequence[str] | None = None) -> Future:
        """Take the memory of ``tags`` again (None: all); resumed weights have no contents, so requests wait for the
        next weight update.  Resolves to the tags resumed now."""
        return self.run_exclusive(lambda model: self._memory.resume(tags))

    def update_weights_from_disk(
        self, path: str | Path, weight_version: str | None = None, abort_running: bool = False
    ) -> Future:
        """Load the Hugging Face folder ``path`` into the model (same architecture and shapes)."""
        load = self._memory.weight_update(lambda model: load_weights_from_disk(model, path))  # None: all written
        return self.run_exclusive(load, weight_version, abort_running)

    def update_weights_from_tensors(
        self,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        weight_version: str | None = None,
        abort_running: bool = False,
    ) -> Future:
        """Copy HF-named tensors into the model (names and shapes checked before any is applied); the caller keeps
        them alive until the future resolves."""
        load = self._memory.weight_update(lambda model: load_named_tensors(model, named_tensors))
        return self.run_exclusive(load, weight_version, abort_running)

    def update_weights_from_group(
        self,
        group: dist.ProcessGroup,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype],
        shapes: Sequence[Sequence[int]],
        weight_version: str | None = None,
        abort_running: bool = False,
        flattened: bool = False,
    ) -> Future:
        """Receive HF-named tensors broadcast from rank 0 of ``group`` (in order, or ``flattened``) into the model."""

        def receive(model: nn.Module) -> None:
            # Received even into released weights (the sender broadcasts regardless), then refused.
            refuse = "the server's weights are released" if "weights" in self._memory.released else None
            self._memory.weights_written(receive_weights(model, group, names, dtypes, shapes, flattened, refuse))

        return self.run_exclusive(receive, weight_version, abort_running)

    def serve_until(self, future: Future[T]) -> T:
        """Wait for ``future`` running the engine on this thread meanwhile; its result.

        For a caller that computes itself between waits (the in-process engine's trainer): on CPU its thread
        already holds the process's OpenMP team, which then serves both phases (``compute_threads``), instead of
        a second team on the generation thread.  The generation thread takes the engine back afterwards.
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("serve_until was called on the generator's own thread; wait on the future instead.")
        future.add_done_callback(lambda _: self._notify())
        with self._cond:
            self._callers_serving += 1  # from here on the generation thread takes no more work
        try:
            with self._engine:  # once the generation thread's round in progress, if any, is over
                while True:
                    with self._cond:
                        while not (future.done() or self._has_work()):
                            self._cond.wait()
                        if future.done() or self._stopping:
                            break
                    self._iterate()
                self._release_if_idle()  # as the generation thread does when it runs out of work
        finally:
            with self._cond:
                self._callers_serving -= 1
                self._cond.notify_all()
        return future.result()

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Abort everything still queued or running and stop the engine thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- engine thread ----------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(
            self._stopping
            or self._inbox
            or self._abort_rids
            or self._abort_everything
            or self._pause_waiters
            or self._exclusive
            or self._running
            or (self._waiting and not self._paused and not self._memory.holds_requests)
        )

    def _run(self, threads_set: threading.Event) -> None:
        torch.get_num_threads()  # torch's once-per-thread setup, which would otherwise undo the next line later
        torch.set_num_threads(self._compute_threads)
        threads_set.set()
        self._loop()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (self._callers_serving or not self._has_work()):
                    self._cond.wait()
                if self._stopping:
                    break
            with self._engine:
                with self._cond:
                    if self._callers_serving:  # a caller came to serve meanwhile: the work is its
                        continue
                self._iterate()
                self._release_if_idle()
        with self._engine:
            self._shut_down()

    def _release_if_idle(self) -> None:
        """With ``_engine`` held: give back what a burst of requests grew the KV cache to, once no work is left."""
        with self._cond:
            if not self._has_work():
                self.cache.release()

    def _iterate(self) -> None:
        """One round of the engine (with ``_engine`` held): take what arrived, apply aborts, pauses and weight
        updates, admit, then one decode step over the running rows."""
        with self._cond:
            if self._stopping or not self._has_work():  # the other engine runner took it meanwhile
                return
            self._queue(self._inbox)
            self._inbox = []
            abort_rids, self._abort_rids = self._abort_rids, set()
            abort_everything, self._abort_everything = self._abort_everything, False
            pause_waiters, self._pause_waiters = self._pause_waiters, []
            paused = self._paused or self._memory.holds_requests
            exclusive = self._exclusive[0] if self._exclusive else None

        self._drop_cancelled()
        if abort_everything:
            self._abort_where(lambda s: True, "aborted by abort_all")
        elif abort_rids:
            self._abort_where(lambda s, rids=abort_rids: s.request.rid in rids, "aborted by abort_request")
        if pause_waiters:
            if any(mode == "abort" for _, mode in pause_waiters):
                self._abort_running("aborted by pause_generation")
            else:
                self._retract_running()
            for f, _ in pause_waiters:
                resolve_future(f, None)
        if exclusive is not None:
            if exclusive.abort_running:
                self._abort_running("aborted for a weight update")
            if not self._running:
                self._run_exclusive(exclusive)
                return
        elif not paused:
            self._admit()
        if self._running:
            self._step(self._decode)

    def _shut_down(self) -> None:
        self._abort_where(lambda s: True, "the server is shutting down")
        with self._cond:
            for s in self._inbox:
                self._finish(s, {"type": "abort", "message": "the server is shutting down"})
            self._inbox = []
            for f, _ in self._pause_waiters:
                resolve_future(f, None)
            for op in self._exclusive:
                fail_future(op.future, RuntimeError("the generator was closed before the weight update ran."))
            self._exclusive.clear()

    def _run_exclusive(self, op: ExclusiveOp) -> None:
        try:
            with torch.no_grad():
                value = op.fn(self.model)
        except BaseException as e:  # noqa: BLE001  reported to the caller, the engine keeps serving
            logger.warning("weight update failed: %s", e)
            fail_future(op.future, e)
        else:
            if op.weight_version is not None:
                self._weight_version = op.weight_version
            resolve_future(op.future, value)
        if self._lean is not None:
            self._lean.refresh()  # an update that assigned new Parameters needs new fused weights
        with self._cond:
            self._exclusive.popleft()

    def _finish(self, seq: ActiveSequence, reason: dict[str, Any]) -> None:
        req = seq.request
        version = seq.weight_version if seq.weight_version is not None else self._weight_version
        # As SGLang: one span even without tokens, and weight_version is the last span's.
        spans = [(str(v), int(a), int(b)) for v, a, b in seq.version_spans] or [(version, 0, 0)]
        result = GenerationResult(
            rid=cast(str, req.rid),  # filled in by submit
            output_ids=list(seq.output_ids),
            output_logprobs=list(seq.logprobs) if req.return_logprob else None,
            finish_reason=reason,
            prompt_tokens=len(req.input_ids),
            weight_version=spans[-1][0],
            e2e_latency=time.perf_counter() - seq.submitted,
            routed_experts=seq.routed_result(self._n_layers, self._moe) if req.return_routed_experts else None,
            weight_versions=spans,
        )
        resolve_future(seq.future, result)

    def _retire(self, keep: list[int]) -> None:
        """Keep running rows ``keep`` (ascending) and compact the cache."""
        if len(keep) != len(self._running):
            self._running = [self._running[i] for i in keep]
            self.cache.keep_rows(keep)

    def _abort_running(self, message: str) -> None:
        for s in self._running:
            self._finish(s, {"type": "abort", "message": message})
        self._running = []
        self.cache.clear()

    def _retract_running(self) -> None:
        """Put the running requests back at the head of the queue, in order, with their tokens so far;
        admission prefills each again (prompt and tokens) and it goes on sampling."""
        self._waiting.extendleft(reversed(self._running))
        self._running = []
        self.cache.clear()

    def _abort_where(self, pred: Callable[[ActiveSequence], bool], message: str) -> None:
        reason = {"type": "abort", "message": message}
        kept_waiting: deque[ActiveSequence] = deque()
        for s in self._waiting:
            if pred(s):
                self._finish(s, reason)
            else:
                kept_waiting.append(s)
        self._waiting = kept_waiting
        keep = []
        for i, s in enumerate(self._running):
            if pred(s):
                self._finish(s, reason)
            else:
                keep.append(i)
        self._retire(keep)

    def _drop_cancelled(self) -> None:
        # A caller that cancelled its future (e.g. a disconnected HTTP client) frees its row.
        if any(s.future.cancelled() for s in self._waiting):
            self._waiting = deque(s for s in self._waiting if not s.future.cancelled())
        self._retire([i for i, s in enumerate(self._running) if not s.future.cancelled()])

    def _queue(self, arrived: list[ActiveSequence]) -> None:
        """Queue newly arrived requests: after the waiting ones, except those of higher priority, which go before
        every waiting request of lower priority (retracted ones included), in arrival order."""
        for seq in arrived:
            at = len(self._waiting)
            if seq.request.priority > 0:
                at = next((i for i, w in enumerate(self._waiting) if w.request.priority < seq.request.priority), at)
            self._waiting.insert(at, seq)

    def _admit(self) -> None:
        """Prefill as many queued requests as fit (running rows, padded prefill tokens)."""
        batch: list[ActiveSequence] = []
        longest = 0
        while self._waiting and len(self._running) + len(batch) < self.max_running_requests:
            seq = self._waiting[0]
            if seq.request.sampling_params.max_new_tokens == 0:
                self._waiting.popleft()
                seq.weight_version = self._weight_version
                self._finish(seq, {"type": "length", "length": 0})
                continue
            n = len(seq.request.input_ids) + len(seq.output_ids)
            if batch and (len(batch) + 1) * max(longest, n) > self.max_prefill_tokens:
                break
            batch.append(self._waiting.popleft())
            longest = max(longest, n)
        if batch:
            self._step(lambda: self._prefill(batch), batch)

    def _step(self, fn: Callable[[], None], new: list[ActiveSequence] | None = None) -> None:
        """Run one forward; on an error fail the requests involved and keep serving."""
        try:
            with self._no_grad(), self._compute():
                fn()
        except Exception as e:  # noqa: BLE001  a model error must not kill the server
            logger.exception("generation step failed")
            # The cache may be half-written; every request in it starts over, so fail them all.
            error = RuntimeError(f"generation failed: {e}")
            for s in {id(s): s for s in self._running + (new or [])}.values():
                fail_future(s.future, error)
            self._running = []
            self.cache.abort_forward()
            self.cache.clear()

    def _prefill(self, batch: list[ActiveSequence]) -> None:
        start = self.cache.add_rows(len(batch))
        batch, logits = self._steps.prefill(batch, start)
        for s in batch:
            s.weight_version = self._weight_version
        self._running.extend(batch)
        self._sample_and_retire(logits, first_row=start)

    def _decode(self) -> None:
        self._sample_and_retire(self._steps.decode(self._running), first_row=0)

    def _sample_and_retire(self, logits: torch.Tensor, first_row: int) -> None:
        """Sample one token for running rows ``first_row..`` from ``logits [b, V]``; retire finished rows."""
        seqs = self._running[first_row:]
        logits = logits.float()
        params = [s.request.sampling_params for s in seqs]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
        sample_logits = logits
        suppress_rows = [
            i for i, (s, p) in enumerate(zip(seqs, params)) if len(s.output_ids) < p.min_new_tokens and s.stop_ids
        ]
        if suppress_rows:
            mask = torch.zeros_like(logits, dtype=torch.bool)
            for i in suppress_rows:
                ids = [t for t in seqs[i].stop_ids if 0 <= t < logits.shape[-1]]
                mask[i, ids] = True
            sample_logits = suppress_tokens(logits, mask)
        tokens = sample_tokens(
            sample_logits,
            temperature,
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=logits.device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=logits.device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=logits.device),
            uniforms=torch.cat([torch.rand(1, generator=s.rng) for s in seqs]).to(logits.device),
        )
        logprobs = None
        if any(s.request.return_logprob for s in seqs):
            logprobs = token_logprobs(logits, temperature, tokens).tolist()
        keep = list(range(first_row))
        for i, (s, p, tok) in enumerate(zip(seqs, params, tokens.tolist())):
            s.output_ids.append(tok)
            s.note_token_version(self._weight_version)
            if logprobs is not None and s.request.return_logprob:
                s.logprobs.append(logprobs[i])
            # Stop tokens are checked before length, as SGLang does: EOS as the last allowed token is 'stop'.
            if tok in s.stop_ids:
                self._finish(s, {"type": "stop", "matched": tok})
            elif len(s.output_ids) >= p.max_new_tokens:
                self._finish(s, {"type": "length", "length": p.max_new_tokens})
            else:
                keep.append(first_row + i)
        self._retire(keep)
