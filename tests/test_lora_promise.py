"""LoRA adapters against the weight-version promise (DESIGN.md, "Adapters obey the same promise"; issue 43, items 1-4).

- An adapter's delta reaches only the engine step that scheduled it: a plain forward of the same model in another
  thread (a trainer's logprob pass, a peft trainer's forward) is bitwise the forward alone, and a second manager on the
  same model serves its own adapters only.
- A token's version names the weights that produced it: a request under adapter ``pol-v1`` that runs across the
  trainer's sync (``load_lora(pol-v2)``, ``unload_lora(pol-v1)``) keeps recording pol-v1's version; a base request
  keeps the base weights' version across adapter loads; a base update is recorded by both.
- An adapter's tensors are copied on load: changing the caller's tensors, or the ``LoraAdapter``'s, afterwards (an
  optimizer step), even across ``stop()`` / ``start()``, changes nothing served.
- A request is bound to its adapter when it is accepted: unloading or reloading the name before the loop picks it up
  does not change what it runs under; a refused replacement (``load_lora(replace=True)``, HTTP ``load_inplace``)
  changes nothing.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, ContinuousBatchingManager, FieldError, build_sampling_params
from rollout.lora import LoraAdapter, adapter_state_dict
from tests.serve_utils import wait_until
from tests.tiny_models import VOCAB_SIZE, random_prompts, tiny_llama
from tests.utils import reference_greedy

peft = pytest.importorskip("peft")

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(base: torch.nn.Module, seed: int, r: int = 4) -> torch.nn.Module:
    """A peft LoRA model on a copy of ``base``, A and B random (seeded, B large enough to move greedy tokens)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=ALL_LINEAR, lora_dropout=0.0, init_lora_weights=False
    )
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model.eval()


def adapter_of(model: torch.nn.Module, name: str, r: int = 4) -> LoraAdapter:
    return LoraAdapter.from_tensors(name, adapter_state_dict(model), r=r, lora_alpha=2 * r)


def manager_on(base: torch.nn.Module, max_new_tokens: int, **config: object) -> ContinuousBatchingManager:
    values = dict(page_size=4, num_blocks=256, max_batch_tokens=64, return_logprobs=True, enable_lora=True, max_loras=2)
    values.update(config)
    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = ContinuousBatchingManager(base, gc, ContinuousBatchingConfig(**values))
    manager.default_params = build_sampling_params(manager.default_params, eos_token_id=[])  # every token counts
    return manager


def fresh(base: torch.nn.Module) -> torch.nn.Module:
    """The same weights in a new model object (whose weight version starts at 0: versions are per model object)."""
    return copy.deepcopy(base)


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    base = tiny_llama()
    return base, peft_model(base, seed=1), peft_model(base, seed=2)


# ---------------------------------------------------------------------------------------------- item 1: no leak
def test_forwards_in_other_threads_see_no_adapter_while_the_engine_decodes_under_one(models: tuple) -> None:
    """While a manager decodes long requests under adapter x, the main thread's forwards of the same model object (a
    plain logprob pass, and a peft trainer's forward over the shared weights, made after the engine hooked the layers)
    equal, bitwise, the same forwards run alone; and x's tokens are still x's."""
    base, x, _ = models
    inputs = torch.tensor([random_prompts(1, VOCAB_SIZE, seed=3, min_len=12, max_len=12)[0]])
    manager = manager_on(base, max_new_tokens=160)
    manager.start()
    try:
        manager.load_lora(adapter_of(x, "x"))
        # A trainer's own adapter, over the engine's (hooked) modules and weights: trainers.lora.shared_module_copy.
        memo = {id(t): t for t in (*base.parameters(), *base.buffers())}
        trainer = peft.get_peft_model(
            copy.deepcopy(base, memo),
            peft.LoraConfig(r=2, lora_alpha=4, target_modules=ALL_LINEAR, lora_dropout=0.0, init_lora_weights=False),
        ).eval()
        with torch.no_grad():
            alone_base = base(inputs).logits
            alone_trainer = trainer(inputs).logits
        assert not torch.equal(alone_base, alone_trainer)  # the trainer's adapter moves its logits
        prompts = random_prompts(4, VOCAB_SIZE, seed=4)
        rids = manager.add_requests(prompts, lora="x")
        running = manager.engine.scheduler.requests  # read, never written, from this thread
        wait_until(lambda: any(r in running for r in rids))
        checked = differed = 0
        with torch.no_grad():
            while any(r in running for r in rids):
                differed += not torch.equal(base(inputs).logits, alone_base)
                differed += not torch.equal(trainer(inputs).logits, alone_trainer)
                checked += 2
        outs = [manager.get_result(r, timeout=120) for r in rids]
    finally:
        manager.stop(block=True)
    assert checked >= 20, checked  # enough forwards ran beside the decoding for a leak to show
    assert differed == 0, f"{differed} of {checked} forwards in another thread saw the engine's adapter"
    assert outs[0].generated_tokens[:8] == reference_greedy(x, prompts[0], 8, None)


