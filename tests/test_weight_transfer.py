"""Weights streamed from a trainer into a running rollout-serve (``rollout.weights.transfer``, ``rollout.fleet.client``,
the four control routes): the tokens and logprobs after a transfer are the sender's model's, a bad announcement
is a 400 naming the field, and a sender killed or stalled mid-transfer fails the transfer in bounded time while
the server keeps its last complete weights (atomic mode) or says it holds partial ones (in-place mode).

Servers run in the test process (uvicorn on 127.0.0.1, a free port); the killed and stalled senders are
processes of their own (tests/weight_sender.py).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from rollout import ContinuousBatchingConfig, RolloutClient, RolloutServerError, RolloutWeightTransfer
from rollout.serve import TransferSettings
from rollout.weights.transfer import TensorMeta, TransferGroup, describe, plan_buckets, receive, send, update_info
from tests.serve_utils import RunningServer, free_port, running_server, wait_until
from tests.tiny_models import tiny_llama, tiny_tokenizer
from tests.utils import assert_close, reference_greedy, teacher_forced_logprobs

REPO = Path(__file__).resolve().parents[1]
CONFIG = ContinuousBatchingConfig(num_blocks=128, page_size=16, return_logprobs=True)
BUCKET_BYTES = 20_000  # the tiny Llama's 427 kB in about 20 buckets
PROMPT = [5, 6, 7, 8, 9, 10]
GREEDY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0, "return_token_ids": True}


@contextlib.contextmanager
def server(mode: str = "atomic", timeout: float = 60.0) -> Iterator[RunningServer]:
    """A server on a fresh tiny Llama (seed 0) with the given transfer settings."""
    with running_server(tiny_llama(), tiny_tokenizer(), CONFIG, transfer=TransferSettings(mode, timeout)) as srv:
        yield srv


def greedy(srv: RunningServer) -> dict:
    response = httpx.post(f"{srv.url}/v1/completions", json={**GREEDY, "ignore_eos": True}, timeout=60)
    response.raise_for_status()
    return response.json()["choices"][0]


def status(srv: RunningServer) -> dict:
    return httpx.get(f"{srv.url}/weight_transfer", timeout=10).json()


# ---------------------------------------------------------------------------------------------- packing
def test_plan_buckets_closes_a_bucket_once_it_exceeds_the_bound_as_vllm_does() -> None:
    metas = [TensorMeta(f"t{i}", torch.float32, (1,)) for i in range(4)]  # 4 bytes each
    assert plan_buckets(metas, 6) == [[0, 1], [2, 3]]
    assert plan_buckets(metas, 8) == [[0, 1, 2], [3]]
    assert plan_buckets(metas, 1) == [[0], [1], [2], [3]]
    assert plan_buckets(metas, 1 << 30) == [[0, 1, 2, 3]]


def test_send_and_receive_in_one_process_round_trip_mixed_dtypes() -> None:
    """An odd number of bfloat16 values before a float32 tensor puts it at an offset that is no multiple of 4."""
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("a", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("c", torch.randn(2, 2, generator=g)),
        ("d", torch.arange(7)),
        ("e", torch.tensor(2.5)),
        ("f", torch.zeros(0, 4)),
    ]
    metas = describe(tensors)
    port = free_port()
    got: list[tuple[str, torch.Tensor]] = []
    joined: dict[str, TransferGroup] = {}
    joiner = threading.Thread(target=lambda: joined.update(g=TransferGroup("127.0.0.1", port, 1, 2, timeout=30)))
    joiner.start()
    sender = TransferGroup("127.0.0.1", port, 0, 2, timeout=30)
    joiner.join()
    receiver = threading.Thread(target=lambda: receive(joined["g"], metas, got.extend, 40, True))
    receiver.start()
    assert send(sender, metas, iter(tensors), 40, True) == sum(m.nbytes for m in metas)
    receiver.join(30)
    assert [n for n, _ in got] == [n for n, _ in tensors]
    for (_, want), (_, have) in zip(tensors, got):
        assert have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(have, want)


# ---------------------------------------------------------------------------------------------- transfer
@pytest.mark.parametrize("mode", ["atomic", "in_place"])
def test_streamed_weights_give_the_senders_greedy_tokens_and_logprobs(mode: str) -> None:
    trained = tiny_llama(seed=1)  # the "trainer's" weights: another random init of the same architecture
    with server(mode) as srv, RolloutClient(srv.url, bucket_bytes=BUCKET_BYTES, timeout=60) as client:
        before = greedy(srv)
        assert before["weight_versions"] == [0] * 8
        client.init_weight_transfer()
        assert client.send_weights(trained.named_parameters()) == 1
        after = greedy(srv)
        assert after["token_ids"] == reference_greedy(trained, PROMPT, 8, None)
        assert after["token_ids"] != before["token_ids"]
        assert_close(
            after["logprobs"]["token_logprobs"], teacher_forced_logprobs(trained, PROMPT, after["token_ids"]), 1e-4
        )
        assert after["weight_versions"] == [1] * 8
        state = status(srv)
        assert state["weights"] == "complete" and state["weight_version"] == 1 and state["last_error"] is None
        assert state["tensors_received"] == len(list(trained.parameters()))
        # A second version over the same group, unpacked this time (one broadcast per tensor).
        assert client.send_weights(tiny_llama().named_parameters(), packed=False) == 2
        assert greedy(srv)["token_ids"] == before["token_ids"]


def _in_flight_greedy(srv: RunningServer, client: RolloutClient) -> tuple[threading.Thread, dict]:
    """A 200-token greedy request of ``client`` in a thread, once it has sampled a few tokens; its answer lands in
    the dict's ``r``."""
    answer: dict = {}
    body = {**GREEDY, "max_tokens": 200, "ignore_eos": True}
    caller = threading.Thread(target=lambda: answer.update(r=client.generate(**body)))
    caller.start()
    wait_until(lambda: srv.manager.engine.stats.num_generated_tokens > 3)
    return caller, answer


