"""GRPO and PPO on multi-turn episodes: each sample is an environment run to its end (``rollout.run_episodes``),
trained with its loss mask.

What differs from single-turn training (``trainers.grpo``, ``trainers.ppo``), and nothing else does:
- the rollout queue (``EpisodeQueue``) submits a batch's G episodes per prompt to a thread pool instead of G
  requests; each episode's turns are requests on the same backend (in process, ``rollout.ManagerTurns``; on a
  ``rollout_server``, ``rollout.ClientTurns`` with the session header), so the engine batches the turns of every
  episode in flight and turn k+1 reuses turn k's KV. It returns each episode as an ``EpisodeOutput``, a
  ``rollout.GenerationOutput`` whose tokens are the episode's completion: the recipe's step, the queue's staleness
  and both algorithms' ``generate_trajectory`` take the batch with the base types, as verl's agent loop hands its
  trainer the same batch as a single turn;
- the scored batch (``score``, which both algorithms' ``generate_trajectory`` build on) is the episodes'
  ``prompt_ids``, ``completion_ids`` (model and environment ids interleaved) and ``loss_mask``, the engine's logprobs
  as the behaviour policy (0 on environment ids, which the mask takes out), and the environment's ``get_reward`` as
  the score. GRPO's loss (``GRPOTrainer._forward_backward``) counts only masked tokens, in the loss and in its
  normaliser; PPO's mask is the loss mask, so its losses, values and KL penalty skip environment tokens, its reward
  sits on the last model token and GAE passes over environment tokens (``trainers.ppo_loss``);
- the held-out evaluation runs greedy episodes: ``eval_accuracy`` is the share of episodes the environment counts a
  success (a positive reward), ``eval_first_attempt_accuracy`` the share rewarded 1.0 (right at once);
- a ``structured_outputs_regex`` or ``_json_schema`` constrains every model turn of a training episode
  (``run_episodes(structured_outputs=...)``), and the held-out episodes' turns only under ``structured_outputs_eval``;
- the run folder gains ``trajectories.jsonl``: ``log_trajectories`` episodes per step, every field of
  ``rollout.Episode`` with ``logprobs_mode`` and ``temperature``.

Staleness counts model tokens only (environment ids carry version -1, which ``RolloutQueue.staleness`` leaves out),
and so does the throughput. The reward comes from the environment, so ``reward_funcs`` is empty.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

import rollout

from .config import ConfigError, GRPOConfig
from .environments import ENVIRONMENTS, environment_factory
from .grpo import GRPOTrainer
from .ppo import PPOTrainer
from .ppo_config import PPOConfig
from .rollout_queue import RolloutBatch, RolloutQueue
from .runs import sample_seed
from .trajectory import Trajectory


@dataclass
class EpisodeFields:
    """The episode fields both multi-turn configs add (``MultiTurnGRPOConfig``, ``MultiTurnPPOConfig``).

    Episodes:
        environment: a name of ``trainers.environments.ENVIRONMENTS`` ("retry_arithmetic").
        environment_kwargs: keyword arguments of the environment's class.
        max_turns: model turns per episode at most.
        max_episode_tokens: completion tokens per episode at most (model and environment); ``max_new_tokens`` bounds
            each model turn of training, ``eval_max_new_tokens`` each of the held-out episodes.
        log_trajectories: episodes per step written to OUTPUT_DIR/trajectories.jsonl (0: none).

    ``reward_funcs`` must be empty (and ``reward_weights`` None): the environment's ``get_reward`` is the score.
    """

    reward_funcs: list[str] = field(default_factory=list)
    reward_weights: list[float] | None = None
    environment: str = "retry_arithmetic"
    environment_kwargs: dict[str, Any] | None = None
    max_turns: int = 2
    max_episode_tokens: int = 256
    log_trajectories: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]
        if getattr(self, "lora_r", None) is not None:
            raise ConfigError(
                "lora_r: multi-turn episodes do not run under a LoRA adapter yet; use the GRPO or PPO trainer"
            )
        if self.environment not in ENVIRONMENTS:
            raise ConfigError(f"environment must be one of {sorted(ENVIRONMENTS)}, got {self.environment!r}")
        for name in ("max_turns", "max_episode_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.log_trajectories < 0:
            raise ConfigError(f"log_trajectories must be >= 0, got {self.log_trajectories!r}")
        try:
            environment_factory(self.environment, **(self.environment_kwargs or {}))()
        except (TypeError, ValueError) as e:
            raise ConfigError(f"environment_kwargs: {e}") from e

    def _check_rewards(self) -> None:
        if self.reward_funcs or self.reward_weights is not None:
            raise ConfigError(
                "reward_funcs must be empty (reward_weights null) for multi-turn training: the environment's "
                "get_reward scores each episode"
            )

    @property
    def limits(self) -> rollout.EpisodeLimits:
        """The training episodes' bounds (``max_new_tokens`` per model turn)."""
        return rollout.EpisodeLimits(self.max_turns, self.max_episode_tokens, self.max_new_tokens)  # type: ignore[attr-defined]

    @property
    def eval_limits(self) -> rollout.EpisodeLimits:
        """The held-out episodes' bounds (``eval_max_new_tokens`` per model turn)."""
        return rollout.EpisodeLimits(self.max_turns, self.max_episode_tokens, self.eval_max_new_tokens)  # type: ignore[attr-defined]