def test_two_managers_on_one_model_serve_their_own_adapters(models: tuple) -> None:
    """Two managers on one model, A serving x and B serving y, decode at the same time: each request's greedy tokens
    are its own adapter's (a hook of A never reads B's step, nor the reverse)."""
    base, x, y = models
    prompts = random_prompts(2, VOCAB_SIZE, seed=5)
    n = 40
    expected = [reference_greedy(x, prompts[0], n, None), reference_greedy(y, prompts[1], n, None)]
    a, b = manager_on(base, n), manager_on(base, n)
    a.start()
    b.start()
    try:
        a.load_lora(adapter_of(x, "x"))
        b.load_lora(adapter_of(y, "y"))
        got: dict[str, list[int]] = {}

        def run(manager: ContinuousBatchingManager, name: str, prompt: list[int]) -> None:
            ids = manager.add_requests([prompt] * 3, lora=name)
            got[name] = [manager.get_result(r, timeout=120).generated_tokens for r in ids]

        threads = [threading.Thread(target=run, args=args) for args in ((a, "x", prompts[0]), (b, "y", prompts[1]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    finally:
        a.stop(block=True)
        b.stop(block=True)
    assert got["x"] == [expected[0]] * 3
    assert got["y"] == [expected[1]] * 3


# ---------------------------------------------------------------------------------------------- item 2: versions
def test_tokens_record_the_version_of_their_own_adapter_across_a_sync(models: tuple) -> None:
    """The trainer's adapter sync (load pol-v2, unload pol-v1) while a pol-v1 request and a base request decode: the
    pol-v1 request's tokens all record pol-v1's version (1), the base request's the base weights' (0), pol-v2's
    requests 2; after a base update (version 3) every running request records 3."""
    base, x, y = models
    base = fresh(base)  # a model object of its own: its weight versions start at 0
    prompts = random_prompts(2, VOCAB_SIZE, seed=6)
    manager = manager_on(base, max_new_tokens=120)
    manager.start()
    try:
        assert manager.load_lora(adapter_of(x, "pol-v1")) == 1
        old = manager.add_request(prompts[0], lora="pol-v1", streaming=True)
        plain = manager.add_request(prompts[1], streaming=True)
        stream = manager.request_id_iter(old, timeout=60)
        while len(next(stream).generated_tokens) < 3:
            pass
        with manager.pause():
            before = len(manager.engine.scheduler.requests[old].token_ids) - len(prompts[0])
            assert manager.load_lora(adapter_of(y, "pol-v2")) == 2
            manager.unload_lora("pol-v1")
        new = manager.add_request(prompts[0], lora="pol-v2", max_new_tokens=4)
        assert manager.get_result(new, timeout=60).weight_versions == [2] * 4
        mid = len(manager.engine.scheduler.requests[old].token_ids) - len(prompts[0])
        with manager.pause():
            after = len(manager.engine.scheduler.requests[old].token_ids) - len(prompts[0])
            assert manager.update_weights(None) == 3  # a base update: every adapter's tokens are new weights too
        old_out = manager.get_result(old, timeout=120)
        plain_out = manager.get_result(plain, timeout=120)
    finally:
        manager.stop(block=True)
    assert 3 <= before <= mid <= after < 120
    assert old_out.weight_versions == [1] * after + [3] * (120 - after)
    assert set(plain_out.weight_versions[:mid]) == {0} and plain_out.weight_versions[-1] == 3
    # The pol-v1 request kept pol-v1's weights: its tokens are x's greedy tokens up to the base update.
    assert old_out.generated_tokens[:after] == reference_greedy(x, prompts[0], after, None)


# ---------------------------------------------------------------------------------------------- item 3: copies
def test_adapter_tensors_changed_after_the_load_change_nothing_served(models: tuple) -> None:
    """``from_tensors`` copies: an optimizer-like in-place change of the caller's tensors and of the adapter object
    after ``load_lora``, then ``stop()`` / ``start()`` (which rebuilds the engine and loads the adapters again): the
    adapter still gives x's tokens, under its version 1."""
    base, x, _ = models
    base = fresh(base)  # a model object of its own: its weight versions start at 0
    prompt = random_prompts(1, VOCAB_SIZE, seed=7)[0]
    expected = reference_greedy(x, prompt, 6, None)
    tensors = {k: v.detach().clone() for k, v in adapter_state_dict(x).items()}
    adapter = LoraAdapter.from_tensors("x", tensors, r=4, lora_alpha=8)
    manager = manager_on(base, max_new_tokens=6)
    manager.start()
    try:
        assert manager.load_lora(adapter) == 1
        with torch.no_grad():
            for t in tensors.values():
                t.mul_(-3.0)
            for a, b in adapter.weights.values():
                a.mul_(-3.0)
                b.mul_(2.0)
        out = manager.get_result(manager.add_request(prompt, lora="x"), timeout=60)
        assert out.generated_tokens == expected and out.weight_versions == [1] * 6
        manager.stop(block=True)
        manager.engine.close()  # the next start() builds a new engine and loads the kept adapters into it
        manager.start()
        out = manager.get_result(manager.add_request(prompt, lora="x"), timeout=60)
    finally:
        manager.stop(block=True)
    assert out.generated_tokens == expected and out.weight_versions == [1] * 6


# ---------------------------------------------------------------------------------------------- item 4: binding
def test_requests_keep_the_adapter_they_were_accepted_under(models: tuple) -> None:
    """Requests added under "pol" inside a pause run under the tensors loaded then, although "pol" is unloaded (a) or
    replaced by other tensors (b) before the loop picks them up; later requests get the new tensors."""
    base, x, y = models
    base = fresh(base)  # a model object of its own: its weight versions start at 0
    prompt = random_prompts(1, VOCAB_SIZE, seed=8)[0]
    ref_x, ref_y = reference_greedy(x, prompt, 6, None), reference_greedy(y, prompt, 6, None)
    assert ref_x != ref_y
    manager = manager_on(base, max_new_tokens=6, max_loras=3)
    manager.start()
    try:
        manager.load_lora(adapter_of(x, "pol"))
        with manager.pause():
            unloaded = manager.add_request(prompt, lora="pol")
            manager.unload_lora("pol")
        assert manager.get_result(unloaded, timeout=60).generated_tokens == ref_x
        manager.load_lora(adapter_of(x, "pol"))
        with manager.pause():
            replaced = manager.add_requests([prompt] * 2, lora="pol")
            assert manager.load_lora(adapter_of(y, "pol"), replace=True) == 3
            later = manager.add_request(prompt, lora="pol")
        outs = [manager.get_result(r, timeout=60) for r in replaced]
        assert [o.generated_tokens for o in outs] == [ref_x, ref_x] and outs[0].weight_versions == [2] * 6
        out = manager.get_result(later, timeout=60)
        assert out.generated_tokens == ref_y and out.weight_versions == [3] * 6
    finally:
        manager.stop(block=True)


def test_a_refused_replacement_changes_nothing(models: tuple) -> None:
    """``load_lora(replace=True)`` refused (rank above max_lora_rank; max_loras=1 while a request still runs under the
    old adapter) raises naming the field and leaves the old adapter loaded and served."""
    base, x, y = models
    base = fresh(base)  # a model object of its own: its weight versions start at 0
    prompt = random_prompts(1, VOCAB_SIZE, seed=9)[0]
    manager = manager_on(base, max_new_tokens=6, max_loras=1, max_lora_rank=4)
    manager.start()
    try:
        manager.load_lora(adapter_of(x, "pol"))
        with pytest.raises(FieldError, match="max_lora_rank") as e:
            manager.load_lora(adapter_of(peft_model(base, 3, r=8), "pol", r=8), replace=True)
        assert e.value.field == "max_lora_rank"
        with manager.pause():
            running = manager.add_request(prompt, lora="pol")
            with pytest.raises(FieldError, match="max_loras") as e:
                manager.load_lora(adapter_of(y, "pol"), replace=True)
            assert e.value.field == "max_loras"
        assert manager.lora_adapters == ["pol"] and manager.weight_version == 1
        assert manager.get_result(running, timeout=60).generated_tokens == reference_greedy(x, prompt, 6, None)
        # No request runs under the old one now: the replacement takes its slot.
        assert manager.load_lora(adapter_of(y, "pol"), replace=True) == 2
        out = manager.get_result(manager.add_request(prompt, lora="pol"), timeout=60)
        assert out.generated_tokens == reference_greedy(y, prompt, 6, None)
    finally:
        manager.stop(block=True)


def test_refused_load_inplace_over_http_keeps_the_adapter(models: tuple, tmp_path: object) -> None:
    """rollout-serve: ``load_inplace`` of an adapter of rank 8 (``--max-lora-rank 4``) answers 400 naming
    ``max_lora_rank``; the old adapter still answers (200, its own tokens), not 404."""
    import httpx

    from tests.serve_utils import running_server
    from tests.tiny_models import tiny_tokenizer

    base, x, _ = models
    small, big = tmp_path / "small", tmp_path / "big"  # type: ignore[operator]
    x.save_pretrained(str(small))
    peft_model(base, 4, r=8).save_pretrained(str(big))
    prompt = random_prompts(1, VOCAB_SIZE, seed=10)[0]
    config = ContinuousBatchingConfig(
        page_size=4, num_blocks=128, max_batch_tokens=64, enable_lora=True, max_loras=2, max_lora_rank=4
    )
    with running_server(base, tiny_tokenizer(), config) as srv:
        loaded = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "pol", "lora_path": str(small)})
        assert loaded.status_code == 200, loaded.text
        body = {"lora_name": "pol", "lora_path": str(big), "load_inplace": True}
        refused = httpx.post(f"{srv.url}/v1/load_lora_adapter", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_lora_rank", refused.text
        req = {"model": "pol", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{srv.url}/v1/completions", json={**req, "return_token_ids": True}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["token_ids"] == reference_greedy(x, prompt, 6, None)
