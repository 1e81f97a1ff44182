"""Time one pass of SmolLM2-135M's linear layers (30 layers x 7 projections, then the lm_head) on the CPU, four
ways: MKL (``F.linear``), oneDNN on the plain weights, oneDNN on weights reordered once into its blocked layout
(``packed``: ``rollout.engine.worker.onednn.PackedWeights``, what the engine runs without AVX-512 or under
``ROLLOUT_ONEDNN_LINEAR=1``), and rollout's GEMM on its column panels (``rollout``: ``PackedWeights(kernel="rollout")``,
``rollout_cpu::packed_linear``, what the engine runs on AVX-512 machines and, per element the same chain, what
``batch_invariant=True`` runs). A whole pass, not one shape at a time: as in an engine step, each layer's weights come
from memory (540 MB in all), not from the caches; the projections unstacked (the engine stacks q/k/v and gate/up).
rollout/engine/worker/onednn.py and docs/engine.md quote it.

    python scripts/bench_cpu_linear.py [--rows 2 32 512] [--repeats 5]

Rounds alternate the four, and each prints its median and every round's time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rollout.engine.attention.cpu import load_kernel
from rollout.engine.worker.onednn import ROLLOUT, PackedWeights, _onednn

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536, 30 layers, vocabulary 49,152.
LAYER_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[2, 32, 512], help="rows per linear call")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for _ in range(LAYERS) for n, k in LAYER_SHAPES]
    weights.append(torch.randn(VOCAB, HIDDEN) * 0.02)
    packs = PackedWeights()
    reason = load_kernel()
    if reason is not None:
        raise SystemExit(f"rollout's CPU kernels are needed for its GEMM: {reason}")
    panels = PackedWeights(kernel=ROLLOUT)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}

        def one_pass(
            linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], inputs: dict[int, torch.Tensor] = inputs
        ) -> None:
            for w in weights:
                linear(inputs[w.shape[1]], w)

        kernels = {
            "mkl": lambda x, w: F.linear(x, w),
            "onednn": lambda x, w: _onednn(x, w, None),
            "packed": lambda x, w: packs.linear(x, w, None),
            "rollout": lambda x, w: panels.linear(x, w, None),
        }
        for linear in kernels.values():
            one_pass(linear)  # builds oneDNN's primitives and the packed copies
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for r in range(args.repeats):
            for name in kernels if r % 2 == 0 else reversed(kernels):
                start = time.perf_counter()
                one_pass(kernels[name])
                times[name].append((time.perf_counter() - start) * 1e3)
        for name, ms in times.items():
            print(f"rows {rows}: {name} {statistics.median(ms):.1f} ms per pass ({', '.join(f'{t:.0f}' for t in ms)})")


if __name__ == "__main__":
    main()