def test_a_paused_request_keeps_its_kv_and_continues_under_the_new_weights() -> None:
    """TRL's order: pause(keep), send, resume; the request in flight reports both weight versions."""
    trained = tiny_llama(seed=1)
    with server() as srv, RolloutClient(srv.url, bucket_bytes=BUCKET_BYTES, timeout=60) as client:
        client.init_weight_transfer()
        caller, answer = _in_flight_greedy(srv, client)
        client.pause("keep")
        client.send_weights(trained.named_parameters())
        client.resume()
        caller.join(60)
        versions = answer["r"]["choices"][0]["weight_versions"]
        assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)


@pytest.mark.parametrize(
    ("how", "mode"),
    [
        ("reset_running_requests", "atomic"),
        ("pause_clear_cache", "atomic"),
        ("start_weight_update", "atomic"),
        ("start_weight_update", "in_place"),
    ],
)
def test_a_recompute_asked_for_reprefills_the_in_flight_request_under_the_new_weights(how: str, mode: str) -> None:
    """vLLM's flow: pause keep, ``/reset_prefix_cache?reset_running_requests=true``, the streamed update, resume (or
    the update's own ``recompute``). From the switch on, the request's logprobs are those of a forward of the new
    model over everything it holds (its KV was recomputed), and its versions say where the switch is. The flag used
    to be answered 200 and ignored: the request went on over its old KV (up to 7 nats off)."""
    trained = tiny_llama(seed=1)
    with server(mode) as srv, RolloutClient(srv.url, bucket_bytes=BUCKET_BYTES, timeout=60) as client:
        client.init_weight_transfer()
        caller, answer = _in_flight_greedy(srv, client)
        if how == "pause_clear_cache":  # vLLM's pause flag (its default there)
            paused = httpx.post(f"{srv.url}/pause", params={"mode": "keep", "clear_cache": "true"}, timeout=30)
            assert paused.json() == {"status": "paused", "mode": "keep"}
        else:
            client.pause("keep")
        if how == "reset_running_requests":
            reset = httpx.post(f"{srv.url}/reset_prefix_cache", params={"reset_running_requests": "true"}, timeout=30)
            assert reset.json() == {"success": True}
        client.send_weights(trained.named_parameters(), recompute=how == "start_weight_update")
        client.resume()
        caller.join(60)
    choice = answer["r"]["choices"][0]
    ids, logprobs, versions = choice["token_ids"], choice["logprobs"]["token_logprobs"], choice["weight_versions"]
    k = versions.index(1)
    assert 0 < k < len(ids) == 200 and versions == [0] * k + [1] * (200 - k)
    assert ids[k:] == reference_greedy(trained, PROMPT + ids[:k], 200 - k, None)
    assert_close(logprobs[k:], teacher_forced_logprobs(trained, PROMPT + ids[:k], ids[k:]), 1e-4)


