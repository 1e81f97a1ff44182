"""attention: the paged dispatcher is shared by every engine on one model object, and only the last one restores it.

Issue 10, case 1: closing one engine (a ``generate_batch`` or ``score`` call, a second manager) used to
put the model's original attention back under a live manager, whose later outputs were then computed
without the paged cache while their status said FINISHED.

Issue 13: a model loaded with ``attn_implementation="flash_attention_2"`` (or a Hub kernel) was refused,
since transformers reads any implementation name containing "flash" as a flash-kernel request; its
training forwards must still reach the original kernel. Case 6: the rules under which the engine uses
flash-attn's paged kernel, and the step metadata of a model sharded over devices.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers.modeling_flash_attention_utils as fa_utils
from transformers import AttentionInterface, GenerationConfig
from transformers.integrations import hub_kernels
from transformers.integrations.hub_kernels import is_kernel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.generic import is_flash_attention_requested

import rollout
import rollout.engine.attention.flash as flash
from rollout import ContinuousBatchingConfig, RequestStatus, generate_batch, init_continuous_batching
from rollout.engine import Engine
from rollout.engine.attention.flash import flash_support, flash_unsupported_reason
from rollout.engine.attention.paged import PagedAttentionMetadata
from rollout.engine.attention.registry import (
    _USERS,
    dispatcher_name,
    enable_paged_attention,
    register_paged_attention,
    restore_attention,
)
from rollout.engine.kv.cache import CacheShape, PagedKVCache
from rollout.engine.worker.inputs import StepBatch
from tests import flash_reference
from tests.tiny_models import EOS_TOKEN_ID, VOCAB_SIZE, random_prompts, tiny_llama
from tests.utils import assert_close, reference_greedy, teacher_forced_logprobs

GREEDY = GenerationConfig(max_new_tokens=8, do_sample=False)


def num_paged_users(model: torch.nn.Module) -> int:
    """Engines currently holding the model on the paged dispatcher (0 when none)."""
    entry = _USERS.get(model)
    return entry.count if entry is not None else 0


def cfg(**kw) -> ContinuousBatchingConfig:  # noqa: ANN003
    kw.setdefault("page_size", 4)
    kw.setdefault("num_blocks", 128)
    return ContinuousBatchingConfig(**kw)


def test_first_user_switches_and_last_user_restores_in_any_order() -> None:
    model = tiny_llama()
    assert enable_paged_attention(model) == "sdpa"
    assert enable_paged_attention(model) == "sdpa"  # a second user sees the same original
    assert model.config._attn_implementation == "rollout_paged|sdpa" and num_paged_users(model) == 2
    restore_attention(model, "sdpa")
    assert model.config._attn_implementation == "rollout_paged|sdpa" and num_paged_users(model) == 1
    restore_attention(model, "sdpa")
    assert model.config._attn_implementation == "sdpa" and num_paged_users(model) == 0
    first, second = Engine(model, cfg()), Engine(model, cfg())
    first.close()
    first.close()  # idempotent: releases once
    assert model.config._attn_implementation == "rollout_paged|sdpa"
    second.close()
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("other", ["generate_batch", "score", "second_manager", "all_while_generating"])
def test_manager_stays_correct_when_other_engines_open_and_close_on_its_model(other: str) -> None:
    model = tiny_llama()
    prompts = random_prompts(4, VOCAB_SIZE, 5, 20, seed=11)
    expected = [reference_greedy(model, p, 8, EOS_TOKEN_ID) for p in prompts]
    manager = init_continuous_batching(model, GREEDY, cfg())
    manager.start()
    try:
        in_flight = manager.add_requests(prompts) if other == "all_while_generating" else []
        if other in ("generate_batch", "all_while_generating"):
            out = generate_batch(model, prompts[:2], GREEDY, cfg())
            assert [o.generated_tokens for o in out.values()] == expected[:2]
        if other in ("score", "all_while_generating"):  # a reward function that scores with the policy
            scored = rollout.score(model, [prompts[0]], [expected[0]], continuous_batching_config=cfg())
            assert_close(scored[0].completion_logprobs, teacher_forced_logprobs(model, prompts[0], expected[0]), 1e-4)
        if other in ("second_manager", "all_while_generating"):
            second = rollout.ContinuousBatchingManager(model, GREEDY, cfg())
            second.start()
            assert second.get_result(second.add_request(prompts[1]), timeout=30).generated_tokens == expected[1]
            second.destroy()
        assert model.config._attn_implementation == "rollout_paged|sdpa"  # the manager still holds it
        ids = manager.add_requests(prompts)
        for rids in (in_flight, ids):
            outs = [manager.get_result(rid, timeout=60) for rid in rids]
            assert all(o.status == RequestStatus.FINISHED for o in outs)
            assert [o.generated_tokens for o in outs] == (expected if rids else [])
    finally:
        manager.destroy()
    assert model.config._attn_implementation == "sdpa" and num_paged_users(model) == 0


# ---------------------------------------------------------------------- issue 13, case 1: flash models
def test_dispatcher_names_never_ask_transformers_for_a_flash_or_hub_kernel() -> None:
    # transformers 5 imports a flash kernel for any name containing "flash" and downloads a Hub kernel for
    # any "org/repo" name (utils.generic.is_flash_attention_requested, integrations.hub_kernels.is_kernel).
    assert dispatcher_name("sdpa") == "rollout_paged|sdpa"
    assert dispatcher_name("flash_attention_2") == "rollout_paged|fa_attention_2"
    assert dispatcher_name("kernels-community/flash-attn2") == "rollout_paged|kernels-community--fa-attn2"
    for original in ("flash_attention_2", "flash_attention_3", "kernels-community/vllm-Flash-attn3", "flex_attention"):
        name = dispatcher_name(original)
        assert not is_flash_attention_requested(requested_attention_implementation=name) and not is_kernel(name)


def test_a_model_loaded_with_flash_attention_2_generates_and_gets_its_implementation_back() -> None:
    # Case 1: the dispatcher was registered as "rollout_paged|flash_attention_2", and set_attn_implementation
    # raised "Could not find the currently requested flash attention implementation".
    model = tiny_llama()
    prompts = random_prompts(3, VOCAB_SIZE, 5, 20, seed=12)
    expected = [reference_greedy(model, p, 8, EOS_TOKEN_ID) for p in prompts]
    model.config._attn_implementation = "flash_attention_2"  # what from_pretrained(attn_implementation=...) leaves
    out = generate_batch(model, prompts, GREEDY, cfg())
    assert [o.generated_tokens for o in out.values()] == expected
    # Put back as it was, without asking transformers to check (and import) flash-attn again.
    assert model.config._attn_implementation == "flash_attention_2" and num_paged_users(model) == 0
    manager = init_continuous_batching(model, GREEDY, cfg())
    manager.start()
    try:
        assert model.config._attn_implementation == "rollout_paged|fa_attention_2"
        assert manager.get_result(manager.add_request(prompts[2]), timeout=60).generated_tokens == expected[2]
    finally:
        manager.destroy()
    assert model.config._attn_implementation == "flash_attention_2"


def _fake_flash_kernels(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Let transformers' own flash wrapper run on CPU: its kernel import (``_lazy_imports``) gets the
    references of tests/flash_reference.py for "flash_attention_2" and, as the real import does for a
    name it has no kernel for, raises for any other name. Returns the names it was asked for."""
    asked: list[str] = []

    def lazy_imports(implementation, attention_wrapper=None, allow_all_kernels=False):  # noqa: ANN001, ANN202
        asked.append(implementation)
        if implementation != "flash_attention_2":
            raise ValueError(f"Could not find the currently requested flash attention implementation {implementation}")
        funcs = (flash_reference.flash_attn_func, flash_reference.flash_attn_varlen_func, None)
        return (*funcs, fa_utils._pad_input, fa_utils._unpad_input)

    monkeypatch.setattr(fa_utils, "_lazy_imports", lazy_imports)
    # Its cache of the loaded kernel, emptied now and put back after the test.
    for name in (
        "_loaded_implementation",
        "_flash_fn",
        "_flash_varlen_fn",
        "_flash_with_kvcache_fn",
        "_pad_fn",
        "_unpad_fn",
        "_process_flash_kwargs_fn",
        "_process_with_kvcache_kwargs_fn",
    ):
        monkeypatch.setattr(fa_utils, name, None)
    return asked


