"""Trainers built on rollout's continuous-batching manager.

Submodules: ``grpo`` (the GRPO trainer), ``loss`` (its objective), ``config`` (its settings), ``cli``
(``rollout-train-grpo`` and ``rollout-eval-grpo``), ``tasks`` (datasets and held-out splits),
``rewards`` (reward functions), ``prompts`` (prompt encoding), ``evaluate`` (held-out accuracy),
``plotting`` (``rollout-plot``); ``trl_plugin`` serves the manager to TRL's GRPOTrainer. They use only
what ``rollout/__init__.py`` exports.
"""
