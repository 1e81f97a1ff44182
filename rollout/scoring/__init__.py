"""Offline scoring: per-token logprobs of given completions through an engine of its own (``offline``: ``score``,
``score_with_engine``), and the ``rollout-score`` command (``cli``). A live manager scores beside generation with
``add_scoring_requests`` instead (rollout.manager).

May import: ``rollout.engine`` (its face), ``rollout.weights``, ``rollout.lora`` and the ground modules.
"""

from typing import TYPE_CHECKING

from rollout.lazy import lazy_face

if TYPE_CHECKING:  # at run time each name is imported on first use: ``rollout-score`` parses its flags before torch
    from rollout.scoring.offline import ScoreOutput, score, score_with_engine

__all__ = ["ScoreOutput", "score", "score_with_engine"]

_EXPORTS = {name: "rollout.scoring.offline" for name in __all__}

__getattr__, __dir__ = lazy_face(globals(), _EXPORTS)
