"""rollout's manager as the generation backend of TRL's ``GRPOTrainer`` (TRL 1.16).

``RolloutGRPOTrainer`` is a ``GRPOTrainer`` whose completions come from one persistent
``ContinuousBatchingManager`` built on the unwrapped policy model itself (the same
object: no weight copy, no second model). Everything else, from rewards and advantages
to the loss, the importance-sampling correction and logging, is TRL's own code.

Which TRL hook, and why:

- ``_generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
  has_tool_images=False) -> (completion_ids, logprobs)`` is overridden. It is the one
  method where TRL itself chooses between its backends (vLLM, transformers'
  continuous batching, ``model.generate``), and its contract is small: token-id
  prompts in (already chat-templated and repeated ``num_generations`` times), one
  list of completion ids and one list of per-token sampling logprobs out. The tool
  loop calls it as well, so tool calling goes through the manager too. Overriding
  ``_generate`` or ``_generate_and_score_completions`` instead would mean copying
  hundreds of lines; ``rollout_func`` (TRL's public hook) receives untokenised prompts
  and still leaves the correction off, because of the next point.
- TRL only applies its importance-sampling correction, computes
  ``old_per_token_logps`` and logs ``sampling/sampling_logp_difference/*`` and
  ``sampling/importance_sampling_ratio/*`` when ``self.use_vllm`` is true (four ``if
  self.use_vllm and self.vllm_importance_sampling_correction`` sites in
  ``_generate_and_score_completions`` and ``_compute_loss``). The trainer therefore
  sets the *instance* attribute ``use_vllm = True`` after ``GRPOTrainer.__init__``;
  ``args.use_vllm`` stays False, so TRL never imports vLLM nor builds its
  ``VLLMGeneration``. Our logprobs then take exactly the path of vLLM's: they become
  ``sampling_per_token_logps``, and ``vllm_importance_sampling_mode`` / ``_clip_min`` /
  ``_clip_max`` apply unchanged. ``vllm_mode`` is set to ``"rollout"`` so the tool loop
  takes its non-colocated branch (context length from the model config).

Weights and pausing: the trainer holds ``manager.pause()`` at all times except inside
the generation call, so TRL's scoring forwards, the training forward/backward and the
optimizer step all run while the manager's loop is parked between steps. A
``TrainerCallback.on_optimizer_step`` (called right after ``optimizer.step()``) then
calls ``manager.update_weights(None)``: the parameters were changed in place on the
shared model, so this only bumps the weight version (prefix-cache blocks of older
versions are never reused). ``manager.weight_version`` thus counts the optimizer
steps of the ``train()`` call.

Lifecycle: the manager is created at the first generation (after TRL and accelerate
have placed the model) and destroyed when ``train()`` returns or raises, which
restores the model's attention implementation; ``evaluate()`` called outside
``train()`` does the same for its own manager.

Structured outputs: ``GRPOConfig.vllm_structured_outputs_regex`` is honoured as TRL's vLLM backend honours it:
every generation (training, evaluation, the tool loop's turns) is constrained to the regex
(``rollout.StructuredOutputs(regex=...)``, compiled once against the trainer's tokenizer), and the logprobs
stay the model's own, unmasked ones (vLLM's default ``raw_logprobs``), so TRL's importance-sampling ratio
compares the same function its training forward computes.

Batch invariance: with ``ContinuousBatchingConfig(batch_invariant=True)`` the engine runs rollout's batch-invariant
kernels and ``_get_per_token_logps_and_entropies`` (TRL's one scoring and training forward) runs inside
``rollout.batch_invariant()`` (``training_step`` too, whose backward recomputes the forward under gradient
checkpointing), and TRL's fused LM head (``add_fused_lm_head``: the vocabulary in tiles with an online logsumexp,
the logits times 1/T) is replaced by its plain form, ``log_softmax(logits / T)`` of the whole vocabulary
(``_plain_lm_head``: the engine's formula, at the memory cost of the [B, T, V] logits). TRL's recomputed logprobs then
equal the sampling logprobs bitwise, so ``sampling/sampling_logp_difference/max`` is 0 and the importance-sampling
ratio 1.0 exactly while the weights have not moved.

Limits: text-only models that rollout can page (``PreTrainedModel``; no PEFT wrapper,
no DeepSpeed ZeRO-3 or FSDP sharding); no ``min_p``, ``repetition_penalty``,
``generation_kwargs`` or ``rollout_func``. The logprobs are ``log_softmax(logits / T)``
of the sampled token (``logprobs_mode="temperature"``), the quantity TRL's training
forward computes; vLLM's ``processed_logprobs`` would also renormalise over the
top-k/top-p support, which this does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import time
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context
from trl.models.utils import disable_gradient_checkpointing

from rollout import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    GenerationOutput,
    RequestStatus,
    SamplingParams,
    StructuredOutputs,
    batch_invariant,
    init_continuous_batching,
)

from .setup import training_memory_percent

logger = logging.getLogger(__name__)

# The overridden method's parameters in TRL 1.16; checked at construction so that a TRL
# release that changes the seam fails loudly instead of silently bypassing the manager.
_EXPECTED_PARAMS = ("prompt_ids", "images", "multimodal_fields", "num_generations")


class _WeightSyncCallback(TrainerCallback):
    """Records each optimizer step with the manager (``update_weights(None)``)."""

    def __init__(self, trainer: RolloutGRPOTrainer) -> None:
        self._trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._trainer._record_optimizer_step()


class RolloutGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` that generates with rollout's continuous-batching manager.

    Takes every argument of ``GRPOTrainer``, plus ``continuous_batching_config``. The
    sampling values come from ``GRPOConfig``: ``temperature``, ``top_p``, ``top_k``,
    ``max_completion_length``, ``vllm_structured_outputs_regex`` (every completion matches it), and the
    eos ids TRL resolved (tokenizer's and model's).
    The G = ``num_generations`` copies of a prompt are queued next to each other and
    share the prompt's full KV blocks through the prefix cache.

    Args:
        *args, **kwargs: as for ``trl.GRPOTrainer``.
        continuous_batching_config: engine settings (block size, cache size, token
            budget...). ``return_logprobs`` is forced to True; ``logprobs_mode`` must be
            ``"temperature"``; an unset ``seed`` becomes ``args.seed`` plus the process index.
            With neither ``num_blocks`` nor ``max_memory_percent`` set, the cache takes
            ``trainers.setup.training_memory_percent(model)`` of the usable memory when the manager is
            built (at the first generation, before any gradient or optimizer state exists): the
            room of the gradients and AdamW moments (3 x the trainable parameters' bytes) set
            aside, 0.5 of the rest, TRL's own default for its continuous-batching path.

    Attributes:
        rollout_structured_outputs: the regex constraint of every generation
            (``args.vllm_structured_outputs_regex``), or None.
        rollout_summary: after the manager is destroyed, its last statistics
            (``weight_version``, ``num_generated_tokens``, ``num_prompt_tokens_computed``,
            ``prefix_cache_hit_blocks``, ``num_forks`` (samples that took a sibling's prompt
            instead of computing it, see docs/kv_cache.md), ``num_engine_steps``,
            ``generation_seconds``); None before.

    Raises:
        ValueError: an option the manager cannot honour (``min_p``, ``repetition_penalty``
            != 1, ``generation_kwargs``, ``rollout_func``, ``use_vllm``,
            ``use_transformers_continuous_batching``, a ``logprobs_mode`` other than
            ``"temperature"``); a ``vllm_structured_outputs_regex`` that xgrammar cannot parse, or
            without xgrammar installed (the message names the field).
        TypeError: the installed TRL's ``_generate_single_turn`` is not the expected seam.
    """

    def __init__(self, *args: Any, continuous_batching_config: ContinuousBatchingConfig | None = None, **kwargs: Any):
        _check_trl_seam()
        if kwargs.get("rollout_func") is not None:
            raise ValueError("RolloutGRPOTrainer generates with rollout's manager; rollout_func is not supported")
        cb = continuous_batching_config or ContinuousBatchingConfig()
        if cb.logprobs_mode != "temperature":
            raise ValueError(
                f"logprobs_mode must be 'temperature' (log_softmax(logits / T), what TRL's training forward computes), "
                f"got {cb.logprobs_mode!r}"
            )
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is not None and (config.use_vllm or config.use_transformers_continuous_batching):
            raise ValueError(
                "RolloutGRPOTrainer is the generation backend: set use_vllm=False and "
                "use_transformers_continuous_batching=False"
            )
        super().__init__(*args, **kwargs)
        args_ = self.args
        unsupported = {
            "min_p": self.min_p is not None,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "generation_kwargs": bool(args_.generation_kwargs),
        }
        bad = [name for name, is_set in unsupported.items() if is_set]
        if bad:
            raise ValueError(f"rollout's sampler does not support {bad}; unset them in GRPOConfig")
        if not isinstance(self.max_completion_length, int) or self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be an int >= 1, got {self.max_completion_length!r}")
        self.rollout_structured_outputs = _regex_constraint(args_.vllm_structured_outputs_regex)
        # One sampling stream per process, as TRL's own `set_seed(args.seed, device_specific=True)`.
        seed = cb.seed if cb.seed is not None else args_.seed + self.accelerator.process_index
        self.rollout_cb_config = dataclasses.replace(cb, return_logprobs=True, seed=seed)
        # Route TRL's importance-sampling correction (gated on `use_vllm`) to our logprobs;
        # see the module docstring. `args.use_vllm` stays False: no vLLM is built.
        self.use_vllm = True
        self.vllm_mode = "rollout"
        self._rollout_manager: ContinuousBatchingManager | None = None
        self._pause: contextlib.AbstractContextManager | None = None
        self._generation_seconds = 0.0
        self.rollout_summary: dict[str, float] | None = None
        self.add_callback(_WeightSyncCallback(self))
        if self.rollout_cb_config.batch_invariant:
            _plain_lm_head(self.model, self.temperature)

    def _invariance(self) -> contextlib.AbstractContextManager[None]:
        return batch_invariant() if self.rollout_cb_config.batch_invariant else contextlib.nullcontext()

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's scoring and training forward, inside ``rollout.batch_invariant()`` when the engine runs
        batch-invariant."""
        with self._invariance():
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The forward and the backward too: under gradient checkpointing (TRL's default) the backward recomputes
        the forward, which must take the same operations."""
        with self._invariance():
            return super().training_step(*args, **kwargs)

    # ------------------------------------------------------------------ manager lifecycle
    @property
    def rollout_manager(self) -> ContinuousBatchingManager | None:
        """The live manager, or None before the first generation and after ``train()``."""
        return self._rollout_manager

    @property
    def rollout_paused(self) -> bool:
        """True while this trainer holds the manager paused (always, outside generation)."""
        return self._pause is not None

    def _ensure_manager(self) -> ContinuousBatchingManager:
        if self._rollout_manager is None:
            model = self.accelerator.unwrap_model(self.model)
            # Exactly TRL's sampling values: the model's generation config (a checkpoint's top_k, top_p
            # or repetition_penalty) must not reach the rollouts, or TRL's importance-sampling ratio
            # compares the policy with a distribution it was not sampled from.
            gc = SamplingParams(
                max_new_tokens=self.max_completion_length,
                do_sample=True,
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                eos_token_ids=tuple(self.eos_token_ids),
            )
            cb = self.rollout_cb_config
            if cb.num_blocks is None and cb.max_memory_percent is None:
                cb = self.rollout_cb_config = dataclasses.replace(cb, max_memory_percent=training_memory_percent(model))
            # The tokenizer compiles the structured-output constraint; a processor's text tokenizer if TRL holds one.
            tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
            manager = init_continuous_batching(model, gc, cb, tokenizer=tokenizer)
            manager.start()
            logger.info("rollout manager started on %s (%s)", type(model).__name__, self.rollout_cb_config)
            self._rollout_manager = manager
            self._generation_seconds = 0.0
            self._hold_pause()
        return self._rollout_manager

    def _hold_pause(self) -> None:
        assert self._rollout_manager is not None and self._pause is None
        pause = self._rollout_manager.pause()
        pause.__enter__()
        self._pause = pause

    def _release_pause(self) -> None:
        pause, self._pause = self._pause, None
        if pause is not None:
            pause.__exit__(None, None, None)

    @contextlib.contextmanager
    def _generation_window(self) -> Iterator[ContinuousBatchingManager]:
        """Let the manager's loop run for the duration of the block; paused again on exit."""
        manager = self._ensure_manager()
        self._release_pause()
        try:
            yield manager
        finally:
            self._hold_pause()

    def close_rollout_manager(self) -> None:
        """Destroy the manager (restoring the model's attention) and keep its last statistics."""
        manager, self._rollout_manager = self._rollout_manager, None
        if manager is None:
            return
        self._release_pause()
        try:
            stats = manager.engine.stats
            self.rollout_summary = {
                "weight_version": manager.weight_version,
                "num_generated_tokens": stats.num_generated_tokens,
                "num_prompt_tokens_computed": stats.num_prompt_tokens_computed,
                "prefix_cache_hit_blocks": stats.num_prefix_cache_hit_blocks,
                "num_forks": stats.num_forks,
                "num_engine_steps": stats.num_steps,
                "generation_seconds": self._generation_seconds,
            }
        finally:
            manager.stop(hard_stop=True)  # requests left by an error are dropped, not run to the end
            manager.destroy()

    def _record_optimizer_step(self) -> None:
        """After ``optimizer.step()`` (taken under the pause): bump the manager's weight version."""
        if self._rollout_manager is None:
            return
        if self._pause is None:  # cannot happen: the pause is released only inside generation
            raise RuntimeError("the optimizer stepped while the rollout manager was running")
        self._rollout_manager.update_weights(None)

    def train(self, *args: Any, **kwargs: Any):
        """``GRPOTrainer.train``; the manager is destroyed when it returns or raises."""
        try:
            return super().train(*args, **kwargs)
        finally:
            self.close_rollout_manager()

    def evaluate(self, *args: Any, **kwargs: Any):
        """``GRPOTrainer.evaluate``; a manager created for it (outside ``train``) is destroyed after."""
        owned = self._rollout_manager is None
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            if owned:
                self.close_rollout_manager()

    # ------------------------------------------------------------------ generation
    def rollout_generate(self, prompt_ids: Sequence[Sequence[int]], **sampling: Any) -> list[GenerationOutput]:
        """Generate one completion per prompt on the manager, with TRL's sampling values.

        Args:
            prompt_ids: token-id prompts; equal prompts share their full KV blocks.
            **sampling: overrides of ``add_request``'s sampling arguments (for example
                ``do_sample=False`` for a greedy check).

        Returns:
            The finished outputs, in input order, each with one logprob per generated token.

        Raises:
            RuntimeError: a request did not finish (its error is named).
        """
        params = {
            "max_new_tokens": self.max_completion_length,
            "do_sample": True,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "eos_token_id": list(self.eos_token_ids),
            "structured_outputs": self.rollout_structured_outputs,
        }
        params.update(sampling)
        model = self.accelerator.unwrap_model(self.model)
        start = time.perf_counter()
        with (
            disable_gradient_checkpointing(model, self.args.gradient_checkpointing_kwargs),
            self._generation_window() as manager,
        ):
            ids = manager.add_requests([list(p) for p in prompt_ids], **params)
            outputs = [manager.get_result(rid) for rid in ids]
        self._generation_seconds += time.perf_counter() - start
        for rid, out in zip(ids, outputs):
            if out is None or out.status != RequestStatus.FINISHED:
                error = "the manager ended" if out is None else f"{out.status.name}: {out.error}"
                raise RuntimeError(f"rollout request {rid} did not finish ({error})")
        return outputs

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's backend seam: completions and their sampling logprobs from the manager.

        Args:
            prompt_ids: list of token-id lists, each prompt already repeated
                ``num_generations`` times by TRL's sampler (G consecutive copies).
            images, multimodal_fields, has_tool_images: must be empty (text only).
            num_generations: G; unused, the copies are already in ``prompt_ids``.

        Returns:
            (completion_ids, logprobs): per sample, the generated ids (the stop token
            included, as vLLM returns them) and one float per id, log_softmax(logits / T).
        """
        if images is not None or multimodal_fields or has_tool_images:
            raise NotImplementedError("RolloutGRPOTrainer generates for text-only models")
        with profiling_context(self, "rollout.generate"):
            outputs = self.rollout_generate(prompt_ids)
        mode = "train" if self.model.training else "eval"
        num_prompt = sum(len(o.prompt_ids) for o in outputs)
        num_cached = sum(o.num_cached_prompt_tokens for o in outputs)
        self._metrics[mode]["rollout/cached_prompt_fraction"].append(num_cached / max(num_prompt, 1))
        self._metrics[mode]["rollout/weight_version"].append(float(self._rollout_manager.weight_version))
        return [o.generated_tokens for o in outputs], [o.logprobs for o in outputs]


def _plain_lm_head(model: Any, temperature: float) -> None:
    """Make ``model(..., labels=labels, fused_lm_head=True)`` (TRL's fused-LM-head contract, ``FusedCausalLMOutput``:
    per-token ``log_probs`` and ``entropy`` of the next-token labels, 0 where a label is -100) compute
    ``log_softmax(logits / T)`` over the whole vocabulary, the formula of the engine's logprobs; other calls run the
    forward they ran."""
    from trl.trainer.utils import FusedCausalLMOutput

    patched = model.forward

    def forward(
        self: Any, *args: Any, fused_lm_head: bool = False, labels: Any = None, shift_labels: Any = None,
        num_items_in_batch: Any = None, **kwargs: Any,
    ) -> Any:  # fmt: skip
        if not fused_lm_head:
            extra = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            return patched(*args, **{k: v for k, v in extra.items() if v is not None}, **kwargs)
        kwargs["use_cache"] = False
        logits = type(self).forward(self, *args, **kwargs).logits
        if shift_labels is None:
            logits, labels = logits[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        mask = labels != -100
        logps = torch.log_softmax(logits.float() / temperature, dim=-1)
        log_probs = logps.gather(-1, labels.clamp(min=0)[..., None])[..., 0].masked_fill(~mask, 0.0)
        entropy = -(logps.exp() * logps).sum(-1).masked_fill(~mask, 0.0)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy, label_mask=mask)

    model.forward = types.MethodType(forward, model)


def _regex_constraint(regex: str | None) -> StructuredOutputs | None:
    """``StructuredOutputs(regex=regex)`` (None for None), checked now: a bad regex fails at construction.

    Raises:
        ValueError: xgrammar cannot parse it, or is not installed; the message names ``vllm_structured_outputs_regex``.
    """
    if regex is None:
        return None
    try:
        return StructuredOutputs(regex=regex)
    except (ValueError, ImportError) as e:
        raise ValueError(f"vllm_structured_outputs_regex: {e}") from e


def _check_trl_seam() -> None:
    params = inspect.signature(GRPOTrainer._generate_single_turn).parameters
    if not all(name in params for name in _EXPECTED_PARAMS):
        raise TypeError(
            f"trl.GRPOTrainer._generate_single_turn has parameters {list(params)}, not the TRL 1.16 seam "
            f"{list(_EXPECTED_PARAMS)} that RolloutGRPOTrainer overrides; pin trl or update trainers/trl_plugin.py"
        )
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    if "self.use_vllm and self.vllm_importance_sampling_correction" not in source:
        raise TypeError(
            "trl.GRPOTrainer no longer gates its importance-sampling correction on `self.use_vllm`; "
            "update trainers/trl_plugin.py"
        )
