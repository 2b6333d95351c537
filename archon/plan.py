"""Placing engines on the cluster: does the run fit, and which devices does each part get.

Rollout servers take the first devices (global indices ``[0, R)``), training takes the next
``T`` (``[R, R+T)``), as AReaL lays them out.  Actor, critic, reference and teacher are colocated on
the same training ranks, so they must have the same world size (their layouts may differ).

On a machine without GPUs the ``local`` backend's servers are CPU processes; CPU configs set
``cluster.n_gpus_per_node`` to the number of processes the run may start, and the same
arithmetic applies.
"""

from __future__ import annotations

from dataclasses import dataclass

from archon.alloc import AllocationError, ModelAllocation

TRAINING_ENGINES = ("actor", "critic", "ref", "teacher")


@dataclass(frozen=True)
class ServerPlacement:
    """Devices of one inference server instance."""

    index: int
    """Instance number (0..d-1)."""
    devices: tuple[int, ...]
    """Global device indices."""
    node: int
    """Node the instance runs on."""
    local_devices: tuple[int, ...]
    """Device indices on that node (what CUDA_VISIBLE_DEVICES lists)."""


@dataclass(frozen=True)
class ClusterPlan:
    """Where rollout servers and training ranks run."""

    n_nodes: int
    n_devices_per_node: int
    servers: tuple[ServerPlacement, ...]
    """One entry per rollout server instance."""
    train_devices: tuple[int, ...]
    """Global device indices of the training ranks (rank i on train_devices[i])."""

    @property
    def rollout_devices(self) -> list[list[int]]:
        return [list(s.devices) for s in self.servers]

    @property
    def total_devices(self) -> int:
        return self.n_nodes * self.n_devices_per_node

    @property
    def used_devices(self) -> int:
        return sum(len(s.devices) for s in self.servers) + len(self.train_devices)


def check_cluster_fit(allocs: dict[str, ModelAllocation], n_nodes: int, n_gpus_per_node: int) -> ClusterPlan:
    """Check that rollout + training fit ``n_nodes x n_gpus_per_node`` and assign devices."""
    if n_nodes < 1 or n_gpus_per_node < 1:
        raise AllocationError(f"cluster.n_nodes={n_nodes} and cluster.n_gpus_per_node={n_gpus_per_node} must both "
                              "be at least 1")
    train = {k: allocs[k] for k in TRAINING_ENGINES if k in allocs}
    sizes = {k: a.world_size for k, a in train.items()}
    if len(set(sizes.values())) > 1:
        first = next(iter(train))
        other = next(k for k in train if sizes[k] != sizes[first])
        raise AllocationError(f"{first}.backend '{train[first]}' needs {sizes[first]} ranks but {other}.backend "
                              f"'{train[other]}' needs {sizes[other]}; actor, critic, ref and teacher share the "
                              "training ranks, so give them allocations of the same world size")
    train_world = next(iter(sizes.values()), 0)
    rollout = allocs.get("rollout")
    rollout_world = rollout.world_size if rollout is not None else 0
    total = n_nodes * n_gpus_per_node
    if rollout_world + train_world > total:
        train_str = f"'{next(iter(train.values()))}'" if train else "none"
        raise AllocationError(
            f"rollout '{rollout}' needs {rollout_world} devices and training {train_str} needs {train_world}; "
            f"together {rollout_world + train_world}, but cluster.n_nodes={n_nodes} x cluster.n_gpus_per_node="
            f"{n_gpus_per_node} gives {total}; add nodes or shrink an allocation")

    servers = []
    if rollout is not None:
        per = rollout.parallel.tp_size * rollout.parallel.pp_size
        for i in range(rollout.parallel.dp_size):
            devices = tuple(range(i * per, (i + 1) * per))
            node = devices[0] // n_gpus_per_node
            if devices[-1] // n_gpus_per_node != node:
                if per <= n_gpus_per_node:
                    raise AllocationError(
                        f"rollout '{rollout}': server {i} would span nodes {node} and {devices[-1] // n_gpus_per_node} "
                        f"({per} devices from device {devices[0]}, {n_gpus_per_node} per node); choose a server size "
                        f"that divides cluster.n_gpus_per_node={n_gpus_per_node}")
            servers.append(ServerPlacement(i, devices, node, tuple(d % n_gpus_per_node for d in devices)))
    train_devices = tuple(range(rollout_world, rollout_world + train_world))
    return ClusterPlan(n_nodes, n_gpus_per_node, tuple(servers), train_devices)
