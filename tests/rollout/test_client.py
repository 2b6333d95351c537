"""RolloutClient against in-process fake SGLang servers: spreading, order, retries, failover, control calls."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from dist_utils import find_free_port, wait_until
from fake_sglang import FakeSGLang, fake_completion
from safetensors.torch import save_file

from archon.config import GenerationConfig
from archon.rollout.client import RolloutClient, RolloutError, RolloutRequestError
from archon.rollout.server_api import sampling_params

PARAMS = {"max_new_tokens": 6, "temperature": 0.0}  # greedy: predictable on any fake server


@pytest.fixture
def make_servers() -> Iterator[Callable[..., list[FakeSGLang]]]:
    started: list[FakeSGLang] = []

    def make(n: int, **kwargs) -> list[FakeSGLang]:
        servers = [FakeSGLang(**kwargs).start() for _ in range(n)]
        started.extend(servers)
        return servers

    yield make
    for s in started:
        s.stop()


def _client(servers: list[FakeSGLang], **kwargs) -> RolloutClient:
    kwargs.setdefault("backoff_s", 0.01)
    kwargs.setdefault("setup_timeout", 120.0)
    return RolloutClient([s.addr for s in servers], **kwargs)


def _prompts(n: int) -> list[list[int]]:
    return [[i, i + 1, 2 * i + 3] for i in range(n)]


def _in_flight(servers: list[FakeSGLang], n: int) -> Callable[[], bool]:
    return lambda: sum(s.in_flight for s in servers) == n


def test_many_requests_spread_least_loaded_and_in_order(make_servers):
    servers = make_servers(3)
    prompts = _prompts(30)
    with _client(servers) as client:
        for s in servers:
            s.hold()
        pending = client.submit(client.agenerate_many(prompts, PARAMS))
        wait_until(_in_flight(servers, 30), "all 30 requests to reach the servers")
        for s in servers:
            s.release()
        results = pending.result(timeout=120)
    assert len(results) == 30
    for prompt, res in zip(prompts, results):
        ids, lps, finish = fake_completion(prompt, PARAMS)
        assert res.output_ids == ids
        assert res.output_logprobs == pytest.approx(lps)
        assert res.finish_reason == finish["type"] == "length"
        assert res.prompt_tokens == len(prompt)
        assert res.weight_version == "0"
    # Sent all at once, fewest-in-flight balancing gives every server a third, all concurrently.
    assert [s.served for s in servers] == [10, 10, 10]
    assert [s.max_in_flight for s in servers] == [10, 10, 10]
    counts = {s.addr: sum(r.server.endswith(s.addr) for r in results) for s in servers}
    assert sorted(counts.values()) == [10, 10, 10]


def test_least_loaded_sends_more_to_the_faster_server(make_servers):
    slow, fast = make_servers(2)
    slow.hold()  # slow answers nothing until the fast one has served everything else
    with _client([slow, fast]) as client:
        pending = client.submit(client.agenerate_many(_prompts(24), PARAMS, max_concurrency=2))
        wait_until(lambda: fast.served == 23, "the fast server to serve 23 requests")
        assert slow.in_flight == 1
        slow.release()
        results = pending.result(timeout=120)
    assert len(results) == 24
    assert slow.max_in_flight == 1 and fast.max_in_flight == 1
    assert (slow.served, fast.served) == (1, 23)


def test_per_prompt_sampling_params_and_stop_tokens(make_servers):
    servers = make_servers(2)
    prompts = _prompts(4)
    first = fake_completion(prompts[1], {**PARAMS, "max_new_tokens": 8})[0]
    per = [
        dict(PARAMS),
        {**PARAMS, "max_new_tokens": 8, "stop_token_ids": [first[2]]},
        dict(PARAMS),
        {**PARAMS, "max_new_tokens": 2},
    ]
    with _client(servers) as client:
        results = client.generate_many(prompts, per)
        with pytest.raises(ValueError, match="4 prompts but 3 sampling_params"):
            client.generate_many(prompts, per[:3])
    assert results[1].finish_reason == "stop" and results[1].matched_stop == first[2]
    assert results[1].output_ids == first[:3]
    assert len(results[3].output_ids) == 2 and results[3].finish_reason == "length"


def test_5xx_is_retried_then_succeeds(make_servers):
    (server,) = make_servers(1)
    server.fail_next = 2
    with _client([server], retries=3) as client:
        res = client.generate([5, 6, 7], PARAMS)
        stats = client.stats()
    assert res.output_ids == fake_completion([5, 6, 7], PARAMS)[0]
    assert server.generate_count == 3
    assert stats["rollout_retries"] == 2 and stats["rollout_servers_down"] == 0


def test_5xx_beyond_retries_is_an_error_naming_the_server(make_servers):
    (server,) = make_servers(1)
    server.fail_next = 10
    with _client([server], retries=1) as client:
        with pytest.raises(RolloutError, match=r"failed after 2 attempt\(s\).*HTTP 500.*fake internal error") as exc:
            client.generate([1, 2], PARAMS)
    assert server.addr in str(exc.value)
    assert server.generate_count == 2


def test_killed_server_requests_are_retried_on_the_others(make_servers):
    servers = make_servers(3)
    servers[1].die_after = 3  # the 4th request it receives kills it, with the 3 in flight
    prompts = _prompts(60)
    with _client(servers, retries=3) as client:
        for s in servers:
            s.hold()  # nothing finishes before server 1 died and its requests moved on
        pending = client.submit(client.agenerate_many(prompts, PARAMS))
        wait_until(_in_flight([servers[0], servers[2]], 60), "all 60 requests to reach the surviving servers")
        for s in servers:
            s.release()
        results = pending.result(timeout=120)
        stats = client.stats()
        assert client.up_addrs == [f"http://{servers[0].addr}", f"http://{servers[2].addr}"]
    assert [r.output_ids for r in results] == [fake_completion(p, PARAMS)[0] for p in prompts]
    # All 20 requests it was given were in flight when it died; each was retried on another server.
    assert servers[1].dead and servers[1].served == 0
    assert not any(r.server.endswith(servers[1].addr) for r in results)
    assert servers[0].served + servers[2].served == 60
    assert stats["rollout_servers_down"] == 1 and stats["rollout_retries"] >= 20


def test_all_servers_down_error_names_them(make_servers):
    servers = make_servers(2)
    with _client(servers, retries=5) as client:
        client.wait_healthy()
        for s in servers:
            s.kill()
        with pytest.raises(RolloutError, match="all rollout servers are down") as exc:
            client.generate([1, 2, 3], PARAMS)
    for s in servers:
        assert s.addr in str(exc.value)


def test_4xx_is_not_retried_and_its_message_surfaces(make_servers):
    (server,) = make_servers(1, context_length=64)
    with _client([server], retries=3) as client:
        with pytest.raises(RolloutRequestError, match="HTTP 400.*maximum context length of 64 tokens") as exc:
            client.generate(list(range(100)), PARAMS)
    assert exc.value.status == 400 and server.addr in exc.value.server
    assert server.generate_count == 1


def test_health_wait_times_out_with_a_clear_error():
    port = find_free_port()
    with RolloutClient([f"127.0.0.1:{port}"], setup_timeout=0.5) as client:
        t0 = time.monotonic()
        with pytest.raises(RolloutError, match=rf"not healthy after 0.5 s: http://127.0.0.1:{port} \(.*connect"):
            client.generate([1], PARAMS)  # the first request checks health first
        assert time.monotonic() - t0 < 60  # setup_timeout was honoured, not the default 300 s
        with pytest.raises(RolloutError, match="raise rollout.setup_timeout"):
            client.wait_healthy(timeout=0.2)


def test_hanging_server_times_out_and_is_retried_elsewhere(make_servers):
    hung, ok = make_servers(2)
    hung.hang = True
    prompts = _prompts(4)
    # The timeout must still leave the healthy server ample time to answer on a loaded machine.
    with _client([hung, ok], request_timeout=3.0, retries=2) as client:
        results = client.generate_many(prompts, PARAMS)
    assert all(r.server.endswith(ok.addr) for r in results)
    assert [r.output_ids for r in results] == [fake_completion(p, PARAMS)[0] for p in prompts]
    # The timed-out requests were aborted on the hung server (best effort, after the results).
    wait_until(lambda: len(hung.aborts) == 2, "two aborts on the hung server")


def test_update_weights_from_disk_fans_out_and_success_false_names_the_server(make_servers, tmp_path: Path):
    servers = make_servers(2)
    weights = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    with _client(servers) as client:
        answers = client.update_weights_from_disk(str(tmp_path), 7)
        assert set(answers) == {f"http://{s.addr}" for s in servers}
        res = client.generate([4, 5], PARAMS)
        assert res.weight_version == "7"
        assert res.output_ids == fake_completion([4, 5], PARAMS, n_updates=1)[0]
        for s in servers:
            assert torch.equal(s.weights["w"], weights["w"]) and s.version == "7"
        servers[1].fail_weight_update = "disk full"
        with pytest.raises(RolloutError, match="disk full") as exc:
            client.update_weights_from_disk(str(tmp_path), 8)
    assert servers[1].addr in str(exc.value) and servers[0].addr not in str(exc.value)


def test_init_weights_update_group_rank_offsets(make_servers):
    servers = make_servers(3)
    for s in servers:
        s.join_group = False
    with _client(servers) as client:
        assert client.weight_group_layout(2) == (7, [1, 3, 5])
        client.init_weights_update_group("10.0.0.1", 29555, "g", "nccl", ranks_per_server=2)
        with pytest.raises(RolloutError, match="group 'other' was not initialised"):
            client.update_weights_from_distributed(["w"], ["float32"], [[2]], "other", 1)
    reqs = [s.group_requests[0] for s in servers]
    assert [r["rank_offset"] for r in reqs] == [1, 3, 5]
    assert all(
        r["world_size"] == 7
        and r["master_address"] == "10.0.0.1"
        and r["master_port"] == 29555
        and r["group_name"] == "g"
        and r["backend"] == "nccl"
        for r in reqs
    )


def test_pause_continue_and_flush_fan_out(make_servers):
    servers = make_servers(2)
    with _client(servers) as client:
        client.wait_healthy()
        client.pause_generation()
        pending = client.submit(client.agenerate_many(_prompts(4), PARAMS))
        wait_until(_in_flight(servers, 4), "the servers to receive the 4 requests")
        assert not pending.done()  # paused servers hold the requests
        client.continue_generation()
        assert len(pending.result(timeout=10)) == 4
        client.flush_cache()
    assert [s.flushes for s in servers] == [1, 1]


def test_sampling_params_from_generation_config():
    g = GenerationConfig(max_new_tokens=32, temperature=0.0, top_k=5, stop_token_ids=[2])
    params = sampling_params(g, sampling_seed=3)
    assert params == {
        "max_new_tokens": 32,
        "min_new_tokens": 0,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 5,
        "min_p": 0.0,
        "stop_token_ids": [2],
        "ignore_eos": False,
        "sampling_seed": 3,
    }


def test_bad_addresses_are_rejected():
    with pytest.raises(ValueError, match="at least one server"):
        RolloutClient([])
    with pytest.raises(ValueError, match="listed more than once"):
        RolloutClient(["127.0.0.1:1", "http://127.0.0.1:1"])
