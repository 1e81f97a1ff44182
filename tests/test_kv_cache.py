"""kv_cache: the paged K/V tensors and the CPU offload pool are ordinary tensors, whatever mode builds them."""

from __future__ import annotations

import pytest
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


def test_keys_and_values_in_another_dtype_are_cast_on_write() -> None:
    # Issue 13, case 2: under autocast a layer's keys (fp32 rotary embedding) and values (bf16 projection)
    # arrive in different dtypes; index_copy_ refused both into a cache of a third.
    cache = PagedKVCache(CacheShape(1, 2, 4, torch.bfloat16), num_blocks=2, block_size=4, device=torch.device("cpu"))
    key = torch.tensor([[[0.1, 0.2, 0.3, 0.4]] * 2, [[1.001, 2.0, 3.0, 4.0]] * 2])  # fp32 [2, 2, 4]
    value = torch.full((2, 2, 4), 0.5, dtype=torch.float16)
    cache.write(0, torch.tensor([5, 2]), key, value)
    assert cache.key[0].dtype == torch.bfloat16
    assert torch.equal(cache.key[0][[5, 2]], key.to(torch.bfloat16))
    assert torch.equal(cache.value[0][[5, 2]], value.to(torch.bfloat16))
    assert cache.key[0][[0, 1, 3, 4, 6, 7]].abs().sum() == 0  # no other slot written


def test_each_layer_lives_on_its_own_device_and_offload_copies_per_layer() -> None:
    # Issue 13, case 6: a device_map-sharded model keeps each layer's KV beside the layer ("meta" stands in
    # for a second GPU: it has shapes and dtypes but no data).
    shape = CacheShape(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    cache = PagedKVCache(shape, num_blocks=4, block_size=4, device=cpu, layer_devices=[cpu, meta, cpu])
    assert [t.device for t in cache.key] == [cpu, meta, cpu] == [t.device for t in cache.value]
    assert cache.size_bytes == 3 * 2 * 2 * 4 * 4 * 16
    with pytest.raises(ValueError, match="one device per layer"):
        PagedKVCache(shape, num_blocks=4, block_size=4, device=cpu, layer_devices=[cpu])
    # Offload through a cache whose layers are all on the CPU, laid out per layer.
    cache = PagedKVCache(shape, num_blocks=4, block_size=4, device=cpu, layer_devices=[cpu] * 3)
    for layer in range(3):
        cache.key[layer][4:8] = layer + 1.0
    pool = CPUOffloadPool(shape, space_gib=0.001, block_size=4)
    ids = pool.allocate(1)
    pool.store(cache, [1], ids)
    pool.load(cache, ids, [3])
    assert [float(cache.key[layer][12:16].mean()) for layer in range(3)] == [1.0, 2.0, 3.0]
