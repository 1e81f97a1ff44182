"""A trainer process for the weight-transfer fault tests: it streams a tiny model's weights into a server and
stalls after some tensors, so that the test can kill it (or let the server's timeout pass) mid-transfer.

Usage: python -m tests.weight_sender URL STALL_AFTER BUCKET_BYTES
It prints ``STALLED`` (flushed) once STALL_AFTER tensors were handed to the broadcast, then sleeps.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import torch

from rollout import RolloutClient
from rollout.weights.transfer import describe
from tests.tiny_models import tiny_llama


def main(url: str, stall_after: int, bucket_bytes: int) -> None:
    pairs = list(tiny_llama(seed=1).named_parameters())

    def stalling() -> Iterator[tuple[str, torch.Tensor]]:
        for i, (name, param) in enumerate(pairs):
            if i == stall_after:
                print("STALLED", flush=True)
                time.sleep(3600)
            yield name, param.detach()

    client = RolloutClient(url, bucket_bytes=bucket_bytes, timeout=3600)
    client.init_weight_transfer()
    print("JOINED", flush=True)
    client.send_weights(stalling(), metas=describe(pairs))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
