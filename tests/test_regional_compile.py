"""Regional compilation (``ContinuousBatchingConfig.regional_compile``, ``engine.worker.regions``): the decoder layers'
norms and MLPs through one compiled call per module class, the attention eager, only in the engine's step thread.

Asserted: greedy tokens equal ``model.generate``'s and logprobs within 1e-4 of a teacher-forced forward, on models
outside the fused family (Gemma 3 with sliding and full layers) and on Llama with the fused layers off, with dynamo
compilations counted (so no test passes by running eager); a forward of the same model in another thread while the
engine steps is bit for bit transformers' own and compiles nothing; deep copies get plain layers and the last engine's
close removes the dispatchers; the refusals; the compile cache's file and key.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from rollout import ContinuousBatchingConfig, SamplingParams
from rollout.engine import Engine
from rollout.engine.worker import regions
from rollout.engine.worker.compile_cache import CompileCache, cache_key
from tests.tiny_models import VOCAB_SIZE, random_prompts, tiny_gemma, tiny_llama, tiny_qwen3
from tests.utils import assert_close, reference_greedy, run_engine, teacher_forced_logprobs

LOGPROB_ATOL = 1e-4


@pytest.fixture(autouse=True)
def compile_home(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    """Each test's compile cache in a folder of its own (``$ROLLOUT_HOME/compile``)."""
    monkeypatch.setenv("ROLLOUT_HOME", str(tmp_path))
    return tmp_path / "compile"


def regional_engine(model, **config) -> Engine:  # noqa: ANN001, ANN003
    config.setdefault("num_blocks", 64)
    return Engine(model, ContinuousBatchingConfig(regional_compile=True, return_logprobs=True, **config))


def generate(engine: Engine, prompts: list[list[int]], n: int) -> list:
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_new_tokens=n, do_sample=False), request_id=str(i))
    outputs = run_engine(engine)
    return [outputs[str(i)] for i in range(len(prompts))]


def layer_dispatchers(model) -> list:  # noqa: ANN001
    """The dispatchers of the model's regions (norms and MLPs of every layer)."""
    return [m._compiled_call_impl for m in model.model.layers.modules() if not isinstance(m, torch.nn.Linear)]


def no_dispatchers(model) -> bool:  # noqa: ANN001
    return all(m._compiled_call_impl is None for m in model.modules())


@pytest.mark.parametrize(
    "make, config",
    [(tiny_gemma, {}), (tiny_llama, {"fused_layers": "off"}), (tiny_qwen3, {"fused_layers": "off"})],
    ids=["gemma3-sliding", "llama-unfused", "qwen3-unfused"],
)
def test_greedy_equals_generate_and_logprobs_teacher_forced(make, config) -> None:  # noqa: ANN001
    model = make()
    prompts = random_prompts(6, VOCAB_SIZE, min_len=3, max_len=20, seed=71)  # chunks, decode of 1 row and of many
    expected = [reference_greedy(model, p, 12, None) for p in prompts]
    engine = regional_engine(model, max_batch_tokens=24, **config)
    try:
        found = regions.regions_of(model)
        assert len(found) >= 3 * len(model.model.layers)  # two norms and an MLP a layer, at least
        assert all(isinstance(m._compiled_call_impl, regions.RegionDispatch) for m in found)
        outputs = generate(engine, prompts, 12)
        assert engine.stats.num_compiles > 0  # the layers did run compiled
    finally:
        engine.close()
    assert no_dispatchers(model)
    for prompt, out, want in zip(prompts, outputs, expected, strict=True):
        assert out.generated_tokens == want
        assert_close(out.logprobs, teacher_forced_logprobs(model, prompt, out.generated_tokens, 1.0), LOGPROB_ATOL)


def test_another_threads_forward_is_transformers_own_while_the_engine_steps() -> None:
    model = tiny_gemma()
    ids = torch.tensor([random_prompts(1, VOCAB_SIZE, min_len=17, max_len=17, seed=5)[0]])
    with torch.no_grad():
        reference = model(ids).logits
    engine = regional_engine(model)
    prompts = random_prompts(4, VOCAB_SIZE, min_len=4, max_len=16, seed=6)
    expected = [reference_greedy(model, p, 24, None) for p in prompts]
    trainer_logits: list[torch.Tensor] = []
    done = threading.Event()

    def trainer() -> None:  # a trainer's forwards beside the engine's steps
        with torch.no_grad():
            while not done.is_set() or not trainer_logits:
                trainer_logits.append(model(ids).logits)

    # Compiled when the engine is built, before the trainer starts (``torch.compiler.is_compiling()`` is True in every
    # thread while one compiles, and transformers' kernels wrapper then goes process-wide): no step compiles.
    compiled = engine.stats.num_compiles
    assert compiled > 0
    thread = threading.Thread(target=trainer)
    try:
        thread.start()
        outputs = generate(engine, prompts, 24)
    finally:
        done.set()
        thread.join()
        engine.close()
    assert engine.stats.num_compiles == compiled
    assert [o.generated_tokens for o in outputs] == expected
    for logits in trainer_logits:
        assert torch.equal(logits, reference)  # bit for bit: the trainer's layers ran their own _call_impl


