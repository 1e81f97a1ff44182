"""The weight routes (control routes): new weights from disk, vLLM's four-call transfer from a trainer, and what
TRL's clients read of the server before a transfer.

They only translate: each body (``protocol.py``) goes to the service's ``WeightUpdater`` (``weight_updates.py``).
``build_app`` includes the router behind the control guard (the API key, ``--enable-control``, no undeclared query
parameter).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request

from rollout.serve.errors import bad_request
from rollout.serve.protocol import (
    InitWeightTransferRequest,
    StartWeightUpdateRequest,
    UpdateWeightsFromTrainerRequest,
    UpdateWeightsRequest,
)
from rollout.serve.service import GenerationService


def weight_router(service: GenerationService, control: Callable[[Request], Awaitable[None]]) -> APIRouter:
    """The weight routes of ``service``, each behind the ``control`` dependency.

    Args:
        service: the server's generation service.
        control: the control routes' guard (raises the 401, 404 or 400).
    """
    router = APIRouter(dependencies=[Depends(control)])
    weights = service.weights

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsRequest) -> dict[str, Any]:
        version = await weights.update_weights_from_disk(body.model_path, body.recompute, body.weight_version)
        return {"success": True, "weight_version": version}

    # vLLM's weight transfer from a trainer: init once, then start, update (one or more), finish per version.
    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: InitWeightTransferRequest) -> dict[str, Any]:
        await weights.init_weight_transfer(body.init_info)
        return {"success": True}

    @router.post("/start_weight_update")
    async def start_weight_update(body: StartWeightUpdateRequest | None = None) -> dict[str, Any]:
        body = body or StartWeightUpdateRequest()
        if not body.is_checkpoint_format:
            raise bad_request(
                "is_checkpoint_format: only checkpoint-format tensors (named as model.named_parameters()) are loaded",
                "is_checkpoint_format",
            )
        weights.start_weight_update(body.recompute, body.lora_adapter, body.weight_version)
        return {"success": True}

    @router.post("/update_weights")
    async def update_weights(body: UpdateWeightsFromTrainerRequest) -> dict[str, Any]:
        return {"success": True, **await weights.update_weights(body.update_info)}

    @router.post("/finish_weight_update")
    async def finish_weight_update() -> dict[str, Any]:
        return {"success": True, "weight_version": await weights.finish_weight_update()}

    @router.get("/weight_transfer")
    async def weight_transfer() -> dict[str, Any]:
        return weights.transfer_status()

    @router.get("/get_world_size")
    async def get_world_size(include_dp: bool = True) -> dict[str, int]:
        # The workers that join a transfer group: this server has one (no tensor or data parallelism), with or
        # without vLLM's data-parallel ranks.
        return {"world_size": 1}

    @router.get("/server_info")
    async def server_info(config_format: str = "json") -> dict[str, Any]:
        # The parts of vLLM's resolved config that TRL's clients read: the weights' dtype (get_dtype), the
        # parallel layout and the adapters (AsyncGRPOTrainer's select_adapter_sync), the transfer engine
        # (VLLMClient.init_communicator refuses a server without one).
        if config_format != "json":
            raise bad_request(f"config_format: only 'json' is served, got {config_format!r}", "config_format")
        return {
            "vllm_config": {
                "model_config": {"dtype": weights.weights_dtype(), "max_model_len": service.info.max_model_len},
                "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1, "pipeline_parallel_size": 1},
                "lora_config": service.lora_config(),
                "weight_transfer_config": {"backend": weights.backend()},
            }
        }

    return router
