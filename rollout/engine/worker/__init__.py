"""The worker room: what runs a scheduled step on the model. The step's inputs (``inputs``: one builder, exact or
padded, into staged buffers), the one forward (``forward``: eager, compiled or CUDA-graphed, and the warm keys of its
shapes), the Llama family's fused decoder layers on CPU (``fused_layer``), the fused oneDNN linear layers
(``onednn``), the model runner (``runner``: forward, then sampling), the readback of its results (``readback``) and
tensor parallelism (``distributed``).

May import the ground modules, ``rollout.lora``, ``rollout.weights``, ``engine.attention``, ``engine.sample``,
``engine.staging``, ``engine.kv`` (the cache tensors and the offload pool, not the KV cache manager) and
``engine.sched.output`` only (the step it runs and the output it returns, never the scheduler).
"""

from rollout.engine.worker.distributed import TensorParallel, is_driver_rank, tensor_parallel_mesh
from rollout.engine.worker.forward import PATHS, mark_warmed, warm_key, warmed_before, warmup_shapes
from rollout.engine.worker.inputs import PaddingRule, StepBatch
from rollout.engine.worker.runner import LaunchedStep, ModelRunner

__all__ = [
    "PATHS",
    "LaunchedStep",
    "ModelRunner",
    "PaddingRule",
    "StepBatch",
    "TensorParallel",
    "is_driver_rank",
    "mark_warmed",
    "tensor_parallel_mesh",
    "warm_key",
    "warmed_before",
    "warmup_shapes",
]
