"""rollout's paged CPU attention kernel (``rollout.engine.attention.cpu``,
``rollout/engine/attention/csrc/paged_attention_cpu.cpp``).

The kernel takes flash-attn's paged inputs, so it is checked against ``tests/flash_reference.py``'s
``reference_attention`` (flash-attn 2's documented semantics: causal mask aligned to the bottom right, left
window, softcap) over keys read through a block table; then an engine on it against ``model.generate``, a
teacher-forced forward and the SDPA path, on tiny models of the three attention kinds it serves (GQA, sliding
windows, softcap). The kernel is compiled on first use (about 20 s on 2 cores, once per machine).
"""

from __future__ import annotations

import logging

import pytest
import torch

import rollout.engine.attention.cpu as cpu_attention
import rollout.engine.worker.runner as model_runner
from rollout import ContinuousBatchingConfig
from rollout.engine import Engine
from rollout.engine.worker.forward import FORWARDS
from tests.flash_reference import reference_attention
from tests.test_flash_path import tiny_gemma2_softcap
from tests.tiny_models import VOCAB_SIZE, random_prompts, tiny_gemma, tiny_llama
from tests.utils import (
    assert_close,
    generate_in_order,
    reference_greedy,
    teacher_forced_logprobs,
)

NUM_BLOCKS, PAGE, HKV, H, D = 24, 8, 2, 6, 16


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    reason = cpu_attention.load_kernel()
    assert reason is None, reason  # this machine has a C++ compiler and ninja: the kernel must build


