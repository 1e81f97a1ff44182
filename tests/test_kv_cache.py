"""kv_cache: the paged K/V tensors and the CPU offload pool are ordinary tensors, whatever mode builds them;
block copies within the cache."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RequestStatus, init_continuous_batching
from rollout.kv_cache import CacheShape, CPUOffloadPool, PagedKVCache
from tests.tiny_models import VOCAB_SIZE, random_prompts, tiny_llama
from tests.utils import reference_greedy


def test_cache_and_pool_built_under_inference_mode_are_not_inference_tensors() -> None:
    shape = CacheShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    with torch.inference_mode():
        cache = PagedKVCache(shape, num_blocks=4, block_size=4, device=torch.device("cpu"))
        pool = CPUOffloadPool(shape, space_gib=0.001, block_size=4)
    assert not any(t.is_inference() for t in cache.key + cache.value + pool.key + pool.value)
    pool.store(cache, [1], pool.allocate(1))  # outside inference mode, as the manager's thread does


def test_copy_blocks_copies_every_slot_of_every_layer_and_reads_every_source_first() -> None:
    shape = CacheShape(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    cache = PagedKVCache(shape, num_blocks=4, block_size=3, device=torch.device("cpu"))
    for layer in range(2):
        cache.key[layer].copy_(torch.arange(24, dtype=torch.float32).reshape(12, 1, 2) + 100 * layer)
        cache.value[layer].copy_(-cache.key[layer])
    before = [t.clone() for t in cache.key + cache.value]
    # Block 1 is the source of the first copy and the destination of the second.
    cache.copy_blocks([(1, 3), (0, 1)])
    for old, new in zip(before, cache.key + cache.value):
        assert torch.equal(new[9:12], old[3:6])  # block 3 <- block 1 as it was
        assert torch.equal(new[3:6], old[0:3])  # block 1 <- block 0
        assert torch.equal(new[0:3], old[0:3]) and torch.equal(new[6:9], old[6:9])  # untouched
    cache.copy_blocks([])


def test_offload_works_for_a_manager_built_inside_inference_mode() -> None:
    # Case 4: the KV cache and the CPU pool, allocated under the caller's inference_mode, were
    # inference tensors; the loop's thread could not write them and every request failed.
    model = tiny_llama()
    prompts = random_prompts(8, VOCAB_SIZE, min_len=10, max_len=30, seed=6)
    gc = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None)
    cfg = ContinuousBatchingConfig(page_size=4, num_blocks=14, safety_margin=0.0, cpu_offload_space=0.01)
    with torch.inference_mode():
        manager = init_continuous_batching(model, gc, cfg)
    assert manager.engine.offload_pool is not None  # cpu_offload_space > 0 turned offload on by itself
    assert not manager.engine.cache.key[0].is_inference() and not manager.engine.offload_pool.key[0].is_inference()
    manager.start()
    try:
        outs = [manager.get_result(r, timeout=60) for r in manager.add_requests(prompts)]
        assert [o.status for o in outs] == [RequestStatus.FINISHED] * 8, outs[0].error
        assert [o.generated_tokens for o in outs] == [reference_greedy(model, p, 16, None) for p in prompts]
        assert manager.engine.stats.num_offloads > 0
    finally:
        manager.destroy()
