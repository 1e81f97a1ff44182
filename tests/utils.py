"""Shared helpers of the test suite: reference generation, teacher forcing, running an engine, pacing a manager."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from rollout import GenerationOutput, RequestStatus, SamplingParams
from rollout.engine import Engine
from rollout.engine.worker.forward import CapturedGraph, CUDAGraphs
from rollout.engine.worker.inputs import StepBatch


def assert_close(actual: Sequence[float] | torch.Tensor, expected: Sequence[float] | torch.Tensor, atol: float) -> None:
    """The one float comparison of the suite: elementwise |a - e| <= atol, same length."""
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


def _ids(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """int64 [1, len(tokens)] on the device of the model's first parameter (a GPU model in test_cuda)."""
    return torch.tensor([tokens], device=next(model.parameters()).device)


def reference_greedy(
    model: PreTrainedModel, prompt: list[int], max_new_tokens: int, eos_token_id: int | None
) -> list[int]:
    """``model.generate`` greedy on one prompt (no padding), generated tokens only."""
    ids = _ids(model, prompt)
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
    ids = _ids(model, prompt + completion)
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


def generate_in_order(engine: Engine, prompts: list[list[int]], max_new_tokens: int = 10) -> list[GenerationOutput]:
    """Greedy outputs of the prompts (in order, no stop but ``max_new_tokens``'s), on an engine that is
    closed afterwards."""
    try:
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens), request_id=f"r{i}")
        outputs = run_engine(engine)
    finally:
        engine.close()
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def assert_greedy_agrees(
    actual: list[GenerationOutput],
    expected: list[GenerationOutput],
    prompts: list[list[int]],
    reference_model: PreTrainedModel,
    atol: float,
) -> None:
    """Greedy tokens equal, and logprobs within ``atol``, up to the first token where the two differ, which must
    be a near-tie: the fp32 ``reference_model``'s logprobs of the two tokens there within ``atol`` of each other.

    Two attention kernels in half precision round differently, and a random model has the odd near-tie
    (tiny_models' docstring); a wrong table, length or window flips tokens the fp32 model tells apart by
    nats, and fails.
    """
    for prompt, a, e in zip(prompts, actual, expected):
        tokens_a, tokens_e = a.generated_tokens, e.generated_tokens
        assert len(tokens_a) == len(tokens_e)
        j = next((i for i, (x, y) in enumerate(zip(tokens_a, tokens_e)) if x != y), len(tokens_a))
        assert_close(a.logprobs[:j], e.logprobs[:j], atol=atol)
        if j < len(tokens_a):
            with torch.no_grad():
                logits = reference_model(_ids(reference_model, prompt + tokens_a[:j])).logits[0, -1].float()
            logprobs = torch.log_softmax(logits, -1)
            gap = abs(logprobs[tokens_a[j]].item() - logprobs[tokens_e[j]].item())
            assert gap < atol, f"token {j} differs ({tokens_a[j]} vs {tokens_e[j]}) by {gap:.3f} nats in fp32"


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


class _ReplayByCalling:
    """A stand-in for a captured CUDA graph on CPU: replay runs the forward again on the graph's static inputs,
    with the ints (``varlen_max_seqlens``) it was captured with, as a replayed graph keeps its launch sizes."""

    def __init__(self, fn: Callable[[StepBatch], torch.Tensor], inputs: StepBatch, output: torch.Tensor) -> None:
        self.fn, self.inputs, self.output = fn, inputs, output

    def replay(self) -> None:
        self.output.copy_(self.fn(self.inputs))


class CPUGraphs(CUDAGraphs):
    """``CUDAGraphs`` on CPU: a capture keeps a copy of the batch (a step staged elsewhere is copied into it)."""

    def capture(self, fn: Callable[[StepBatch], torch.Tensor], batch: StepBatch) -> CapturedGraph:
        static = batch.clone()
        output = fn(static)
        return CapturedGraph(_ReplayByCalling(fn, static, output), static, output)
