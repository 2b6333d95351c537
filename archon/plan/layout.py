"""The cluster plan of a config's run: ``plan_for_config``.

Where processes go is decided by ``archon.placement.plan_cluster`` from allocations and cluster
sizes alone (so ``archon.config`` can check a run fits without importing this package); this
module feeds it a whole ``Config``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from archon.placement import ClusterPlan, Job, plan_cluster

if TYPE_CHECKING:
    from archon.config import Config


def plan_for_config(cfg: Config, job: Job = "rl") -> ClusterPlan:
    """The plan of a run of ``cfg``: with its rollout servers for RL, training ranks only for SFT.

    Servers given by address (``rollout.server_addrs``) keep their place in the plan: started by
    hand on the cluster, they belong on the GPUs it reserves for them.  With ``rollout.colocate``
    the servers share the training ranks' GPUs.
    """
    allocs = cfg.allocations()
    if job == "sft":
        allocs.pop("rollout")
    colocate = cfg.rollout.colocate and job == "rl"
    return plan_cluster(allocs, cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node, colocate=colocate)