def _loss_and_grads(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # noqa: ANN001
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits.float()
    loss = torch.log_softmax(logits[0, :-1], -1).gather(1, ids[0, 1:, None]).mean()
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def test_training_forward_of_a_flash_model_reaches_its_kernel_while_a_manager_holds_it(monkeypatch) -> None:
    # The plain forward goes through the dispatcher's fallback into transformers' flash wrapper, which picks
    # its kernel by module.config._attn_implementation: it must see "flash_attention_2", not the dispatcher.
    model = tiny_llama().to(torch.bfloat16)  # flash kernels read only fp16/bf16
    ids = torch.tensor([random_prompts(1, VOCAB_SIZE, 40, 40, seed=3)[0]])
    sdpa_logits, sdpa_grads = _loss_and_grads(model, ids)
    asked = _fake_flash_kernels(monkeypatch)
    model.config._attn_implementation = "flash_attention_2"
    manager = init_continuous_batching(model, GREEDY, cfg())
    manager.start()
    try:
        assert model.config._attn_implementation == "rollout_paged|fa_attention_2"
        logits, grads = _loss_and_grads(model, ids)
    finally:
        manager.destroy()
    assert asked == ["flash_attention_2"]  # the reference kernel ran, under the original's name only
    # bf16 attention by two kernels: the same up to bf16 rounding.
    assert_close(logits.flatten(), sdpa_logits.flatten(), atol=0.1)
    assert grads.keys() == sdpa_grads.keys() and len(grads) == len(list(model.parameters()))
    for name, grad in grads.items():
        scale = float(sdpa_grads[name].abs().max())
        assert float((grad - sdpa_grads[name]).abs().max()) <= 0.05 * scale + 1e-3, name


def test_a_hub_kernel_as_original_implementation_does_not_replace_the_dispatcher(monkeypatch) -> None:
    # A Hub kernel name ("org/repo") used to reach transformers' kernel loader under the dispatcher's own
    # name, which registers the downloaded kernel under that name: over the dispatcher.
    kernel_name = "kernels-community/flash-attn2"
    loader_asked: list[str] = []
    kernel_saw: list[str] = []

    def loader(attn_implementation, attention_wrapper=None, allow_all_kernels=False):  # noqa: ANN001, ANN202
        # What hub_kernels.load_and_register_attn_kernel does for a kernel repo: register it under the name.
        loader_asked.append(attn_implementation)
        AttentionInterface.register(attn_implementation, kernel)
        return None

    def kernel(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN003, ANN202
        kernel_saw.append(module.config._attn_implementation)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(hub_kernels, "load_and_register_attn_kernel", loader)
    # The model as loading that kernel left it: the kernel and its mask function registered under its name.
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, kernel_name, kernel)
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, kernel_name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model = tiny_llama()
    prompts = random_prompts(2, VOCAB_SIZE, 5, 20, seed=13)
    expected = [reference_greedy(model, p, 8, EOS_TOKEN_ID) for p in prompts]
    ids = torch.tensor([prompts[0]])
    plain = model(ids).logits.detach()
    model.config._attn_implementation = kernel_name
    manager = init_continuous_batching(model, GREEDY, cfg())
    manager.start()
    try:
        name = model.config._attn_implementation
        assert name == "rollout_paged|kernels-community--fa-attn2"
        assert ALL_ATTENTION_FUNCTIONS[name].__qualname__ == f"rollout_paged_attention[{kernel_name}]"
        outs = [manager.get_result(rid, timeout=60) for rid in manager.add_requests(prompts)]
        assert [o.generated_tokens for o in outs] == expected
        assert kernel_saw == []  # generation runs the paged attention, not the kernel
        assert_close(model(ids).logits.detach().flatten(), plain.flatten(), atol=1e-5)  # training forward
        assert kernel_saw == [kernel_name] * model.config.num_hidden_layers  # ... reaches the kernel, by its name
    finally:
        manager.destroy()
    assert loader_asked == [] and model.config._attn_implementation == kernel_name


def test_a_replaced_registration_is_put_back(monkeypatch) -> None:
    name = register_paged_attention("sdpa")
    dispatch = ALL_ATTENTION_FUNCTIONS[name]
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, name, sdpa_attention_forward)
    assert register_paged_attention("sdpa") == name and ALL_ATTENTION_FUNCTIONS[name] is dispatch


