"""Weight sync time from a trainer process to a ``rollout-serve`` process: streamed over the transfer group
(``RolloutClient.send_weights``) against the bucket size, and reloaded from disk (``/update_weights_from_disk``).

The server is a process of its own (``python -m rollout.serve --enable-control``) on the same model; this
process plays the trainer, holding the model's fp32 weights. Each configuration is timed ``repeats`` times
after one warm-up; the table reports the median and the spread (min-max) in seconds, with the throughput of
the median, and the warm-up call's own time (the first call of its kind in the server's life: first touches of
buffers and files, first imports). A sync time counts the whole call as a trainer sees it: the HTTP calls, the
broadcasts, the server's copy into its live weights and its version bump. The disk path is given in its two parts
(the trainer's safetensors write, the server's load and copy) and as their sum; the load is timed twice, from the
page cache (the file was just written) and cold: the file's pages dropped from the page cache first (``fsync``, then
``posix_fadvise(DONTNEED)``; on a virtual machine the host may still cache them).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.report import machine_info
from rollout import RolloutClient, load_model

DEFAULT_BUCKETS_MB = (4, 16, 64, 256, 1024)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model: str, threads: int) -> Iterator[str]:
    """A ``rollout-serve`` subprocess on 127.0.0.1 with control routes; yields its URL, stops it at the end."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout.serve", "--model", model, "--port", str(port), "--enable-control",
         "--log-level", "warning"],
        env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        client = RolloutClient(url)
        deadline = time.monotonic() + 600
        while not client.health():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(1)
        client.close()
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def measure(model_name: str, buckets_mb: Sequence[int], repeats: int, threads: int) -> dict:
    """Time every configuration; returns the rows and the machine.

    The configurations run round-robin, one run each per round after a warm-up round, so that a change of
    the machine's load (other processes share it) touches every configuration alike.
    """
    torch.set_num_threads(threads)
    model, _ = load_model(model_name, dtype=torch.float32)
    params = [(n, p.detach()) for n, p in model.named_parameters()]
    nbytes = sum(p.numel() * p.element_size() for _, p in params)
    with serve(model_name, threads) as url, tempfile.TemporaryDirectory() as tmp:
        client = RolloutClient(url)
        client.init_weight_transfer()
        path = Path(tmp)

        def packed(mb: int) -> None:
            client.bucket_bytes = mb << 20
            client.send_weights(params)

        def write() -> None:
            save_file({n: p.contiguous() for n, p in params}, str(path / "model.safetensors"))

        def load() -> None:
            client.update_weights_from_disk(tmp)

        write_label, load_label = "safetensors write of the weights (trainer side)", "/update_weights_from_disk"
        configs = [(f"stream, packed, {mb} MiB buckets", lambda mb=mb: packed(mb)) for mb in buckets_mb]
        configs += [
            (f"stream, unpacked ({len(params)} broadcasts)", lambda: client.send_weights(params, packed=False)),
            (write_label, write),
            (f"{load_label}: load + copy from the page cache (server side)", load),
            (f"{load_label}: load + copy, file dropped from the page cache", load),
        ]
        cold = configs[-1][0]
        times: dict[str, list[float]] = {label: [] for label, _ in configs}
        first: dict[str, float] = {}
        for round_ in range(repeats + 1):
            for label, fn in configs:
                if label == cold:
                    drop_from_page_cache(path)
                t0 = time.perf_counter()
                fn()
                if round_:  # round 0 warms up: first touch of buffers, connections, the page cache
                    times[label].append(time.perf_counter() - t0)
                else:
                    first[label] = time.perf_counter() - t0
        client.close()
    rows = [{"method": label, "times": t, "first": first[label]} for label, t in times.items()]
    page_cache = configs[-2][0]
    disk = [w + r for w, r in zip(times[write_label], times[page_cache])]
    rows.append({"method": "disk round trip: write + load + copy", "times": disk, "first": None})
    return {"rows": rows, "bytes": nbytes, "tensors": len(params), "machine": machine_info("cpu")}


def drop_from_page_cache(folder: Path) -> None:
    """Ask the kernel to drop the pages of ``folder``'s safetensors files from the page cache (no root needed: the
    pages are clean once written back), so that the next read goes to the disk."""
    for file in folder.glob("*.safetensors"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def markdown(result: dict, model_name: str, repeats: int, threads: int) -> str:
    """The table of docs/weight_sync.md."""
    m = result["machine"]
    lines = [
        "| method | median s | min-max s | GB/s at the median | first call s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        t = row["times"]
        med = statistics.median(t)
        first = "" if row["first"] is None else f"{row['first']:.3f}"
        lines.append(
            f"| {row['method']} | {med:.3f} | {min(t):.3f}-{max(t):.3f} | {result['bytes'] / med / 1e9:.2f} | {first} |"
        )
    head = (
        f"{model_name}, fp32: {result['tensors']} tensors, {result['bytes'] / 1e6:.0f} MB; trainer and server "
        f"on one machine over 127.0.0.1 (gloo, atomic mode), {threads} torch thread(s) each; {repeats} timed "
        f"rounds (every configuration once per round) after a warm-up round. Commit {m['git_commit']}; "
        f"{m['cpu_model']}, {m['cpu_count']} CPUs, torch {m['torch']}."
    )
    return head + "\n\n" + "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--buckets-mb", type=int, nargs="+", default=list(DEFAULT_BUCKETS_MB))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each process")
    parser.add_argument("--out", default=None, help="write the table (markdown) here too")
    args = parser.parse_args(argv)
    result = measure(args.model, args.buckets_mb, args.repeats, args.threads)
    table = markdown(result, args.model, args.repeats, args.threads)
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    return 0
