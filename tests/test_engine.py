"""Engine: the KV cache's dtype and devices and the attention kernel it picks (issue 13, cases 2 and 6).

Case 2: under accelerate's ``mixed_precision="bf16"`` (TRL's default) the model keeps fp32 weights and
runs under autocast; the cache was fp32 while keys and values arrived in bf16, and the first step failed
in ``index_copy_``. Case 6: the manager's thread never made the model's GPU current, and the flash
kernel was used without checking what it needs. The GPU side of both is in tests/test_cuda.py.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from accelerate import Accelerator
from transformers import GenerationConfig

import rollout.engine.attention.flash as flash_module
from rollout import ContinuousBatchingConfig, ContinuousBatchingManager, generate_batch
from rollout.engine import Engine
from rollout.engine.attention.flash import choose_flash
from tests.tiny_models import EOS_TOKEN_ID, VOCAB_SIZE, random_prompts, tiny_llama
from tests.utils import reference_greedy

GREEDY = GenerationConfig(max_new_tokens=8, do_sample=False)


def cfg(**kw) -> ContinuousBatchingConfig:  # noqa: ANN003
    kw.setdefault("page_size", 4)
    kw.setdefault("num_blocks", 128)
    return ContinuousBatchingConfig(**kw)


def test_generation_under_accelerate_bf16_mixed_precision(accelerate_state) -> None:
    model = Accelerator(cpu=True, mixed_precision="bf16").prepare(tiny_llama())
    prompts = random_prompts(4, VOCAB_SIZE, 5, 30, seed=8)
    # model.generate runs the same autocast forward (accelerate wrapped model.forward itself).
    expected = [reference_greedy(model, p, 8, EOS_TOKEN_ID) for p in prompts]
    engine = Engine(model, cfg())
    try:
        assert engine.cache.dtype == torch.bfloat16  # what the attention computes in, not the fp32 weights
    finally:
        engine.close()
    out = generate_batch(model, prompts, GREEDY, cfg())
    assert [o.generated_tokens for o in out.values()] == expected
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_the_manager_thread_makes_the_model_gpu_current(monkeypatch) -> None:
    # A new thread starts on cuda:0; on rank 1 the loop must launch on cuda:1. No GPU here: the engine's
    # device is faked and set_device recorded (the steps themselves run on the CPU cache).
    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d)))
    model = tiny_llama()
    prompt = random_prompts(1, VOCAB_SIZE, 5, 10, seed=2)[0]
    manager = ContinuousBatchingManager(model, GREEDY, cfg())
    monkeypatch.setattr(manager.engine, "device", torch.device("cuda", 1))
    manager.start()
    try:
        out = manager.get_result(manager.add_request(prompt), timeout=60)
        assert out.generated_tokens == reference_greedy(model, prompt, 8, EOS_TOKEN_ID)
    finally:
        manager.destroy()
    assert calls == [("rollout-manager", torch.device("cuda", 1))]


def test_a_cpu_engine_never_sets_a_gpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail(f"set_device({d}) on a CPU engine"))
    engine = Engine(tiny_llama(), cfg())
    engine.use_device_in_this_thread()
    engine.close()


def test_flash_is_chosen_only_for_a_cache_on_gpus_that_pass_every_check(monkeypatch, caplog) -> None:
    asked: list[list[torch.device]] = []
    reason: list[str | None] = ["page_size is 4; flash-attn's paged kernel needs a multiple of 256"]

    def support(devices, dtype, head_dim, page_size):  # noqa: ANN001, ANN202
        asked.append(list(devices))
        assert (dtype, head_dim, page_size) == (torch.float32, 16, 4)
        return reason[0]

    monkeypatch.setattr(flash_module, "flash_support", support)
    monkeypatch.setattr(flash_module, "_LOGGED_FLASH_REASONS", set())
    monkeypatch.setattr(flash_module, "flash_attn_available", lambda: True)
    shape = (torch.float32, 16, 4)  # cache dtype, head dim, page size of the engine asking
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert choose_flash([torch.device("cpu")] * 2, *shape) is False and asked == []  # CPU: no check
    assert choose_flash([gpus[0], torch.device("cpu")], *shape) is False and asked == []
    with caplog.at_level(logging.INFO, logger="rollout.engine.attention.flash"):
        assert choose_flash(gpus, *shape) is False
    assert asked == [gpus] and "SDPA, not flash-attn: page_size is 4" in caplog.text
    assert caplog.records[-1].levelno == logging.WARNING  # installed but unusable: a warning
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rollout.engine.attention.flash"):
        assert choose_flash(gpus, *shape) is False
    assert caplog.text == ""  # each reason once per process (generate_batch builds an engine per call)
    reason[0] = None
    assert choose_flash(gpus, *shape) is True


def test_a_cache_that_cannot_be_had_is_refused_naming_num_blocks_and_max_memory_percent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``num_blocks`` past the usable memory is a FieldError naming it before anything is allocated; an allocation
    that fails anyway (torch's CPU allocator: a plain RuntimeError) is a CacheAllocationError (a MemoryError) naming
    what was asked and what is usable; another error of the allocation passes through as it was."""
    import rollout.engine.build
    from rollout import FieldError
    from rollout.engine.kv.sizing import CacheAllocationError, num_blocks_for_model

    model = tiny_llama()
    too_many = 4 * num_blocks_for_model(model, ContinuousBatchingConfig(), memory_percent=1.0)  # memory moves a little
    with pytest.raises(FieldError, match=rf"num_blocks={too_many}: .* room for at most \d+ blocks") as e:
        Engine(model, ContinuousBatchingConfig(num_blocks=too_many))
    assert e.value.field == "num_blocks" and "max_memory_percent" in str(e.value)

    def no_memory(*args: object, **kwargs: object) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 bytes")

    monkeypatch.setattr(rollout.engine.build, "PagedKVCache", no_memory)
    with pytest.raises(CacheAllocationError, match=r"^num_blocks=8: the KV cache of 8 blocks could not be allocated"):
        Engine(model, ContinuousBatchingConfig(num_blocks=8))
    with pytest.raises(MemoryError, match="max_memory_percent=0.5: .* GiB are usable on cpu now"):
        Engine(model, ContinuousBatchingConfig(max_memory_percent=0.5))

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("something else")

    monkeypatch.setattr(rollout.engine.build, "PagedKVCache", broken)
    with pytest.raises(RuntimeError, match="^something else$"):
        Engine(model, ContinuousBatchingConfig(num_blocks=8))
