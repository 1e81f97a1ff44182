"""The recipe both trainers are: setup, the training loop, held-out evaluation, saving and the run folder, over a
rollout backend. GRPO and PPO (``trainers.grpo``, ``trainers.ppo``) supply only what differs.

The shape is torchtune's (``recipes/dev/grpo_full_finetune_distributed.py``): ``__init__`` composes the setup
steps; a step is ``generate_trajectory(batch, outputs) -> Trajectory`` (the batch scored, then the algorithm's
advantages) and ``train_on(trajectory) -> Stats`` (the algorithm's gradients and optimizer steps, as
``grpo_step``/``ppo_step``); ``metrics_row`` builds the step's metrics from those two records in one place, and
neither logs anything. The recipe is a base class with hooks rather than a component the algorithms hold: both
hooks read and write the same state (the accelerator, the model, its optimizer, the rollout queue).

What the recipe owns:
- setup, in this order (the steps in ``trainers.setup``): the accelerator and the output folder, the datasets
  and reward functions (a bad column fails before the model loads), the policy and tokenizer, the algorithm's
  modules and optimizer (``setup_model``), the rollout backend and the rollout queue;
- the weights: an algorithm changes the policy's weights only inside ``changing_weights()``, which holds the
  backend's pause and gives the backend the new weight version before it resumes (so no token is sampled
  under weights its version does not name);
- one step's frame (``train_step``): take the batch, build its trajectory, run the algorithm's step, build the
  metrics row and the step's wall-clock figures (``trainers.runs.TIMING_KEYS``: ``wait_rollout_s`` until the
  batch is complete, ``prepare_s`` for the trajectory, ``train_s`` for the algorithm's step, weight update
  included);
- the loop (``train``): held-out evaluation at step 0, every ``eval_steps`` and at the end, ``max_steps`` steps,
  the run folder (``trainers.runs``) and the trackers, the saved model and the summary.

The backend is a ``trainers.backend.RolloutBackend``: a ``rollout.ContinuousBatchingManager`` on the trained model
object, or ``trainers.remote.RemoteRollouts`` when ``rollout_server`` is set.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import datasets
import torch
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_scheduler

import rollout

from .backend import RolloutBackend
from .config import TrainerConfig
from .evaluate import evaluate_sharded
from .lora import LoraRollouts, lora_policy
from .prompts import encode_prompt
from .rewards import RewardFunc, compute_rewards
from .rollout_queue import PromptSampler, RolloutBatch, RolloutQueue
from .runs import RunFolder, flat_config, nanstd, sample_seed, summary
from .setup import rollout_backend, setup_accelerator, setup_data, setup_policy
from .trajectory import TrainerState, Trajectory

logger = logging.getLogger(__name__)


TrajectoryT = TypeVar("TrajectoryT", bound=Trajectory)
StatsT = TypeVar("StatsT")


class Recipe(abc.ABC, Generic[TrajectoryT, StatsT]):
    """A trainer with continuous-batching rollouts: setup, loop, evaluation, saving; the algorithm in the hooks.

    Args:
        config: the run's settings (validated).
        model, tokenizer: the policy; loaded from ``config.model`` with ``rollout.load_model`` when None.
        train_dataset: a ``datasets.Dataset`` with ``config.prompt_column`` and the columns the reward
            functions need; built from ``config.dataset`` when None.
        reward_funcs: callables with TRL's signature (or names/paths); ``config.reward_funcs`` when None.
        accelerator: an existing Accelerator; one is built otherwise (CPU when CUDA is absent, with
            ``config.mixed_precision``). A given one must agree with ``config.mixed_precision`` when that is set.
        eval_dataset: held-out problems (``config.prompt_column`` and ``answer`` columns) for ``eval_accuracy``;
            when None and ``train_dataset`` is None, the held-out split of ``config.dataset``
            (``trainers.tasks.build_datasets``); None with a given ``train_dataset``: no evaluation.

    Raises:
        ConfigError: a bad setting or a dataset without a needed column (the message names it); raised before
            the model is loaded. Among them: ``mixed_precision`` "fp16" without CUDA, a given accelerator whose
            mixed precision differs from ``config.mixed_precision``, and mixed precision (from the config or the
            launcher) with a ``dtype`` other than float32.
    """

    algo: ClassVar[str]  # "grpo", "ppo": the run folder's config file, generated folder names, trackers
    trajectory_in_pause: ClassVar[bool] = False  # hold the backend's pause while the trajectory is built
    progress_metrics: ClassVar[dict[str, str]] = {"reward": "reward_mean", "tok_s": "rollout_tokens_per_s"}

    # Set by ``setup_model``: the module trained (DDP-wrapped), its unwrapped form, the optimizer and schedule.
    model: torch.nn.Module
    unwrapped: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def __init__(
        self,
        config: TrainerConfig,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        train_dataset: datasets.Dataset | None = None,
        reward_funcs: Sequence[RewardFunc | str] | None = None,
        accelerator: Accelerator | None = None,
        eval_dataset: datasets.Dataset | None = None,
    ) -> None:
        self._t_created = time.perf_counter()  # the run's wall time counts the model load
        self.config = config
        acc, self.output_dir = setup_accelerator(config, accelerator, self.algo)
        self.accelerator = acc
        self.rank, self.world_size = acc.process_index, acc.num_processes
        # Data and rewards first: a bad column fails before the model loads.
        self.dataset, self.eval_dataset, self.reward_funcs, self.reward_names, self.reward_weights = setup_data(
            config, train_dataset, eval_dataset, reward_funcs, self.world_size
        )
        torch.manual_seed(config.seed)
        self.policy, self.tokenizer, self.pad_token_id, self.eos_token_ids = setup_policy(config, model, tokenizer)
        # A LoRA run trains peft's adapter over a tree of its own (``trainers.lora``); the engine keeps ``policy``.
        self.trained_policy = lora_policy(config, self.policy) if config.lora_r is not None else self.policy
        self.setup_model(self.trained_policy)  # before the backend: a local engine switches the policy's attention
        self.backend = self.setup_backend(self.policy)
        self._sampler = PromptSampler(self.dataset, config.prompts_per_batch, config.seed, self.rank, self.world_size)
        self.queue = self.setup_queue()
        self.state = TrainerState(0, config.max_steps)
        self.run_folder = RunFolder(self.output_dir, self.algo, acc.is_main_process)
        self._logged_metrics: dict[str, list[float]] = {}

    # ------------------------------------------------------------------ hooks of an algorithm
    @abc.abstractmethod
    def setup_model(self, policy: PreTrainedModel) -> None:
        """Build what is trained from ``policy``: set ``model``, ``unwrapped``, ``optimizer`` and ``scheduler``
        (``setup_optimization`` sets all four from a module and its parameter groups)."""

    @abc.abstractmethod
    def generate_trajectory(self, batch: RolloutBatch, outputs: list[rollout.GenerationOutput]) -> TrajectoryT:
        """A collected batch scored (``score``) with the algorithm's advantages. Logs nothing."""

    @abc.abstractmethod
    def train_on(self, trajectory: TrajectoryT) -> StatsT:
        """The algorithm's step on a trajectory: gradients and optimizer steps, the weights changed only inside
        ``changing_weights()``. Returns this process's statistics; logs nothing."""

    @abc.abstractmethod
    def metrics(self, trajectory: TrajectoryT, stats: StatsT) -> dict[str, float]:
        """The algorithm's learning figures of a step, over all processes (collective: every process calls it)."""

    @abc.abstractmethod
    def describe_step(self) -> str:
        """What a step does, for the line logged before training ("training 30 steps of ...")."""

    def completion_fields(self, trajectory: TrajectoryT, i: int) -> dict[str, float]:
        """The algorithm's figures of sample ``i`` in completions.jsonl (its advantage, ...)."""
        return {}

    def summary_fields(self) -> dict[str, Any]:
        """Fields the algorithm adds to summary.json."""
        return {}

    # ------------------------------------------------------------------ setup
    def setup_optimization(self, module: torch.nn.Module, param_groups: Any) -> None:
        """AdamW over ``param_groups`` (``config.learning_rate`` unless a group sets its own), the module and the
        optimizer prepared by accelerate, and the learning-rate schedule over ``max_steps`` steps."""
        cfg = self.config
        optimizer = torch.optim.AdamW(
            param_groups,
            lr=cfg.learning_rate,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            weight_decay=cfg.weight_decay,
        )
        self.model, self.optimizer = self.accelerator.prepare(module, optimizer)
        self.unwrapped = self.accelerator.unwrap_model(self.model)
        self.scheduler = get_scheduler(
            cfg.lr_scheduler_type, self.optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.max_steps
        )

    def setup_backend(self, policy: PreTrainedModel) -> RolloutBackend:
        """The rollout backend on ``policy`` (``trainers.setup.rollout_backend``); in a LoRA run, wrapped so that
        only the adapter is synced and every request names the latest (``trainers.lora.LoraRollouts``)."""
        cfg = self.config
        backend = rollout_backend(cfg, policy, self.accelerator, self.eos_token_ids, self.tokenizer)
        if cfg.lora_r is None:
            return backend
        return LoraRollouts(backend, self.trained_policy, cfg.lora_r, cfg.lora_alpha, prefix=self.algo)

    @property
    def engine_backend(self) -> RolloutBackend:
        """The backend that generates: ``backend``, or the one a LoRA run's ``LoraRollouts`` wraps."""
        return self.backend.backend if isinstance(self.backend, LoraRollouts) else self.backend

    def setup_queue(self) -> RolloutQueue:
        """The rollout queue over the backend, with the config's sampling and staleness bound."""
        cfg = self.config
        return RolloutQueue(
            self.backend,
            # Through the method, so a subclass that overrides _rows_for_batch is honoured.
            rows_for_batch=lambda j: self._rows_for_batch(j),
            encode=lambda row: self.encode_prompt(row[cfg.prompt_column]),
            samples_per_prompt=cfg.num_generations,
            max_steps=cfg.max_steps,
            prefetch=cfg.effective_prefetch,
            max_staleness=cfg.max_staleness,
            stale_policy=cfg.stale_policy,
            request_kwargs=cfg.rollout_options(self.eos_token_ids),
            seed=lambda j, i, g: sample_seed(cfg.seed, self.rank, j, i, g),
            id_prefix=self.algo,
            pauses_stop_generation=isinstance(self.engine_backend, rollout.ContinuousBatchingManager),
        )

    def _rows_for_batch(self, j: int) -> list[dict[str, Any]]:
        return self._sampler.rows(j)

    def encode_prompt(self, prompt: str | list[dict[str, str]]) -> list[int]:
        """Token ids of a prompt (``trainers.prompts.encode_prompt``), truncated to ``max_prompt_length``."""
        return encode_prompt(self.tokenizer, prompt, self.config.max_prompt_length)

    # ------------------------------------------------------------------ the step
    def _log_metric(self, name: str, value: float) -> None:
        self._logged_metrics.setdefault(name, []).append(float(value))

    def score(self, batch: RolloutBatch, outputs: list[rollout.GenerationOutput]) -> Trajectory:
        """Decode and score a collected batch with the reward functions, and measure its staleness.

        Raises:
            RuntimeError: the engine returned no logprobs (``return_logprobs`` must be on).
        """
        cfg = self.config
        G = cfg.num_generations
        rows = [row for row in batch.rows for _ in range(G)]
        prompts = [r[cfg.prompt_column] for r in rows]
        completion_ids = [list(o.generated_tokens) for o in outputs]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        conversational = isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        columns = {k: [r[k] for r in rows] for k in self.dataset.column_names if k != cfg.prompt_column}
        scores, per_func = compute_rewards(
            self.reward_funcs,
            self.reward_weights,
            prompts,
            completions,
            completion_ids,
            columns,
            trainer_state=self.state,
            log_metric=self._log_metric,
        )
        staleness, too_old = self.queue.staleness(outputs)
        if too_old.any() and cfg.stale_policy == "wait":
            logger.warning(
                "%d samples are older than max_staleness under stale_policy 'wait'; dropping them", int(too_old.sum())
            )
        for o in outputs:
            if len(o.logprobs) != len(o.generated_tokens):
                raise RuntimeError("the engine returned no logprobs: return_logprobs must be on")
        return Trajectory(
            prompt_ids=[ids for ids in batch.prompt_ids for _ in range(G)],
            completion_ids=completion_ids,
            behaviour_logprobs=[list(o.logprobs) for o in outputs],
            scores=scores.float(),
            scores_per_func=per_func.float(),
            staleness=staleness,
            dropped=too_old.float(),
            truncated=torch.tensor([o.finish_reason == "length" for o in outputs], dtype=torch.float32),
            texts=texts,
            prompts=prompts,
        )

    def micro_batches(self, indices: Sequence[int], length: Callable[[int], int]) -> list[list[int]]:
        """``indices`` longest first (by ``length``; ties keep their order) in chunks of ``micro_batch_size``: similar
        lengths share a micro-batch and little is padded."""
        order = sorted(indices, key=length, reverse=True)
        size = self.config.micro_batch_size
        return [order[i : i + size] for i in range(0, len(order), size)]

    @contextlib.contextmanager
    def changing_weights(self) -> Iterator[None]:
        """Hold the backend while the optimizer changes the policy's weights; before it resumes, the backend moves
        to the new weights (``update_weights``: a new version on every later token)."""
        with self.queue.paused():
            yield
            self.backend.update_weights(None)  # re-entrant: still inside the pause

    def train_step(self, step: int) -> dict[str, float]:
        """One step: collect batch ``step``, build its trajectory, run the algorithm's step on it.

        Returns:
            The metrics row: the learning figures, then the wall-clock ones (``train`` files them apart).
        """
        acc = self.accelerator
        t0, c0 = time.perf_counter(), time.process_time()
        batch, outputs = self.queue.take(step)
        t_collected = time.perf_counter()
        tokens_per_s = self.queue.throughput(batch, outputs)
        self.state.global_step = step
        self._logged_metrics = {}
        lr = self.scheduler.get_last_lr()[0]
        with self.queue.paused() if self.trajectory_in_pause else contextlib.nullcontext():
            trajectory = self.generate_trajectory(batch, outputs)
            t_prepared = time.perf_counter()
            stats = self.train_on(trajectory)
        t_end = time.perf_counter()
        row = self.metrics_row(step, trajectory, stats, lr)
        row.update(
            step_time_s=t_end - t0,
            step_cpu_s=time.process_time() - c0,
            wait_rollout_s=t_collected - t0,
            prepare_s=t_prepared - t_collected,
            train_s=t_end - t_prepared,
            # Summed over processes: the run's rollout throughput.
            rollout_tokens_per_s=float(
                acc.reduce(torch.tensor([tokens_per_s], dtype=torch.float64, device=acc.device), "sum")[0]
            ),
        )
        if self.config.log_completions:
            self._write_completions(step + 1, trajectory)
        acc.wait_for_everyone()
        return row

    def metrics_row(self, step: int, trajectory: TrajectoryT, stats: StatsT, lr: float) -> dict[str, float]:
        """The step's learning figures over all processes: rewards and lengths, the algorithm's ``metrics``, the
        learning rate the step used, the weight version after it, each reward function's mean and the metrics the
        reward functions logged."""
        acc = self.accelerator
        device = acc.device
        scores = acc.gather(trajectory.scores.to(device))
        per_func = acc.gather(trajectory.scores_per_func.to(device))
        lengths = acc.gather(torch.tensor([float(len(c)) for c in trajectory.completion_ids], device=device))
        truncated = acc.gather(trajectory.truncated.to(device))
        row: dict[str, float] = {
            "step": step + 1,
            "reward_mean": float(torch.nanmean(scores)),
            "reward_std": float(nanstd(scores)),
            "completion_len_mean": float(lengths.mean()),
            "completion_len_max": float(lengths.max()),
            "truncated_fraction": float(truncated.mean()),
            "generated_tokens": float(lengths.sum()),
            **self.metrics(trajectory, stats),
            "learning_rate": lr,
            "weight_version": self.backend.weight_version,
        }
        if isinstance(self.backend, LoraRollouts):  # what the step's sync sent, against a full sync of the weights
            row["lora_sync_bytes"] = float(self.backend.last_sync_bytes)
            row["full_sync_bytes"] = float(self.backend.full_bytes)
        for j, name in enumerate(self.reward_names):
            row[f"rewards/{name}"] = float(torch.nanmean(per_func[:, j]))
        for name, values in self._logged_metrics.items():
            row[f"custom/{name}"] = sum(values) / len(values)
        return row

    def _write_completions(self, step: int, trajectory: TrajectoryT) -> None:
        records = []
        for i in range(min(self.config.log_completions, len(trajectory.texts))):
            prompt = trajectory.prompts[i]
            records.append(
                {
                    "step": step,
                    "prompt": prompt if isinstance(prompt, str) else prompt[-1].get("content", ""),
                    "completion": trajectory.texts[i],
                    "reward": float(trajectory.scores[i]),
                    **self.completion_fields(trajectory, i),
                }
            )
        self.run_folder.append("completions.jsonl", records)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, step: int) -> dict[str, float]:
        """Greedy held-out accuracy of the current weights (all processes; each takes a shard).

        Returns:
            ``eval_accuracy`` (fraction right, by ``trainers.evaluate.is_correct``) and ``eval_completion_len``
            (mean tokens); an empty dict without an evaluation set. The main process appends every process's
            samples to OUTPUT_DIR/eval_completions.jsonl. Unconstrained unless ``structured_outputs_eval`` is set.
        """
        if self.eval_dataset is None:
            return {}
        cfg = self.config
        total, samples = evaluate_sharded(
            self.backend,
            self.tokenizer,
            self.accelerator,
            self.eval_dataset,
            self.encode_prompt,
            cfg.prompt_column,
            cfg.eval_max_new_tokens,
            self.eos_token_ids,
            cfg.eval_structured_outputs,
        )
        self.run_folder.append("eval_completions.jsonl", [{"step": step, **sample} for sample in samples])
        return {"eval_accuracy": total.accuracy, "eval_completion_len": total.completion_len_mean}

    def _eval_due(self, step: int) -> bool:
        """Evaluate after step ``step`` (1-based)? At the last step, and every ``eval_steps``."""
        every = self.config.eval_steps
        return step == self.config.max_steps or (every is not None and step % every == 0)

    def _timed_eval(self, step: int) -> dict[str, float]:
        n = len(self.eval_dataset) if self.eval_dataset is not None else 0
        self._log(
            f"step {step}: evaluating {n} held-out problems (greedy, at most {self.config.eval_max_new_tokens} tokens)"
        )
        t0 = time.perf_counter()
        result = self.evaluate(step)
        result["eval_time_s"] = time.perf_counter() - t0
        self._log(
            f"step {step}: eval_accuracy {result['eval_accuracy']:.3f}, "
            f"eval_completion_len {result['eval_completion_len']:.1f} tokens ({result['eval_time_s']:.0f} s)"
        )
        return result

    # ------------------------------------------------------------------ the run
    def train(self) -> list[dict[str, float]]:
        """Run ``max_steps`` steps; write the run folder (``trainers.runs``), trackers and the final model.

        OUTPUT_DIR/metrics.jsonl gets one row per step (a row ``step: 0`` holds the evaluation before training); in
        synchronous mode it is the same on every run of a config. The wall-clock figures (step times, rollout
        tokens/s, evaluation time) vary from run to run and go to OUTPUT_DIR/timing.jsonl; the returned rows and
        the trackers get both.
        """
        cfg, acc = self.config, self.accelerator
        self.run_folder.start(cfg.to_dict())
        if cfg.log_with:
            acc.init_trackers(self.algo, config=flat_config(cfg.to_dict()))
        rows: list[dict[str, float]] = []

        def record(row: dict[str, float]) -> None:
            rows.append(row)
            self.run_folder.record(row)
            if cfg.log_with:
                acc.log({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))

        t_start = time.perf_counter()
        self._log(f"writing metrics, samples and the final model to {self.output_dir}")
        self.backend.start()
        try:
            if self.eval_dataset is not None:
                record({"step": 0, **self._timed_eval(0)})
            self._log(self.describe_step())
            bar = tqdm(total=cfg.max_steps, desc=self.algo, unit="step", disable=not acc.is_main_process)
            try:
                for step in range(cfg.max_steps):
                    row = self.train_step(step)
                    if self.eval_dataset is not None and self._eval_due(step + 1):
                        bar.clear()
                        row.update(self._timed_eval(step + 1))
                    record(row)
                    bar.set_postfix({k: f"{row[key]:.3g}" for k, key in self.progress_metrics.items()}, refresh=False)
                    bar.update(1)
            finally:
                bar.close()
        finally:
            # A batch still generating (after an error) is dropped, not finished: destroy() alone would let it run
            # to the end first.
            self.close()
        acc.wait_for_everyone()
        if cfg.save_model:
            self.save_model(self.output_dir)
        if cfg.log_with:
            acc.end_training()
        wall = time.perf_counter() - self._t_created
        self.run_folder.write_summary(
            rows,
            steps=cfg.max_steps,
            wall_s=wall,
            train_s=time.perf_counter() - t_start,
            world_size=self.world_size,
            device=str(acc.device),
            mixed_precision=acc.mixed_precision,
            **self.summary_fields(),
        )
        self._log(summary(rows, self.output_dir, wall, cfg.save_model, self.saved_files() if cfg.save_model else ""))
        return rows

    def saved_files(self) -> str:
        """What ``save_model`` writes beyond the policy and tokenizer, for the closing lines (", the value head")."""
        return ""

    def _log(self, message: str) -> None:
        if self.accelerator.is_main_process:
            logger.info(message)

    def close(self) -> None:
        """Close the queue, then stop and destroy the backend (``train`` does it at its end), dropping unfinished
        requests; a local engine restores the model's attention implementation."""
        self.queue.close()
        self.backend.stop(hard_stop=True)
        self.backend.destroy()

    def save_model(self, directory: str | Path) -> None:
        """save_pretrained of the policy (main process) and of the tokenizer; a LoRA run saves its peft adapter
        (``adapter_config.json``, ``adapter_model.safetensors``: ``rollout-serve``'s ``/v1/load_lora_adapter`` and
        ``rollout.LoraAdapter.from_peft_dir`` load it)."""
        acc = self.accelerator
        if acc.is_main_process:
            self.trained_policy.save_pretrained(str(directory), is_main_process=True, save_function=acc.save)
            self.tokenizer.save_pretrained(str(directory))
        acc.wait_for_everyone()
