"""Putting a run on a cluster through Slurm or Ray, process by process as the cluster plan says.

Archon schedules nothing itself: ``archon.plan`` says which node and GPUs every rollout
server and training rank gets, and the cluster's own scheduler places them.

* ``python -m archon.launch slurm --config x.toml [overrides]``: an sbatch script with one
  ``srun`` step per rollout node and one torchrun step over the training nodes
  (``archon.launch.slurm``); ``--submit`` submits it, ``--dry-run`` prints each node's
  commands and environment.
* ``python -m archon.launch ray --config x.toml [--address host:port] [overrides]``: placement
  groups with one bundle per GPU, each process started where the plan puts it
  (``archon.launch.ray_cluster``).
* ``python -m archon.launch serve-node`` and ``prepare``: what those launchers run on the
  nodes (``archon.launch.serve``): a node's rollout servers, published for the trainer
  (``archon.launch.discovery``), and a Slurm job's shared run directory.

Rollout servers on one node: ``servers`` (start, watch and stop them; ``RolloutLauncher``),
``server_commands`` (their command lines), ``discovery`` (servers another node published) and
``recovery`` (servers that die during a run).  The trainer uses those four; the cluster entry
points (``cli``, ``slurm``, ``ray_cluster``, ``serve``) are imported by nothing else.
"""
