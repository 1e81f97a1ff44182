"""kv_cache, cpu_offload, cache_sizing: the paged K/V tensors and the CPU offload pool (ordinary tensors whatever
mode builds them; exact pinned size; copies that land before they are read), block copies within the cache, and
the sizing of the cache from usable memory."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import GenerationConfig

import rollout
import rollout.engine
from rollout import ContinuousBatchingConfig, RequestStatus, init_continuous_batching
from rollout.engine import Engine
from rollout.engine.kv import cache as kv_cache
from rollout.engine.kv import offload as cpu_offload
from rollout.engine.kv import sizing as cache_sizing
from rollout.engine.kv.cache import GIB, CacheShape, PagedKVCache
from rollout.engine.kv.offload import CPUOffloadPool
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


# ---------------------------------------------------------------- issue 13 case 3: the offload pool
SHAPE = CacheShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)  # 128 bytes per token
BS = 4
BYTES_PER_BLOCK = 128 * BS  # 512


def filled_cache(num_blocks: int, device: str = "cpu", shape: CacheShape = SHAPE, block_size: int = BS) -> PagedKVCache:
    """A cache whose every K/V entry is a distinct value (so a misplaced copy shows)."""
    cache = PagedKVCache(shape, num_blocks=num_blocks, block_size=block_size, device=torch.device(device))
    numel = cache.key[0].numel()
    for layer in range(shape.num_layers):
        base = 2 * layer * numel
        values = torch.arange(base, base + 2 * numel, device=device).to(shape.dtype)
        cache.key[layer].copy_(values[:numel].view_as(cache.key[layer]))
        cache.value[layer].copy_(values[numel:].view_as(cache.value[layer]))
    return cache


def block_contents(cache: PagedKVCache, block: int) -> torch.Tensor:
    """[layers, 2, block_size, heads, dim]: one cache block of every layer, the pool's block layout."""
    rows = slice(block * cache.block_size, (block + 1) * cache.block_size)
    return torch.stack([torch.stack((cache.key[i][rows], cache.value[i][rows])) for i in range(len(cache.key))])


def test_offload_pool_is_one_buffer_of_exactly_the_blocks_that_fit_the_space() -> None:
    pool = CPUOffloadPool(SHAPE, space_gib=10.5 * BYTES_PER_BLOCK / GIB, block_size=BS)
    assert pool.num_blocks == 10
    assert pool.size_bytes == 10 * BYTES_PER_BLOCK == 5120  # not a power of two: nothing rounded up
    assert pool.buffer.untyped_storage().nbytes() == 5120
    assert tuple(pool.blocks.shape) == (10, 2, 2, BS, 2, 4)
    # key/value are views of the one buffer, not separate allocations.
    assert pool.key[1].untyped_storage().data_ptr() == pool.buffer.data_ptr()
    assert pool.allocate(3) == [0, 1, 2]  # ascending: a request's blocks form one run


def test_pinned_pool_page_locks_its_one_buffer_for_exactly_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's pinned allocator rounds every pin_memory=True tensor up to a power of two (5120 -> 8192);
    # the pool pins its buffer in place instead, so the pinned bytes are what was asked.
    locked: list[tuple[int, int]] = []
    unlocked: list[int] = []
    monkeypatch.setattr(
        cpu_offload, "_page_lock", lambda t: locked.append((t.data_ptr(), t.untyped_storage().nbytes()))
    )
    monkeypatch.setattr(cpu_offload, "_page_unlock", lambda t: unlocked.append(t.data_ptr()))
    pool = CPUOffloadPool(SHAPE, space_gib=10.5 * BYTES_PER_BLOCK / GIB, block_size=BS, pin=True)
    assert pool.pinned
    assert locked == [(pool.buffer.data_ptr(), 5120)]
    pool.close()
    pool.close()
    assert unlocked == [pool.buffer.data_ptr()] and not pool.pinned