def test_a_region_call_outside_a_step_runs_the_modules_own_call() -> None:
    model = tiny_gemma()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        reference = model(ids).logits
    engine = regional_engine(model)
    try:
        calls = []

        def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls.append(1)
            raise AssertionError("the compiled region call ran outside a step")

        dispatch = model.model.layers[0].mlp._compiled_call_impl
        dispatch._run, real = spy, dispatch._run  # what a step calls
        try:
            with torch.no_grad():
                assert torch.equal(model(ids).logits, reference)
            with regions.regional_step(), pytest.raises(AssertionError, match="outside a step"):
                with torch.no_grad():
                    model(ids)  # and inside one, this thread's layers do take it
        finally:
            dispatch._run = real
        assert calls == [1]
    finally:
        engine.close()


def test_deepcopy_gets_plain_layers_and_the_last_engine_removes_the_dispatchers() -> None:
    model = tiny_gemma()
    first, second = regional_engine(model), regional_engine(model)
    try:
        found = regions.regions_of(model)
        assert all(m._compiled_call_impl.engines == 2 for m in found)
        clone = copy.deepcopy(model)
        assert no_dispatchers(clone)
        first.close()
        assert all(m._compiled_call_impl.engines == 1 for m in found)
    finally:
        first.close()
        second.close()
    assert no_dispatchers(model)


def test_fused_family_and_user_compiled_layers_keep_their_paths() -> None:
    llama = tiny_llama()  # fused decoder layers by default: nothing to compile
    engine = regional_engine(llama)
    try:
        assert not engine.runner.regional and no_dispatchers(llama)
    finally:
        engine.close()
    gemma = tiny_gemma()
    gemma.model.layers[1].mlp.compile()  # the user's own compile is left alone: the engine runs eager
    own = gemma.model.layers[1].mlp._compiled_call_impl
    engine = regional_engine(gemma)
    try:
        assert not engine.runner.regional
        assert (
            gemma.model.layers[1].mlp._compiled_call_impl is own
            and gemma.model.layers[0].mlp._compiled_call_impl is None
        )
    finally:
        engine.close()


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"default_compile_level": 1}, "default_compile_level=0"),
        ({"enable_lora": True}, "LoRA"),
        ({"batch_invariant": True}, "batch_invariant"),
    ],
)
def test_refusals_name_the_option_before_anything_is_built(extra, words) -> None:  # noqa: ANN001
    model = tiny_gemma()
    with pytest.raises(ValueError, match=f"regional_compile=True: .*{words}"):
        regional_engine(model, **extra)
    assert no_dispatchers(model)


def test_config_checks_the_type() -> None:
    with pytest.raises(ValueError, match="regional_compile"):
        ContinuousBatchingConfig(regional_compile="yes")


def test_compile_cache_file_is_written_and_keyed(compile_home) -> None:  # noqa: ANN001
    model = tiny_gemma()
    engine = regional_engine(model)
    try:
        cache = engine.runner.compile_counter.cache  # saved when the engine compiled, at its build
        assert cache is not None and cache.saved > 0
        assert cache.path.parent == compile_home and cache.path.stat().st_size == cache.saved
    finally:
        engine.close()
    settings = {"dynamic": True}
    key = cache_key(model, settings)
    assert key == cache_key(tiny_gemma(seed=1), settings)  # the weights' values are not in it
    assert key != cache_key(tiny_gemma(sliding_window=4), settings)  # the config is
    assert key != cache_key(model, {"dynamic": False})  # and the settings


def test_a_corrupt_cache_file_costs_a_compile_not_the_engine(compile_home, caplog) -> None:  # noqa: ANN001
    compile_home.mkdir(parents=True)
    cache = CompileCache("0" * 32, compile_home)
    cache.path.write_bytes(b"not a cache")
    assert cache.load() == 0
    assert "not loaded" in caplog.text


def test_a_hook_set_after_the_compile_runs_in_the_steps() -> None:
    """A graph compiled before a hook came would not run it (dynamo does not guard an empty hook dict): the dispatcher
    sends a hooked region to its own call, so the engine computes what ``model.generate`` does with the hook."""
    model = tiny_gemma()
    prompts = random_prompts(3, VOCAB_SIZE, min_len=3, max_len=12, seed=9)
    engine = regional_engine(model)
    try:
        handle = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, args, out: out * -50.0)
        try:
            expected = [reference_greedy(model, p, 8, None) for p in prompts]
            outputs = generate(engine, prompts, 8)
        finally:
            handle.remove()
        plain = [reference_greedy(model, p, 8, None) for p in prompts]
    finally:
        engine.close()
    assert [o.generated_tokens for o in outputs] == expected
    assert expected != plain  # the hook changed the tokens, so the test sees whether it ran


def test_an_engine_collected_unclosed_takes_its_dispatchers_off() -> None:
    import gc

    model = tiny_gemma()
    engine = regional_engine(model)
    assert not no_dispatchers(model)
    del engine
    gc.collect()
    assert no_dispatchers(model)


def test_a_cache_file_that_cannot_be_written_leaves_nothing_behind(compile_home) -> None:  # noqa: ANN001
    model = tiny_gemma()
    (compile_home / (cache_key(model, {"x": 1}) + ".bin")).mkdir(parents=True)  # a directory where the file goes
    cache = CompileCache(cache_key(model, {"x": 1}), compile_home)
    engine = regional_engine(model)  # compiles, so torch has artifacts to save
    try:
        assert cache.save() == 0
    finally:
        engine.close()
    assert [p.name for p in compile_home.iterdir() if p.name.startswith(".")] == []