# ---------------------------------------------------------------------- issue 13, case 6: flash rules
GOOD = dict(version="2.8.3", capabilities=[(9, 0)], dtype=torch.bfloat16, head_dim=128, page_size=256)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"version": None}, "flash-attn is not installed"),
        ({"version": "2.5.9"}, "older than 2.6.0"),
        ({"capabilities": [(8, 0), (7, 5)]}, "compute capability 7.5"),
        ({"capabilities": [(9, 0), None]}, "not on a CUDA GPU"),
        ({"dtype": torch.float32}, "float16 and bfloat16"),
        ({"head_dim": 84}, "head_dim is 84"),
        ({"head_dim": 512}, "at most 256"),
        ({"page_size": 32}, "page_size is 32"),
    ],
)
def test_flash_is_refused_with_the_first_unmet_requirement(change: dict, reason: str) -> None:
    found = flash_unsupported_reason(**{**GOOD, **change})
    assert found is not None and reason in found


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"version": "2.6.0"},
        {"version": "2.7.4.post1"},
        {"version": "2.8.3+cu12torch2.7cxx11abiTRUE"},
        {"capabilities": [(8, 0), (8, 6), (12, 0)]},
        {"dtype": torch.float16},
        {"head_dim": 256},
        {"head_dim": 8},
        {"page_size": 512},
    ],
)
def test_flash_is_accepted_when_every_requirement_holds(change: dict) -> None:
    assert flash_unsupported_reason(**{**GOOD, **change}) is None


