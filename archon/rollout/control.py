"""The rollout client's control operations: pause, resume, flush, and weight updates on every server.

``ServerControl`` holds a reference to the client's ``Transport`` and the weight-update groups
it set up.  Each operation is spelled for the servers' family by the transport's ``ServerAPI``
and fanned out to every server that is up (or to a weight-update group's members), failing
fast on the first server that fails.  ``RolloutClient`` offers each one as an async method
(``a...``, for the client's event loop) and a blocking twin.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from archon.rollout.server_api import Call, RolloutError
from archon.rollout.transport import ServerState, Transport
from archon.wire.tensor_share import SHARE_TENSORS


class ServerControl:
    """Control operations on the servers of a ``Transport``; runs on its event loop."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self.group_members: dict[str, list[ServerState]] = {}
        """The servers that joined each weight-update group, by group name."""

    def _no_distributed_weights(self) -> RolloutError:
        return RolloutError(
            f"{self.transport.api.name} rollout servers cannot join a weight-update group; set "
            "rollout.weight_sync = 'disk' so that new weights reach them through a folder"
        )

    async def apause_generation(self, mode: str | None = None) -> dict[str, Any]:
        """Pause every server; ``mode`` is SGLang's ('abort', 'retract', 'in_place'; None: the server's default,
        abort)."""
        return await self.transport.fan_out(self.transport.api.pause(mode), retry=True)

    async def acontinue_generation(self) -> dict[str, Any]:
        """Resume every server."""
        return await self.transport.fan_out(self.transport.api.resume(), retry=True)

    async def aflush_cache(self) -> dict[str, Any]:
        """Flush every server's prefix cache."""
        return await self.transport.fan_out(self.transport.api.flush_cache(), retry=True)

    async def aserver_info(self) -> dict[str, Any]:
        """Every up server's ``/get_server_info`` (its settings and state; the built-in server adds its memory)."""
        return await self.transport.fan_out([Call("GET", "/get_server_info")], retry=True)

    async def aupdate_weights_from_disk(
        self, path: str, version: int | str, *, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        """Every up server loads the weights in folder ``path`` and calls them ``version``."""
        targets = self.transport.up_servers()
        result = await self.transport.fan_out(
            self.transport.api.update_weights_from_disk(str(path), str(version), abort_all_requests), servers=targets
        )
        for s in targets:
            s.weight_version = str(version)
        return result

    async def aload_lora_adapter(self, name: str, path: str, version: int | str) -> dict[str, Any]:
        """Every up server loads the PEFT adapter folder ``path`` as ``name`` and reports ``version``; from then on
        every generate request to it names ``name``, and then the adapter it named before is unloaded there.

        Requests already running finish with the adapter they started with, so no request mixes two; a new name
        per sync keeps servers that cache adapters by name (vLLM) from serving stale weights.
        """
        api, targets = self.transport.api, self.transport.up_servers()
        result = await self.transport.fan_out(api.load_lora_adapter(name, str(path), str(version)), servers=targets)
        previous = {}
        for s in targets:
            if s.lora_name and s.lora_name != name:
                previous[s.url] = s.lora_name
            s.lora_name, s.weight_version = name, str(version)
        await self._unload(previous)
        return result

    async def aunload_lora_adapter(self) -> dict[str, Any]:
        """Every up server unloads the adapter its requests name; they name none from then on (the base weights)."""
        names = {s.url: s.lora_name for s in self.transport.up_servers() if s.lora_name}
        for s in self.transport.up_servers():
            s.lora_name = ""
        return await self._unload(names)

    async def _unload(self, names: dict[str, str]) -> dict[str, Any]:
        """Unload adapter ``names[url]`` on each server ``url``."""
        if not names:
            return {}
        targets = [self.transport.server(url) for url in names]
        plans = [self.transport.api.unload_lora_adapter(names[s.url]) for s in targets]
        return await self.transport.fan_out(servers=targets, per_server=plans)

    def weight_group_layout(self, ranks_per_server: int) -> tuple[int, list[int]]:
        """(world size, rank offset of each up server) of a weight-update group; the trainer is rank 0."""
        if ranks_per_server < 1:
            raise ValueError(f"ranks_per_server = {ranks_per_server} must be at least 1 (a server's tp size)")
        n = len(self.transport.up_servers())
        return 1 + n * ranks_per_server, [1 + i * ranks_per_server for i in range(n)]

    async def ainit_weights_update_group(
        self, master_address: str, master_port: int, group_name: str, backend: str, ranks_per_server: int = 1
    ) -> dict[str, Any]:
        """Ask every up server to join ``group_name``; server i's processes are ranks 1+i*t .. t+i*t."""
        if not self.transport.api.distributed_weights:
            raise self._no_distributed_weights()
        members = self.transport.up_servers()
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
        result = await self.transport.fan_out(servers=members, per_server=plans)
        self.group_members[group_name] = members
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
        if not self.transport.api.distributed_weights:
            raise self._no_distributed_weights()
        members = self.group_members.get(group_name)
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
        result = await self.transport.fan_out(
            [Call("POST", "/update_weights_from_distributed", payload)], servers=members
        )
        if version is not None:
            for s in members:
                s.weight_version = str(version)
        return result

    def _targets(self, addrs: Sequence[str] | None) -> list[ServerState]:
        """The servers at ``addrs`` (None: every up one); a KeyError names an address not of this client."""
        return self.transport.up_servers() if addrs is None else [self.transport.server(a) for a in addrs]

    async def arelease_memory_occupation(
        self, tags: Sequence[str] | None = None, addrs: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """The servers give back the memory of ``tags`` ('weights', 'kv_cache', 'cuda_graph'; None: all) while the
        trainer uses the GPUs; requests sent meanwhile wait.  Not retried: a repeated release is not a no-op
        everywhere (SGLang refuses it)."""
        calls = self.transport.api.release_memory(None if tags is None else list(tags))
        return await self.transport.fan_out(calls, servers=self._targets(addrs))

    async def aresume_memory_occupation(
        self, tags: Sequence[str] | None = None, addrs: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """The servers take the memory of ``tags`` again (None: all); resumed weights hold no values until the
        next weight update, which must follow before requests are served."""
        calls = self.transport.api.resume_memory(None if tags is None else list(tags))
        return await self.transport.fan_out(calls, servers=self._targets(addrs))

    async def asetup_tensor_weights(self) -> dict[str, Any]:
        """Once before the first weight update from tensors (vLLM's ``/init_weight_transfer_engine``; SGLang and the
        built-in server need nothing)."""
        calls = self.transport.api.setup_tensor_weights()
        return await self.transport.fan_out(calls, servers=self.transport.servers) if calls else {}

    async def aupdate_weights_from_tensor(
        self,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        version: int | str | None,
        *,
        addrs: Sequence[str] | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        first: bool = True,
    ) -> dict[str, Any]:
        """Servers on this machine load HF-named ``named_tensors`` in place from this process's memory (SGLang's
        form: CUDA IPC handles or shared CPU memory, ``archon.wire.tensor_ipc``; vLLM's: CUDA IPC handles keyed by
        GPU, ``archon.wire.vllm_ipc``): no copy travels over HTTP.

        Each server of ``addrs`` (None: every up one) gets its own handles; the tensors stay referenced here
        until every server has answered.  As with the distributed update, a sync in several buckets passes
        ``version`` with the last one only (None for the others) and ``first`` with the first one only.
        """
        targets = self._targets(addrs)
        share = SHARE_TENSORS[self.transport.api.tensor_share_format]
        parts = [[share(named_tensors)] for _ in targets]
        return await self._aload_parts(targets, parts, version, flush_cache, abort_all_requests, first)

    async def aupdate_weights_from_parts(
        self,
        parts: Sequence[Sequence[Any]],
        version: int | str | None,
        *,
        first: bool,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """As ``aupdate_weights_from_tensor``, with every server's own shared parts (``archon.wire.tensor_share``):
        entry i of ``parts`` goes to server i of the address list, one part per GPU of it, each made by the process
        on that GPU (as colocated trainer ranks do)."""
        servers = self.transport.servers
        if len(parts) != len(servers):
            raise RolloutError(
                f"weights shared by {len(parts)} groups of trainer ranks for {len(servers)} rollout servers; "
                "colocated servers must each have the trainer ranks of their GPUs (rollout.colocate)"
            )
        up = [(server, own) for server, own in zip(servers, parts) if not server.down]
        targets, up_parts = [server for server, _ in up], [own for _, own in up]
        return await self._aload_parts(targets, up_parts, version, flush_cache, abort_all_requests, first)

    async def _aload_parts(
        self,
        targets: Sequence[ServerState],
        parts: Sequence[Sequence[Any]],
        version: int | str | None,
        flush_cache: bool,
        abort_all_requests: bool,
        first: bool,
    ) -> dict[str, Any]:
        api = self.transport.api
        version_str = None if version is None else str(version)
        plans = [
            api.update_weights_from_tensor(list(own), version_str, flush_cache, abort_all_requests, first)
            for own in parts
        ]
        result = await self.transport.fan_out(servers=list(targets), per_server=plans)
        if version_str is not None:
            for s in targets:
                s.weight_version = version_str
        return result
