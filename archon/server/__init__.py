"""Archon's built-in rollout server: any Archon model served over SGLang's HTTP protocol.

``app`` (the HTTP surface and process), ``protocol`` (request and response bodies),
``generator`` (continuous batching in one thread) with ``generation_types``, ``kv_cache`` and
``sampling``, ``weight_update`` (new weights from disk or a broadcast) and ``http_limits``.
It shares only ``archon.wire`` with the trainer side, never ``archon.rollout``:
``python -m archon.server --model-path HF_FOLDER --port 30000`` starts one.
"""