@dataclass
class MultiTurnGRPOConfig(EpisodeFields, GRPOConfig):
    """Settings of a multi-turn GRPO run: ``GRPOConfig``'s fields and the episode's (``EpisodeFields``)."""

    trainer_name: ClassVar[str] = "multi-turn GRPO"
    default_config_file: ClassVar[str | None] = "grpo_multiturn.yaml"


@dataclass
class MultiTurnPPOConfig(EpisodeFields, PPOConfig):
    """Settings of a multi-turn PPO run: ``PPOConfig``'s fields and the episode's (``EpisodeFields``)."""

    trainer_name: ClassVar[str] = "multi-turn PPO"
    default_config_file: ClassVar[str | None] = None


# ``rollout.run_episodes`` on the trainer's backend: (rows, episode_ids, seeds) -> the episodes, in id order.
EpisodeRunner = Callable[[list[dict[str, Any]], list[str], list[int | None]], list[rollout.Episode]]


@dataclass
class EpisodeOutput(rollout.GenerationOutput):
    """One episode as a rollout output: what ``EpisodeQueue.take`` returns, so that episodes enter the recipe
    through the base queue's types.

    ``generated_tokens`` are the episode's completion ids (model and environment ids interleaved), ``logprobs`` and
    ``weight_versions`` one per id (0.0 and -1 on environment ids: no weights sampled them, so the base queue's
    ``staleness`` leaves them out), ``finish_reason`` the episode's. The episode is ``episode``; its other fields
    (``loss_mask``, ``reward``, ``turns``, ``num_model_turns``...) read through.
    """

    episode: rollout.Episode = field(kw_only=True)

    @classmethod
    def of(cls, episode: rollout.Episode) -> EpisodeOutput:
        """The output of a finished episode."""
        return cls(
            request_id=episode.episode_id,
            prompt_ids=episode.prompt_ids,
            generated_tokens=episode.completion_ids,
            logprobs=episode.logprobs,
            status=rollout.RequestStatus.FINISHED,
            weight_versions=episode.weight_versions,
            finish_reason=episode.finish_reason,
            episode=episode,
        )

    def __getattr__(self, name: str) -> Any:
        # Called only for names a GenerationOutput lacks. Dunders and a half-built copy (no ``episode`` yet) are not
        # the episode's to answer.
        episode = self.__dict__.get("episode")
        if episode is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(episode, name)


