"""The rollout client's control operations: pause, resume, flush, and weight updates on every server.

``RolloutClient`` (``archon.rollout.client``) inherits these from ``ServerControl``; each one is
an async method (``a...``, for the client's event loop) and a blocking twin.  They are spelled
for the servers' family by the client's ``ServerAPI`` and fanned out to every server that is up
(or to a weight-update group's members), failing fast on the first server that fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from archon.rollout.server_api import Call, RolloutError, ServerAPI

T = TypeVar("T")


@dataclass
class ServerState:
    """Load and health of one server, touched only on the client's event loop."""

    index: int
    """Position in the client's address list (tie-breaker)."""
    url: str
    """Base URL, e.g. http://127.0.0.1:30000."""
    in_flight: int = 0
    """Generate requests currently waiting on this server."""
    sent: int = 0
    """Generate requests sent so far."""
    consecutive_failures: int = 0
    """Failures since the last success."""
    down: bool = False
    """Marked down: receives no more requests."""
    last_error: str = ""
    """Most recent failure, for error messages."""
    weight_version: str = ""
    """Version of the last weight update this client made on the server ("" before any)."""


class ServerStateFailure(Exception):
    """A failure worth retrying elsewhere: connection error, timeout or 5xx."""

    def __init__(self, message: str, *, refused: bool = False, timed_out: bool = False):
        super().__init__(message)
        self.refused = refused
        self.timed_out = timed_out
        self.recorded = False
        """Counted against its server already (a batch's failure reaches each of its requests)."""


async def cancel_on_first_error(tasks: list[asyncio.Task]) -> list[BaseException]:
    """Wait for ``tasks``; at the first failure cancel the rest. Returns the failures (empty if none)."""
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    errors = [e for t in tasks if t.done() and not t.cancelled() and (e := t.exception()) is not None]
    if errors:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return errors


async def gather_or_cancel(aws: Iterable[Awaitable[T]]) -> list[T]:
    """The results of ``aws`` in order; at the first failure (or when the caller is cancelled) the
    others are cancelled and waited for, and the failure is raised."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class ServerControl:
    """Control operations of ``RolloutClient`` (a mixin: the client provides the fan-out and the servers)."""

    api: ServerAPI
    _servers: list[ServerState]
    _group_members: dict[str, list[ServerState]]

    if TYPE_CHECKING:

        async def _fan_out(
            self,
            calls: Sequence[Call] = (),
            *,
            retry: bool = False,
            servers: Sequence[ServerState] | None = None,
            per_server: Sequence[Sequence[Call]] | None = None,
            timeout: float | None = None,
        ) -> dict[str, Any]: ...

        def _wait(self, coro: Coroutine[Any, Any, T]) -> T: ...

    def _no_distributed_weights(self) -> RolloutError:
        return RolloutError(
            f"{self.api.name} rollout servers cannot join a weight-update group; set "
            "rollout.weight_sync = 'disk' so that new weights reach them through a folder"
        )

    async def apause_generation(self, mode: str | None = None) -> dict[str, Any]:
        """Pause every server; ``mode`` is SGLang's ('abort', 'retract', 'in_place'; None: the server's default,
        abort)."""
        return await self._fan_out(self.api.pause(mode), retry=True)

    async def acontinue_generation(self) -> dict[str, Any]:
        return await self._fan_out(self.api.resume(), retry=True)

    async def aflush_cache(self) -> dict[str, Any]:
        return await self._fan_out(self.api.flush_cache(), retry=True)

    async def aupdate_weights_from_disk(
        self, path: str, version: int | str, *, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        targets = [s for s in self._servers if not s.down]
        result = await self._fan_out(
            self.api.update_weights_from_disk(str(path), str(version), abort_all_requests), servers=targets
        )
        for s in targets:
            s.weight_version = str(version)
        return result

    def weight_group_layout(self, ranks_per_server: int) -> tuple[int, list[int]]:
        """(world size, rank offset of each up server) of a weight-update group; the trainer is rank 0."""
        if ranks_per_server < 1:
            raise ValueError(f"ranks_per_server = {ranks_per_server} must be at least 1 (a server's tp size)")
        n = sum(not s.down for s in self._servers)
        return 1 + n * ranks_per_server, [1 + i * ranks_per_server for i in range(n)]

    async def ainit_weights_update_group(
        self, master_address: str, master_port: int, group_name: str, backend: str, ranks_per_server: int = 1
    ) -> dict[str, Any]:
        """Ask every up server to join ``group_name``; server i's processes are ranks 1+i*t .. t+i*t."""
        if not self.api.distributed_weights:
            raise self._no_distributed_weights()
        members = [s for s in self._servers if not s.down]
        world_size, offsets = self.weight_group_layout(ranks_per_server)
        plans = [
            [
                Call(
                    "POST",
                    "/init_weights_update_group",
                    {
                        "master_address": master_address,
                        "master_port": int(master_port),
                        "rank_offset": off,
                        "world_size": world_size,
                        "group_name": group_name,
                        "backend": backend,
                    },
                )
            ]
            for off in offsets
        ]
        result = await self._fan_out(servers=members, per_server=plans)
        self._group_members[group_name] = members
        return result

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
        """Tell the group's servers to receive these tensors; the trainer broadcasts them meanwhile.

        SGLang sets its weight version after every call that carries one, so a sync in several
        buckets passes ``version`` with the last bucket only (None for the others): a sync that
        fails half-way never reports new weights on half-updated ones.  ``load_format =
        'flattened_bucket'``: the tensors come as one broadcast of their bytes, in order.
        """
        if not self.api.distributed_weights:
            raise self._no_distributed_weights()
        members = self._group_members.get(group_name)
        if members is None:
            raise RolloutError(
                f"weight-update group '{group_name}' was not initialised by this client; call "
                "init_weights_update_group first"
            )
        down = [s.url for s in members if s.down]
        if down:
            raise RolloutError(
                f"rollout server(s) {', '.join(down)} of weight-update group '{group_name}' are down, "
                "so the broadcast cannot complete; restart the servers and the run"
            )
        payload = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if version is not None:
            payload["weight_version"] = str(version)
        if load_format is not None:
            payload["load_format"] = load_format
        result = await self._fan_out([Call("POST", "/update_weights_from_distributed", payload)], servers=members)
        if version is not None:
            for s in members:
                s.weight_version = str(version)
        return result

    def pause_generation(self, mode: str | None = None) -> dict[str, Any]:
        return self._wait(self.apause_generation(mode))

    def continue_generation(self) -> dict[str, Any]:
        return self._wait(self.acontinue_generation())

    def flush_cache(self) -> dict[str, Any]:
        return self._wait(self.aflush_cache())

    def update_weights_from_disk(
        self, path: str, version: int | str, *, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        return self._wait(self.aupdate_weights_from_disk(path, version, abort_all_requests=abort_all_requests))

    def init_weights_update_group(
        self, master_address: str, master_port: int, group_name: str, backend: str, ranks_per_server: int = 1
    ) -> dict[str, Any]:
        return self._wait(
            self.ainit_weights_update_group(master_address, master_port, group_name, backend, ranks_per_server)
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
        return self._wait(
            self.aupdate_weights_from_distributed(
                names, dtypes, shapes, group_name, version, flush_cache=flush_cache, load_format=load_format
            )
        )
