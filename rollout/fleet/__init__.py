"""rollout.fleet: the trainer's side of a fleet of ``rollout-serve`` replicas, over HTTP.

Owns ``RolloutPool`` by plane: ``http`` (the wire, ``RolloutServerError``, the connections), ``membership`` (live,
dropped and returning replicas), ``routing`` (the data plane: generation, sessions), ``control`` (the fan-out and
the control calls), ``weight_sync`` (the transfer group and the weight updates) and ``pool`` (the class composing
them); ``client`` (``RolloutClient``, the one-server pool, and ``RolloutWeightTransfer`` for TRL), ``cli``
(``rollout-fleet``) and ``ray_replicas`` (replicas as Ray actors).

May import ``rollout.weights``, ``rollout.lora`` and the ground modules (``rollout.checks``, ``config``,
``sampling_params``, ``stop_strings``, ``requests``); never the engine, the manager, ``rollout.serve`` or
``rollout.agents``: the fleet is an HTTP client, and the engines live in the servers.
"""

from typing import TYPE_CHECKING

from rollout.lazy import lazy_face

if TYPE_CHECKING:  # at run time each name is imported on first use: ``rollout-fleet`` parses its flags before torch
    from rollout.fleet.client import RolloutClient, RolloutWeightTransfer
    from rollout.fleet.http import RolloutServerError
    from rollout.fleet.pool import RolloutPool
    from rollout.fleet.routing import pick_replica

__all__ = ["RolloutClient", "RolloutPool", "RolloutServerError", "RolloutWeightTransfer", "pick_replica"]

# Each public name -> the module that defines it.
_EXPORTS = {
    "RolloutClient": "rollout.fleet.client",
    "RolloutWeightTransfer": "rollout.fleet.client",
    "RolloutServerError": "rollout.fleet.http",
    "RolloutPool": "rollout.fleet.pool",
    "pick_replica": "rollout.fleet.routing",
}

__getattr__, __dir__ = lazy_face(globals(), _EXPORTS)
