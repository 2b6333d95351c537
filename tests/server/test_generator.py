"""The rollout generation engine (``archon.server.generator``) against independent references.

References never use the KV cache or the engine: greedy tokens come from re-running the whole
sequence through the model at every step, logprobs from one full forward over
``prompt + completion``.  Everything runs in float32 on tiny models.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from generation_refs import _Triggered, greedy_reference, logprob_reference
from hf_fixtures import random_tokens, save_tiny_hf

import models
from archon.server.app import use_one_thread_here
from archon.server.generator import GenerationRequest, Generator
from archon.server.kv_cache import BatchedKVCache
from archon.server.sampling import SamplingParams
from archon.server.weight_update import read_eos_token_ids

ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    out = {}
    for model_type in ("qwen3", "qwen3_moe"):
        save_tiny_hf(root / model_type, model_type, seed=21)
        out[model_type] = root / model_type
    return out


@pytest.fixture(scope="module")
def qwen3(folders):
    return models.load_hf_model(folders["qwen3"])


def _greedy(prompt: list[int], n: int, **kw) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(max_new_tokens=n, temperature=0.0, **kw), return_logprob=True)


# ---- KV cache ---------------------------------------------------------------------------------


@torch.no_grad()
def test_kv_cache_padding_growth_and_compaction_match_full_forward(qwen3):
    args = qwen3.args
    cache = BatchedKVCache(args.n_layers, args.n_kv_heads, args.head_dim, initial_rows=1, initial_length=2)
    seqs = [random_tokens(3, 1), random_tokens(6, 2)]

    def prefill(new: list[list[int]]) -> None:
        start = cache.add_rows(len(new))
        longest = max(map(len, new))
        tokens = torch.zeros(len(new), longest, dtype=torch.long)
        for i, s in enumerate(new):
            tokens[i, : len(s)] = torch.tensor(s)
        cache.begin_forward(start, start + len(new), longest, valid=[len(s) for s in new])
        logits = qwen3(tokens, positions=cache.positions(), cache=cache)
        cache.end_forward()
        for i, s in enumerate(new):
            full = qwen3(torch.tensor([s]))[0, -1]
            assert (logits[i, len(s) - 1] - full).abs().max() < ATOL

    def decode(step: int) -> None:
        tokens = torch.tensor([[(7 * step + 3 * i) % 128] for i in range(len(seqs))])
        cache.begin_forward(0, len(seqs), 1)
        logits = qwen3(tokens, positions=cache.positions(), cache=cache)
        cache.end_forward()
        for i, s in enumerate(seqs):
            s.append(int(tokens[i, 0]))
            assert (logits[i, 0] - qwen3(torch.tensor([s]))[0, -1]).abs().max() < ATOL

    prefill(seqs)
    for step in range(3):
        decode(step)
    assert cache.lengths == [len(s) for s in seqs] and cache.capacity >= 9 and cache.row_capacity >= 2
    cache.keep_rows([1])  # the first sequence finished: the second moves to row 0
    seqs = seqs[1:]
    new = [random_tokens(4, 3), random_tokens(9, 4)]
    prefill(new)
    seqs += new
    for step in range(3, 6):
        decode(step)
    cache.keep_rows([0, 2])
    seqs = [seqs[0], seqs[2]]
    decode(6)


# ---- greedy decoding and logprobs ---------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_greedy_equals_full_recomputation(folders, model_type):
    model = models.load_hf_model(folders[model_type])
    prompts = [random_tokens(5, 10), random_tokens(11, 11), random_tokens(2, 12)]
    with Generator(model) as gen:
        results = gen.generate([_greedy(p, 12) for p in prompts])
    for p, r in zip(prompts, results):
        assert r.output_ids == greedy_reference(model, p, 12)
        assert r.finish_reason == {"type": "length", "length": 12}
        assert r.prompt_tokens == len(p) and r.completion_tokens == 12
        ref = logprob_reference(model, p, r.output_ids, 1.0)  # greedy reports T = 1
        assert (torch.tensor(r.output_logprobs) - ref).abs().max() < ATOL


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 5, 0.9), (0.7, 3, 0.8)])
def test_logprobs_equal_recomputation_before_filtering(qwen3, temperature, top_k, top_p):
    prompts = [random_tokens(6, 20), random_tokens(3, 21)]
    params: dict[str, Any] = dict(max_new_tokens=16, temperature=temperature, top_k=top_k, top_p=top_p)
    with Generator(qwen3) as gen:
        results = gen.generate(
            [
                GenerationRequest(p, SamplingParams(**params, sampling_seed=i), return_logprob=True)
                for i, p in enumerate(prompts)
            ]
        )
    filtered_mass = []
    for p, r in zip(prompts, results):
        ref = logprob_reference(qwen3, p, r.output_ids, temperature)
        assert (torch.tensor(r.output_logprobs) - ref).abs().max() < ATOL
        with torch.no_grad():
            logits = qwen3(torch.tensor([p + r.output_ids]))[0, len(p) - 1 : -1]
        # Sampling did filter: every token is in the top_k of its step ...
        ranks = (logits > logits.gather(1, torch.tensor(r.output_ids)[:, None])).sum(-1)
        assert (ranks < top_k).all()
        filtered_mass.append(ref.exp())
    # ... yet the reported probabilities are not renormalised over the kept tokens.
    assert torch.cat(filtered_mass).max() < 0.999


# ---- continuous batching ------------------------------------------------------------------------


def test_continuous_batching_equals_one_at_a_time(qwen3):
    specs = [(3, 10), (7, 4), (12, 15), (5, 6), (9, 8), (4, 12)]  # (prompt length, max_new_tokens)
    requests = [_greedy(random_tokens(n, 30 + i), m, ignore_eos=True) for i, (n, m) in enumerate(specs)]
    model = _Triggered(qwen3)
    with Generator(model, max_running_requests=3) as gen:
        futures = [gen.submit(r) for r in requests[:2]]
        # Later arrivals join while earlier requests are decoding.
        model.triggers[3] = lambda: futures.extend(gen.submit(r) for r in requests[2:4])
        model.triggers[7] = lambda: futures.extend(gen.submit(r) for r in requests[4:])
        batched = [f.result(timeout=300) for f in futures]
        calls = list(model.calls)
        alone = [gen.generate([r])[0] for r in requests]
    decode_batches = [b for b, s in calls if s == 1]
    prefills = [b for b, s in calls if s > 1]
    assert max(decode_batches) == 3 and len(prefills) >= 3  # rows were shared and arrivals staggered
    for b, a, (_, m) in zip(batched, alone, specs):
        assert b.output_ids == a.output_ids and len(b.output_ids) == m
        assert b.output_logprobs is not None and a.output_logprobs is not None
        assert max(abs(x - y) for x, y in zip(b.output_logprobs, a.output_logprobs)) < ATOL
    assert [b.output_ids for b in batched[:2]] == [
        greedy_reference(qwen3, r.input_ids, m) for r, (_, m) in zip(requests[:2], specs[:2])
    ]


def test_batch_invariant_results_do_not_depend_on_the_requests_beside_them(qwen3):
    # Batched forwards move logprobs in the last bits with the rows beside them; batch-invariant ones must not.
    p = random_tokens(9, 70)
    prompts = [p, random_tokens(4, 71), p, random_tokens(13, 72), random_tokens(6, 73), p]
    requests = [
        GenerationRequest(
            prompt,
            SamplingParams(max_new_tokens=4 + i, temperature=1.0, sampling_seed=i, ignore_eos=True),
            return_logprob=True,
        )
        for i, prompt in enumerate(prompts)
    ]
    model = _Triggered(qwen3)
    with Generator(model, max_running_requests=4, batch_invariant=True) as gen:
        gen.pause().result(timeout=60)  # queue the first three, then admit them in one prefill
        futures = [gen.submit(r) for r in requests[:3]]
        model.triggers[2] = lambda: futures.extend(gen.submit(r) for r in requests[3:])
        gen.resume()
        together = [f.result(timeout=300) for f in futures]
        calls = list(model.calls)
        alone = [gen.generate([r])[0] for r in requests]
    assert {b for b, _ in calls} == {1}  # one row per forward
    assert calls[:3] == [(1, 9), (1, 4), (1, 1)]  # the first prefill computed p once (its copy shares the row)
    for t, a in zip(together, alone):
        assert t.output_ids == a.output_ids and t.output_logprobs == a.output_logprobs  # bit for bit


def test_identical_prompts_prefilled_once_give_per_request_results(qwen3):
    # A GRPO group: one prompt sampled several times, next to another prompt.
    p, q = random_tokens(9, 60), random_tokens(5, 61)
    requests = [
        GenerationRequest(
            prompt, SamplingParams(max_new_tokens=8, temperature=1.0, sampling_seed=seed), return_logprob=True
        )
        for prompt, seed in [(p, 1), (q, 2), (p, 3), (p, 4), (q, 5)]
    ]
    model = _Triggered(qwen3)
    with Generator(model) as gen:
        gen.pause().result(timeout=60)  # queue all five, then admit them in one prefill
        futures = [gen.submit(r) for r in requests]
        gen.resume()
        together = [f.result(timeout=60) for f in futures]
        prefills = [b for b, s in model.calls if s > 1]
        alone = [gen.generate([r])[0] for r in requests]
    assert prefills[0] == 2  # one row per distinct prompt
    for t, a in zip(together, alone):
        assert t.output_ids == a.output_ids
        assert t.output_logprobs is not None and a.output_logprobs is not None
        assert max(abs(x - y) for x, y in zip(t.output_logprobs, a.output_logprobs)) < ATOL
    assert len({tuple(r.output_ids) for r in together}) == 5  # the copies sampled independently


# ---- seeds ---------------------------------------------------------------------------------------


def _sampled(prompt: list[int], seed: int | None, n: int = 16, **kw) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(max_new_tokens=n, temperature=1.0, sampling_seed=seed, **kw))


def test_seeded_sampling_is_reproducible(qwen3):
    p, q = random_tokens(5, 40), random_tokens(8, 41)
    with Generator(qwen3, random_seed=3) as gen:
        first = gen.generate([_sampled(p, 7)])[0].output_ids
        # Same seed in a different batch composition: same tokens.
        again = gen.generate([_sampled(q, 1), _sampled(p, 7), _sampled(q, 2, top_k=4)])[1].output_ids
        other = gen.generate([_sampled(p, 8)])[0].output_ids
        unseeded = [r.output_ids for r in gen.generate([_sampled(p, None), _sampled(p, None)])]
        top1 = gen.generate([_sampled(q, 9, top_k=1, top_p=0.5)])[0].output_ids
        greedy = gen.generate([_greedy(q, 16)])[0].output_ids
    assert first == again
    assert first != other
    assert unseeded[0] != unseeded[1]  # null seeds come from a request counter
    assert top1 == greedy == greedy_reference(qwen3, q, 16)
    with Generator(qwen3, random_seed=3) as gen:  # the same server seed replays null-seed requests
        gen.generate([_sampled(p, 7)])
        gen.generate([_sampled(q, 1), _sampled(p, 7), _sampled(q, 2, top_k=4)])
        gen.generate([_sampled(p, 8)])
        assert [r.output_ids for r in gen.generate([_sampled(p, None), _sampled(p, None)])] == unseeded


def test_top_k_restricts_the_support(qwen3):
    p = random_tokens(4, 50)
    with Generator(qwen3) as gen:
        results = gen.generate([_sampled(p, s, n=6, top_k=2) for s in range(12)])
    seen = set()
    for r in results:
        with torch.no_grad():
            logits = qwen3(torch.tensor([p + r.output_ids]))[0, len(p) - 1 : -1]
        top2 = logits.topk(2, dim=-1).indices
        assert (top2 == torch.tensor(r.output_ids)[:, None]).any(-1).all()
        seen.add(r.output_ids[0])
    assert len(seen) == 2  # both allowed first tokens do occur: it samples, it is not greedy


# ---- stop conditions -------------------------------------------------------------------------------


def _first_new_token(tokens: list[int], at_least: int) -> tuple[int, int]:
    """A token whose first occurrence is at index >= ``at_least``: ``(token, index)``."""
    for i, t in enumerate(tokens):
        if i >= at_least and t not in tokens[:i]:
            return t, i
    raise AssertionError(f"no fresh token after index {at_least} in {tokens}")


def test_stop_tokens_eos_min_new_tokens_and_length(qwen3):
    p = random_tokens(6, 60)
    full = greedy_reference(qwen3, p, 24)
    stop, at = _first_new_token(full, 3)
    eos, eos_at = _first_new_token(full, at + 1)
    with Generator(qwen3, eos_token_ids=[eos]) as gen:
        by_stop, by_eos, ignored, held, length, zero = gen.generate(
            [
                _greedy(p, 24, stop_token_ids=[stop]),
                _greedy(p, 24),
                _greedy(p, 24, ignore_eos=True, stop_token_ids=[stop]),  # SGLang: ignore_eos ignores both
                _greedy(p, 24, stop_token_ids=[stop], min_new_tokens=eos_at + 2),
                _greedy(p, 2),
                _greedy(p, 0),
            ]
        )
    assert by_stop.output_ids == full[: at + 1] and by_stop.finish_reason == {"type": "stop", "matched": stop}
    assert by_eos.output_ids == full[: eos_at + 1] and by_eos.finish_reason == {"type": "stop", "matched": eos}
    assert ignored.output_ids == full and ignored.finish_reason == {"type": "length", "length": 24}
    # min_new_tokens: neither stop nor EOS can be chosen before eos_at + 2 tokens exist.
    expected = greedy_reference(qwen3, p, 24, banned=({stop, eos}, eos_at + 2), stop={stop, eos})
    assert held.output_ids == expected and not {stop, eos} & set(held.output_ids[: eos_at + 2])
    matched = expected[-1] in (stop, eos)  # even as the 24th token: stop is checked before length
    assert held.finish_reason == (
        {"type": "stop", "matched": expected[-1]} if matched else {"type": "length", "length": 24}
    )
    assert length.output_ids == full[:2] and length.finish_reason == {"type": "length", "length": 2}
    assert zero.output_ids == [] and zero.finish_reason == {"type": "length", "length": 0}


def test_eos_as_the_last_allowed_token_is_stop_as_in_sglang(qwen3):
    p = random_tokens(6, 61)
    full = greedy_reference(qwen3, p, 24)
    eos, at = _first_new_token(full, 3)
    with Generator(qwen3, eos_token_ids=[eos]) as gen:
        last, before = gen.generate([_greedy(p, at + 1), _greedy(p, at)])
    # SGLang checks stop tokens before the length budget (Req.update_finish_state).
    assert last.output_ids == full[: at + 1] and last.finish_reason == {"type": "stop", "matched": eos}
    assert before.output_ids == full[:at] and before.finish_reason == {"type": "length", "length": at}


def test_top_k_one_is_greedy_with_unscaled_logprobs_as_in_sglang(qwen3):
    p = random_tokens(7, 62)
    with Generator(qwen3) as gen:
        top1, greedy = gen.generate(
            [
                GenerationRequest(
                    p, SamplingParams(max_new_tokens=10, temperature=0.6, top_k=1, sampling_seed=4), return_logprob=True
                ),
                _greedy(p, 10),
            ]
        )
    assert top1.output_ids == greedy.output_ids == greedy_reference(qwen3, p, 10)
    # SGLang's all-greedy path (every top_k <= 1) reports log_softmax(logits), not of logits / T.
    ref = logprob_reference(qwen3, p, top1.output_ids, 1.0)
    assert (torch.tensor(top1.output_logprobs) - ref).abs().max() < ATOL
    assert (torch.tensor(top1.output_logprobs) - logprob_reference(qwen3, p, top1.output_ids, 0.6)).abs().max() > 1e-2


def test_eos_ids_come_from_config_and_generation_config(tmp_path):
    save_tiny_hf(tmp_path, "qwen3", seed=1, eos_token_id=5)
    assert read_eos_token_ids(tmp_path) == [5]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5]}))
    assert read_eos_token_ids(tmp_path) == [5, 7]


def test_invalid_requests_are_refused(qwen3):
    with Generator(qwen3, context_length=32) as gen:
        for ids, params, match in [
            ([], SamplingParams(), "non-empty"),
            ([1, 128], SamplingParams(), "outside the vocabulary"),
            ([1, 2.0], SamplingParams(), "integers"),
            ([1] * 20, SamplingParams(max_new_tokens=13), "context length 32"),
            ([1], SamplingParams(top_p=0.0), "top_p"),
        ]:
            with pytest.raises(ValueError, match=match):
                gen.submit(GenerationRequest(ids, params))
        assert gen.generate([_greedy([1] * 20, 12)])[0].completion_tokens == 12


def test_a_request_of_higher_priority_is_admitted_before_the_queued_ones(qwen3):
    # SGLang's priority field (larger first): the trainer's weight probe goes ahead of a queued rollout round.
    low = [_greedy(random_tokens(4, 60 + i), 3, ignore_eos=True) for i in range(3)]
    high = _greedy(random_tokens(4, 70), 3, ignore_eos=True)
    high.priority = 1
    finished: list[str] = []
    with Generator(qwen3, max_running_requests=1) as gen:
        gen.pause().result(timeout=60)  # queue everything first, then admit one request at a time
        futures = [gen.submit(r) for r in [*low, high]]
        for name, future in zip(["low0", "low1", "low2", "high"], futures):
            future.add_done_callback(lambda _, name=name: finished.append(name))
        gen.resume()
        results = [f.result(timeout=300) for f in futures]
    assert finished == ["high", "low0", "low1", "low2"]
    assert results[-1].output_ids == greedy_reference(qwen3, high.input_ids, 3)  # priority changes order only


def test_compute_threads_is_the_generation_threads_count_and_leaves_the_other_threads_theirs(qwen3):
    """One OpenMP team per process: the engine thread computes with ``compute_threads``, while the constructing
    thread and threads started later keep the counts they had (torch.set_num_threads also sets the latter)."""

    def count_in_new_thread() -> int:
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        return seen[0]

    torch.set_num_threads(2)  # the module runs at one thread (one_torch_thread); back to it below
    try:
        with Generator(qwen3, compute_threads=1) as gen:
            engine = gen.run_exclusive(lambda m: torch.get_num_threads()).result()
            assert (engine, torch.get_num_threads(), count_in_new_thread()) == (1, 2, 2)
        with Generator(qwen3) as gen:
            assert gen.run_exclusive(lambda m: torch.get_num_threads()).result() == 2
    finally:
        torch.set_num_threads(1)
    with pytest.raises(ValueError, match="compute_threads must be >= 1"):
        Generator(qwen3, compute_threads=0)


def test_a_cpu_server_leaves_its_http_thread_one_thread_and_hands_the_rest_to_generation():
    seen: dict[str, Any] = {}

    def http_thread() -> None:
        torch.set_num_threads(2)
        seen["cuda"] = use_one_thread_here("cuda")  # a GPU server changes nothing
        seen["cuda_left"] = torch.get_num_threads()
        seen["cpu"] = use_one_thread_here("cpu")
        seen["cpu_left"] = torch.get_num_threads()

    thread = threading.Thread(target=http_thread)
    thread.start()
    thread.join()
    torch.set_num_threads(1)  # the count later threads start with, as the module had it
    assert seen == {"cuda": None, "cuda_left": 2, "cpu": 2, "cpu_left": 1}


def _all_done(futures: list[Future]) -> Future:
    """A future done once every one of ``futures`` is."""
    done: Future = Future()
    left, lock = [len(futures)], threading.Lock()

    def count(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                done.set_result(None)

    for f in futures:
        f.add_done_callback(count)
    return done


def test_serve_until_runs_the_engine_on_the_waiting_thread_with_the_generation_threads_results(qwen3):
    """The in-process engine's trainer waits in ``serve_until`` and computes the rollout itself: the same tokens
    and logprobs as the generation thread gives, the engine's work done on the waiting thread, and the generation
    thread serving again afterwards."""

    def requests() -> list[GenerationRequest]:
        prompts = [random_tokens(5 + i, seed=i) for i in range(12)]  # more rows than the cache starts with
        return [
            GenerationRequest(
                p, SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=i), return_logprob=True
            )
            for i, p in enumerate(prompts)
        ]

    # Batch-invariant: a request's logprobs do not depend on which thread admitted which requests together.
    with Generator(qwen3, batch_invariant=True) as gen:
        idle_cache_bytes = gen.cache.nbytes
        expected = gen.generate(requests())
        futures = [gen.submit(r) for r in requests()]
        gen.serve_until(_all_done(futures))
        served = [f.result() for f in futures]
        assert gen.cache.nbytes == idle_cache_bytes  # released once the served work ran out, as when idle
        assert [(r.output_ids, r.output_logprobs) for r in served] == [
            (r.output_ids, r.output_logprobs) for r in expected
        ]
        # Work arriving while a thread serves is that thread's: here a thread serving until the test says stop.
        stop: Future = Future()
        server = threading.Thread(target=gen.serve_until, args=(stop,))
        server.start()
        deadline = time.monotonic() + 30
        while gen._callers_serving == 0 and time.monotonic() < deadline:  # the state the assertion needs
            time.sleep(0.001)
        where = gen.run_exclusive(lambda m: threading.current_thread()).result(timeout=30)
        stop.set_result(None)
        server.join(timeout=30)
        assert where is server
        assert gen.run_exclusive(lambda m: threading.current_thread()).result() is gen._thread
        assert [r.output_ids for r in gen.generate(requests())] == [r.output_ids for r in expected]
        with pytest.raises(RuntimeError, match="own thread"):
            gen.run_exclusive(lambda m: gen.serve_until(Future())).result()
