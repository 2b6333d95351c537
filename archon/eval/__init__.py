"""Evaluation of a policy on held-out prompts: greedy accuracy and sampled pass@k with the run's reward function.

``pass_at_k`` (the unbiased estimator), ``evaluation`` (one evaluation through a rollout client), ``periodic``
(the RL loop's evaluations, ``valid_dataset`` and ``evaluator``), ``cli`` (``python -m archon.eval``: a saved
model, evaluated the same way).
"""
