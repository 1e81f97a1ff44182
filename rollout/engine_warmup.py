"""Compiling (and on CUDA capturing) an engine's static step shapes before the first request: ``Warmup``.

It owns what the warmup found (whether it ran, its seconds, the compilations and CUDA graph captures at its end), which
``Engine.stats`` reads to count those made after it.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
from tqdm.auto import tqdm

from .model_runner import ModelRunner
from .static_step import mark_warmed, warm_key, warmed_before, warmup_shapes

logger = logging.getLogger("rollout.engine.warmup")  # under the engine's logger, which users configure

__all__ = ["Warmup"]


class Warmup:
    """The warmup of one engine's runner (see ``Engine.warmup``).

    Args:
        runner: the engine's model runner.
        model: the engine's model (earlier warmups on it are remembered: ``static_step.warmed_before``).
        device: the engine's device; on CUDA the warmup runs on it whatever the calling thread's device is.

    Attributes:
        done: the warmup ran with something to compile or capture, or found it done by an earlier engine.
        seconds: its wall time (0.0 when an earlier engine did it); None when it never ran or had nothing to do.
        compiles_at, captures_at: the runner's compilations and CUDA graph captures when it ended.
    """

    def __init__(self, runner: ModelRunner, model: torch.nn.Module, device: torch.device) -> None:
        self.runner = runner
        self.model = model
        self.device = device
        self.done = False
        self.seconds: float | None = None
        self.compiles_at = 0
        self.captures_at = 0

    def counts(self) -> tuple[int, int]:
        """The runner's dynamo compilations and CUDA graph captures so far, warmup included."""
        graphs = self.runner.graphs
        return self.runner.compile_counter.count, graphs.num_captures if graphs is not None else 0

    def plan(self) -> list[tuple[str, tuple[int, ...]]]:
        """The (path, padded shape) pairs ``run`` runs: two per compiled or graphed path
        (``static_step.warmup_shapes``); empty when every path is eager."""
        rule = self.runner.padding
        if rule is None:
            return []
        return [(path, shape) for path in self.runner.static_paths for shape in warmup_shapes(path, rule)]

    def run(self, progress_bar: bool) -> float:
        """Run each shape of ``plan`` once (``ModelRunner.warmup``); returns the seconds it took.

        A no-op (logged at debug) when no path is compiled or graphed, when it already ran, and when an earlier engine
        on the same model object warmed up the same ``dynamic=True`` compile configs and padding
        (``static_step.warm_key``: its graphs serve any cache size).
        """
        plan = self.plan()
        if not plan:
            logger.debug("warmup: no path is compiled or CUDA-graphed; nothing to do")
            return 0.0
        if self.done:
            logger.debug("warmup: already done for this engine")
            return 0.0
        runner = self.runner
        assert runner.padding is not None  # a plan means a static path, which has a padding rule
        key = warm_key(runner.compile_configs, runner.cuda_graph_paths, runner.padding)
        if warmed_before(self.model, key):
            # dynamic=True graphs compiled by an earlier engine on this model: nothing to compile here.
            logger.debug("warmup: these step shapes were compiled by an earlier engine on this model")
            self.done, self.seconds = True, 0.0
            return 0.0
        t0 = time.perf_counter()
        device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with device, tqdm(total=len(plan), desc="rollout warmup", unit="shape", disable=not progress_bar) as bar:
            runner.warmup(plan, lambda: bar.update(1))
        self.seconds = time.perf_counter() - t0
        self.done = True
        self.compiles_at, self.captures_at = self.counts()
        mark_warmed(self.model, key)
        logger.info(
            "warmup: %d step shapes of the %s path(s) in %.1f s (%d compilations, %d CUDA graphs captured)",
            len(plan),
            " and ".join(runner.static_paths),
            self.seconds,
            self.compiles_at,
            self.captures_at,
        )
        return self.seconds
