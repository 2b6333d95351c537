"""Checkpointing, as torchtitan's checkpointer: what a checkpoint holds and how a run keeps them.

``state`` (an engine's parts, each a ``Stateful``), ``dcp`` (one engine's state with
torch.distributed.checkpoint, read back without running code), ``manager`` (a run's checkpoint
folders: written atomically, checked before use, pruned only when safe).
"""
