"""Fakes of the rollout side for strategy tests: a client whose 'server' answers with each request's sampling
seed, a weight sync that records the versions sent, and a supervisor that restarts every lost server."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from archon.launch.recovery import Recovery
from archon.rollout.client import RolloutError
from archon.rollout.server_api import GenerateResult


class SeedEchoClient:
    """A rollout client whose 'server' answers each request with its sampling seed as the only token,
    tagged with the weight version it holds; ``failures`` first calls raise ``RolloutError``."""

    def __init__(self, failures: int = 0) -> None:
        self.version = "default"
        self.failures = failures
        self.up_addrs = ["fake"]
        self.lost: list[str] = []
        """Servers a failed call lost (the supervisor's ``down`` list)."""
        self.seeds: list[int] = []
        """The sampling seed of every single request answered (``agenerate``)."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def result(self, future):
        """As ``RolloutClient.result`` without an in-process engine."""
        return future.result()

    async def agenerate_many(self, prompts, params, **_: Any) -> list[GenerateResult]:
        if self.failures:
            self.failures -= 1
            self.lost.append("fake")
            raise RolloutError("the only server went away")
        return [
            GenerateResult(
                [p["sampling_seed"]], [-1.0], "stop", len(ids), self.version, "fake", output_versions=[self.version]
            )
            for ids, p in zip(prompts, params)
        ]

    async def agenerate(self, input_ids, params, **kw: Any) -> GenerateResult:
        """One request (``seeds`` keeps its seed)."""
        result = (await self.agenerate_many([input_ids], [params], **kw))[0]
        self.seeds.append(params["sampling_seed"])
        return result

    async def apause_generation(self, mode=None) -> None:
        pass

    async def acontinue_generation(self) -> None:
        pass

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class RecordingWeightSync:
    """Every version sent (the fake server then holds it) and every re-formed group."""

    def __init__(self, client: SeedEchoClient) -> None:
        self.client = client
        self.synced: list[str] = []
        self.rebuilds = 0

    def sync(self, version: str, servers_quiet: bool = False) -> dict[str, float]:
        self.synced.append(version)
        self.client.version = version
        return {"weight_sync_time_s": 0.0}

    def rebuild(self) -> None:
        self.rebuilds += 1


class RestartingSupervisor:
    """Restarts every server the client failed on."""

    def __init__(self, client: SeedEchoClient) -> None:
        self.client = client
        self.down = client.lost

    def lost(self) -> list[str]:
        return list(self.down)

    def can_restart(self, lost: list[str]) -> bool:
        return True

    def recover(self) -> Recovery:
        restarted = list(self.down)
        self.down.clear()
        return Recovery(restarted=restarted)
