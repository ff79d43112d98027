"""The KV connector: the seam through which a prefill replica hands a prompt's KV blocks to a decode replica.

A handoff is named by a transfer id that the router picks and gives to both sides in the requests'
``kv_transfer_params`` (``KVTransferParams``). The prefill side pushes each full block of the prompt
(``send``) as soon as its chunk is computed, then says it is done (``finish``); the decode side waits
until every block is at hand (in its device cache or its tiers), the transfer ended (done, failed,
cancelled) or its time ran out, then admits the request, whose ordinary prefix lookup restores what
arrived and recomputes the rest. Blocks travel in the tiers' entry format (``tiers.encode_entry``:
the KV layout's fingerprint, the block's tokens, a sha256 of the payload, which holds an 8-bit
pool's scales), so a corrupt or foreign block is never used.

Implementations: ``tcp_connector.TCPConnector`` (a direct stream between the replicas) and
``SharedTierConnector`` here (the shared Redis or directory tier both replicas use). No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvserve.errors import InvalidArgumentError
from kvserve.kv.tiers import Tier

PENDING, DONE, FAILED = "pending", "done", "failed"  # a transfer's state as the decode side sees it


@dataclass
class KVTransferParams:
    """vLLM's ``kv_transfer_params`` of one request: ``send_to`` on the prefill side (the decode side's
    connector address), ``first_token_ids`` on the decode side (what the prefill side sampled)."""

    transfer_id: str
    send_to: str | None = None
    first_token_ids: list[int] = field(default_factory=list)

    @property
    def receives(self) -> bool:
        return bool(self.first_token_ids)

    @classmethod
    def parse(cls, raw: Any) -> KVTransferParams | None:
        """From a request body's field; a 400 naming ``kv_transfer_params`` for any other shape."""
        if raw is None:
            return None

        def bad(why: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"kv_transfer_params {why}", param="kv_transfer_params")

        if not isinstance(raw, dict):
            raise bad("must be an object")
        tid, send_to, first = raw.get("transfer_id"), raw.get("send_to"), raw.get("first_token_ids", [])
        if not isinstance(tid, str) or not 0 < len(tid) <= 128:
            raise bad("needs a transfer_id string of 1 to 128 characters")
        if send_to is not None and not isinstance(send_to, str):
            raise bad("send_to must be a HOST:PORT string")
        if not isinstance(first, list) or not all(isinstance(t, int) and t >= 0 for t in first):
            raise bad("first_token_ids must be a list of token ids")
        if (send_to is not None) == bool(first):
            raise bad("needs either send_to (a prefill request) or first_token_ids (a decode request)")
        return cls(tid, send_to, list(first))


class KVConnector(Protocol):
    """What the engine's handoff (``kvserve.engine.handoff``) asks of a transport."""

    address: str  # where prefill sides send to reach this one ("" where nothing is received directly)
    stream_blocks: bool  # send every block, also those the destination's shared tier already holds

    def send(self, dest: str, transfer_id: str, key: bytes, tokens: Sequence[int], payload: bytes) -> None: ...

    def finish(self, dest: str, transfer_id: str, num_blocks: int) -> None: ...

    def cancel(self, dest: str, transfer_id: str) -> None: ...

    def state(self, transfer_id: str) -> str: ...  # PENDING, DONE or FAILED

    def drop(self, transfer_id: str) -> None: ...  # the decode side is done with it (admitted or cancelled)

    def tiers(self) -> list[Tier]: ...  # tiers to add to the KV manager (what arrives, looked up like any tier)

    def close(self) -> None: ...


class SharedTierConnector:
    """Through the shared tiers (``--kv-offload-url``, ``--kv-offload-dir-shared``) both sides use: the
    prefill side writes each block there (those it already had cached too), the decode side's prefix
    lookup finds them. There is no side channel, so the decode side waits until its tiers hold every
    block of the prompt, or its time runs out."""

    address = ""
    stream_blocks = False

    def __init__(self, shared: Sequence[Tier]):
        if not shared:
            raise InvalidArgumentError("--kv-connector shared-tier needs a tier replicas share: --kv-offload-url "
                                       "or --kv-offload-dir with --kv-offload-dir-shared", param="kv_connector")
        self.shared = list(shared)

    def send(self, dest: str, transfer_id: str, key: bytes, tokens: Sequence[int], payload: bytes) -> None:
        for t in self.shared:
            if not t.knows(key):
                t.put(key, tokens, payload)

    def knows(self, key: bytes) -> bool:
        return all(t.knows(key) for t in self.shared)

    def finish(self, dest: str, transfer_id: str, num_blocks: int) -> None:
        pass

    def cancel(self, dest: str, transfer_id: str) -> None:
        pass

    def state(self, transfer_id: str) -> str:
        return PENDING

    def drop(self, transfer_id: str) -> None:
        pass

    def tiers(self) -> list[Tier]:
        return []

    def close(self) -> None:
        pass
