"""Disaggregated prefill and decode, the engine's part: handing a prompt's KV over a ``KVConnector``.

- **Prefill side** (a request whose ``kv_transfer_params`` has ``send_to``): after every step, each
  full block of its prompt that the prefix cache now holds (computed by this step's chunk, or cached
  before) is queued as a ``send`` copy (``KVManager.queue_send``); the runner reads it at the start of
  the next step and the connector's thread sends it while that step computes, so the transfer
  overlaps the prefill. Once every block went, the connector says so (``finish``). The transfer
  outlives the request (which ends at its first token); an abort before the end cancels it.
- **Decode side** (``first_token_ids`` given): the request is built with those tokens as its output
  (the first goes to the client at once) and parked until its prompt's full blocks are all at hand
  (device cache or tiers, the connector's among them), its transfer ended, or ``timeout_s`` passed;
  then it is queued, and the ordinary prefix lookup restores what arrived and recomputes the rest.
No torch here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.engine.request import Request, RequestStatus
from kvserve.kv.connector import PENDING, KVConnector, KVTransferParams
from kvserve.kv.manager import KVManager
from kvserve.kv.radix_cache import chain_hash

POLL_S = 0.02  # how often a parked request looks for its blocks in the tiers (a remote tier is a round trip)


def prompt_keys(root: bytes, token_ids: list[int], block_size: int) -> list[tuple[bytes, tuple[int, ...]]]:
    """(chain hash, tokens) of each full block of a prompt, as the prefix cache names them."""
    out, key = [], root
    for i in range(len(token_ids) // block_size):
        tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
        key = chain_hash(key, tokens)
        out.append((key, tokens))
    return out


@dataclass
class _Outgoing:
    params: KVTransferParams
    blocks: list[tuple[bytes, tuple[int, ...]]]
    queued: int = 0  # leading blocks queued for sending
    computed_at: list[float] = field(default_factory=list)  # when each block was found computed


@dataclass
class _Parked:
    request: Request
    params: KVTransferParams
    deadline: float
    next_poll: float = 0.0


class Handoff:
    def __init__(self, kv: KVManager, connector: KVConnector, timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.kv, self.connector, self.timeout_s, self.clock = kv, connector, timeout_s, clock
        self._out: dict[str, _Outgoing] = {}  # request id -> its transfer, until every block went
        self._wanted: dict[bytes, list[_Outgoing]] = {}  # a queued block -> transfers waiting for its payload
        self._parked: dict[str, _Parked] = {}
        self._restoring: dict[str, _Parked] = {}  # queued, not admitted yet
        self.stats = {"sent_transfers": 0, "received_transfers": 0, "recomputed_transfers": 0}
        self.sent_timelines: dict[str, list[float]] = {}  # transfer id -> when each block was computed (last 64)
        kv.on_send = self._on_payload

    @property
    def has_parked(self) -> bool:
        return bool(self._parked)

    # -- prefill side -------------------------------------------------------------------------------
    def start_send(self, request_id: str, token_ids: list[int], params: KVTransferParams) -> None:
        blocks = prompt_keys(self.kv.cache_root_key, token_ids, self.kv.block_size)
        out = _Outgoing(params, blocks)
        self._out[request_id] = out
        if not blocks:
            self._finish(request_id)

    def after_step(self) -> None:
        """Queue a send of every block of an outgoing prompt that the prefix cache holds and that was not sent."""
        for rid, p in list(self._restoring.items()):
            if p.request.status != RequestStatus.WAITING or p.request.is_finished:
                del self._restoring[rid]
                self.connector.drop(p.params.transfer_id)
        cache = self.kv.cache
        if cache is None:
            return
        now = self.clock()
        for rid, out in list(self._out.items()):
            if out.queued == len(out.blocks):
                continue
            node = cache.deepest([t for _, tokens in out.blocks for t in tokens])
            path = []
            while node is not cache.root and node is not None:
                path.append(node)
                node = node.parent
            path.reverse()
            knows = getattr(self.connector, "knows", None)
            for node in path[out.queued :]:
                out.computed_at.append(now)
                if knows is not None and knows(node.key):  # a shared tier holds it already
                    out.queued += 1
                    continue
                if node.key not in self._wanted:
                    self.kv.queue_send(node.block, node.key, node.tokens)
                self._wanted.setdefault(node.key, []).append(out)
                out.queued += 1
            if out.queued == len(out.blocks) and not any(out in w for w in self._wanted.values()):
                self._finish(rid)

    def _on_payload(self, key: bytes, tokens: tuple[int, ...], payload: bytes) -> None:
        for out in self._wanted.pop(key, []):
            self.connector.send(out.params.send_to or "", out.params.transfer_id, key, tokens, payload)
        for rid, out in list(self._out.items()):
            if out.queued == len(out.blocks) and not any(out in w for w in self._wanted.values()):
                self._finish(rid)

    def _finish(self, request_id: str) -> None:
        out = self._out.pop(request_id)
        self.connector.finish(out.params.send_to or "", out.params.transfer_id, len(out.blocks))
        self.stats["sent_transfers"] += 1
        self.sent_timelines[out.params.transfer_id] = out.computed_at
        while len(self.sent_timelines) > 64:
            del self.sent_timelines[next(iter(self.sent_timelines))]

    # -- decode side ----------------------------------------------------------------------------------
    def park(self, request: Request, params: KVTransferParams) -> None:
        self._parked[request.request_id] = _Parked(request, params, self.clock() + self.timeout_s)

    def ready(self) -> list[Request]:
        """Parked requests whose blocks are all here, whose transfer ended, or whose time is up."""
        out, now = [], self.clock()
        for rid, p in list(self._parked.items()):
            state = self.connector.state(p.params.transfer_id)
            if state == PENDING and now < p.deadline:
                if now < p.next_poll:
                    continue
                if not self._all_here(p.request):
                    p.next_poll = now + POLL_S
                    continue
            del self._parked[rid]
            self._restoring[rid] = p  # its blocks are dropped once it was admitted (and restored them)
            self.stats["received_transfers" if self._all_here(p.request) else "recomputed_transfers"] += 1
            out.append(p.request)
        return out

    def _all_here(self, req: Request) -> bool:
        cache = self.kv.cache
        if cache is None:
            return True
        blocks = prompt_keys(self.kv.cache_root_key, req.token_ids[: req.num_prompt_tokens], self.kv.block_size)
        depth = cache.deepest(req.token_ids[: len(blocks) * self.kv.block_size]).depth
        rest = [k for k, _ in blocks[depth:]]
        return not rest or len(self.kv.tiers.find_chain(rest)) == len(rest)

    # -- either side ------------------------------------------------------------------------------------
    def cancel(self, request_id: str) -> bool:
        """Drop a request's transfer (either side); True if the request was parked here (so it is not in
        the engine: nothing else to abort)."""
        p = self._parked.pop(request_id, None)
        if p is not None:
            self.connector.drop(p.params.transfer_id)
            return True
        p = self._restoring.pop(request_id, None)
        if p is not None:
            self.connector.drop(p.params.transfer_id)
            return False
        out = self._out.pop(request_id, None)
        if out is None:
            return False
        for key in [k for k, w in self._wanted.items() if out in w]:
            self._wanted[key].remove(out)  # the queued copy still runs; its payload goes to nobody
        self.connector.cancel(out.params.send_to or "", out.params.transfer_id)
        return False
