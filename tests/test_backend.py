"""trainers/backend.py: the local manager and the remote server both implement ``RolloutBackend``, every method
with the keywords the trainers call it with."""

from __future__ import annotations

import inspect

import pytest
from transformers import GenerationConfig

import rollout
from tests.tiny_models import tiny_llama
from trainers.backend import BatchOptions, RequestOptions, RolloutBackend
from trainers.remote import RemoteRollouts

# What the recipe, the rollout queue and the evaluation pass to each method: positional arguments, keywords.
CALLS = {
    "add_request": ([[5, 6]], ["request_id", *RequestOptions.__optional_keys__]),
    "add_requests": ([[[5, 6]]], sorted(BatchOptions.__optional_keys__)),
    "get_result": (["req_0"], ["timeout"]),
    "stop": ([], ["hard_stop"]),
    "update_weights": ([], ["named_tensors"]),
    "pause": ([], []),
    "start": ([], []),
    "destroy": ([], []),
}


def _local() -> RolloutBackend:
    config = rollout.ContinuousBatchingConfig(num_blocks=16, return_logprobs=True)
    return rollout.ContinuousBatchingManager(tiny_llama(), GenerationConfig(max_new_tokens=4), config)


def _remote() -> RolloutBackend:
    return RemoteRollouts("http://127.0.0.1:9", tiny_llama())  # connects only at start()


@pytest.mark.parametrize("make", [_local, _remote], ids=["manager", "remote"])
def test_backend_implements_every_method_of_the_protocol_with_its_keywords(make) -> None:
    backend = make()
    try:
        assert isinstance(backend, RolloutBackend)
        assert backend.weight_version == 0
        for name, (args, keywords) in CALLS.items():
            signature = inspect.signature(getattr(backend, name))
            signature.bind(*args, **dict.fromkeys(keywords))  # TypeError: an argument the backend does not take
    finally:
        backend.destroy()


def test_remote_backend_refuses_named_tensors_rather_than_ignoring_them() -> None:
    backend = RemoteRollouts("http://127.0.0.1:9", tiny_llama())
    try:
        with pytest.raises(ValueError, match="named_tensors must be None"):
            backend.update_weights({"lm_head.weight": None})
    finally:
        backend.destroy()