def _cache(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, PAGE, HKV, D)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _expected(q, k_cache, v_cache, q_lens, k_lens, table, scale, window, softcap) -> torch.Tensor:  # noqa: ANN001
    """The reference, sequence by sequence, over keys gathered through the table; rows past the last sequence 0."""
    out = torch.zeros_like(q)
    start = 0
    for b, (n, m) in enumerate(zip(q_lens, k_lens)):
        slots = (table[b].long()[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:m]
        k = k_cache.reshape(-1, HKV, D)[slots]
        v = v_cache.reshape(-1, HKV, D)[slots]
        if n:
            out[start : start + n] = reference_attention(q[start : start + n], k, v, scale, True, (window, 0), softcap)
        start += n
    return out


@pytest.mark.parametrize("window, softcap", [(-1, 0.0), (5, 0.0), (-1, 2.0), (3, 2.0)])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_varlen_kernel_computes_flash_attns_paged_attention(window, softcap, dtype, atol) -> None:  # noqa: ANN001
    k_cache, v_cache = _cache(dtype)
    # A decode row, a chunk after cached keys, a whole prompt of more than one row tile (16), an empty sequence,
    # and two rows of padding after the last sequence.
    q_lens, k_lens = [1, 6, 21, 0], [13, 30, 21, 4]
    table = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1))[:16].view(4, 4).int()
    T = sum(q_lens) + 2
    q = torch.randn(T, H, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    cu_q = torch.tensor([0, 1, 7, 28, 28], dtype=torch.int32)
    cu_k = torch.tensor([0, 13, 43, 64, 68], dtype=torch.int32)
    out = cpu_attention.flash_attn_varlen_func(
        q, k_cache, v_cache, cu_q, cu_k, 21, 30, 0.3, True, (window, 0), softcap, block_table=table
    )
    expected = _expected(q.float(), k_cache.float(), v_cache.float(), q_lens, k_lens, table, 0.3, window, softcap)
    assert out.dtype == dtype and out.shape == (T, H, D)
    assert_close(out.float().flatten(), expected.flatten(), atol=atol)
    assert torch.equal(out[28:].float(), torch.zeros(2, H, D))  # the padded rows: exactly 0


@pytest.mark.parametrize(
    "head_dim, page, dtype, window, softcap, atol",
    [
        (64, 32, torch.float32, -1, 0.0, 1e-5),
        (64, 5, torch.float32, 45, 0.0, 1e-5),
        (128, 32, torch.float32, -1, 2.0, 1e-5),
        (128, 16, torch.bfloat16, 70, 0.0, 2e-2),
        (40, 32, torch.float32, -1, 0.0, 1e-5),
        (40, 7, torch.float16, 20, 3.0, 2e-3),
    ],
)
def test_long_prefills_match_flash_attns_paged_attention(head_dim, page, dtype, window, softcap, atol) -> None:  # noqa: ANN001
    """Prefills of many 32-key chunks and of partial ones, in one call: query counts around the 16-row tile (tiles
    of 1 row take the dot-product path, of 15 and 16 the GEMM-shaped one), more keys than queries, a window that
    starts inside a chunk, chunks spanning blocks (pages of 5 and 7), head dims specialised (64, 128) or not (40),
    query groups of 3, and caches and queries that are strided views."""
    hkv, group = 3, 3
    heads = hkv * group
    q_lens, k_lens = [1, 15, 16, 17, 100, 513], [37, 18, 16, 50, 164, 590]
    widths = [-(-m // page) for m in k_lens]
    num_blocks = sum(widths) + 3
    g = torch.Generator().manual_seed(7)
    # Each token's slot holds one KV head more than the layer reads: rows wider than the layer's (strided).
    k_cache, v_cache = (
        torch.randn(num_blocks, page, hkv + 1, head_dim, generator=g).to(dtype)[:, :, :hkv] for _ in range(2)
    )
    order = torch.randperm(num_blocks, generator=g).int()
    table = torch.zeros(len(q_lens), max(widths), dtype=torch.int32)
    used = 0
    for b, w in enumerate(widths):
        table[b, :w] = order[used : used + w]
        used += w
    T = sum(q_lens) + 3
    qkv = torch.randn(T, heads + 2 * hkv, head_dim, generator=g).to(dtype)
    q = qkv[:, :heads]  # a view of a fused projection, as a model's q may be
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim**-0.5
    out = cpu_attention.flash_attn_varlen_func(
        q, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens), scale, True, (window, 0), softcap, block_table=table
    )
    expected = torch.zeros(T, heads, head_dim)
    for b, m in enumerate(k_lens):
        slots = (table[b].long()[:, None] * page + torch.arange(page)).reshape(-1)[:m]
        k = k_cache.float().reshape(-1, hkv, head_dim)[slots]
        v = v_cache.float().reshape(-1, hkv, head_dim)[slots]
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        expected[rows] = reference_attention(q[rows].float(), k, v, scale, True, (window, 0), softcap)
    assert out.dtype == dtype and out.shape == (T, heads, head_dim)
    assert_close(out.float().flatten(), expected.flatten(), atol=atol)
    assert torch.equal(out[-3:].float(), torch.zeros(3, heads, head_dim))  # the padded rows: exactly 0


def test_the_kvcache_form_is_the_varlen_kernel_with_one_query_per_sequence() -> None:
    k_cache, v_cache = _cache()
    lens = torch.tensor([1, 9, 32, 17], dtype=torch.int32)
    table = torch.arange(16, dtype=torch.int32).flip(0).view(4, 4)
    q = torch.randn(4, 1, H, D, generator=torch.Generator().manual_seed(3))
    out = cpu_attention.flash_attn_with_kvcache(q, k_cache, v_cache, lens, table, 0.25, True, (7, 0), 0.0)
    cu_q = torch.arange(5, dtype=torch.int32)
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()])
    varlen = cpu_attention.flash_attn_varlen_func(
        q[:, 0], k_cache, v_cache, cu_q, cu_k, 1, 32, 0.25, True, (7, 0), 0.0, block_table=table
    )
    assert out.shape == (4, 1, H, D) and torch.equal(out[:, 0], varlen)


@pytest.mark.parametrize("dtype, softcap, head_dim", [(torch.float32, 0.0, 64), (torch.float32, 3.0, 16),
                                                      (torch.bfloat16, 0.0, 64)])  # fmt: skip
