"""An engine's warmup (``Warmup``): its padded step shapes compiled, and on CUDA captured, before the first request.

Each (path, padded shape) of the plan, two per compiled or graphed path (``worker.forward.warmup_shapes``), runs once on
a synthetic batch that touches only the padding block (``ModelRunner.warmup``): requests, blocks, the prefix cache, the
random generators and the request counters are as they were. It runs once per engine, and not at all when an earlier
engine on the same model warmed up the same ``dynamic=True`` configs and padding (``worker.forward.warm_key``). What it
leaves (its seconds, the compilations and captures at its end) feeds ``Engine.stats``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from rollout.engine.worker.forward import mark_warmed, warm_key, warmed_before, warmup_shapes
from rollout.engine.worker.onednn import OneDNNLinear
from rollout.engine.worker.regions import warm
from rollout.engine.worker.runner import ModelRunner

__all__ = ["Warmup"]

logger = logging.getLogger(__name__)


class Warmup:
    """The warmup of one engine's runner.

    Args:
        model: the engine's model (the warm key of its compiled shapes is kept on it).
        runner: the engine's model runner.

    Attributes:
        done: ``run`` compiled or captured the plan, or found it warmed on this model by an earlier engine.
        seconds: what ``run`` took (0.0 when an earlier engine had done it); None until then.
        counts: the runner's (compilations, CUDA graph captures) when it ended.
    """

    def __init__(self, model: torch.nn.Module, runner: ModelRunner) -> None:
        self.model = model
        self.runner = runner
        self.done = False
        self.seconds: float | None = None
        self.counts = (0, 0)

    def compile_counts(self) -> tuple[int, int]:
        """The runner's dynamo compilations and CUDA graph captures so far, warmup included."""
        graphs = self.runner.graphs
        return self.runner.compile_counter.count, graphs.num_captures if graphs is not None else 0

    def compile_regions(self) -> float:
        """Compile the model's regions (``regional_compile``; the engine does when it is built): T = 1 and 2 tokens,
        since dynamo specialises size 1 and a dynamic graph for 2 serves every larger T; steps never compile (what
        does not match runs eagerly). Under what a step runs: the packed weights, the linear layers' mode.

        Returns:
            The seconds it took.
        """
        runner = self.runner
        t0 = time.perf_counter()
        packs = runner.packs.active() if runner.packs is not None else contextlib.nullcontext()
        with torch.inference_mode(), packs, OneDNNLinear() if runner.onednn else contextlib.nullcontext():
            warm(self.model, runner.device, (1, 2), runner.compile_counter.run)
        seconds = time.perf_counter() - t0
        logger.info(
            "regional_compile: the regions compiled in %.1f s (%d compilations)", seconds, self.compile_counts()[0]
        )
        return seconds

    def plan(self) -> list[tuple[str, tuple[int, ...]]]:
        """The (path, padded shape) pairs ``run`` runs: two per compiled or graphed path; empty when every path is
        eager."""
        rule = self.runner.padding
        if rule is None:
            return []
        return [(path, shape) for path in self.runner.static_paths for shape in warmup_shapes(path, rule)]

    def run(self, progress_bar: bool, quiesce: Callable[[], None]) -> float:
        """Compile (and on CUDA capture) each shape of ``plan`` once; a no-op (logged at debug) when there is nothing
        to compile, when it already ran, or when an earlier engine on the model warmed up the same shapes.

        Args:
            progress_bar: show a tqdm bar over the shapes.
            quiesce: finishes the engine's step in flight, which would run beside the warmup's forwards.

        Returns:
            The seconds it took (0.0 when there was nothing to do).
        """
        plan = self.plan()
        if not plan or self.done:
            logger.debug(
                "warmup: %s", "already done for this engine" if plan else "no compiled or graphed path; nothing to do"
            )
            return 0.0
        runner = self.runner
        assert runner.padding is not None  # a plan means a static path, which has a padding rule
        key = warm_key(runner.compile_configs, runner.cuda_graph_paths, runner.padding)
        if warmed_before(self.model, key):
            logger.debug("warmup: these step shapes were compiled by an earlier engine on this model")
            self.done, self.seconds = True, 0.0
            return 0.0
        quiesce()
        t0 = time.perf_counter()
        device = torch.cuda.device(runner.device) if runner.device.type == "cuda" else contextlib.nullcontext()
        with device, tqdm(total=len(plan), desc="rollout warmup", unit="shape", disable=not progress_bar) as bar:
            runner.warmup(plan, lambda: bar.update(1))
        self.seconds = time.perf_counter() - t0
        self.done = True
        self.counts = self.compile_counts()
        mark_warmed(self.model, key)
        logger.info(
            "warmup: %d step shapes of the %s path(s) in %.1f s (%d compilations, %d CUDA graphs captured)",
            len(plan),
            " and ".join(runner.static_paths),
            self.seconds,
            *self.counts,
        )
        return self.seconds
