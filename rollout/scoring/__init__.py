"""Offline scoring: per-token logprobs of given completions through an engine of its own (``offline``: ``score``,
``score_with_engine``), and the ``rollout-score`` command (``cli``). A live manager scores beside generation with
``add_scoring_requests`` instead (rollout.manager).

May import: ``rollout.engine`` (its face), ``rollout.weights``, ``rollout.lora`` and the ground modules.
"""

from rollout.scoring.offline import ScoreOutput, score, score_with_engine

__all__ = ["ScoreOutput", "score", "score_with_engine"]
