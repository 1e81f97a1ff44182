"""The engine's float32 CPU linear layers through oneDNN, in the eager step and the static-shape one.

On the 2-core AMD EPYC the project measures on, ``torch.nn.functional.linear`` in float32 runs MKL's
sgemm, and oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``) on the same unpacked weight
is 1.1-2.7x faster on the model's shapes at 32 and 512 rows (``scripts/profile_step.py
--linear-microbench``, docs/profile.md; at a few rows some shapes are slower). The linear layers are
most of a step on MKL (67% of a bare transformers decode forward of 32 requests, 86% of a 512-token
prefill: docs/profile.md), so both the eager step (``ModelRunner._eager_forward``) and the compiled one
call them through oneDNN: ``OneDNNLinear`` is a ``TorchFunctionMode`` (which dynamo traces) mapping
each float32 CPU ``F.linear`` to the custom op ``rollout::onednn_linear``. ``rollout-bench`` compares
eager rollout with ``rollout-mkl`` (the same engine on MKL): 1.61x the tokens/s on gsm8k-greedy
(README, Benchmarks).
Only the engine's own forwards run inside the mode: training and ``model.generate`` keep MKL.

Why a custom op: inductor lowers ``mkldnn._linear_pointwise`` only for weights frozen into the graph
(``torch._inductor.config.freezing``, which folds the parameters in as constants, so an in-place
weight update would go unseen); the custom op is opaque to inductor, reads the live parameter at every
call, and costs one Python dispatch per layer. ``ROLLOUT_ONEDNN_LINEAR=0`` in the environment turns the
mapping off for the engines built after it is set, eager and compiled steps alike
(``onednn_linear_enabled``). The results equal ``F.linear``'s up to float32 rounding (another summation
order), not bit for bit.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# Read once: dynamo does not trace ``torch.backends`` (a call inside a compiled step breaks its graph).
MKLDNN_AVAILABLE = torch.backends.mkldnn.is_available()


# The values of ROLLOUT_ONEDNN_LINEAR that turn the mapping off (case-insensitive).
OFF_VALUES = ("0", "false", "off", "no")


def onednn_linear_enabled() -> bool:
    """Whether an engine built now maps its CPU linear layers to oneDNN: oneDNN is available and the
    environment does not set ``ROLLOUT_ONEDNN_LINEAR`` to 0, false, off or no (to compare with MKL: the benchmark's
    ``rollout-mkl`` system; or with inductor's freezing, which prepacks only the aten linear layers it
    sees). Each ``ModelRunner`` reads it once, at construction.
    """
    return MKLDNN_AVAILABLE and os.environ.get("ROLLOUT_ONEDNN_LINEAR", "1").strip().lower() not in OFF_VALUES


try:  # a tensor-parallel shard keeps its own linear (the op takes plain tensors)
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without distributed
    DTensor = None


@torch.library.custom_op("rollout::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN's inner product.

    Args:
        x: float32 [..., K] on the CPU.
        weight: float32 [N, K], a plain (unpacked) tensor: the model's live parameter.
        bias: float32 [N] or None.

    Returns:
        float32 [..., N], a new tensor.
    """
    # oneDNN reads the bias as dense memory: a strided or expanded view would be read wrongly.
    bias = bias.contiguous() if bias is not None else None
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _onednn_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def onednn_linear_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``OneDNNLinear`` maps linear layers on this device and dtype: float32 on a CPU with oneDNN.

    (bfloat16 and float16 ``F.linear`` on CPU already run oneDNN; CUDA keeps cuBLAS.)
    """
    return device.type == "cpu" and dtype == torch.float32 and MKLDNN_AVAILABLE


class OneDNNLinear(TorchFunctionMode):
    """Inside it, ``F.linear`` on float32 CPU tensors without autograd runs ``rollout::onednn_linear``.

    Anything else (other functions, other devices or dtypes, a tensor that needs a gradient, a
    tensor-parallel ``DTensor``, any call while CPU autocast is on) runs as it would without the mode.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (
                x.device.type == "cpu"
                and x.dtype == torch.float32
                and weight.dtype == torch.float32
                and not (DTensor is not None and (isinstance(x, DTensor) or isinstance(weight, DTensor)))
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
                # Under autocast F.linear computes in autocast's dtype; the custom op would stay float32.
                and not torch.is_autocast_enabled("cpu")
            ):
                return onednn_linear(x, weight, bias)
        return func(*args, **kwargs)