def test_an_in_place_sync_holds_a_new_request_until_resume_and_health_stays_ok() -> None:
    """TRL's worker keeps sending during syncs: under /pause?mode=keep a completion sent while a successful in-place
    update streams in waits for /resume and completes under the new weights, as in atomic mode (it used to get 503
    "the weights are partial", and /health 503 throughout). 503 is for a transfer that failed part way (below)."""
    trained = tiny_llama(seed=1)
    pairs = [(n, p.detach()) for n, p in trained.named_parameters()]
    gate = threading.Event()

    def held_mid_way() -> Iterator[tuple[str, torch.Tensor]]:
        for i, pair in enumerate(pairs):
            if i == 8:
                gate.wait(60)
            yield pair

    with server("in_place") as srv, RolloutClient(srv.url, bucket_bytes=BUCKET_BYTES, timeout=60) as client:
        client.init_weight_transfer()
        client.pause("keep")
        sent: dict = {}
        sender = threading.Thread(target=lambda: sent.update(v=client.send_weights(held_mid_way(), describe(pairs))))
        sender.start()
        wait_until(lambda: status(srv)["tensors_received"] > 0)  # buckets are in the live weights
        assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
        answer: dict = {}
        body = {**GREEDY, "ignore_eos": True}
        caller = threading.Thread(target=lambda: answer.update(r=httpx.post(f"{srv.url}/v1/completions", json=body)))
        caller.start()
        time.sleep(0.5)
        assert "r" not in answer  # waiting, not refused
        gate.set()
        sender.join(60)
        assert sent["v"] == 1 and "r" not in answer and status(srv)["weights"] == "complete"
        client.resume()
        caller.join(60)
    choice = answer["r"].json()["choices"][0]
    assert choice["token_ids"] == reference_greedy(trained, PROMPT, 8, None)
    assert choice["weight_versions"] == [1] * 8


def test_a_control_route_refuses_a_query_parameter_it_does_not_honour() -> None:
    with server() as srv:
        response = httpx.post(f"{srv.url}/reset_prefix_cache", params={"reset_all": "true"}, timeout=10)
        assert response.status_code == 400 and response.json()["error"]["param"] == "reset_all"
        assert "reset_running_requests" in response.json()["error"]["message"]


def test_a_bad_announcement_is_a_400_naming_the_field_before_any_byte() -> None:
    with server() as srv, RolloutClient(srv.url, timeout=30) as client:
        no_group = httpx.post(f"{srv.url}/update_weights", json={"update_info": update_info([])}, timeout=10)
        assert no_group.status_code == 400 and no_group.json()["error"]["param"] == "init_info"
        client.init_weight_transfer()
        meta = TensorMeta("model.embed_tokens.weight", torch.float32, (256, 64))
        cases = {
            "update_info.names": TensorMeta("model.nope.weight", torch.float32, (2,)),
            "update_info.shapes": TensorMeta(meta.name, torch.float32, (256, 63)),
            "update_info.dtype_names": TensorMeta(meta.name, torch.bfloat16, (256, 64)),
        }
        for param, bad in cases.items():
            response = httpx.post(f"{srv.url}/update_weights", json={"update_info": update_info([bad])}, timeout=10)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param
        unknown_dtype = {**update_info([meta]), "dtype_names": ["float33"]}
        response = httpx.post(f"{srv.url}/update_weights", json={"update_info": unknown_dtype}, timeout=10)
        assert response.status_code == 400 and response.json()["error"]["param"] == "update_info.dtype_names"
        bad_rank = {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 2, "world_size": 2}
        response = httpx.post(f"{srv.url}/init_weight_transfer_engine", json={"init_info": bad_rank}, timeout=10)
        assert response.status_code == 400 and response.json()["error"]["param"] == "init_info.rank_offset"
        assert status(srv)["weight_version"] == 0 and status(srv)["initialized"]


