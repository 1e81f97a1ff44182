"""What one small GEMM costs in the main thread and in a second thread (the manager's loop runs the engine's steps in
one), after the main thread has run an OpenMP parallel region as any program that loaded a model has.

    python scripts/omp_thread_cost.py            # microseconds per torch.mm of [16, 576] x [576, 8]

With GNU OpenMP (torch's CPU wheels) each thread that opens parallel regions keeps a pool of workers; once two pools
exist on a machine with fewer cores than their threads, libgomp throttles the workers' spinning and a region waits for
a worker to wake. docs/lora.md cites this script's figures for why the LoRA product has a kernel of its own.
"""

import argparse
import threading
import time

import torch


def microseconds(x: torch.Tensor, a: torch.Tensor, calls: int) -> float:
    """Mean microseconds of ``torch.mm(x, a)`` over ``calls`` calls (after 50 unmeasured)."""
    for _ in range(50):
        torch.mm(x, a)
    t0 = time.perf_counter()
    for _ in range(calls):
        torch.mm(x, a)
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16, help="rows of x (a decode step's tokens)")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    x, a = torch.randn(args.rows, 576), torch.randn(8, 576).t()
    main_us = microseconds(x, a, args.calls)
    result: list[float] = []
    thread = threading.Thread(target=lambda: result.append(microseconds(x, a, args.calls)))
    thread.start()
    thread.join()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads: torch.mm [{args.rows}, 576] x [576, 8]")
    print(f"main thread   {main_us:7.1f} us")
    print(f"second thread {result[0]:7.1f} us")


if __name__ == "__main__":
    main()
