"""Held-out evaluation of a policy: greedy answers through a rollout backend, scored by their last number.

A completion is right when the last number in its text equals the problem's answer (after
normalisation: "1,234" = "1234", "7.0" = "7"). The rule does not look for an "Answer:" line, so a
model cannot score by format alone, and it is the rule the GRPO trainer's ``eval_accuracy`` and
``scripts/eval_grpo.py`` share.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import rollout

from .backend import RolloutBackend
from .prompts import encode_prompt, eos_token_ids
from .tasks import normalize_number

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number in ``text``, normalised; None when it has none."""
    numbers = _NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def is_correct(text: str, answer: str) -> bool:
    """True when the last number of ``text`` equals ``answer`` (both normalised)."""
    predicted = last_number(text)
    return predicted is not None and predicted == normalize_number(str(answer))


@dataclass
class EvalResult:
    """Counts of one evaluation (summable across processes).

    Attributes:
        num_correct: completions whose last number is the answer.
        num_problems: problems evaluated.
        num_tokens: generated tokens of all completions.
        samples: one dict per problem (``question``, ``answer``, ``completion``, ``correct``).
    """

    num_correct: int
    num_problems: int
    num_tokens: int
    samples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        """Fraction right, in [0, 1]; NaN for no problems."""
        return self.num_correct / self.num_problems if self.num_problems else float("nan")

    @property
    def completion_len_mean(self) -> float:
        """Mean completion length in tokens; NaN for no problems."""
        return self.num_tokens / self.num_problems if self.num_problems else float("nan")


def evaluate_greedy(
    backend: RolloutBackend,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    answers: Sequence[str],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    questions: Sequence[str] | None = None,
    structured_outputs: rollout.StructuredOutputs | None = None,
) -> EvalResult:
    """Greedy completions of the prompts on a running backend, scored by ``is_correct``.

    The requests are queued under ``backend.pause()`` so a local engine admits them in one go: the
    steps, hence the completions, do not depend on thread timing.

    Args:
        backend: a started rollout backend on the model to evaluate (a manager, a server).
        tokenizer: decodes the completions (special tokens skipped).
        prompt_ids: one token-id list per problem.
        answers: the expected final number of each problem.
        max_new_tokens: most tokens per completion.
        eos_token_ids: token ids that end a completion.
        questions: the problems' text, kept in ``samples`` (optional).
        structured_outputs: what every answer must match; None (the default): unconstrained.

    Returns:
        The counts and the per-problem samples.

    Raises:
        ValueError: ``prompt_ids`` and ``answers`` differ in length.
        RuntimeError: a request did not finish (the message names it and its error).
    """
    if len(prompt_ids) != len(answers):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(answers)} answers")
    if not prompt_ids:
        return EvalResult(0, 0, 0)
    with backend.pause():
        ids = backend.add_requests(
            prompt_ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(eos_token_ids),
            structured_outputs=structured_outputs,
        )
    outputs = []
    for rid in ids:
        out = backend.get_result(rid)
        if out is None or out.status != rollout.RequestStatus.FINISHED:
            raise RuntimeError(f"evaluation request {rid} did not finish: {out.error if out else 'backend ended'}")
        outputs.append(out)
    texts = tokenizer.batch_decode([o.generated_tokens for o in outputs], skip_special_tokens=True)
    samples = []
    correct = 0
    for i, (text, answer) in enumerate(zip(texts, answers)):
        ok = is_correct(text, answer)
        correct += ok
        samples.append(
            {"question": questions[i] if questions else None, "answer": str(answer), "completion": text, "correct": ok}
        )
    return EvalResult(correct, len(outputs), sum(len(o.generated_tokens) for o in outputs), samples)


def evaluate_model(
    model: Any,
    tokenizer: Any,
    heldout: Any,
    prompt_column: str = "prompt",
    max_new_tokens: int = 96,
    max_prompt_length: int | None = None,
    engine_config: rollout.ContinuousBatchingConfig | None = None,
) -> EvalResult:
    """Held-out accuracy of a model on its own manager (started and destroyed here).

    Args:
        model, tokenizer: the policy.
        heldout: a ``datasets.Dataset`` with ``prompt_column`` and ``answer`` (and optionally
            ``question``) columns.
        prompt_column: the column holding each prompt (text or chat messages).
        max_new_tokens: most tokens per greedy completion.
        max_prompt_length: prompts keep their last this many tokens (None: all).
        engine_config: the engine's settings; when it sets no ``num_blocks``, the cache holds
            every problem at once (its prompt plus ``max_new_tokens``) rather than a share of free
            memory.

    Returns:
        The counts and samples (see ``evaluate_greedy``).
    """
    eos = eos_token_ids(model, tokenizer)
    prompts = [encode_prompt(tokenizer, p, max_prompt_length) for p in heldout[prompt_column]]
    config = engine_config or rollout.ContinuousBatchingConfig()
    if config.num_blocks is None:
        block = config.resolved_page_size(next(model.parameters()).device.type)
        blocks = sum(-(-(len(p) + max_new_tokens) // block) for p in prompts) + 8
        config = dataclasses.replace(config, num_blocks=blocks)
    # Plain greedy, as the trainer's own evaluation: no processor of the model's generation config.
    params = rollout.SamplingParams(max_new_tokens=max_new_tokens, do_sample=False, eos_token_ids=tuple(eos))
    manager = rollout.ContinuousBatchingManager(model, params, config)
    manager.start()
    try:
        return evaluate_greedy(
            manager,
            tokenizer,
            prompts,
            heldout["answer"],
            max_new_tokens,
            eos,
            questions=heldout["question"] if "question" in heldout.column_names else None,
        )
    finally:
        manager.destroy()


def evaluate_sharded(
    backend: RolloutBackend,
    tokenizer: Any,
    accelerator: Any,
    heldout: Any,
    encode: Any,
    prompt_column: str,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    structured_outputs: rollout.StructuredOutputs | None = None,
) -> tuple[EvalResult, list[dict[str, Any]]]:
    """Greedy held-out accuracy over all processes of a run, each answering its shard on its own backend.

    Args:
        backend: this process's started rollout backend on the policy.
        tokenizer: decodes the completions.
        accelerator: the run's ``accelerate.Accelerator`` (sums the counts, gathers the samples).
        heldout: a ``datasets.Dataset`` with ``prompt_column`` and ``answer`` (optionally ``question``).
        encode: token ids of one prompt (the trainer's truncation applied).
        prompt_column: the column holding the prompts.
        max_new_tokens: most tokens per completion.
        eos_token_ids: ids that end a completion.
        structured_outputs: the answers' constraint (the trainer's ``eval_structured_outputs``: None, unconstrained,
            unless ``structured_outputs_eval`` is set).

    Returns:
        The run-wide counts, and every process's samples (complete on the main process).
    """
    from accelerate.utils import gather_object

    rank, world = accelerator.process_index, accelerator.num_processes
    shard = heldout.select(range(rank, len(heldout), world))
    result = evaluate_greedy(
        backend,
        tokenizer,
        [encode(p) for p in shard[prompt_column]],
        shard["answer"],
        max_new_tokens,
        eos_token_ids,
        questions=shard["question"] if "question" in shard.column_names else None,
        structured_outputs=structured_outputs,
    )
    totals = accelerator.reduce(
        torch.tensor(
            [result.num_correct, result.num_problems, result.num_tokens],
            dtype=torch.float64,
            device=accelerator.device,
        ),
        reduction="sum",
    )
    samples = gather_object(result.samples) if world > 1 else result.samples
    return EvalResult(int(totals[0]), int(totals[1]), int(totals[2])), samples
