"""What the tensor-parallel tests run: once on every rank under ``torchrun`` (a model loaded with
``tp_plan="auto"``), once in the test's own process on the unsharded model (the reference).

``python tests/tp_scenario.py MODEL_DIR OUT_DIR [--quick]`` (under ``torchrun --nproc_per_node N``)
writes ``OUT_DIR/rank{r}.json`` from every rank: what each rollout call returned there. The test
compares the driver's file with ``run_scenario`` run on the plain model, and checks that the other
ranks returned nothing. ``--quick`` runs ``generate_batch`` and ``score`` only (the 3-rank SmolLM2 run).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script by torchrun
    sys.path.insert(0, str(REPO))

import rollout  # noqa: E402
import rollout.engine  # noqa: E402

MAX_NEW = 10
# Small pages so that the prompts span several blocks (prefix caching, block tables of several entries).
CONFIG = dict(page_size=8, num_blocks=96, return_logprobs=True, logprobs_mode="raw")


def prompts_for(vocab: int) -> list[list[int]]:
    """Four prompts of 5 to 37 tokens, two sharing a 16-token prefix, ids below ``vocab``."""
    shared = [(7 * i + 3) % vocab for i in range(16)]
    return [
        [1, 5, 9, 20, 30],
        shared + [11, 12, 13],
        shared + [40, 41, 42, 43, 44, 45],
        [(13 * i + 2) % vocab for i in range(37)],
    ]


def new_weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Full tensors for some of the model's weights, the same on every rank (a seeded generator).

    Sharded projections (DTensors under TP) and a replicated norm weight, so that ``update_weights``
    is exercised on both kinds.
    """
    generator = torch.Generator().manual_seed(1234)
    chosen = {}
    for name, param in sorted(model.named_parameters()):
        if name.endswith(("q_proj.weight", "mlp.down_proj.weight", "model.norm.weight")):
            chosen[name] = (torch.randn(tuple(param.shape), generator=generator) * 0.2).to(param.dtype)
    return chosen


def _outputs(outputs: dict[str, Any]) -> dict[str, Any]:
    return {
        rid: {
            "tokens": out.generated_tokens,
            "logprobs": out.logprobs,
            "versions": out.weight_versions,
            "cached": out.num_cached_prompt_tokens,
        }
        for rid, out in outputs.items()
    }


def run_scenario(
    model: PreTrainedModel, eos: int, quick: bool = False, sync: Any = None, late_pause: float = 0.0
) -> dict[str, Any]:
    """Every rollout call of the tests, in order; returns what each returned on this process.

    Args:
        model: the tiny model (or SmolLM2), TP-sharded or not.
        eos: the eos id of the generation config.
        quick: ``generate_batch`` and ``score`` only.
        sync: a callable that waits for every rank (a barrier on a group of its own), or None.
        late_pause: seconds to wait before entering the pause that updates the weights: the ranks other
            than the driver come late, and no rank may step before their update is done too.
    """
    vocab = model.get_input_embeddings().num_embeddings
    prompts = prompts_for(vocab)
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos)
    config = rollout.ContinuousBatchingConfig(**CONFIG)
    record: dict[str, Any] = {}

    record["generate_batch"] = _outputs(rollout.generate_batch(model, prompts, gc, config))

    if not quick:
        # Sampling without seeds: each rank's generator is seeded from the OS, yet every rank must
        # append the driver's tokens (the engine API returns requests on every rank).
        engine = rollout.engine.Engine(model, rollout.ContinuousBatchingConfig(page_size=8, num_blocks=96))
        params = rollout.SamplingParams(max_new_tokens=MAX_NEW, do_sample=True, temperature=1.5, eos_token_ids=())
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=f"sample_{i}")
        sampled: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for req in engine.step():
                if req.status == rollout.RequestStatus.FINISHED:
                    sampled[req.request_id] = req.generated_tokens
        engine.close()
        record["engine_sampled"] = sampled

        # The manager: streaming requests, then a pause holding new requests and a weight update.
        manager = rollout.init_continuous_batching(model, gc, config)
        manager.start()
        ids = [manager.add_request(p, streaming=True) for p in prompts[:3]]
        record["stream_ids"] = ids
        streams = {}
        for rid in ids:
            if rid is not None:  # the driver reads; the other ranks got None and read nothing
                chunks = list(manager.request_id_iter(rid))
                streams[rid] = {
                    "lengths": [len(c.generated_tokens) for c in chunks],
                    "final": _outputs({rid: chunks[-1]})[rid],
                    "status": chunks[-1].status.name,
                }
        record["streams"] = streams
        if sync is not None:
            sync()  # the other ranks update the weights only once the driver has read the streams
        update = new_weights(model)
        time.sleep(late_pause)
        with manager.pause():
            later = manager.add_requests(prompts)
            record["version"] = manager.update_weights(update, recompute=True)
        record["later_ids"] = later
        record["later"] = _outputs({rid: manager.get_result(rid) for rid in later if rid is not None})
        manager.destroy()

        # generate_batch on a persistent manager: started, used and stopped (its cache kept) by the call.
        record["persistent"] = _outputs(rollout.generate_batch(model, prompts, gc, config, persistent_manager=True))
        rollout.init_continuous_batching(model).destroy()

    completions = [[(5 * i + j) % vocab for j in range(6 + i)] for i in range(len(prompts))]
    scores = rollout.score(model, prompts, completions, include_prompt=True)
    record["score"] = [{"completion": s.completion_logprobs, "prompt": s.prompt_logprobs} for s in scores]
    return record


def main(argv: list[str]) -> int:
    """Load the model sharded over the ``torchrun`` ranks and write this rank's record.

    Arguments: MODEL_DIR OUT_DIR [--quick] [--kv-error MODEL_DIR]: the second model's KV heads do not
    split over the ranks, and what ``generate_batch`` raised on it is recorded.
    """
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    model_dir, out_dir = Path(argv[0]), Path(argv[1])
    quick = "--quick" in argv
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
    rank = dist.get_rank()
    barrier_group = dist.new_group(backend="gloo")  # not the model's group, which the manager's steps use
    eos = int(os.environ.get("TP_SCENARIO_EOS", "2"))
    try:
        late = 0.0 if rank == 0 else 1.0
        record = run_scenario(model, eos, quick, sync=lambda: dist.barrier(group=barrier_group), late_pause=late)
        engine = rollout.engine.Engine(model, rollout.ContinuousBatchingConfig(num_blocks=4))
        record["local_kv_heads"] = engine.cache.shape.num_kv_heads  # the KV heads this rank's cache holds
        record["async_default"] = engine.async_batching  # None under TP: off
        engine.close()
        try:  # refused on every rank before any collective, so no rank waits for the others
            config = rollout.ContinuousBatchingConfig(num_blocks=4, use_async_batching=True)
            rollout.engine.Engine(model, config).close()
            record["async_error"] = None
        except ValueError as e:
            record["async_error"] = str(e)
        if "--kv-error" in argv:
            bad = argv[argv.index("--kv-error") + 1]
            bad_model = AutoModelForCausalLM.from_pretrained(bad, tp_plan="auto", dtype=torch.float32).eval()
            try:
                rollout.generate_batch(bad_model, [[1, 2, 3]], GenerationConfig(max_new_tokens=2, eos_token_id=eos))
                record["kv_error"] = None
            except ValueError as e:
                record["kv_error"] = str(e)
        (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()  # an orderly end: gloo aborts a process that exits with open groups
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
