"""Planning a run on a cluster: where every process runs, whether it fits in memory, and a rehearsal.

* ``archon.plan.layout``: ``plan_for_config``, the ``ClusterPlan`` (node, GPUs and role of every
  rollout server and training rank) of a config's run, placed by ``archon.placement.plan_cluster``;
* ``archon.plan.memory``: the per-GPU memory estimate of training ranks and rollout servers;
* ``archon.plan.rehearse``: a shrunken model of the same architecture trained under the
  actor's allocation with real gloo ranks on this machine, compared with one device;
* ``python -m archon.plan --config x.toml [overrides]`` prints the plan and the memory check,
  ``python -m archon.plan rehearse --config x.toml [overrides]`` rehearses the layout.

Only the layout (and the placement below it) is imported here, so reading a config never imports torch.
"""

from archon.placement import IN_PROCESS_BACKEND, TRAINING_ENGINES, ClusterPlan, Job, Process, Role, plan_cluster
from archon.plan.layout import plan_for_config

__all__ = [
    "IN_PROCESS_BACKEND",
    "TRAINING_ENGINES",
    "ClusterPlan",
    "Job",
    "Process",
    "Role",
    "plan_cluster",
    "plan_for_config",
]