def test_decode_forks_sharing_blocks_get_the_kernels_output_bit_for_bit(dtype, softcap, head_dim) -> None:  # noqa: ANN001
    """Decode sequences whose tables begin with the same blocks (prompt forks) run as one group that reads each shared
    key and value row once (``attend_decode_group``); each row's output must be what it is when the same keys lie in
    blocks of its own (no group): bit for bit, against flash-attn's semantics to 1e-5 (float32). Runs of 4, 2 and 1
    sequences, a member shorter than the shared blocks (its keys end inside them), and a sequence between groups."""
    g = torch.Generator().manual_seed(11)
    page, hkv, heads, shared_blocks = 8, 2, 6, 3
    lens = [40, 33, 26, 19, 30, 37, 12, 25, 41]  # 19: ends inside the 3 shared blocks (24 keys)
    share = [0, 0, 0, 0, 1, 1, None, 2, 2]  # None: a prefix of its own
    width = max((n + page - 1) // page for n in lens)
    shape = (200, page, hkv, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    own = torch.zeros(len(lens), width, dtype=torch.int32)
    prefixes: dict = {}
    nxt = 1
    for b, n in enumerate(lens):
        for k in range((n + page - 1) // page):
            if share[b] is not None and k < shared_blocks:
                if (share[b], k) not in prefixes:
                    prefixes[(share[b], k)] = nxt
                    nxt += 1
                table[b, k] = prefixes[(share[b], k)]
            else:
                table[b, k] = nxt
                nxt += 1
    for b, n in enumerate(lens):  # the same keys, every block a copy of its own
        for k in range((n + page - 1) // page):
            own[b, k] = nxt
            k_cache[nxt], v_cache[nxt] = k_cache[table[b, k]], v_cache[table[b, k]]
            nxt += 1
    q = torch.randn(len(lens), 1, heads, head_dim, generator=g).to(dtype)
    used = torch.tensor(lens, dtype=torch.int32)
    grouped = cpu_attention.flash_attn_with_kvcache(q, k_cache, v_cache, used, table, 0.3, softcap=softcap)
    alone = cpu_attention.flash_attn_with_kvcache(q, k_cache, v_cache, used, own, 0.3, softcap=softcap)
    assert torch.equal(grouped, alone)
    if dtype == torch.float32:
        for b, n in enumerate(lens):
            slots = (table[b].long()[:, None] * page + torch.arange(page)).reshape(-1)[:n]
            k = k_cache.reshape(-1, hkv, head_dim)[slots]
            v = v_cache.reshape(-1, hkv, head_dim)[slots]
            expected = reference_attention(q[b], k, v, 0.3, True, (-1, 0), softcap)
            assert_close(grouped[b], expected, atol=1e-5)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"k_lens": [13, 40]}, "more than its table of 4 blocks holds"),  # 40 keys > 4 blocks of 8
        ({"k_lens": [13, 3]}, "has 6 queries but 3 keys"),
        ({"int64": True}, "must be int32"),
        ({"dtype": torch.float64}, "must share a dtype"),
    ],
)
def test_the_kernel_refuses_inputs_it_cannot_read_before_any_work(change: dict, message: str) -> None:
    k_cache, v_cache = _cache()
    k_lens = change.get("k_lens", [13, 30])
    q = torch.randn(7, H, D).to(change.get("dtype", torch.float32))
    cu_q = torch.tensor([0, 1, 7])
    cu_k = torch.tensor([0, k_lens[0], sum(k_lens)])
    if not change.get("int64"):
        cu_q, cu_k = cu_q.int(), cu_k.int()
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    with pytest.raises(RuntimeError, match=message):
        cpu_attention.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 6, 30, block_table=table)


def test_a_right_window_or_a_non_causal_call_is_refused() -> None:
    k_cache, v_cache = _cache()
    q, table, lens = torch.randn(1, 1, H, D), torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="no right window"):
        cpu_attention.flash_attn_with_kvcache(q, k_cache, v_cache, lens, table, window_size=(4, 2))
    with pytest.raises(ValueError, match="causal"):
        cpu_attention.flash_attn_with_kvcache(q, k_cache, v_cache, lens, table, causal=False)


def _engine(model, choice: str, **overrides: object) -> Engine:  # noqa: ANN001
    config = ContinuousBatchingConfig(
        page_size=4, num_blocks=160, max_batch_tokens=48, return_logprobs=True, cpu_attention=choice, **overrides
    )
    return Engine(model, config)


@pytest.mark.parametrize(
    "build", [tiny_llama, tiny_gemma, tiny_gemma2_softcap], ids=["llama_gqa", "gemma3_sliding", "gemma2_softcap"]
)
def test_an_engine_on_the_kernel_generates_what_generate_does_with_teacher_forced_logprobs(build) -> None:  # noqa: ANN001
    model = build()
    # Prompts of several blocks: chunked prefills (48-token budget), then decode steps of 5 requests.
    prompts = random_prompts(5, VOCAB_SIZE, 10, 70, seed=5)
    paged = _engine(model, "auto")
    assert paged.use_flash  # the kernel built: every step takes it
    outputs = generate_in_order(paged, prompts, max_new_tokens=12)
    sdpa = generate_in_order(_engine(model, "sdpa"), prompts, max_new_tokens=12)
    assert paged.stats.num_decode_fast_path_steps == len(paged.stats.decode_step_batch) > 0
    for prompt, out, ref in zip(prompts, outputs, sdpa):
        assert out.generated_tokens == reference_greedy(model, prompt, 12, eos_token_id=None)
        expected = teacher_forced_logprobs(model, prompt, out.generated_tokens)
        assert_close(out.logprobs, expected, atol=1e-4)
        assert out.generated_tokens == ref.generated_tokens
        assert_close(out.logprobs, ref.logprobs, atol=1e-4)