def test_a_refused_send_leaves_no_update_open() -> None:
    # send_weights opens an update (/start_weight_update) before /update_weights refuses its announcement: the server
    # used to report "updating" (and keep the update open) until the next send's init.
    with server() as srv:
        with RolloutClient(srv.url, timeout=3) as client:
            with pytest.raises(RolloutServerError) as refused:
                client.send_weights([("model.nope.weight", torch.zeros(2))])
        assert refused.value.status == 400 and refused.value.param == "update_info.names"
        state = status(srv)
        assert not state["updating"] and state["weight_version"] == 0
        assert state["last_error"].startswith("the open weight update was dropped: its announcement was refused")
        finish = httpx.post(f"{srv.url}/finish_weight_update", timeout=10)
        assert finish.status_code == 400 and "no weight update is open" in finish.json()["error"]["message"]
        # The same through the four calls by hand, with a shape the model does not have.
        with RolloutClient(srv.url, timeout=30) as client:
            client.init_weight_transfer()
            assert httpx.post(f"{srv.url}/start_weight_update", timeout=10).status_code == 200
            assert status(srv)["updating"]
            bad = TensorMeta("model.embed_tokens.weight", torch.float32, (256, 63))
            response = httpx.post(f"{srv.url}/update_weights", json={"update_info": update_info([bad])}, timeout=10)
            assert response.status_code == 400 and response.json()["error"]["param"] == "update_info.shapes"
            assert not status(srv)["updating"]
            # A complete send afterwards is one new version, the sender's weights.
            assert client.send_weights(tiny_llama(seed=1).named_parameters()) == 1
        assert greedy(srv)["token_ids"] == reference_greedy(tiny_llama(seed=1), PROMPT, 8, None)


def _start_sender(srv: RunningServer, stall_after: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.weight_sender", srv.url, str(stall_after), str(BUCKET_BYTES)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "JOINED"
    assert proc.stdout.readline().strip() == "STALLED"
    wait_until(lambda: status(srv)["tensors_received"] > 0, timeout=30)  # some buckets arrived
    return proc


def test_a_killed_sender_fails_the_transfer_at_once_and_the_server_keeps_its_weights() -> None:
    with server("atomic", timeout=60) as srv:
        before = greedy(srv)
        proc = _start_sender(srv, stall_after=8)
        try:
            assert status(srv)["receiving"]
            t0 = time.monotonic()
            proc.kill()
            wait_until(lambda: not status(srv)["receiving"], timeout=30)
            failed_after = time.monotonic() - t0
        finally:
            proc.kill()
            proc.wait(10)
        assert failed_after < 10  # the closed connection, not the 60 s timeout
        state = status(srv)
        assert "the weight transfer failed after" in state["last_error"]
        assert "keeps its weights of version 0" in state["last_error"]
        assert not state["initialized"] and state["weights"] == "complete" and state["weight_version"] == 0
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert greedy(srv) == before
        # A new trainer can init and send again.
        with RolloutClient(srv.url, bucket_bytes=BUCKET_BYTES, timeout=60) as client:
            assert client.send_weights(tiny_llama(seed=1).named_parameters()) == 1
        assert greedy(srv)["token_ids"] == reference_greedy(tiny_llama(seed=1), PROMPT, 8, None)


def test_a_stalled_sender_times_out_and_in_place_partial_weights_are_reported_until_a_full_update() -> None:
    with server("in_place", timeout=2.0) as srv:
        proc = _start_sender(srv, stall_after=8)
        try:
            t0 = time.monotonic()
            wait_until(lambda: not status(srv)["receiving"], timeout=30)
            failed_after = time.monotonic() - t0
            state = status(srv)
        finally:
            proc.kill()
            proc.wait(10)
        assert failed_after < 10  # the 2 s timeout, bounded
        assert state["weights"] == "partial" and "holds partial weights" in state["last_error"]
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503 and "partial" in health.json()["error"]["message"]
        refused = httpx.post(f"{srv.url}/v1/completions", json=GREEDY, timeout=10)
        assert refused.status_code == 503 and "partial" in refused.json()["error"]["message"]
        with RolloutClient(srv.url, bucket_bytes=BUCKET_BYTES, timeout=60) as client:
            with pytest.raises(RolloutServerError):
                client.generate(PROMPT, max_tokens=2)
            partial_version = client.weight_version()  # the partial copy may count as a version of its own
            assert client.send_weights(tiny_llama(seed=1).named_parameters()) == partial_version + 1
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert greedy(srv)["token_ids"] == reference_greedy(tiny_llama(seed=1), PROMPT, 8, None)


# ---------------------------------------------------------------------------------------------- TRL
def test_trl_vllm_client_drives_the_four_calls_with_rollouts_transfer_group() -> None:
    """TRL's own HTTP client (trl/experimental/async_grpo/vllm_client.py) makes the calls its
    ``WeightTransferClient`` makes, in its order (pause, start, update while rank 0 broadcasts, finish, resume),
    with rollout's transfer group as the NCCL-free rank 0; AsyncGRPOTrainer itself cannot train on a CPU
    (docs/serving.md, "Weight transfer")."""
    from accelerate import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    PartialState()  # VLLMClient logs through accelerate
    trained = tiny_llama(seed=1)
    pairs = [(n, p.detach()) for n, p in trained.named_parameters()]
    metas = describe(pairs)
    with server() as srv:
        trl = VLLMClient(srv.url, server_timeout=10)
        trl.wait_for_server_ready(poll_interval_s=0.1)
        assert trl.get_dtype() == "torch.float32" and trl.get_world_size() == 1
        port = free_port()
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "packed": True}
        joined: dict[str, TransferGroup] = {}
        joiner = threading.Thread(target=lambda: joined.update(g=TransferGroup("127.0.0.1", port, 0, 2, timeout=30)))
        joiner.start()
        trl.init_weight_transfer_engine(init, timeout=30)
        joiner.join(30)
        trl.pause(timeout=30)
        trl.start_weight_update(timeout=30)
        sender = threading.Thread(target=lambda: send(joined["g"], metas, iter(pairs), 1 << 30, True))
        sender.start()
        trl.update_weights({k: v for k, v in update_info(metas).items() if k != "packed_buffer_size_bytes"}, timeout=30)
        sender.join(30)
        trl.finish_weight_update(timeout=30)
        trl.resume(timeout=30)
        choice = greedy(srv)
        assert choice["token_ids"] == reference_greedy(trained, PROMPT, 8, None)
        assert choice["weight_versions"] == [1] * 8


