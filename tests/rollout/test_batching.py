"""Generate requests made together go to their server as one batch (``archon.rollout.batching``).

The batcher alone against a scripted ``send`` (what is sent, who gets which answer or error,
cancellation), then the client against the built-in server (answers equal to unbatched
requests, a bad request in a batch refused alone) and against a fake SGLang server (a failed
batch is retried and counted once against its server).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from fake_sglang import FakeSGLang, fake_completion
from hf_fixtures import save_tiny_hf

import models
from archon.rollout.batching import RequestBatcher
from archon.rollout.client import RolloutClient, RolloutRequestError, api_for_backend
from archon.rollout.server_api import BuiltinServerAPI, RolloutError, ServerAPI
from archon.server.app import serve_in_thread
from archon.server.generator import Generator

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _payload(i: int, **shared: Any) -> dict[str, Any]:
    return {"input_ids": [i, i + 1], "sampling_params": {"max_new_tokens": i}, "rid": f"r{i}", **shared}


class ScriptedServer:
    """``send`` for a batcher: records every body; answers each prompt with its own ids reversed."""

    def __init__(self, refuse: int | None = None, fail: BaseException | None = None):
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self.refuse = refuse
        self.fail = fail
        self.hold = asyncio.Event()
        self.hold.set()

    async def send(self, url: str, body: dict[str, Any]) -> Any:
        self.bodies.append((url, body))
        await self.hold.wait()
        if self.fail is not None:
            raise self.fail
        batched = isinstance(body["input_ids"][0], list)
        prompts = body["input_ids"] if batched else [body["input_ids"]]
        if self.refuse is not None and any(self.refuse in p for p in prompts):
            raise RolloutRequestError(url, 400, f"token {self.refuse} is out of range")
        answers = [{"echo": list(reversed(p)), "url": url} for p in prompts]
        return answers if batched else answers[0]


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_requests_of_one_turn_go_as_one_batch_per_server_and_shared_fields():
    server = ScriptedServer()

    async def main() -> list[Any]:
        batcher = RequestBatcher(server.send)
        calls = [batcher.post("a", _payload(i, return_logprob=True)) for i in range(5)]
        calls += [batcher.post("b", _payload(i, return_logprob=True)) for i in range(5, 7)]
        calls += [batcher.post("a", _payload(7, return_logprob=False))]
        return await asyncio.gather(*calls)

    answers = _run(main())
    assert [a["echo"] for a in answers] == [[i + 1, i] for i in range(8)]
    assert [a["url"] for a in answers] == ["a"] * 5 + ["b"] * 2 + ["a"]
    assert len(server.bodies) == 3
    url, body = server.bodies[0]
    assert url == "a" and body == {
        "return_logprob": True,
        "input_ids": [[i, i + 1] for i in range(5)],
        "sampling_params": [{"max_new_tokens": i} for i in range(5)],
        "rid": [f"r{i}" for i in range(5)],
    }
    assert server.bodies[1][0] == "b" and server.bodies[1][1]["rid"] == ["r5", "r6"]
    # A request alone (here: other shared fields) goes in SGLang's single form.
    assert server.bodies[2] == ("a", _payload(7, return_logprob=False))


def test_batches_are_capped_by_requests_and_tokens():
    server = ScriptedServer()

    async def main(**caps: int) -> list[int]:
        server.bodies.clear()
        batcher = RequestBatcher(server.send, **caps)
        await asyncio.gather(*(batcher.post("a", _payload(i)) for i in range(10)))
        return [len(b["rid"]) if isinstance(b["rid"], list) else 1 for _, b in server.bodies]

    assert _run(main(max_requests=4)) == [4, 4, 2]
    assert _run(main(max_tokens=6)) == [3, 3, 3, 1]  # 2 prompt tokens each


def test_a_refused_batch_is_sent_again_one_request_at_a_time():
    server = ScriptedServer(refuse=13)

    async def main() -> list[Any]:
        batcher = RequestBatcher(server.send)
        return await asyncio.gather(*(batcher.post("a", _payload(i)) for i in (3, 12, 5)), return_exceptions=True)

    ok3, bad, ok5 = _run(main())
    assert ok3["echo"] == [4, 3] and ok5["echo"] == [6, 5]
    assert isinstance(bad, RolloutRequestError) and "token 13 is out of range" in str(bad)
    assert [b["rid"] for _, b in server.bodies] == [["r3", "r12", "r5"], "r3", "r12", "r5"]


def test_a_failed_batch_fails_every_request_with_the_same_error():
    failure = ConnectionError("connection lost")
    server = ScriptedServer(fail=failure)

    async def main() -> list[Any]:
        batcher = RequestBatcher(server.send)
        return await asyncio.gather(*(batcher.post("a", _payload(i)) for i in range(3)), return_exceptions=True)

    assert _run(main()) == [failure] * 3
    assert len(server.bodies) == 1


def test_a_batch_answered_with_the_wrong_number_of_entries_is_an_error():
    async def short(url: str, body: dict[str, Any]) -> Any:
        return [{}]

    async def main() -> list[Any]:
        batcher = RequestBatcher(short)
        return await asyncio.gather(*(batcher.post("a", _payload(i)) for i in range(2)), return_exceptions=True)

    errors = _run(main())
    assert all(isinstance(e, RolloutError) and "batch of 2 generate requests with 1 list" in str(e) for e in errors)


def test_cancelling_every_caller_cancels_the_batch_and_one_caller_does_not():
    server = ScriptedServer()
    server.hold.clear()

    async def main() -> tuple[bool, Any]:
        batcher = RequestBatcher(server.send)
        calls = [asyncio.ensure_future(batcher.post("a", _payload(i))) for i in range(3)]
        await asyncio.sleep(0.01)
        (sending,) = batcher._tasks
        calls[0].cancel()
        await asyncio.sleep(0.01)
        still_sending = not sending.done()
        server.hold.set()
        answers = await asyncio.gather(*calls[1:])
        # Everyone gone: the batch's request is cancelled too.
        server.hold.clear()
        more = [asyncio.ensure_future(batcher.post("a", _payload(i))) for i in range(2)]
        await asyncio.sleep(0.01)
        (sending,) = batcher._tasks
        for c in more:
            c.cancel()
        await asyncio.gather(*more, return_exceptions=True)
        await asyncio.sleep(0)
        return still_sending and sending.cancelled(), answers

    cancelled_with_its_callers, answers = _run(main())
    assert cancelled_with_its_callers
    assert [a["echo"] for a in answers] == [[2, 1], [3, 2]]


def test_one_callers_group_goes_in_as_few_batches_as_the_caps_allow_and_fails_as_a_whole():
    async def main(server: ScriptedServer, **caps: int) -> list[Any]:
        return await RequestBatcher(server.send, **caps).post_many("a", [_payload(i) for i in range(10)])

    server = ScriptedServer()
    answers = _run(main(server, max_requests=4))
    assert [a["echo"] for a in answers] == [[i + 1, i] for i in range(10)]
    assert [b["rid"] for _, b in server.bodies] == [[f"r{i}" for i in c] for c in ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9))]
    server.bodies.clear()
    _run(main(server, max_tokens=6))  # 2 prompt tokens each
    assert [b["rid"] for _, b in server.bodies][-2:] == [["r6", "r7", "r8"], "r9"]
    assert [len(b["rid"]) for _, b in server.bodies[:-1]] == [3, 3, 3]
    server.bodies.clear()
    assert _run(main(server, max_requests=1))[3]["echo"] == [4, 3]
    assert all(isinstance(b["rid"], str) for _, b in server.bodies)  # alone: SGLang's single form
    # A 4xx is the group's: raised as it is, not sent again request by request.
    refusing = ScriptedServer(refuse=5)
    with pytest.raises(RolloutRequestError, match="token 5 is out of range"):
        _run(main(refusing))
    assert len(refusing.bodies) == 1
    failure = ConnectionError("connection lost")
    with pytest.raises(ConnectionError):
        _run(main(ScriptedServer(fail=failure), max_requests=4))


# ---- the client -----------------------------------------------------------------------------


def test_only_the_builtin_backend_batches():
    assert api_for_backend("local").batch_generate
    assert not api_for_backend("sglang").batch_generate
    assert not api_for_backend("vllm").batch_generate


def test_the_builtin_server_answers_a_batch_as_it_answers_each_request(tmp_path):
    save_tiny_hf(tmp_path, "qwen3", seed=5)
    server = serve_in_thread(Generator(models.load_hf_model(tmp_path), random_seed=0), model_path=str(tmp_path))
    prompts = [[(7 * i + j) % 100 + 2 for j in range(3 + i % 4)] for i in range(12)]
    greedy = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    try:
        with RolloutClient([server.url], api=ServerAPI()) as one_by_one:
            expected = one_by_one.generate_many(prompts, greedy)
        with RolloutClient([server.url], api=BuiltinServerAPI()) as batching:
            got = batching.generate_many(prompts, greedy)
            assert batching._batcher is not None and batching._batcher.batches_sent == 1

            async def with_a_bad_request() -> list[Any]:
                ids = [*prompts[:2], [10**6], prompts[3]]  # an id far beyond the vocabulary
                return await asyncio.gather(*(batching.agenerate(p, greedy) for p in ids), return_exceptions=True)

            mixed = batching.submit(with_a_bad_request()).result(timeout=120)
    finally:
        server.stop()
    assert [r.output_ids for r in got] == [r.output_ids for r in expected]
    for a, b in zip(got, expected):
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
        assert a.finish_reason == b.finish_reason == "length"
    assert isinstance(mixed[2], RolloutRequestError) and "vocab" in str(mixed[2]).lower()
    assert [r.output_ids for r in (mixed[0], mixed[1], mixed[3])] == [expected[i].output_ids for i in (0, 1, 3)]
    assert torch.get_num_threads() == 1


def test_a_failed_batch_is_retried_and_counted_once_against_its_server():
    fake = FakeSGLang().start()
    params = {"max_new_tokens": 4, "temperature": 0.0}
    prompts = [[i, i + 2, 5] for i in range(6)]
    try:
        fake.fail_next = 1  # one HTTP 500, for the first batch
        with RolloutClient([fake.addr], api=BuiltinServerAPI(), backoff_s=0.01, down_after=2) as client:
            results = client.generate_many(prompts, params)
            stats = client.stats()
            assert client._batcher is not None and client._batcher.batches_sent == 2
    finally:
        fake.stop()
    assert [r.output_ids for r in results] == [fake_completion(p, params)[0] for p in prompts]
    # Six requests failed together once: one failure of the server, which is not marked down.
    assert stats["rollout_servers_down"] == 0
    assert stats["rollout_retries"] == 6
    assert fake.generate_count == 2


def test_many_prompts_go_as_one_batch_per_server_in_shares_of_the_least_loaded():
    fakes = [FakeSGLang().start() for _ in range(3)]
    params = {"max_new_tokens": 3, "temperature": 0.0}
    prompts = [[i, i + 1, 7] for i in range(31)]
    try:
        with RolloutClient([f.addr for f in fakes], api=BuiltinServerAPI()) as client:
            results = client.generate_many(prompts, params)
            assert client._batcher is not None and client._batcher.batches_sent == 3
            # As request by request, where each goes to the server with the fewest in flight.
            results += client.generate_many(prompts[:2], params)
    finally:
        for f in fakes:
            f.stop()
    assert [r.output_ids for r in results] == [fake_completion(p, params)[0] for p in prompts + prompts[:2]]
    assert [f.generate_count for f in fakes] == [1, 2, 2]
    # Contiguous shares in order, the first server taking the one left over.
    owners = [next(i for i, f in enumerate(fakes) if r.server.endswith(f.addr)) for r in results[:31]]
    assert owners == [0] * 11 + [1] * 10 + [2] * 10
    assert [fakes.index(f) for f in fakes if results[31].server.endswith(f.addr)] == [1]


def test_a_failed_share_is_retried_request_by_request_on_the_other_servers():
    bad, good = FakeSGLang().start(), FakeSGLang().start()
    params = {"max_new_tokens": 3, "temperature": 0.0}
    prompts = [[i, 3, 9] for i in range(8)]
    try:
        bad.fail_next = 5
        with RolloutClient([bad.addr, good.addr], api=BuiltinServerAPI(), backoff_s=0.01) as client:
            results = client.generate_many(prompts, params)
            stats = client.stats()
    finally:
        bad.stop()
        good.stop()
    assert [r.output_ids for r in results] == [fake_completion(p, params)[0] for p in prompts]
    assert all(r.server.endswith(good.addr) for r in results)
    # The good server's share, then the bad server's four sent again together, to the good one.
    assert (bad.generate_count, good.generate_count) == (1, 2)
    assert stats["rollout_requests"] == 12 and stats["rollout_retries"] == 4