def test_store_and_load_move_every_layer_of_each_block_also_out_of_order() -> None:
    cache = filled_cache(num_blocks=8)
    expected = {b: block_contents(cache, b).clone() for b in range(8)}
    pool = CPUOffloadPool(SHAPE, space_gib=6 * BYTES_PER_BLOCK / GIB, block_size=BS)
    first = pool.allocate(3)
    pool.store(cache, [5, 1, 3], first)
    pool.free([first[1]])  # block 1 of the pool is free again: the next request gets 1, then 3, 4
    second = pool.allocate(3)
    assert second == [1, 3, 4]  # two runs: [1] and [3, 4]
    pool.store(cache, [6, 0, 7], second)
    held = pool.read_blocks(first[:1] + first[2:] + second)
    want = [expected[b] for b in (5, 3, 6, 0, 7)]
    assert torch.equal(held, torch.stack(want))
    # Load back into other cache blocks: each receives exactly the block stored from its source.
    cache.key[0].zero_()
    cache.value[1].zero_()
    pool.load(cache, second, [2, 5, 4])
    for dst, src in zip([2, 5, 4], [6, 0, 7], strict=True):
        assert torch.equal(block_contents(cache, dst), expected[src]), (dst, src)


# ---------------------------------------------------------------- issue 13 case 4: memory sizing
MIB = 1024**2


def test_memory_report_counts_torch_cached_memory_as_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    # A second engine, or one built after a training step, finds the memory the first one (or the step)
    # freed in torch's caching allocator: the driver calls it used, torch hands it out first.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * GIB)
    report = cache_sizing.memory_report(torch.device("cuda", 0))
    assert (report.free, report.cached, report.usable) == (3 * GIB, 6 * GIB, 9 * GIB)
    assert cache_sizing.usable_memory_bytes(torch.device("cuda", 0)) == 9 * GIB


def test_logits_workspace_is_batch_tokens_times_vocab_times_the_logits_and_eight_float32() -> None:
    assert cache_sizing.logits_workspace_bytes(64, 256, torch.float32) == 64 * 256 * (4 + 32)
    assert cache_sizing.logits_workspace_bytes(2048, 49152, torch.bfloat16) == 2048 * 49152 * (2 + 32)


def test_num_blocks_for_memory_takes_the_workspace_out_of_the_share() -> None:
    per_block = SHAPE.bytes_per_token * BS  # 512
    blocks = cache_sizing.num_blocks_for_memory(
        SHAPE, BS, torch.device("cpu"), 0.5, workspace_bytes=1 * MIB, usable_bytes=10 * MIB
    )
    assert blocks == (5 * MIB - 1 * MIB) // per_block == 8192
    # A workspace larger than the share still leaves one block (and a warning).
    assert cache_sizing.num_blocks_for_memory(SHAPE, BS, torch.device("cpu"), 0.5, 6 * MIB, usable_bytes=10 * MIB) == 1


def test_engine_sizes_its_cache_from_usable_memory_minus_the_logits_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_sizing, "usable_memory_bytes", lambda device: 8 * MIB)
    model = tiny_llama()  # 2 layers, 2 KV heads, head dim 16, fp32, vocab 256
    cfg = ContinuousBatchingConfig(page_size=4, max_batch_tokens=64, max_memory_percent=0.5)
    engine = Engine(model, cfg)
    try:
        per_block = (2 * 2 * 2 * 16 * 4) * 4  # bytes per token x tokens per block = 2048
        workspace = 64 * VOCAB_SIZE * (4 + 32)  # 589,824
        assert engine.num_blocks == (4 * MIB - workspace) // per_block == 1760
        assert rollout.engine.num_blocks_for_model(model, cfg) == 1760
    finally:
        engine.close()


