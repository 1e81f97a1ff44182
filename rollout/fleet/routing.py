"""The fleet's data plane: generation goes to one routing point.

That point is vLLM's router (``vllm-router --policy consistent_hash``) in front of the replicas, with a session header
(``X-Session-ID``) that keeps one session (the G samples of a prompt, one trajectory) on one replica for its prefix
cache; SkyRL and prime-rl run it so. Without a router the pool picks the replica itself, by rendezvous hashing of the
session key over the live replicas (the same key, the same replica, and only the keys of a dropped replica move).

A generation that fails to reach a replica is sent again to the survivors once the dead ones are dropped; the last
replica's failure is raised, as ``RolloutClient`` (the one-server pool) always did.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import httpx

from rollout.fleet.http import Connections, answer, logger
from rollout.fleet.membership import Membership

DEFAULT_SESSION_HEADER = "X-Session-ID"


def pick_replica(session: str, urls: Sequence[str]) -> str:
    """The replica of a session without a router: rendezvous (highest random weight) hashing.

    A key keeps its replica while that replica lives; when one is dropped, only its keys move (Thaler and Ravishankar,
    "Using name-based mappings to increase hit rates", 1998). The hash is sha256, stable across processes (never
    Python's salted ``hash``), so every trainer process picks the same replica for a session.

    Args:
        session: the session key.
        urls: the live replicas, non-empty.
    """
    return max(urls, key=lambda url: hashlib.sha256(f"{url}\0{session}".encode()).digest())


class Routing:
    """Generation, chat and scoring requests of the pool, each to the router or to its session's replica.

    Args:
        http: the pool's connections.
        membership: the pool's replicas (a failed request drops the dead ones before it is sent again).
        session_header: the header that carries a request's session key (the router hashes it).
        model: the ``model`` field of generation requests (None: the servers' one model).
    """

    def __init__(self, http: Connections, membership: Membership, session_header: str, model: str | None) -> None:
        self.http = http
        self.membership = membership
        self.session_header = session_header
        self.model = model

    def generate(
        self,
        prompt: Sequence[int] | str | Sequence[Sequence[int]],
        session: str | None = None,
        **params: Any,
    ) -> dict[str, Any]:
        """``POST /v1/completions`` with token ids and logprobs back: the response body.

        Args:
            prompt: token ids, a text, or a list of token-id lists.
            session: the session key (sent as ``session_header``): requests with one key go to one replica.
            params: the completions fields (``max_tokens``, ``temperature``, ``n``, ``seed``, ``stop_token_ids``...).
                ``logprobs`` defaults to 0 and ``return_token_ids`` to True: each choice carries ``token_ids``,
                ``logprobs.token_logprobs`` and ``weight_versions``.

        Raises:
            RolloutServerError: the server (or router) answered an error.
            httpx.HTTPError: the last replica did not answer.
        """
        body = {"prompt": prompt, "logprobs": 0, "return_token_ids": True, **params}
        return self.post("/v1/completions", body, session)

    def chat(self, messages: list[dict[str, Any]], session: str | None = None, **params: Any) -> dict[str, Any]:
        """``POST /v1/chat/completions`` (``logprobs`` and ``return_token_ids`` on): the response body.

        Raises:
            RolloutServerError, httpx.HTTPError: as ``generate``.
        """
        body = {"messages": messages, "logprobs": True, "return_token_ids": True, **params}
        return self.post("/v1/chat/completions", body, session)

    def score(self, prompt_ids: Sequence[int], session: str | None = None) -> list[float]:
        """The logprob of each prompt token after the first under the current weights (nats).

        Returns:
            float [len(prompt_ids) - 1], from vLLM's ``prompt_logprobs`` (one token is generated and dropped).

        Raises:
            RolloutServerError, httpx.HTTPError: as ``generate``.
        """
        body = self.generate(list(prompt_ids), session, max_tokens=1, prompt_logprobs=0, temperature=0)
        entries = body["choices"][0]["prompt_logprobs"][1:]
        return [entry[str(tok)]["logprob"] for entry, tok in zip(entries, prompt_ids[1:])]

    def target(self, session: str | None, direct: bool = False) -> tuple[httpx.Client, dict[str, str]]:
        """Where a request of ``session`` goes, with its headers: the router, unless ``direct`` or there is none;
        else the session's replica (``pick_replica``)."""
        headers = {self.session_header: session} if session is not None else {}
        if self.http.router is not None and not direct:
            return self.http.router, headers
        urls = self.membership.live()
        return self.http.replicas[pick_replica(session or "", urls) if len(urls) > 1 else urls[0]], headers

    def post(self, path: str, body: dict[str, Any], session: str | None) -> Any:
        """POST a generation body (with the pool's ``model`` unless it names one); when it fails to reach a replica
        (no answer, or a 5xx) and a replica turns out dead, the dead ones are dropped and the request is sent again,
        straight to a live replica.

        The resend skips the router: ``/remove_worker`` may not have taken effect yet (another thread may have dropped
        the replica a moment ago), and the router would pick the dead replica again. A failure on a live replica is
        the request's own and is answered unless that replica has died too.

        Raises:
            RolloutServerError: the answer is an error (the request's own).
            httpx.TransportError: no replica answered and none died (the last one's failure).
        """
        if self.model is not None:
            body.setdefault("model", self.model)
        direct = False
        while True:
            client, headers = self.target(session, direct)
            through_router = client is self.http.router
            try:
                response = client.post(path, json=body, headers=headers)
                if response.status_code < 500:
                    return answer(response)
                failure = f"{response.status_code} {response.text[:200]}"
            except httpx.TransportError as e:
                if not self._a_replica_died(through_router):
                    raise
                failure = f"{type(e).__name__}: {e}"
            else:
                if not self._a_replica_died(through_router):  # nobody died: the failure is the request's own
                    return answer(response)
            direct = True
            logger.warning("%s failed (%s); sending it again to %s", path, failure, self.membership.urls)

    def _a_replica_died(self, through_router: bool) -> bool:
        """After a failed generation call: drop the replicas that do not answer ``/health``; True when one is gone
        (now, or earlier when the call went through the router, which may still hold it)."""
        if len(self.membership.urls) > 1 and self.membership.drop_unhealthy():
            return True
        return through_router and bool(self.membership.dropped)
