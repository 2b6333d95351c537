"""Parallel dimensions of one engine and the device meshes that realise them.

Global ranks are laid out as ``[pp, dp_replicate, dp_shard, cp, tp]`` with ``tp`` fastest,
so tensor-parallel groups are consecutive ranks (one node on a GPU cluster).  Every other
view is an unflattening of the same 1-D world mesh, so all views agree on rank order:

* dense ``[pp, dp_replicate, dp_shard, cp, tp]``: TP, CP and PP groups;
* ``dp`` = dp_replicate x dp_shard (who draws different data), ``dp_shard_cp`` (what FSDP
  shards over), ``dp_cp`` (over what the loss is reduced), ``hsdp`` = [dp_replicate, dp_shard_cp];
* with expert parallel or expert tensor parallel, the MoE-folded sparse mesh
  ``[pp, dp_replicate, efsdp, ep, etp]``.  Inside one pipeline stage and replica, experts fold
  the ``dp_shard*cp*tp`` ranks their own way: ``etp`` consecutive ranks split every expert's
  hidden dim (and pool their tokens, see ``parallel/expert_parallel.py``), ``ep`` such groups
  split the experts, and the remaining ``efsdp`` ranks shard each expert group with FSDP.
  Any ``ep*etp`` dividing ``dp_shard*cp*tp`` works: ``etp`` may be 1, equal to ``tp`` (the
  TP groups), smaller (part of a TP group) or larger (several TP or data-parallel groups).

Example, 8 ranks, dp_shard=2, cp=2, tp=2, ep=4, etp=1 (one stage, one replica)::

    dense  [dp_shard, cp, tp]   rank = 4*dp_shard + 2*cp + tp
    tp groups  {0,1} {2,3} {4,5} {6,7}
    sparse [efsdp=2, ep=4, etp=1]
    ep groups  {0,1,2,3} {4,5,6,7}      efsdp groups {0,4} {1,5} {2,6} {3,7}

Size-1 dimensions get torch's "fake" process group (no communicator is created) and are
not handed out by ``get_mesh``: a collective over one rank is a no-op, but a fake group
would not even copy, so callers ask ``get_optional_mesh`` and skip what is disabled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel.errors import ParallelConfigError

_MESH_DOCS = {
    "pp": "pipeline stages",
    "dp_replicate": "HSDP replicas",
    "dp_shard": "FSDP shards (without cp)",
    "cp": "context parallel",
    "tp": "tensor parallel",
    "dp": "data loading (dp_replicate x dp_shard)",
    "dp_shard_cp": "FSDP (dp_shard x cp)",
    "dp_cp": "loss reduction (dp_replicate x dp_shard x cp)",
    "hsdp": "2-D FSDP mesh [dp_replicate, dp_shard_cp]",
    "ep": "expert parallel",
    "etp": "expert tensor parallel",
    "efsdp": "FSDP of expert weights",
    "ehsdp": "2-D expert FSDP mesh [dp_replicate, efsdp]",
}


def _ensure_fake_backend() -> bool:
    """Register torch's no-communication process group under the name 'fake' (once)."""
    if "fake" in dist.Backend.backend_list:
        return True
    try:
        from torch._C._distributed_c10d import FakeProcessGroup
    except ImportError:  # pragma: no cover - very old torch
        return False

    def create(common_opts: Any, backend_opts: Any):
        # (the stubs omit the options argument that torch's own fake backend passes)
        return FakeProcessGroup._create_internal(
            common_opts.group_rank,
            common_opts.group_size,
            backend_opts,  # pyright: ignore[reportCallIssue]
        )

    dist.Backend.register_backend("fake", create, extended_api=True, devices=["cpu", "cuda"])
    return True