def test_flash_support_asks_each_gpu_once(monkeypatch) -> None:
    asked: list[torch.device] = []

    def capability(device):  # noqa: ANN001, ANN202
        asked.append(device)
        return {0: (9, 0), 1: (7, 5)}[device.index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(flash, "flash_attn_varlen_func", flash_reference.flash_attn_varlen_func)
    monkeypatch.setattr(flash, "flash_attn_version", "2.8.3")
    monkeypatch.setattr(torch.version, "hip", None)
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert flash_support([gpu0, gpu0], torch.bfloat16, 64, 256) is None and asked == [gpu0]
    assert "compute capability 7.5" in flash_support([gpu0, gpu1, gpu1], torch.bfloat16, 64, 256)
    assert "not on a CUDA GPU" in flash_support([gpu0, torch.device("cpu")], torch.bfloat16, 64, 256)
    monkeypatch.setattr(flash, "flash_attn_varlen_func", None)
    assert flash_support([gpu0], torch.bfloat16, 64, 256) == "flash-attn is not installed"


def test_metadata_moves_to_a_layer_device_once_per_step() -> None:
    # A sharded model's layers read the step's metadata on their own device ("meta" stands in for a second GPU).
    cache = PagedKVCache(CacheShape(1, 2, 8, torch.float32), num_blocks=4, block_size=4, device=torch.device("cpu"))
    rows = torch.arange(5)
    batch = StepBatch(
        rows,
        rows,
        torch.arange(5)[None, :],
        rows,
        torch.tensor([0, 1]),
        torch.zeros(1, 2, 1, dtype=torch.int64),
        torch.tensor([2, 3]),
        torch.tensor([[2, 3], [4, 5]]),
        torch.tensor([[[1, 2]], [[3, 0]]]).view(1, 2, 2),
        torch.tensor([[3, 4], [5, 0]]),
        varlen_cu_seqlens=torch.tensor([[0, 5], [0, 9]]),
        varlen_tables=torch.tensor([[[1, 2, 3]]]),
        varlen_max_seqlens=(5, 9),
    )
    meta = PagedAttentionMetadata.from_batch(cache, 4, batch)
    assert meta.decode_gather is None and meta.prefill_gather is None  # flash-attn reads the block tables
    assert meta.on(torch.device("cpu")) is meta
    moved = meta.on(torch.device("meta"))
    assert meta.on(torch.device("meta")) is moved  # built once, reused by the step's other layers
    tensors = [
        moved.slot_mapping,
        moved.decode_rows,
        moved.decode_pos,
        moved.prefill_rows,
        moved.prefill_pos,
        moved.decode_read,
        moved.prefill_read,
        moved.flash["cu_seqlens_q"],
    ]
    assert all(t.device.type == "meta" for t in tensors)
    assert moved.flash["max_seqlen_q"] == 5 and moved.flash["cu_seqlens_q"].dtype == torch.int32
    assert moved.cache is cache and meta.slot_mapping.device.type == "cpu"


def test_without_flash_the_metadata_gathers_every_groups_slots_from_its_block_tables() -> None:
    cache = PagedKVCache(CacheShape(1, 2, 8, torch.float32), num_blocks=4, block_size=2, device=torch.device("cpu"))
    tables = torch.tensor([[[3, 1]], [[0, 2]]])  # two layer groups, one decode row, 2 blocks of 2 slots
    row = torch.zeros(1, dtype=torch.int64)
    batch = StepBatch(row, row, torch.zeros(2, 1, dtype=torch.int64), row, None, tables, torch.tensor([2]))
    meta = PagedAttentionMetadata.from_batch(cache, 2, batch)
    assert meta.decode_gather.tolist() == [[[6, 7, 2, 3]], [[0, 1, 4, 5]]]


@pytest.mark.parametrize("loaded_as", ["paged|sdpa", "paged|eager"])
def test_a_model_loaded_with_transformers_paged_attention_matches_generate(tmp_path, loaded_as: str) -> None:
    # Issue 22, item 2: transformers' continuous-batching guide loads models with attn_implementation
    # "paged|sdpa" or "paged|eager" to keep off flash attention. rollout runs the named kernel underneath
    # and puts back what the user loaded when the last engine closes.
    from transformers import AutoModelForCausalLM

    tiny_llama().save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=loaded_as.removeprefix("paged|"))
    with pytest.warns(FutureWarning) if loaded_as == "paged|sdpa" else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=loaded_as)
    as_loaded = model.config._attn_implementation  # transformers 5.24 keeps "paged|eager", maps "paged|sdpa"
    prompts = random_prompts(3, VOCAB_SIZE, 5, 40, seed=5)
    outs = generate_batch(
        model, prompts, GenerationConfig(max_new_tokens=8, do_sample=False), cfg(return_logprobs=True)
    ).values()
    for prompt, out in zip(prompts, outs):
        assert out.generated_tokens == reference_greedy(reference, prompt, 8, EOS_TOKEN_ID)
        assert_close(out.logprobs, teacher_forced_logprobs(reference, prompt, out.generated_tokens), atol=1e-4)
    assert model.config._attn_implementation == as_loaded and num_paged_users(model) == 0
