"""OutputRouter without a thread: final results, streamed snapshots, delivery once, result handlers."""

from __future__ import annotations

import asyncio

import pytest

from rollout.manager.outputs import OutputRouter, ended_output
from rollout.requests import GenerationOutput, Request, RequestStatus
from rollout.sampling_params import SamplingParams


def running_request(request_id: str, generated: list[int]) -> Request:
    req = Request(request_id, [5, 6, 7], SamplingParams(max_new_tokens=10))
    for tok in generated:
        req.append_token(tok, None, 0)
    req.status = RequestStatus.DECODING
    return req


def finished(req: Request) -> Request:
    req.status = RequestStatus.FINISHED
    return req


def test_streaming_snapshots_never_change_and_the_last_one_delivers_the_result() -> None:
    router = OutputRouter(producing=lambda: False)
    router.open("a", streaming=True)
    req = running_request("a", [1])
    router.publish([req])
    req.append_token(2, None, 0)
    router.publish([req])
    req.append_token(3, None, 0)
    router.publish([finished(req)])
    chunks = list(router.stream("a"))
    assert [c.generated_tokens for c in chunks] == [[1], [1, 2], [1, 2, 3]]
    assert [c.status for c in chunks] == [RequestStatus.DECODING, RequestStatus.DECODING, RequestStatus.FINISHED]
    assert "a" not in router  # delivered by the stream
    with pytest.raises(KeyError, match="already delivered"):
        router.get_result("a")


def test_non_streaming_request_gets_its_final_output_only_and_once() -> None:
    router = OutputRouter(producing=lambda: False)
    router.open("a", streaming=False)
    req = running_request("a", [1])
    router.publish([req])  # no snapshot kept
    router.publish([finished(req)])
    assert router.is_pending("a") is False
    out = router.get_result("a")
    assert out is not None and out.status == RequestStatus.FINISHED and out.generated_tokens == [1]
    with pytest.raises(KeyError):
        router.get_result("a")


def test_get_result_without_id_takes_results_in_finishing_order() -> None:
    router = OutputRouter(producing=lambda: False)
    for rid in ("a", "b", "c"):
        router.open(rid, streaming=False)
    router.publish([finished(running_request("c", [1]))])
    router.finish("a", ended_output("a", [5], RequestStatus.CANCELLED, "cancelled by the caller"))
    assert [router.get_result().request_id for _ in range(2)] == ["c", "a"]
    assert router.is_pending("b")
    assert router.get_result(timeout=0) is None  # b is pending but nothing produces any more


def test_get_result_returns_none_when_nothing_is_pending() -> None:
    router = OutputRouter(producing=lambda: True)
    assert router.get_result() is None


def test_open_refuses_an_id_whose_result_is_not_delivered() -> None:
    router = OutputRouter()
    router.open("a", streaming=False)
    with pytest.raises(ValueError, match="'a' is already in use"):
        router.open("a", streaming=True)


def test_fail_pending_ends_every_open_request_and_keeps_finished_ones() -> None:
    router = OutputRouter(producing=lambda: False)
    router.open("a", streaming=False)
    router.open("b", streaming=True)
    router.publish([finished(running_request("a", [1]))])
    router.fail_pending("RuntimeError: boom")
    a, b = router.get_result("a"), router.get_result("b")
    assert a.status == RequestStatus.FINISHED
    assert b.status == RequestStatus.FAILED and b.error == "RuntimeError: boom" and b.finish_reason == "error"


def test_handler_without_a_loop_is_called_per_chunk_and_once_at_the_end() -> None:
    router = OutputRouter(producing=lambda: False)
    router.open("a", streaming=True)
    seen: list[GenerationOutput] = []
    router.register_handler("a", seen.append)
    req = running_request("a", [1])
    router.publish([req])
    req.append_token(2, None, 0)
    router.publish([finished(req)])
    router.publish([req])  # after the end: nothing more
    assert [(len(o.generated_tokens), o.status.is_final) for o in seen] == [(1, False), (2, True)]
    assert "a" not in router


def test_handler_registered_after_the_end_is_called_at_once() -> None:
    router = OutputRouter(producing=lambda: False)
    router.open("a", streaming=False)
    router.publish([finished(running_request("a", [4]))])
    seen: list[GenerationOutput] = []
    router.register_handler("a", seen.append)
    assert [o.generated_tokens for o in seen] == [[4]]


def test_a_raising_handler_does_not_reach_the_producer(caplog: pytest.LogCaptureFixture) -> None:
    router = OutputRouter(producing=lambda: False)
    router.open("a", streaming=False)

    def broken(_: GenerationOutput) -> None:
        raise RuntimeError("handler bug")

    router.register_handler("a", broken)
    router.publish([finished(running_request("a", [1]))])
    assert "result handler of a raised" in caplog.text


def test_handler_registered_in_an_asyncio_loop_runs_in_that_loop() -> None:
    router = OutputRouter(producing=lambda: False)
    router.open("a", streaming=False)

    async def main() -> list[bool]:
        loop = asyncio.get_running_loop()
        ran_in_loop: list[bool] = []
        router.register_handler("a", lambda _: ran_in_loop.append(asyncio.get_running_loop() is loop))
        router.publish([finished(running_request("a", [1]))])  # the producer's call: scheduled, not run
        assert ran_in_loop == []
        await asyncio.sleep(0)
        return ran_in_loop

    assert asyncio.run(main()) == [True]


def test_stream_ends_without_a_final_chunk_when_the_producer_is_gone() -> None:
    router = OutputRouter(producing=lambda: False)
    router.open("a", streaming=True)
    assert list(router.stream("a")) == []
    with pytest.raises(TimeoutError):
        next(iter(router.stream("a", timeout=0.01)))
