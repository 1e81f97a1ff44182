"""Tensor parallelism through transformers' ``tp_plan``: one engine per rank, every rank in lockstep.

A model loaded under ``torchrun`` with ``tp_plan="auto"`` (or a ``DistributedConfig``) holds DTensor shards: each
rank's attention computes ``num_key_value_heads / tp_size`` KV heads and the forward's collectives give every rank
the same logits. rollout runs one engine per rank, after transformers' continuous batching
(``generation/continuous_batching/distributed.py``: a gloo group for control messages, a driver owning the queue):

- every rank calls the same rollout API with the same inputs; the driver (TP rank 0) decides what enters each step
  (requests, cancels, recomputes, the weight version, a stop) and shares it over a CPU group (``cpu_group_timeout``);
- each rank's KV cache holds its own KV heads; ``num_key_value_heads % tp_size != 0`` is refused
  (``check_kv_heads_divisible``);
- the engine's size is the smallest any rank measured, so every rank's scheduler decides alike;
- after each step the driver's sampled tokens, logprobs and scores are broadcast (``share_output``);
- only the driver returns results: elsewhere ``add_request`` returns None, ``generate_batch`` an empty dict and
  ``score`` an empty list.

The CPU group is created once per process and set of ranks (``dist.new_group`` is collective: every rank builds its
first engine in the same order). Two engines must not step at once on one rank: their collectives would interleave
in a different order on each rank.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from rollout.config import ContinuousBatchingConfig
from rollout.engine.sched.output import RunnerOutput
from rollout.weights.model_info import UnsupportedModelError, layer_kv_shapes

logger = logging.getLogger(__name__)

# Environment variable that ``disable_nccl_graph_mixing`` sets (see ``config.ContinuousBatchingConfig``).
NCCL_GRAPH_MIXING_ENV = "NCCL_GRAPH_MIXING_SUPPORT"


def disable_nccl_graph_mixing() -> bool:
    """Set ``NCCL_GRAPH_MIXING_SUPPORT=0`` unless the variable is set already (a user's value is kept).

    NCCL reads it when a communicator starts, so it covers the communicators started after this call
    (see ``ContinuousBatchingConfig.disable_nccl_graph_mixing``). Called by a tensor-parallel engine on CUDA.

    Returns:
        True when this call set it.
    """
    if NCCL_GRAPH_MIXING_ENV in os.environ:
        return False
    os.environ[NCCL_GRAPH_MIXING_ENV] = "0"
    logger.info("%s set to 0 (disable_nccl_graph_mixing=True, tensor parallelism on CUDA)", NCCL_GRAPH_MIXING_ENV)
    return True


# ``cpu_group_timeout=None`` means no timeout; gloo wants one, so None becomes a year.
NO_TIMEOUT = timedelta(days=365)

# The CPU (gloo) groups built so far: (default group's id, ranks, timeout in seconds) -> group.
_CPU_GROUPS: dict[tuple[int, tuple[int, ...], float | None], Any] = {}
_CPU_GROUPS_LOCK = threading.Lock()


def tensor_parallel_mesh(model: PreTrainedModel) -> Any | None:
    """The model's tensor-parallel ``DeviceMesh``, or None when its weights are not TP-sharded.

    transformers keeps the mesh it sharded the model over in ``model._device_mesh`` (dims named
    ``pp``, ``fsdp`` and ``tp``; an unnamed mesh is a TP mesh). A TP size of 1 is no TP.

    Raises:
        UnsupportedModelError: the mesh shards the model over FSDP or pipeline stages, which a
            generation engine cannot drive (transformers refuses FSDP too).
    """
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        return None
    names = mesh.mesh_dim_names
    if names is None:
        return mesh if mesh.size() > 1 else None
    for other in ("fsdp", "pp"):
        if other in names and mesh[other].size() > 1:
            raise UnsupportedModelError(
                f"{type(model).__name__} is sharded over {other} (size {mesh[other].size()}); rollout runs tensor "
                "parallelism only (load the model with tp_plan='auto' and no fsdp or pipeline size)"
            )
    if "tp" in names and mesh["tp"].size() > 1:
        return mesh["tp"]
    return None


def is_driver_rank(model: PreTrainedModel) -> bool:
    """False on a tensor-parallel rank other than TP rank 0 (which returns no results); True otherwise."""
    mesh = tensor_parallel_mesh(model)
    return mesh is None or mesh.get_local_rank() == 0


def check_kv_heads_divisible(num_key_value_heads: int, tp_size: int) -> None:
    """Refuse a TP size that would split a KV head between ranks.

    Each rank's attention computes whole KV heads: its shard of ``k_proj``/``v_proj`` must hold
    ``num_key_value_heads / tp_size`` of them.

    Raises:
        ValueError: ``num_key_value_heads % tp_size != 0`` (the message names both numbers).
    """
    if num_key_value_heads % tp_size != 0:
        divisors = [d for d in range(1, num_key_value_heads + 1) if num_key_value_heads % d == 0]
        raise ValueError(
            f"num_key_value_heads ({num_key_value_heads}) is not divisible by the tensor-parallel size "
            f"({tp_size}): every rank must hold whole KV heads; launch with a tp size in {divisors}"
        )


def kv_heads_sharded(model: PreTrainedModel) -> bool:
    """True when the model's key projections are split over the TP ranks (a Shard placement).

    transformers' plans shard ``k_proj``/``v_proj`` column-wise for most decoders; a plan that
    leaves them replicated keeps every KV head on every rank.
    """
    for module in model.modules():
        weight = getattr(getattr(module, "k_proj", None), "weight", None)
        if weight is not None and hasattr(weight, "placements"):
            return any(placement.is_shard() for placement in weight.placements)
    return False


def _timeout(seconds: float | None) -> timedelta:
    return NO_TIMEOUT if seconds is None else timedelta(seconds=seconds)


def cpu_group(ranks: Sequence[int], timeout: float | None) -> Any:
    """The gloo process group of ``ranks`` for control messages, built on first use and kept.

    ``dist.new_group`` is a collective over the whole world (or over ``ranks`` alone, with
    ``use_local_synchronization``, when the TP group is part of a larger world): every rank of
    ``ranks`` must ask for it in the same order, which holds when they build their engines in the same
    order. A group is rebuilt after ``dist.destroy_process_group()`` and a new ``init_process_group``.

    Args:
        ranks: global ranks of the TP group, ascending.
        timeout: seconds a collective on the group may wait before it raises; None for no timeout.
    """
    key = (id(dist.group.WORLD), tuple(ranks), timeout)
    with _CPU_GROUPS_LOCK:
        group = _CPU_GROUPS.get(key)
        if group is None:
            group = dist.new_group(
                ranks=list(ranks),
                backend="gloo",
                timeout=_timeout(timeout),
                use_local_synchronization=len(ranks) < dist.get_world_size(),
            )
            _CPU_GROUPS[key] = group
        return group


@dataclass(frozen=True)
class RoundState:
    """What the ranks of a manager's loop agree on before each step (``TensorParallel.agree``).

    Attributes:
        num_items: requests, cancels and recompute marks the driver took from its inbox this round.
        stop: the driver asked the loop to stop once idle.
        hard_stop: some rank asked for a hard stop.
        paused: some rank holds a pause, or not every rank has entered the pauses the others did: no
            step may run (a pause is collective: every rank calls ``pause()``/``update_weights``).
        weight_version: the driver's weight version, which every rank adopts.
    """

    num_items: int
    stop: bool
    hard_stop: bool
    paused: bool
    weight_version: int


class TensorParallel:
    """One rank's view of the TP group an engine runs in.

    Build it with ``TensorParallel.from_model``. Every method that communicates is a collective on the
    CPU group: every rank calls it, in the same order.

    Attributes:
        tp_size: ranks in the TP group.
        tp_rank: this rank's index in the group; 0 is the driver.
        is_driver: True on TP rank 0, which decides what enters each step and returns results.
        driver_rank: the driver's global rank (the source of broadcasts).
        group: the CPU (gloo) group of control messages (``cpu_group``).
        device_type: where the model computes (``"cpu"``: gloo; ``"cuda"``: NCCL for the model).
    """

    def __init__(self, tp_size: int, tp_rank: int, driver_rank: int, group: Any, device_type: str) -> None:
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.is_driver = tp_rank == 0
        self.driver_rank = driver_rank
        self.group = group
        self.device_type = device_type

    @classmethod
    def from_model(cls, model: PreTrainedModel, config: ContinuousBatchingConfig) -> TensorParallel | None:
        """The TP group of a model loaded with a ``tp_plan``, or None when it is not TP-sharded.

        Checks first, before any communication, so that every rank raises the same error: the model's
        KV heads must split evenly. On CUDA with ``config.disable_nccl_graph_mixing``, turns NCCL's graph
        mixing off for the communicators started from now on (``disable_nccl_graph_mixing``). Then joins
        the CPU group (a collective on first use).

        Raises:
            ValueError: ``num_key_value_heads`` is not divisible by the TP size.
            UnsupportedModelError: the model is sharded over FSDP or pipeline stages.
        """
        mesh = tensor_parallel_mesh(model)
        if mesh is None:
            return None
        tp_size = mesh.size()
        if kv_heads_sharded(model):
            heads = sorted({kv for kv, _ in layer_kv_shapes(model, local=False)})
            for num_kv_heads in heads:
                check_kv_heads_divisible(num_kv_heads, tp_size)
        device_group = mesh.get_group()
        ranks = sorted(dist.get_process_group_ranks(device_group))
        device_type = mesh.device_type
        if device_type == "cuda" and config.disable_nccl_graph_mixing:
            disable_nccl_graph_mixing()
        group = cpu_group(ranks, config.cpu_group_timeout)
        tp = cls(tp_size, mesh.get_local_rank(), ranks[0], group, device_type)
        if tp.is_driver:
            logger.info(
                "tensor parallelism: %d ranks %s, %s; KV heads per rank: %s",
                tp_size,
                ranks,
                device_type,
                sorted({kv for kv, _ in layer_kv_shapes(model)}),
            )
        return tp

    # ------------------------------------------------------------------ collectives
    def agree_min(self, value: float) -> float:
        """The smallest ``value`` over the ranks (each rank sizes its cache from its own free memory)."""
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return float(t.item())

    def broadcast_object(self, obj: Any) -> Any:
        """The driver's ``obj`` on every rank (pickled; the driver gets its own object back)."""
        holder = [obj if self.is_driver else None]
        dist.broadcast_object_list(holder, src=self.driver_rank, group=self.group, device=torch.device("cpu"))
        return holder[0]

    def agree(
        self,
        num_items: int,
        stop: bool,
        hard_stop: bool,
        holding: bool,
        pauses_entered: int,
        weight_version: int,
    ) -> RoundState:
        """One round of a manager's loop: combine every rank's state with a single MAX all-reduce.

        Driver-only fields (``num_items``, ``stop``, ``weight_version``) are sent as 0 by the other
        ranks, so the maximum is the driver's value. The pause is open while any rank holds one or the
        ranks have entered different numbers of pauses (the maximum of ``-pauses_entered`` is minus
        the minimum).

        Args:
            num_items: items the driver took from its inbox.
            stop: this rank's manager was asked to stop once idle.
            hard_stop: this rank's manager was asked to stop now.
            holding: a thread of this rank holds the pause.
            pauses_entered: pauses entered on this rank since the manager was built.
            weight_version: this rank's engine weight version.
        """
        driver = self.is_driver
        values = [
            num_items if driver else 0,
            int(stop and driver),
            int(hard_stop),
            int(holding),
            pauses_entered,
            -pauses_entered,
            weight_version if driver else 0,
        ]
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        n, stop_, hard, held, most, neg_least, version = t.tolist()
        return RoundState(n, bool(stop_), bool(hard), bool(held) or most != -neg_least, version)

    def share_output(self, output: RunnerOutput) -> RunnerOutput:
        """The driver's step results on every rank: sampled tokens, their logprobs, scored logprobs.

        Every rank ran the same step on the same requests, so the results have the same layout
        everywhere; their values are packed in one float64 vector (token ids below 2**53 and float32
        logprobs are exact in it) and broadcast from the driver. A rank whose sampler drew another
        token (logits that differ in the last bit, an unseeded generator) takes the driver's.

        Returns:
            ``output`` with the driver's values in place of this rank's (the driver's own, unchanged).
        """
        values: list[float] = [v for _, lps in output.prompt_logprobs for v in lps]
        values += [float(t) for t in output.sampled_token_ids]
        values += output.logprobs or []
        for ids, lps in output.top_logprobs or []:
            values += [float(t) for t in ids] + lps
        if not values:
            return output
        t = torch.tensor(values, dtype=torch.float64)
        dist.broadcast(t, src=self.driver_rank, group=self.group)
        if self.is_driver:
            return output
        host = t.tolist()
        i = 0
        prompt_logprobs = []
        for req, lps in output.prompt_logprobs:
            prompt_logprobs.append((req, host[i : i + len(lps)]))
            i += len(lps)
        b = len(output.sampled_token_ids)
        tokens = [int(v) for v in host[i : i + b]]
        i += b
        logprobs = None
        if output.logprobs is not None:
            logprobs = host[i : i + b]
            i += b
        top = None
        if output.top_logprobs is not None:
            top = []
            for ids, _ in output.top_logprobs:
                n = len(ids)
                top.append(([int(t) for t in host[i : i + n]], host[i + n : i + 2 * n]))
                i += 2 * n
        return RunnerOutput(tokens, logprobs, prompt_logprobs, top)
