"""The model's weights: loading and provisioning (``loading``), introspection of a model for the engine
(``model_info``), in-place copies, the weight fingerprint and the per-model version watch (``versions``), and the
trainer-to-server transfer group with its packed buckets (``transfer``).

May import: the ground modules only (``rollout.checks``, ``config``, ``sampling_params``, ``stop_strings``,
``requests``). Every other room may import it (tests/test_layering.py holds the table).
"""

from rollout.weights.loading import load_model, rollout_home
from rollout.weights.model_info import UnsupportedModelError, model_context_length

__all__ = ["UnsupportedModelError", "load_model", "model_context_length", "rollout_home"]