@dataclass
class ParallelDims:
    """Sizes of every parallel dimension of one engine; ``build_meshes`` creates its device meshes."""

    dp_shard: int
    """FSDP shard degree (data parallel without replication); -1 fills the rest of world_size."""
    dp_replicate: int
    """HSDP replica groups (1 unless asked for)."""
    cp: int
    """Context parallel (Ulysses) degree."""
    tp: int
    """Tensor parallel degree."""
    pp: int
    """Pipeline parallel degree."""
    ep: int
    """Expert parallel degree (borrowed, with etp, from the dp_shard*cp*tp ranks of a stage)."""
    etp: int
    """Expert tensor parallel degree: ranks that split each expert's hidden dim (any divisor with ep)."""
    world_size: int
    """Ranks of this engine."""
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "cp", "tp", "pp", "ep", "etp", "world_size"):
            if getattr(self, name) < 1:
                raise ParallelConfigError(f"parallel size {name}={getattr(self, name)} must be at least 1")
        if self.dp_shard == -1:
            rest = self.dp_replicate * self.cp * self.tp * self.pp
            if self.world_size % rest:
                raise ParallelConfigError(
                    f"world_size={self.world_size} is not divisible by dp_replicate*cp*tp*pp={rest}, "
                    "so dp_shard=-1 cannot fill it"
                )
            self.dp_shard = self.world_size // rest
        if self.dp_shard < 1:
            raise ParallelConfigError(
                f"parallel size dp_shard={self.dp_shard} must be at least 1 (or -1 to fill the rest)"
            )
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise ParallelConfigError(
                f"dp_replicate*dp_shard*cp*tp*pp = {self.dp_replicate}*{self.dp_shard}*{self.cp}*"
                f"{self.tp}*{self.pp} = {product} does not equal world_size={self.world_size}"
            )
        block = self.dp_shard * self.cp * self.tp
        if self.ep * self.etp > 1 and block % (self.ep * self.etp):
            raise ParallelConfigError(
                f"ep*etp = {self.ep}*{self.etp} must divide dp_shard*cp*tp = {block} (experts fold the "
                "ranks of one pipeline stage and add none); choose ep and the ffn t from its divisors"
            )

    @classmethod
    def from_allocation(cls, alloc: Any, world_size: int | None = None, dp_replicate: int = 1) -> ParallelDims:
        """From any object with ``dp_size, tp_size, pp_size, cp_size, ep_size, etp_size`` (or its ``.parallel``)."""
        strategy = getattr(alloc, "parallel", alloc)
        dp = strategy.dp_size
        if dp_replicate < 1 or dp % dp_replicate:
            raise ParallelConfigError(f"dp_replicate={dp_replicate} must divide the data-parallel size d={dp}")
        sizes = dict(
            dp_shard=dp // dp_replicate,
            dp_replicate=dp_replicate,
            cp=strategy.cp_size,
            tp=strategy.tp_size,
            pp=strategy.pp_size,
            ep=strategy.ep_size,
            etp=strategy.etp_size,
        )
        world = dp * strategy.tp_size * strategy.pp_size * strategy.cp_size
        if world_size is not None and world_size != world:
            raise ParallelConfigError(f"the allocation needs {world} ranks (d*t*p*c) but world_size={world_size}")
        return cls(world_size=world, **sizes)

    # ---- flags -------------------------------------------------------------------------
    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP is applied when parameters can be sharded over dp_shard*cp (or replicated for HSDP)."""
        return self.dp_shard * self.cp > 1 or self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def etp_enabled(self) -> bool:
        return self.etp > 1

    @property
    def moe_folding_enabled(self) -> bool:
        """Experts get their own layout (the sparse mesh): expert parallel or expert tensor parallel."""
        return self.ep > 1 or self.etp > 1

    @property
    def dp_cp_enabled(self) -> bool:
        return self.dp_enabled or self.cp_enabled

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.tp_enabled

    @property
    def non_data_parallel_size(self) -> int:
        return self.cp * self.tp * self.pp

    @property
    def seq_len_divisor(self) -> int:
        """Packed lengths must divide by this: sequence parallel splits by tp, Ulysses by cp."""
        return self.tp * self.cp

    @property
    def fsdp_gradient_divide_factor(self) -> int:
        """Ranks whose loss terms sum to the global loss; FSDP's default mean divides by this."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks that shard one expert group with FSDP after EP took its share."""
        return self.dp_shard * self.cp * self.tp // (self.ep * self.etp)

    def describe(self) -> str:
        """The layout in one line, as the engine logs it; ``dp_replicate`` appears when HSDP replicates."""
        replicate = f"dp_replicate={self.dp_replicate}, " if self.dp_replicate > 1 else ""
        return (
            f"pp={self.pp}, {replicate}dp_shard={self.dp_shard}, tp={self.tp}, cp={self.cp}, "
            f"ep={self.ep}, etp={self.etp}"
        )

    # ---- meshes ------------------------------------------------------------------------
    def _unflatten(self, world: DeviceMesh, dims: list[tuple[str, int]], real: tuple[str, ...] = ()) -> DeviceMesh:
        names = tuple(n for n, _ in dims)
        sizes = tuple(s for _, s in dims)
        # FSDP meshes keep real groups even at size 1: HSDP's shard dim must actually copy.
        override: dict[str, Any] | None = (
            {n: "fake" for n, s in dims if s == 1 and n not in real} if self._fake_ok else None
        )
        return world._unflatten(0, sizes, names, backend_override=override or None)

    def build_meshes(self, device_type: str) -> None:
        """Create every mesh of this layout over the default process group (collective: all ranks call it)."""
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"the process group has {dist.get_world_size()} ranks but these parallel dims need {self.world_size}"
            )
        self._fake_ok = _ensure_fake_backend()
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        dense = self._unflatten(
            world,
            [
                ("pp", self.pp),
                ("dp_replicate", self.dp_replicate),
                ("dp_shard", self.dp_shard),
                ("cp", self.cp),
                ("tp", self.tp),
            ],
        )
        meshes = {"dense": dense, "world": world}
        for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
            meshes[name] = dense[name]
        fsdp = self._unflatten(
            world,
            [
                ("pp", self.pp),
                ("dp_replicate", self.dp_replicate),
                ("dp_shard_cp", self.dp_shard * self.cp),
                ("tp", self.tp),
            ],
            real=("dp_replicate", "dp_shard_cp"),
        )
        meshes["dp_shard_cp"] = fsdp["dp_shard_cp"]
        meshes["hsdp"] = fsdp["dp_replicate", "dp_shard_cp"]
        loading = self._unflatten(
            world, [("pp", self.pp), ("dp", self.dp_replicate * self.dp_shard), ("cp", self.cp), ("tp", self.tp)]
        )
        meshes["dp"] = loading["dp"]
        loss = self._unflatten(
            world, [("pp", self.pp), ("dp_cp", self.dp_replicate * self.dp_shard * self.cp), ("tp", self.tp)]
        )
        meshes["dp_cp"] = loss["dp_cp"]
        if self.moe_folding_enabled:
            sparse = self._unflatten(
                world,
                [
                    ("pp", self.pp),
                    ("dp_replicate", self.dp_replicate),
                    ("efsdp", self.efsdp),
                    ("ep", self.ep),
                    ("etp", self.etp),
                ],
                real=("dp_replicate", "efsdp"),
            )
            meshes["sparse"] = sparse
            for name in ("efsdp", "ep", "etp"):
                meshes[name] = sparse[name]
            meshes["ehsdp"] = sparse["dp_replicate", "efsdp"]
        self._meshes = meshes

    def _size(self, name: str) -> int:
        return {
            "world": self.world_size,
            "dense": self.world_size,
            "sparse": self.world_size,
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
            "dp": self.dp_replicate * self.dp_shard,
            "dp_shard_cp": self.dp_shard * self.cp,
            "dp_cp": self.dp_replicate * self.dp_shard * self.cp,
            "hsdp": self.dp_replicate * self.dp_shard * self.cp,
            "ep": self.ep,
            "etp": self.etp,
            "efsdp": self.efsdp,
            "ehsdp": self.dp_replicate * self.efsdp,
        }[name]

    def get_optional_mesh(self, name: str) -> DeviceMesh | None:
        """The named mesh, or None when that dimension has size 1."""
        if not self._meshes:
            raise RuntimeError("call build_meshes(device_type) before asking for meshes")
        if name not in self._meshes:
            if name in ("ep", "etp", "efsdp", "ehsdp", "sparse"):
                return None
            known = ", ".join(sorted(self._meshes))
            raise KeyError(f"unknown mesh '{name}'; meshes are {known}")
        if self._size(name) == 1 and name not in ("world", "dense"):
            return None
        if name == "hsdp" and self.dp_replicate == 1:
            return self._meshes["dp_shard_cp"]
        if name == "ehsdp" and self.dp_replicate == 1:
            return self._meshes["efsdp"] if self.efsdp > 1 else None
        return self._meshes[name]

    def get_mesh(self, name: str) -> DeviceMesh:
        """The named mesh (see the module docstring); an error when that dimension is disabled."""
        mesh = self.get_optional_mesh(name)
        if mesh is None:
            raise ValueError(
                f"mesh '{name}' ({_MESH_DOCS.get(name, name)}) has size 1 in this layout "
                f"({self.describe()}); check the matching *_enabled flag before asking for it"
            )
        return mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        return self._meshes["dense"]

    @property
    def dense_mesh(self) -> DeviceMesh:
        return self._meshes["dense"]

    @property
    def sparse_mesh(self) -> DeviceMesh | None:
        return self._meshes.get("sparse")