def test_rollout_weight_transfer_satisfies_trls_weight_transfer_protocol() -> None:
    """The calls AsyncGRPOTrainer makes on its ``weight_transfer`` (init once; per sync pause, send_weights with
    TRL's lazy iterator, resume; destroy at the end), with the names, dtypes and shapes given up front as TRL does."""
    from trl.experimental.async_grpo.async_grpo_trainer import WeightTransferProtocol

    trained = tiny_llama(seed=1)
    info = update_info(describe(trained.named_parameters()))
    with server() as srv:
        transfer = RolloutWeightTransfer(srv.url, weight_update_info=info, bucket_bytes=BUCKET_BYTES, timeout=60)
        for name in ("init_weight_transfer", "pause", "send_weights", "resume", "destroy"):
            assert callable(getattr(transfer, name)) and hasattr(WeightTransferProtocol, name)
        transfer.init_weight_transfer()
        for expected_version in (1, 2):
            transfer.pause()
            transfer.send_weights((n, p.detach()) for n, p in trained.named_parameters())
            transfer.resume()
            assert transfer.weight_version == expected_version
        transfer.destroy()
        assert greedy(srv)["token_ids"] == reference_greedy(trained, PROMPT, 8, None)
        assert not httpx.get(f"{srv.url}/is_paused").json()["is_paused"]


# Rank 0 or 1 of a two-process group; rank 0 starts a broadcast that rank 1 never receives, closes the group and exits.
_UNRECEIVED_BROADCAST = """
import sys, time, torch
from rollout.weights.transfer import TransferGroup
rank, port = int(sys.argv[1]), int(sys.argv[2])
group = TransferGroup("127.0.0.1", port, rank, 2, timeout=30)
if rank == 1:
    time.sleep(600)
group.broadcast(torch.zeros(1 << 18))
t0 = time.monotonic()
group.close()
print(f"closed in {time.monotonic() - t0:.3f}", flush=True)
"""


def test_closing_a_group_with_a_broadcast_in_flight_returns_at_once_and_the_process_exits_cleanly() -> None:
    """A collective nobody receives holds a gloo group's destructor until its timeout: ``close`` must not wait for it,
    and a process that exits meanwhile must not abort (a group destroyed in a daemon thread at exit did: SIGABRT)."""
    port = free_port()
    cmd = [sys.executable, "-c", _UNRECEIVED_BROADCAST]
    peer = subprocess.Popen([*cmd, "1", str(port)])
    try:
        sender = subprocess.Popen([*cmd, "0", str(port)], stdout=subprocess.PIPE, text=True)
        line = sender.stdout.readline()
        assert line.startswith("closed in ") and float(line.split()[-1]) < 5, line
        peer.kill()  # the collective now fails; the sender exits once its group is gone
        assert sender.wait(timeout=60) == 0
    finally:
        peer.kill()
        peer.wait()
