"""Shared helpers of the test suite: reference generation, teacher forcing, running an engine, pacing a manager."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from rollout import Engine, GenerationOutput, RequestStatus


def assert_close(actual: Sequence[float] | torch.Tensor, expected: Sequence[float] | torch.Tensor, atol: float) -> None:
    """The one float comparison of the suite: elementwise |a - e| <= atol, same length."""
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


def reference_greedy(
    model: PreTrainedModel, prompt: list[int], max_new_tokens: int, eos_token_id: int | None
) -> list[int]:
    """``model.generate`` greedy on one prompt (no padding), generated tokens only."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def reference_generate(model: PreTrainedModel, prompt: list[int], max_new_tokens: int, **kwargs: object) -> list[int]:
    """``model.generate`` greedy on one prompt (no padding) with extra generation settings (a processor,
    ``stop_strings`` with ``tokenizer``, another ``eos_token_id``...); generated tokens only."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


def teacher_forced_logprobs(
    model: PreTrainedModel, prompt: list[int], completion: list[int], temperature: float = 1.0
) -> list[float]:
    """log_softmax(logits / T) of each completion token under one plain forward of prompt + completion."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return [lp[len(prompt) - 1 + i, tok].item() for i, tok in enumerate(completion)]


def run_engine(engine: Engine, max_steps: int = 10_000) -> dict[str, GenerationOutput]:
    """Step an engine until no request is left; outputs of the requests that ended, by id."""
    outputs: dict[str, GenerationOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        for req in engine.step():
            if req.status == RequestStatus.FINISHED:
                outputs[req.request_id] = req.to_output()
    raise AssertionError(f"engine did not finish within {max_steps} steps")


class StepControl:
    """Watches and paces the engine steps of a manager's loop, from the test side.

    It wraps ``manager.engine.step`` (through pytest's ``monkeypatch``, so production code keeps no
    test hook): each step is counted when it starts and when it ends, may wait for the test's
    permission (``hold``/``allow``/``release``), may first run ``before(step_number)`` (to inject a
    failure) and may take ``delay`` extra seconds (a slow forward, so that the test's next call
    lands while requests are in flight).
    """

    def __init__(self, monkeypatch, manager, delay: float = 0.0) -> None:  # noqa: ANN001
        self._cond = threading.Condition()
        self.started = 0
        self.finished = 0
        self.delay = delay
        self.before: Callable[[int], None] | None = None
        self._allowed: int | None = None  # None: every step may run
        original = manager.engine.step

        def step() -> list:
            with self._cond:
                if not self._cond.wait_for(lambda: self._allowed is None or self._allowed > 0, timeout=60):
                    raise TimeoutError("a held engine step was never allowed")
                if self._allowed is not None:
                    self._allowed -= 1
                self.started += 1
                number = self.started
                self._cond.notify_all()
            try:
                if self.before is not None:
                    self.before(number)
                if self.delay:
                    time.sleep(self.delay)
                return original()
            finally:
                with self._cond:
                    self.finished += 1
                    self._cond.notify_all()

        monkeypatch.setattr(manager.engine, "step", step)

    def hold(self) -> None:
        """Steps wait from now on until ``allow`` or ``release``."""
        with self._cond:
            self._allowed = 0

    def allow(self, n: int) -> None:
        """Let ``n`` more steps run (after ``hold``)."""
        with self._cond:
            self._allowed = (self._allowed or 0) + n
            self._cond.notify_all()

    def release(self) -> None:
        """Let every step run."""
        with self._cond:
            self._allowed = None
            self._cond.notify_all()

    def wait_started(self, n: int, timeout: float = 30.0) -> bool:
        """Wait until ``n`` steps have started; False after ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self.started >= n, timeout)

    def wait_finished(self, n: int, timeout: float = 30.0) -> bool:
        """Wait until ``n`` steps have ended; False after ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self.finished >= n, timeout)
