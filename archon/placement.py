"""Which process of a run runs on which node and GPU: ``ClusterPlan`` and ``plan_cluster``.

Pure Python below ``archon.config`` (which checks that a run fits with it) and ``archon.plan``
(whose ``plan_for_config`` places a whole config's run): it sees only allocations and cluster sizes.

A run is rollout servers (``sglang:dNtM``: N servers of M*P GPUs; ``local:dN``: N built-in
servers of one slot each) and training ranks (one GPU each; actor, critic, reference and teacher share
them).  ``plan_cluster`` places them, rollout first and training after, as AReaL does:

1. A server never spans nodes, so a node holds ``n_gpus_per_node // server_size`` servers.
2. Whole nodes for rollout when the sizes allow: the servers fill the first nodes, and the
   training ranks take the following nodes, in rank order, GPU 0 first.  No server then
   shares a node with a training rank.
3. When that does not fit (one node, or too few nodes), the servers are packed the same way
   and the training ranks take every GPU left, node by node in GPU order, so a node may hold
   both.  If even that does not fit, the run is refused before anything starts: outside a
   colocated layout no two processes ever share a GPU.

Colocated (``colocate=True``, ``rollout.colocate``): servers and training ranks take turns on the
same GPUs.  The training ranks are placed alone (node by node, GPU 0 first) and server ``i`` of
``size`` GPUs runs on the GPUs of training ranks ``i*size .. (i+1)*size - 1``, which must be on one
node; the rollout allocation must use exactly the training ranks' GPUs.  The ``inprocess``
backend places no rollout process at all: it generates inside the training ranks.

On a CPU-only machine a "GPU" is a process slot (``cluster.n_gpus_per_node`` counts the
processes a node may start) and the same arithmetic applies; a ``local`` server takes a slot
(on a GPU node it runs on the CPU and its slot stays idle), unless colocated: then it shares its
training rank's slot (or GPU) and takes none of its own.

The plan is what launchers consume::

    plan = plan_cluster(allocs, n_nodes, n_gpus_per_node)   # or archon.plan.plan_for_config(cfg)
    plan.processes                           # every process: role, index, node, gpus, local_index
    plan.servers / plan.train_ranks          # the two roles, by server index / by rank
    plan.rollout_nodes / plan.train_nodes    # nodes holding servers / training ranks
    plan.on_node(n)                          # processes of node n
    plan.train_gpus(n)                       # node n's training GPUs in rank order (CUDA_VISIBLE_DEVICES)
    plan.first_rank(n)                       # global rank of node n's first training rank
    plan.rank(r)                             # training rank r's Process
    plan.colocated_ranks(server)             # training ranks sharing a colocated server's GPUs
    plan.to_dict()                           # plain data (python -m archon.plan --json)

A Slurm launcher starts one step per rollout node (its servers, each with
``CUDA_VISIBLE_DEVICES`` = the server's ``gpus``) and one torchrun step over ``train_nodes``
(``--nproc_per_node=len(plan.train_gpus(n))`` on node n); a Ray launcher makes one placement
group bundle per GPU of every process.  Training ranks pick their GPU by the rule in
``archon.engine.dist``: the plan's GPU id, found in ``CUDA_VISIBLE_DEVICES`` when a launcher
exported it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from archon.alloc import AllocationError, ModelAllocation

TRAINING_ENGINES = ("actor", "critic", "ref", "teacher")
IN_PROCESS_BACKEND = "inprocess"
"""The rollout backend that generates inside the training ranks (``rollout.backend = 'inprocess:dN'``)."""

Role = Literal["rollout", "train"]
Job = Literal["rl", "sft"]
"""What a run does: RL has rollout servers and training ranks, SFT training ranks only."""


@dataclass(frozen=True)
class Process:
    """One process of a run and where it runs."""

    role: Role
    """'rollout' (an inference server instance) or 'train' (one training rank)."""
    index: int
    """Server number (0..d-1) for rollout; global rank (0..world-1) for training."""
    node: int
    """Node the process runs on (0..n_nodes-1)."""
    gpus: tuple[int, ...]
    """Node-local GPU ids it owns: a server's t*p GPUs, or a training rank's one GPU."""
    local_index: int
    """Position among the processes of the same role on its node (a training rank's LOCAL_RANK)."""

    @property
    def name(self) -> str:
        return f"server {self.index}" if self.role == "rollout" else f"rank {self.index}"


@dataclass(frozen=True)
class ClusterPlan:
    """Where every rollout server and training rank of a run runs (see the module docstring)."""

    n_nodes: int
    """Nodes of the cluster (cluster.n_nodes)."""
    n_gpus_per_node: int
    """GPUs (CPU: process slots) per node (cluster.n_gpus_per_node)."""
    processes: tuple[Process, ...]
    """Rollout servers by index, then training ranks by rank."""
    rollout: str = ""
    """The rollout allocation placed ('' when the run has none; 'inprocess:dN' places no process)."""
    train: str = ""
    """The training allocation placed (actor's; critic and ref share its ranks)."""
    colocated: bool = False
    """Servers run on the training ranks' GPUs and take turns with them (rollout.colocate)."""

    @property
    def servers(self) -> tuple[Process, ...]:
        return tuple(p for p in self.processes if p.role == "rollout")

    @property
    def train_ranks(self) -> tuple[Process, ...]:
        return tuple(p for p in self.processes if p.role == "train")

    @property
    def train_world_size(self) -> int:
        return len(self.train_ranks)

    @property
    def rollout_nodes(self) -> tuple[int, ...]:
        return tuple(sorted({p.node for p in self.servers}))

    @property
    def train_nodes(self) -> tuple[int, ...]:
        return tuple(sorted({p.node for p in self.train_ranks}))

    @property
    def shared_nodes(self) -> tuple[int, ...]:
        """Nodes that hold both servers and training ranks (colocated, or a cluster too small for whole nodes)."""
        return tuple(sorted(set(self.rollout_nodes) & set(self.train_nodes)))

    @property
    def total_gpus(self) -> int:
        return self.n_nodes * self.n_gpus_per_node

    @property
    def used_gpus(self) -> int:
        """GPUs (CPU: slots) holding at least one process; a colocated GPU counts once."""
        return len({(p.node, g) for p in self.processes for g in p.gpus})

    def on_node(self, node: int) -> tuple[Process, ...]:
        """The processes of ``node``, servers first."""
        return tuple(p for p in self.processes if p.node == node)

    def servers_on(self, node: int) -> tuple[Process, ...]:
        return tuple(p for p in self.servers if p.node == node)

    def train_ranks_on(self, node: int) -> tuple[Process, ...]:
        return tuple(p for p in self.train_ranks if p.node == node)

    def train_gpus(self, node: int) -> tuple[int, ...]:
        """Node-local GPU ids of ``node``'s training ranks in rank order (its CUDA_VISIBLE_DEVICES)."""
        return tuple(p.gpus[0] for p in self.train_ranks_on(node))

    def first_rank(self, node: int) -> int:
        """Global rank of ``node``'s first training rank (its ranks are consecutive)."""
        ranks = self.train_ranks_on(node)
        if not ranks:
            raise ValueError(f"node {node} holds no training rank; training nodes are {list(self.train_nodes)}")
        return ranks[0].index

    def idle_gpus(self, node: int) -> tuple[int, ...]:
        used = {g for p in self.on_node(node) for g in p.gpus}
        return tuple(g for g in range(self.n_gpus_per_node) if g not in used)

    def colocated_ranks(self, server: Process) -> tuple[int, ...]:
        """Global ranks of the training ranks on ``server``'s GPUs (empty outside a colocated plan)."""
        if not self.colocated:
            return ()
        return tuple(r.index for r in self.train_ranks_on(server.node) if r.gpus[0] in server.gpus)

    def to_dict(self) -> dict:
        """The plan as plain data (what ``python -m archon.plan --json`` prints), e.g. for a launcher's script."""
        processes = []
        for p in self.processes:
            row = {"role": p.role, "index": p.index, "node": p.node, "gpus": list(p.gpus), "local_index": p.local_index}
            if p.role == "rollout" and self.colocated:
                row["colocated_with_ranks"] = list(self.colocated_ranks(p))
            processes.append(row)
        return {
            "n_nodes": self.n_nodes,
            "n_gpus_per_node": self.n_gpus_per_node,
            "rollout": self.rollout,
            "train": self.train,
            "colocated": self.colocated,
            "processes": processes,
        }

    def rank(self, rank: int) -> Process:
        """Training rank ``rank``'s process."""
        ranks = self.train_ranks
        if not 0 <= rank < len(ranks):
            raise ValueError(
                f"training rank {rank} is not in the plan, which has {len(ranks)} training ranks "
                f"({self.train or 'none'})"
            )
        return ranks[rank]


def _server_size(rollout: ModelAllocation) -> int:
    return rollout.parallel.tp_size * rollout.parallel.pp_size


def _training_world(allocs: dict[str, ModelAllocation]) -> tuple[int, str]:
    train = {k: allocs[k] for k in TRAINING_ENGINES if k in allocs}
    sizes = {k: a.world_size for k, a in train.items()}
    if len(set(sizes.values())) > 1:
        first = next(iter(train))
        other = next(k for k in train if sizes[k] != sizes[first])
        raise AllocationError(
            f"{first}.backend '{train[first]}' needs {sizes[first]} ranks but {other}.backend "
            f"'{train[other]}' needs {sizes[other]}; actor, critic, ref and teacher share the "
            "training ranks, so give them allocations of the same world size"
        )
    if not train:
        return 0, ""
    return next(iter(sizes.values())), str(next(iter(train.values())))


def plan_cluster(
    allocs: dict[str, ModelAllocation], n_nodes: int, n_gpus_per_node: int, colocate: bool = False
) -> ClusterPlan:
    """Place the rollout servers of ``allocs['rollout']`` (if any) and the training ranks on the cluster.

    ``colocate``: servers share the training ranks' GPUs (see the module docstring).  Raises
    ``AllocationError`` (one sentence) when the run does not fit.
    """
    if n_nodes < 1 or n_gpus_per_node < 1:
        raise AllocationError(
            f"cluster.n_nodes={n_nodes} and cluster.n_gpus_per_node={n_gpus_per_node} must both be at least 1"
        )
    n_train, train_str = _training_world(allocs)
    rollout = allocs.get("rollout")
    if rollout is not None and rollout.backend == IN_PROCESS_BACKEND:
        # Generation runs inside the training ranks: no process of its own to place.
        plan = _place(None, n_train, train_str, n_nodes, n_gpus_per_node)
        return ClusterPlan(n_nodes, n_gpus_per_node, plan.processes, str(rollout), train_str)
    if colocate and rollout is not None:
        return _place_colocated(rollout, n_train, train_str, n_nodes, n_gpus_per_node)
    return _place(rollout, n_train, train_str, n_nodes, n_gpus_per_node)


def _cluster_text(n_nodes: int, n_gpus_per_node: int) -> str:
    return f"cluster.n_nodes={n_nodes} x cluster.n_gpus_per_node={n_gpus_per_node}"


def _check_server_size(rollout: ModelAllocation, n_gpus_per_node: int) -> int:
    size = _server_size(rollout)
    if size > n_gpus_per_node:
        raise AllocationError(
            f"rollout '{rollout}' gives each server {size} GPUs (t*p), more than a node's "
            f"cluster.n_gpus_per_node={n_gpus_per_node}, and a server never spans nodes; lower t/p "
            "(use d for more servers) or use nodes with more GPUs"
        )
    return size


def _place_train_ranks(free: list[tuple[int, int]], n_train: int) -> list[Process]:
    """Training ranks on the first ``n_train`` of ``free`` (node, GPU) slots, numbered in that order."""
    ranks = []
    local: dict[int, int] = {}
    for rank, (node, gpu) in enumerate(free[:n_train]):
        ranks.append(Process("train", rank, node, (gpu,), local.get(node, 0)))
        local[node] = local.get(node, 0) + 1
    return ranks


def _place_colocated(
    rollout: ModelAllocation, n_train: int, train_str: str, n_nodes: int, n_gpus_per_node: int
) -> ClusterPlan:
    """Training ranks alone, then server i on the GPUs of ranks i*size .. (i+1)*size - 1."""
    size = _check_server_size(rollout, n_gpus_per_node)
    total = n_nodes * n_gpus_per_node
    if rollout.world_size != n_train:
        raise AllocationError(
            f"a colocated rollout '{rollout}' ({rollout.world_size} GPUs) must use exactly the GPUs of the training "
            f"ranks, {repr(train_str) if train_str else 'none'} ({n_train}); make their sizes equal"
        )
    if n_train > total:
        raise AllocationError(
            f"training {train_str!r} needs {n_train} devices, but {_cluster_text(n_nodes, n_gpus_per_node)} gives "
            f"{total}; add nodes or shrink the allocation"
        )
    ranks = _place_train_ranks([(node, g) for node in range(n_nodes) for g in range(n_gpus_per_node)], n_train)
    servers = []
    on_node: dict[int, int] = {}
    for i in range(rollout.parallel.dp_size):
        mine = ranks[i * size : (i + 1) * size]
        nodes = sorted({r.node for r in mine})
        if len(nodes) > 1:
            raise AllocationError(
                f"colocated rollout server {i} of '{rollout}' would run on training ranks "
                f"{mine[0].index}-{mine[-1].index}, which span nodes {nodes[0]}-{nodes[-1]}, and a server never "
                f"spans nodes; choose a server size t*p ({size}) that divides cluster.n_gpus_per_node={n_gpus_per_node}"
            )
        servers.append(Process("rollout", i, nodes[0], tuple(r.gpus[0] for r in mine), on_node.get(nodes[0], 0)))
        on_node[nodes[0]] = on_node.get(nodes[0], 0) + 1
    return ClusterPlan(n_nodes, n_gpus_per_node, tuple(servers) + tuple(ranks), str(rollout), train_str, colocated=True)


def _place(
    rollout: ModelAllocation | None, n_train: int, train_str: str, n_nodes: int, n_gpus_per_node: int
) -> ClusterPlan:
    """Servers and training ranks on GPUs of their own (rollout first, see the module docstring)."""
    n_servers = rollout.parallel.dp_size if rollout is not None else 0
    size = _check_server_size(rollout, n_gpus_per_node) if rollout is not None else 0
    cluster = _cluster_text(n_nodes, n_gpus_per_node)
    total = n_nodes * n_gpus_per_node
    per_node = n_gpus_per_node // size if n_servers else 0
    rollout_gpus = n_servers * size
    if n_servers and n_servers > per_node * n_nodes:
        raise AllocationError(
            f"rollout '{rollout}' needs {n_servers} servers of {size} GPUs, but a node of "
            f"{n_gpus_per_node} GPUs holds {per_node} whole servers, {per_node * n_nodes} on "
            f"{cluster}; add nodes or choose a server size that divides {n_gpus_per_node}"
        )
    if rollout_gpus + n_train > total:
        raise AllocationError(
            f"rollout '{rollout}' needs {rollout_gpus} devices and training "
            f"{repr(train_str) if train_str else 'none'} needs {n_train}; together "
            f"{rollout_gpus + n_train}, but {cluster} gives {total}; add nodes or shrink an "
            "allocation"
        )

    servers = []
    for i in range(n_servers):
        node, slot = divmod(i, per_node)
        servers.append(Process("rollout", i, node, tuple(range(slot * size, (slot + 1) * size)), slot))
    rollout_nodes = -(-n_servers // per_node) if n_servers else 0
    if (n_nodes - rollout_nodes) * n_gpus_per_node >= n_train:
        free = [(node, g) for node in range(rollout_nodes, n_nodes) for g in range(n_gpus_per_node)]
    else:
        used = {(s.node, g) for s in servers for g in s.gpus}
        free = [(node, g) for node in range(n_nodes) for g in range(n_gpus_per_node) if (node, g) not in used]
    assert len(free) >= n_train, "packed servers leave exactly the GPUs the totals check counted"
    ranks = _place_train_ranks(free, n_train)
    return ClusterPlan(
        n_nodes, n_gpus_per_node, tuple(servers) + tuple(ranks), str(rollout) if n_servers else "", train_str
    )