def test_the_padded_paths_run_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # The static-shape step without compiling (the plain forwards stand in for the compiled ones): padded decode
    # rows, the padding block in the tables, filler rows reading one key; padded varlen steps with filler
    # sequences of no query and no key, and query rows past the last sequence.
    monkeypatch.setattr(model_runner, "compiled_forward", lambda path, config: FORWARDS[path])
    model = tiny_llama()
    prompts = random_prompts(5, VOCAB_SIZE, 10, 70, seed=6)
    padded = _engine(model, "auto", default_compile_level=1)
    calls: dict[str, list[tuple[int, ...]]] = {"flash_attn_with_kvcache": [], "flash_attn_varlen_func": []}

    def counting(name: str) -> object:
        kernel = getattr(cpu_attention, name)

        def call(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            calls[name].append(tuple(q.shape))
            return kernel(q, *args, **kwargs)

        return call

    for name in calls:
        monkeypatch.setattr(cpu_attention, name, counting(name))
    outputs = generate_in_order(padded, prompts, max_new_tokens=12)
    assert padded.stats.num_padded_steps == padded.stats.num_steps
    # Every step ran the kernel, in one of its two forms, on rows padded to the CPU's 4-row interval.
    layers = model.config.num_hidden_layers
    assert len(calls["flash_attn_with_kvcache"]) == layers * len(padded.stats.decode_step_batch) > 0
    varlen_steps = padded.stats.num_steps - len(padded.stats.decode_step_batch)
    assert len(calls["flash_attn_varlen_func"]) == layers * varlen_steps > 0
    assert all(shape[0] % 4 == 0 for shapes in calls.values() for shape in shapes)
    for prompt, out in zip(prompts, outputs):
        assert out.generated_tokens == reference_greedy(model, prompt, 12, eos_token_id=None)


def test_cpu_attention_names_its_choices() -> None:
    with pytest.raises(ValueError, match="cpu_attention"):
        ContinuousBatchingConfig(cpu_attention="flash")
    engine = _engine(tiny_llama(), "sdpa")
    try:
        assert not engine.use_flash
    finally:
        engine.close()


def test_a_kernel_that_cannot_build_falls_back_to_sdpa_on_auto_and_raises_on_paged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_attention, "load_kernel", lambda: "ninja is not installed (pip install ninja)")
    with caplog.at_level(logging.WARNING, logger="rollout.engine.attention.cpu"):
        assert cpu_attention.choose_cpu_attention("auto") is False
    assert "ninja is not installed" in caplog.text
    with pytest.raises(RuntimeError, match="cpu_attention='paged': ninja is not installed"):
        cpu_attention.choose_cpu_attention("paged")
    assert cpu_attention.choose_cpu_attention("sdpa") is False


def test_engines_built_at_once_in_two_threads_wait_for_one_build(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import time

    builds: list[int] = []

    def slow_build() -> None:
        builds.append(1)
        time.sleep(0.2)  # both threads ask while the first build runs

    monkeypatch.setattr(cpu_attention, "_LOADED", [])
    monkeypatch.setattr(cpu_attention, "_build_and_load", slow_build)
    results: list[str | None] = []
    threads = [threading.Thread(target=lambda: results.append(cpu_attention.load_kernel())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert builds == [1] and results == [None, None]


def test_a_build_killed_midway_does_not_hang_the_next_load(tmp_path) -> None:  # noqa: ANN001
    """A build killed midway leaves torch's lock file in the build directory; torch's own ``load`` then waits on it
    forever (CI's first tests hung so). Under rollout's OS lock the stale file is removed and the kernel loads."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    script = (
        "import rollout.engine.attention.cpu as c; from pathlib import Path; "
        "from torch.utils.cpp_extension import _get_build_directory as d; "
        "Path(d(c.build_name(), False), 'lock').touch(); print(c.load_kernel())"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None", out.stdout + out.stderr
    assert not (tmp_path / cpu_attention.build_name() / "lock").exists()