def episodes_of(outputs: Sequence[rollout.GenerationOutput]) -> list[rollout.Episode]:
    """The episodes behind an ``EpisodeQueue``'s outputs, in order.

    Raises:
        TypeError: an output is a single request's, not an episode's (the recipe's queue is not an ``EpisodeQueue``).
    """
    episodes = [o.episode for o in outputs if isinstance(o, EpisodeOutput)]
    if len(episodes) != len(outputs):
        raise TypeError("multi-turn training scores episodes: the rollout queue must be an EpisodeQueue")
    return episodes


class EpisodeQueue(RolloutQueue):
    """The rollout queue of episodes: batch j's G episodes per prompt run in a thread pool from submission; ``take``
    waits for them and returns each as an ``EpisodeOutput``. Submission, prefetch, the staleness bound and its
    measure are ``RolloutQueue``'s.

    Args:
        run: ``(rows, episode_ids, seeds) -> episodes`` (``rollout.run_episodes`` on the trainer's backend).
        Others: ``RolloutQueue``'s.
    """

    def __init__(self, *args: Any, run: EpisodeRunner, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.run = run
        self._futures: dict[int, concurrent.futures.Future[tuple[list[rollout.Episode], float]]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="episode-batch")
        self._done = 0.0  # when the last batch taken ended

    def submit(self, j: int) -> None:
        """Start batch ``j``'s episodes."""
        rows = self.rows_for_batch(j)
        G = self.samples_per_prompt
        ids = [f"{self.id_prefix}_b{j}_p{i}_g{g}" for i in range(len(rows)) for g in range(G)]
        seeds: list[int | None] = [self.seed(j, i, g) for i in range(len(rows)) for g in range(G)]
        batch_rows = [r for r in rows for _ in range(G)]
        t0 = time.perf_counter()
        self._futures[j] = self._pool.submit(lambda: (self.run(batch_rows, ids, seeds), time.perf_counter()))
        self.pending.append(RolloutBatch(j, rows, [], ids, self.backend.weight_version, t0))
        self.next_batch = j + 1

    def take(self, step: int) -> tuple[RolloutBatch, list[rollout.GenerationOutput]]:
        """Start what may run, then wait for batch ``step``'s episodes (in episode-id order), as ``EpisodeOutput``s.

        Raises:
            RuntimeError: an episode could not finish (the backend stopped).
        """
        self.fill(step)
        batch = self.pending.popleft()
        episodes, done = self._futures.pop(step).result()
        for ep in episodes:
            if ep.finish_reason == "aborted":
                raise RuntimeError(f"episode {ep.episode_id} did not finish: the rollout backend stopped")
        batch.prompt_ids = [ep.prompt_ids for ep in episodes[:: self.samples_per_prompt]]
        self._done = done
        outputs: list[rollout.GenerationOutput] = [EpisodeOutput.of(ep) for ep in episodes]
        return batch, outputs

    def throughput(self, batch: RolloutBatch, outputs: Sequence[rollout.GenerationOutput]) -> float:
        """Sampled (model) tokens per second of the backend over the last batches (``RolloutQueue``'s accounting,
        with a batch's end the moment its last episode ended)."""
        return self._charge(batch, self._done, sum(sum(ep.loss_mask) for ep in episodes_of(outputs)))

    def close(self) -> None:
        """Stop taking batches (running episodes end when the backend stops)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class EpisodeRecipe:
    """What a recipe (``trainers.recipe.Recipe``) changes to train on episodes: the queue, ``score`` and the held-out
    evaluation (see the module docstring). Placed before the algorithm's trainer class in the bases, so GRPO's and
    PPO's ``generate_trajectory`` build their trajectories on this ``score``.

    Args and errors: those of the algorithm's trainer, with a config that has the ``EpisodeFields``; the datasets'
    rows are passed to the environment's ``reset`` (the arithmetic task's ``answer`` column).
    """

    config: Any
    progress_metrics: ClassVar[dict[str, str]] = {"reward": "reward_mean", "turns": "custom/episode_model_turns"}

    def _turns(self, greedy: bool) -> rollout.TurnBackend:
        cfg = self.config
        if isinstance(self.engine_backend, rollout.ContinuousBatchingManager):
            sampling: dict[str, Any] = (
                {"do_sample": False} if greedy else {"do_sample": True, "temperature": cfg.temperature}
            )
            return rollout.ManagerTurns(self.backend, eos_token_id=list(self.eos_token_ids), **sampling)
        params: dict[str, Any] = {
            "temperature": 0.0 if greedy else cfg.temperature,
            "stop_token_ids": list(self.eos_token_ids),
        }
        # The server's versions, in the run's count (RemoteRollouts.weight_version's), so staleness compares them.
        base = self.engine_backend.version_base  # a RemoteRollouts
        return rollout.ClientTurns(self.backend.client, version_base=base, **params)

    def _run(
        self, rows: list[dict[str, Any]], ids: list[str], seeds: list[int | None], greedy: bool = False
    ) -> list[rollout.Episode]:
        cfg = self.config
        return rollout.run_episodes(
            self._turns(greedy),
            self.tokenizer,
            environment_factory(cfg.environment, **(cfg.environment_kwargs or {})),
            rows,
            prompt_column=cfg.prompt_column,
            limits=cfg.eval_limits if greedy else cfg.limits,
            episode_ids=ids,
            seeds=None if greedy else seeds,
            # Every model turn of a training episode; held-out ones only under structured_outputs_eval.
            structured_outputs=cfg.eval_structured_outputs if greedy else cfg.structured_outputs,
        )

    def setup_queue(self) -> RolloutQueue:
        cfg = self.config
        return EpisodeQueue(
            self.backend,
            rows_for_batch=lambda j: self._rows_for_batch(j),
            encode=lambda row: [],
            samples_per_prompt=cfg.num_generations,
            max_steps=cfg.max_steps,
            prefetch=cfg.effective_prefetch,
            max_staleness=cfg.max_staleness,
            stale_policy=cfg.stale_policy,
            request_kwargs={},
            seed=lambda j, i, g: sample_seed(cfg.seed, self.rank, j, i, g),
            id_prefix="episode",
            pauses_stop_generation=isinstance(self.engine_backend, rollout.ContinuousBatchingManager),
            run=self._run,
        )

    def score(self, batch: RolloutBatch, outputs: list[rollout.GenerationOutput]) -> Trajectory:
        """The episodes (``EpisodeQueue``'s outputs) as a scored batch: their ids and loss masks, the engine's
        logprobs (0 on environment ids), the environment's reward, staleness over model tokens; writes
        ``log_trajectories`` of them to trajectories.jsonl and logs the episodes' turns, environment tokens and
        success.

        Raises:
            TypeError: ``outputs`` are not episodes (``episodes_of``).
        """
        cfg = self.config
        G = cfg.num_generations
        episodes = episodes_of(outputs)
        scores = torch.tensor([ep.reward if ep.reward is not None else float("nan") for ep in episodes]).float()
        staleness, too_old = self.queue.staleness(outputs)
        n = len(episodes)
        self._log_metric("episode_model_turns", sum(ep.num_model_turns for ep in episodes) / n)
        self._log_metric("episode_env_tokens", sum(len(ep.loss_mask) - sum(ep.loss_mask) for ep in episodes) / n)
        self._log_metric("episode_success", sum((ep.reward or 0) > 0 for ep in episodes) / n)
        if cfg.log_trajectories:
            extra = {"logprobs_mode": "temperature", "temperature": cfg.temperature}
            records = [
                {"step": self.state.global_step + 1, **ep.to_dict(), **extra} for ep in episodes[: cfg.log_trajectories]
            ]
            self.run_folder.append("trajectories.jsonl", records)
        return Trajectory(
            prompt_ids=[ep.prompt_ids for ep in episodes],
            completion_ids=[ep.completion_ids for ep in episodes],
            behaviour_logprobs=[ep.logprobs for ep in episodes],
            scores=scores,
            scores_per_func=scores[:, None].clone(),
            staleness=staleness,
            dropped=too_old.float(),
            truncated=torch.tensor(
                [ep.finish_reason in ("length", "max_tokens") for ep in episodes], dtype=torch.float32
            ),
            texts=self.tokenizer.batch_decode([ep.completion_ids for ep in episodes], skip_special_tokens=True),
            prompts=[r[cfg.prompt_column] for r in batch.rows for _ in range(G)],
            loss_mask=[ep.loss_mask for ep in episodes],
        )

    def evaluate(self, step: int) -> dict[str, float]:
        """Greedy episodes on the held-out rows (each process its shard): ``eval_accuracy`` (success: a positive
        reward), ``eval_first_attempt_accuracy`` (reward 1.0), ``eval_completion_len`` (completion ids per episode,
        environment ids included) and ``eval_model_turns``."""
        if self.eval_dataset is None:
            return {}
        acc = self.accelerator
        shard = self.eval_dataset.select(range(self.rank, len(self.eval_dataset), self.world_size))
        rows = [shard[i] for i in range(len(shard))]
        episodes = self._run(rows, [f"eval{step}_{self.rank}_{i}" for i in range(len(rows))], [None] * len(rows), True)
        local = [
            sum((ep.reward or 0) > 0 for ep in episodes),
            sum(ep.reward == 1.0 for ep in episodes),
            sum(len(ep.completion_ids) for ep in episodes),
            sum(ep.num_model_turns for ep in episodes),
            len(episodes),
        ]
        t = acc.reduce(torch.tensor(local, dtype=torch.float64, device=acc.device), reduction="sum")
        total = max(float(t[4]), 1.0)
        samples = [
            {
                "step": step,
                "question": row.get("question"),
                "answer": row.get("answer"),
                "conversation": ep.messages,
                "reward": ep.reward,
            }
            for row, ep in zip(rows, episodes)
        ]
        self.run_folder.append("eval_completions.jsonl", samples)
        return {
            "eval_accuracy": float(t[0]) / total,
            "eval_first_attempt_accuracy": float(t[1]) / total,
            "eval_completion_len": float(t[2]) / total,
            "eval_model_turns": float(t[3]) / total,
        }

    def summary_fields(self) -> dict[str, Any]:
        return {"environment": self.config.environment, "max_turns": self.config.max_turns}


class MultiTurnGRPOTrainer(EpisodeRecipe, GRPOTrainer):
    """GRPO on episodes (``EpisodeRecipe``): G episodes per prompt, group-normalised rewards, the loss on model
    tokens only."""

    config: MultiTurnGRPOConfig


class MultiTurnPPOTrainer(EpisodeRecipe, PPOTrainer):
    """PPO on episodes (``EpisodeRecipe``): one episode per prompt; values, GAE, the KL penalty and the losses on
    model tokens only (``trainers.ppo_loss.gae`` carries values and advantages across environment tokens)."""

    config: MultiTurnPPOConfig


def train_multiturn_ppo(config: MultiTurnPPOConfig, **kwargs: Any) -> list[dict[str, float]]:
    """Build a MultiTurnPPOTrainer and run it."""
    return MultiTurnPPOTrainer(config, **kwargs).train()


def train_multiturn_grpo(config: MultiTurnGRPOConfig, **kwargs: Any) -> list[dict[str, float]]:
    """Build a MultiTurnGRPOTrainer and run it (the script's entry point)."""
    return MultiTurnGRPOTrainer(config, **kwargs).train()


__all__ = [
    "EpisodeFields",
    "EpisodeOutput",
    "EpisodeQueue",
    "EpisodeRecipe",
    "MultiTurnGRPOConfig",
    "MultiTurnGRPOTrainer",
    "MultiTurnPPOConfig",
    "MultiTurnPPOTrainer",
    "train_multiturn_grpo",
    "train_multiturn_ppo",
]
