"""Trainers built on rollout's continuous-batching manager.

Submodules: ``recipe`` (what every trainer does: setup, the loop, evaluation, the run folder), ``grpo`` and
``ppo`` (what each algorithm adds: its trajectory, step and metrics), ``backend`` (the ``RolloutBackend`` protocol
the local manager and ``remote.RemoteRollouts`` implement), ``config`` and ``ppo_config`` (the settings),
``arguments`` (their parser), ``cli`` (``rollout-train-grpo``, ``rollout-train-ppo``, ``rollout-eval-grpo``),
``loss`` and ``ppo_loss`` (the objectives), ``tasks`` (datasets and held-out splits), ``rewards`` (reward
functions), ``prompts`` (prompt encoding), ``evaluate`` (held-out accuracy), ``plotting`` (``rollout-plot``);
``trl_plugin`` serves the manager to TRL's GRPOTrainer. They use only what ``rollout/__init__.py`` exports.
"""
