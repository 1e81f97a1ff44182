"""The console entry points of the benchmark commands: parse the flags (``arguments``), then import the benchmark.

``rollout-bench``, ``rollout-bench-scoring``, ``rollout-bench-manager`` and ``rollout-bench-serve`` (and
``scripts/bench.py``, ``bench_scoring.py``, ``bench_manager.py``) run these: a bad flag is answered with the usage at
once, before torch, transformers and the systems are imported. Each benchmark module's own ``main`` does the same
after its imports (``python -m benchmarks.generation``).
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.arguments import generation_parser, manager_parser, scoring_parser, serving_parser


def bench_main(argv: Sequence[str] | None = None) -> int:
    """``rollout-bench``: run the generation benchmark (``benchmarks.generation``); 0 when it ran."""
    parser = generation_parser()
    args = parser.parse_args(argv)
    from benchmarks.generation import check_args, run

    run(check_args(args, parser))
    return 0


def bench_scoring_main(argv: Sequence[str] | None = None) -> int:
    """``rollout-bench-scoring``: run the scoring benchmark (``benchmarks.scoring``); 0 when it ran."""
    args = scoring_parser().parse_args(argv)
    from benchmarks.scoring import run

    run(args)
    return 0


def bench_manager_main(argv: Sequence[str] | None = None) -> int:
    """``rollout-bench-manager``: run the manager benchmark (``benchmarks.manager``); 0 when it ran."""
    args = manager_parser().parse_args(argv)
    from benchmarks.manager import run

    run(args)
    return 0


def bench_serve_main(argv: Sequence[str] | None = None) -> int:
    """``rollout-bench-serve``: run the serving benchmark (``benchmarks.serving``); 0 when it ran."""
    args = serving_parser().parse_args(argv)
    from benchmarks.serving import run

    run(args, argv)
    return 0
