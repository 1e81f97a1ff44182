"""Trainers built on rollout's continuous-batching manager.

Submodules: ``grpo`` (the GRPO trainer), ``config`` (its settings), ``tasks`` (datasets),
``rewards`` (reward functions); ``trl_plugin`` serves the manager to TRL's GRPOTrainer.
They use only what ``rollout/__init__.py`` exports.
"""