# ---------------------------------------------------------------- CUDA (run by the GPU check script)
@pytest.mark.cuda
def test_cuda_pool_is_pinned_exactly_and_a_read_right_after_store_sees_the_copied_blocks() -> None:
    # Large blocks, so that the device-to-host copies are still in flight when the host reads: the
    # old pool scattered a non-blocking copy's destination on the host before the copy landed.
    shape = CacheShape(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    block_size = 256
    per_block = shape.bytes_per_token * block_size  # 8 MiB
    cache = PagedKVCache(shape, num_blocks=72, block_size=block_size, device=torch.device("cuda"))
    for t in cache.key + cache.value:
        t.normal_()
    pool = CPUOffloadPool(shape, space_gib=(64 * per_block + per_block // 2) / GIB, block_size=block_size, pin=True)
    try:
        assert pool.num_blocks == 64 and pool.size_bytes == 64 * per_block  # not rounded up to a power of two
        assert pool.buffer.is_pinned() and pool.pinned
        src = list(range(3, 67))
        ids = pool.allocate(64)
        pool.store(cache, src, ids)
        held = pool.read_blocks(ids)
        want = torch.stack([block_contents(cache, b) for b in src]).cpu()
        assert torch.equal(held, want)
        # Restores read the pool on the device side, ordered after the stores by the event.
        pool.load(cache, ids[:8], list(range(8)))
        for i in range(8):
            assert torch.equal(block_contents(cache, i).cpu(), want[i])
    finally:
        pool.close()


@pytest.mark.cuda
def test_cuda_offload_preemption_generates_what_model_generate_does() -> None:
    model = tiny_llama().cuda()
    prompts = random_prompts(8, VOCAB_SIZE, min_len=10, max_len=30, seed=6)
    gen_config = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None)
    cfg = ContinuousBatchingConfig(page_size=4, num_blocks=14, safety_margin=0.0, cpu_offload_space=0.01)
    manager = init_continuous_batching(model, gen_config, cfg)
    assert manager.engine.offload_pool is not None and manager.engine.offload_pool.pinned
    manager.start()
    try:
        outs = [manager.get_result(r, timeout=120) for r in manager.add_requests(prompts)]
        assert [o.status for o in outs] == [RequestStatus.FINISHED] * 8, outs[0].error
        cpu_model = tiny_llama()  # the same weights, for the reference
        assert [o.generated_tokens for o in outs] == [reference_greedy(cpu_model, p, 16, None) for p in prompts]
        assert manager.engine.stats.num_offloads > 0
    finally:
        manager.destroy()


@pytest.mark.cuda
def test_cuda_engine_built_after_a_destroyed_one_gets_as_many_blocks() -> None:
    # mem_get_info does not count what the first engine's cache left in torch's caching allocator.
    model = tiny_llama().cuda()
    cfg = ContinuousBatchingConfig(max_memory_percent=0.3)
    first = Engine(model, cfg)
    n_first, cache_bytes = first.num_blocks, first.cache.size_bytes
    first.close()
    del first
    gc.collect()
    # The first cache is back in torch's allocator, which the driver still counts as used.
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() >= 0.9 * cache_bytes
    second = Engine(model, cfg)
    try:
        assert second.num_blocks >= 0.97 * n_first
    finally:
        second.close()


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


# ---------------------------------------------------------------- layer groups (issue 12, item 3)
def _gemma3_shape(window: int = 64) -> CacheShape:
    """Gemma 3's pattern: 5 sliding layers then 1 global layer, 2 KV heads of dim 16, fp32."""
    layers = tuple(kv_cache.LayerKV(2, 16, window) for _ in range(5)) + (kv_cache.LayerKV(2, 16, None),)
    return CacheShape(6, 2, 16, torch.float32, layers)


def test_gemma3_pattern_is_six_one_layer_groups_sharing_one_tensor_slot() -> None:
    shape = _gemma3_shape()
    layout = kv_cache.CacheLayout.build(shape, [torch.device("cpu")] * 6)
    assert [g.name for g in layout.groups] == [f"sliding64:{i}" for i in range(5)] + ["full:5"]
    assert layout.layer_group == (0, 1, 2, 3, 4, 5) and layout.layer_slot == (0,) * 6
    assert layout.num_slots == 1 and layout.row_shape == (2, 16)
    # A whole-model block (4 tokens of 6 layers) is the bytes of 6 block ids of one slot.
    assert layout.pool_blocks(shape, 10, 4) == 60
    cache = PagedKVCache(shape, num_blocks=60, block_size=4, device=torch.device("cpu"))
    assert cache.size_bytes == 10 * 4 * shape.bytes_per_token == 2 * 60 * 4 * 2 * 16 * 4
    assert all(cache.key[i].data_ptr() == cache.slot_key[0].data_ptr() for i in range(6))
    assert all(cache.value[i].data_ptr() == cache.slot_value[0].data_ptr() for i in range(6))


def test_alternating_layers_are_two_groups_of_two_over_two_slots() -> None:
    # tiny_gemma's pattern: sliding, full, sliding, full. gcd(2, 2) = 2 layers per group.
    layers = tuple(kv_cache.LayerKV(2, 16, 8 if i % 2 == 0 else None) for i in range(4))
    layout = kv_cache.CacheLayout.build(CacheShape(4, 2, 16, torch.float32, layers), [torch.device("cpu")] * 4)
    assert [(g.name, g.layers) for g in layout.groups] == [("sliding8:0,2", (0, 2)), ("full:1,3", (1, 3))]
    assert layout.layer_group == (0, 1, 0, 1) and layout.layer_slot == (0, 0, 1, 1)


def test_a_model_whose_layers_share_one_kind_keeps_one_slot_per_layer() -> None:
    layout = kv_cache.CacheLayout.build(SHAPE, [torch.device("cpu")] * 2)
    assert [g.name for g in layout.groups] == ["full:0,1"]
    assert layout.layer_slot == (0, 1) and layout.pool_blocks(SHAPE, 7, BS) == 7


def test_layers_with_other_shapes_share_slots_padded_to_the_widest_row() -> None:
    # Gemma-4 style: sliding layers 2 x 16, global layers 2 x 32 (64 elements per token row).
    layers = tuple(kv_cache.LayerKV(2, 16, 8) if i % 2 == 0 else kv_cache.LayerKV(2, 32, None) for i in range(4))
    shape = CacheShape(4, 2, 16, torch.float32, layers)
    assert shape.bytes_per_token == 2 * (32 + 64 + 32 + 64) * 4
    layout = kv_cache.CacheLayout.build(shape, [torch.device("cpu")] * 4)
    assert [g.name for g in layout.groups] == ["sliding8:0,2:2x16", "full:1,3:2x32"]
    assert layout.row_shape == (1, 64)
    # 12 whole-model blocks (192 elements per token) buy 12 * 192 / 128 = 18 block ids of 2 padded slots.
    assert layout.pool_blocks(shape, 12, 4) == 18
    cache = PagedKVCache(shape, num_blocks=18, block_size=4, device=torch.device("cpu"))
    assert [tuple(k.shape) for k in cache.key] == [(72, 2, 16), (72, 2, 32), (72, 2, 16), (72, 2, 32)]
    key = torch.arange(32, dtype=torch.float32).view(1, 2, 16)
    cache.write(2, torch.tensor([5]), key, -key)  # layer 2 is slot 1's narrow layer
    assert torch.equal(cache.slot_key[1][5, 0, :32], key.flatten()) and cache.slot_key[1][5, 0, 32:].abs().sum() == 0
    assert torch.equal(cache.key[2][5], key[0]) and cache.slot_key[0].abs().sum() == 0


def test_a_group_split_over_devices_gets_a_slot_on_each() -> None:
    # "meta" stands in for a second GPU: layers 0-2 on the CPU, 3-5 there.
    shape = _gemma3_shape()
    cpu, meta = torch.device("cpu"), torch.device("meta")
    layout = kv_cache.CacheLayout.build(shape, [cpu] * 3 + [meta] * 3)
    assert layout.layer_slot == (0, 0, 0, 1, 1, 1) and layout.slot_devices == (cpu, meta)
    # Each device holds 3 layers of a whole-model block and 1 slot of a block id: 3 ids per whole-model block.
    assert layout.pool_blocks(shape, 10, 4) == 30


def test_offload_of_a_grouped_cache_moves_every_slot_of_each_block() -> None:
    shape = _gemma3_shape()
    cache = PagedKVCache(shape, num_blocks=12, block_size=BS, device=torch.device("cpu"))
    cache.slot_key[0].copy_(torch.arange(cache.slot_key[0].numel(), dtype=torch.float32).view_as(cache.slot_key[0]))
    cache.slot_value[0].copy_(-cache.slot_key[0])
    pool = CPUOffloadPool(shape, space_gib=4 * 2 * BS * 32 * 4 / GIB, block_size=BS, layout=cache.layout)
    assert pool.num_blocks == 4 and tuple(pool.blocks.shape) == (4, 1, 2, BS, 2, 16)
    ids = pool.allocate(2)
    pool.store(cache, [7, 2], ids)
    expected = [cache.key[5][b * BS : (b + 1) * BS].clone() for b in (7, 2)]
    pool.load(cache, ids, [0, 11])
    assert torch.equal(cache.key[0][0:BS], expected[0]) and torch.equal(cache.key[3][11 * BS :], expected[1])
    assert torch.equal(cache.value[1][0:BS], -expected[0])
