"""What the trainer side (``archon.rollout``) and the built-in server (``archon.server``) share.

``auth``: the shared secret of SGLang's ``--api-key`` scheme; ``weight_group``: the extra
process group the trainer's rank 0 and every server process join for weight broadcasts;
``sglang``: the ``sampling_params`` fields (defaults and docs) both sides use; ``tensor_ipc``: named
tensors handed to a server on the same machine as handles (``update_weights_from_tensor``).
Both sides import this package and nothing of each other.
"""
