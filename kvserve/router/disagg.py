"""Disaggregated prefill and decode behind the router (``kvserve router --prefill URL... --decode URL...``).

A completion or chat request that can be split goes twice: first to a prefill replica chosen by the
cache-aware policy over the prefill set (prefix affinity), as a non-streamed request for one token
with ``kv_transfer_params.send_to`` naming the decode replica's KV connector, which the least loaded
decode replica was chosen for beforehand; then, with the token the prefill replica sampled
(``first_token_ids``), to that decode replica, whose answer (streamed or not) goes to the client as
it is: its first token leaves at once, the rest as it decodes on the KV the prefill replica sent.
Both legs carry the same transfer id.

A request for one token (``max_tokens`` 1) is all prefill: it goes whole to a prefill replica, whose
answer is the client's, and no KV moves (a decode replica would only receive it and drop it).

What cannot be split (n > 1, beam search, logprobs, prompt logprobs, echo, structured output) goes
to a decode replica whole, which computes its prompt itself, as does a request whose prefill leg
found no prefill replica up or failed before answering. A decode replica that fails before its first
byte is replaced by another, given the request whole. A prefill replica's 4xx (the client's error)
is the answer.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import replace
from typing import Any

import httpx
from fastapi.responses import Response

from kvserve.router.backends import Backend
from kvserve.router.proxy import NoBackendError, Proxy, Route

log = logging.getLogger("kvserve.router")

ADDRESS_TTL_S = 2.0  # a decode replica's connector address is asked again this often (a restart moves it)
UNSPLIT_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "use_beam_search", "response_format",
                  "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                  "kv_transfer_params")


def splittable(payload: Any) -> bool:
    """Whether a request body can go prefill-then-decode (what the decode side cannot continue is not)."""
    if not isinstance(payload, dict) or payload.get("n", 1) != 1:
        return False
    if payload.get("max_tokens") == 0 or payload.get("min_tokens", 0) not in (0, None):
        return False
    return not any(payload.get(f) not in (None, False) for f in UNSPLIT_FIELDS)


def one_token(payload: dict) -> bool:
    """Whether a (splittable) request asks for a single token: its prefill is all of it."""
    return payload.get("max_tokens") == 1 or payload.get("max_completion_tokens") == 1


def first_token_ids(content: bytes) -> list[int] | None:
    """The token ids a prefill replica's answer (``return_token_ids``) sampled; None if it has none."""
    try:
        ids = json.loads(content)["choices"][0]["token_ids"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return ids if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids) else None


class SplitProxy:
    """``client`` asks decode replicas where they receive KV: it carries ``--backend-api-key``."""

    def __init__(self, prefill: Proxy, decode: Proxy, client: httpx.AsyncClient):
        self.prefill, self.decode, self.client = prefill, decode, client
        self._addresses: dict[str, tuple[float, str | None]] = {}
        self.stats = {"split": 0, "whole": 0, "prefill_fallbacks": 0, "prefill_only": 0}

    async def _address(self, backend: Backend) -> str | None:
        """Where ``backend`` receives KV ("" for a shared tier); None if it is no decode replica."""
        now = time.monotonic()
        cached = self._addresses.get(backend.url)
        if cached is not None and now - cached[0] < ADDRESS_TTL_S:
            return cached[1]
        try:
            body = (await self.client.get(backend.url + "/kv/transfer")).json()
            address = body["address"] if body.get("role") == "decode" else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            address = None
        self._addresses[backend.url] = (now, address)
        return address

    async def forward(self, route: Route) -> Response:
        try:
            payload = json.loads(route.body)
        except ValueError:
            payload = None
        if splittable(payload) and one_token(payload):
            try:
                answer = await self.prefill.forward(route)
            except NoBackendError:
                answer = None
            if answer is not None:
                self.stats["prefill_only"] += 1
                return answer
        choice = self.decode.choose(route) if splittable(payload) else None
        address = await self._address(choice[0]) if choice is not None else None
        if choice is None or address is None:
            self.stats["whole"] += 1
            return await self.decode.forward(route)
        decode, tid = choice[0], uuid.uuid4().hex
        leg = dict(payload, stream=False, max_tokens=1, return_token_ids=True,
                   kv_transfer_params={"transfer_id": tid, "send_to": address})
        leg.pop("stream_options", None)
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        try:
            answer: Response | None = await self.prefill.forward(replace(route, body=json.dumps(leg).encode(),
                                                                         stream=False))
        except NoBackendError:
            answer = None
        if answer is not None and 400 <= answer.status_code < 500 and answer.status_code != 429:
            return answer  # the request's own fault: the decode side would say the same
        first = first_token_ids(bytes(answer.body)) if answer is not None and answer.status_code == 200 else None
        if first is None:
            log.info("prefill leg failed (%s): the request goes whole to a decode replica",
                     answer.status_code if answer is not None else "no prefill replica")
            self.stats["prefill_fallbacks"] += 1
            return await self.decode.forward(route)
        self.stats["split"] += 1
        body = dict(payload, kv_transfer_params={"transfer_id": tid, "first_token_ids": first})
        out = await self.decode.attempt(decode, replace(route, body=json.dumps(body).encode()))
        if out is not None:
            return out
        self._addresses.pop(decode.url, None)
        return await self.decode.forward(route, exclude={decode.url})
