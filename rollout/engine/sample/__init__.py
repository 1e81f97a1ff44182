"""The sampling room: the logits processors (``logits_processors``) and the sampler (``sampler``: temperature, top-k,
top-p and min-p, seeded draws independent of the batch, logprobs in the three modes, top logprobs, the logprobs of
scored positions).

May import the ground modules and ``engine.staging`` (a step's per-row values reach the device in one staged copy),
nothing else of rollout: not the scheduler, not the KV cache, not the worker.
"""

from rollout.engine.sample.logits_processors import apply_logits_processors
from rollout.engine.sample.sampler import (
    TopLogprobs,
    sample_tokens,
    score_logprobs,
    seeded_uniforms,
    step_uniforms,
    unpack_top_logprobs,
)

__all__ = [
    "TopLogprobs",
    "apply_logits_processors",
    "sample_tokens",
    "score_logprobs",
    "seeded_uniforms",
    "step_uniforms",
    "unpack_top_logprobs",
]
