"""The scheduling room: the scheduler (``scheduler``), its async subclass (``async_scheduler``) and the records a step
passes between the scheduler and the worker (``output``: ``SchedulerOutput`` out, ``RunnerOutput`` back).

What a scheduler owes the engine (vLLM v1's ``sched/interface.py``): ``add_request``, ``schedule() ->
SchedulerOutput`` (the requests of the next step and how many tokens each computes, their blocks allocated),
``update_from_output(scheduler_output, runner_output)`` (the one writer of a request's status, tokens and counts;
returns the requests updated), ``finish_request``, ``has_unfinished``, ``recompute_all`` (after a weight update that
asks for re-prefill), and the ``weight_version`` new tokens and cached blocks record.

May import the ground modules and ``engine.kv`` (the KV cache manager), nothing else of rollout. The worker imports
``sched.output`` only, never the scheduler.
"""

from rollout.engine.sched.async_scheduler import AsyncScheduler
from rollout.engine.sched.output import RunnerOutput, ScheduledRequest, SchedulerOutput
from rollout.engine.sched.scheduler import Scheduler

__all__ = ["AsyncScheduler", "RunnerOutput", "ScheduledRequest", "Scheduler", "SchedulerOutput"]
