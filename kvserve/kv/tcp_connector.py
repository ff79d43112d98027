"""The direct KV connector: blocks streamed over TCP from a prefill replica to a decode replica.

Every replica of a split may send; a decode replica also listens (``--kv-transfer-port``). A sender
keeps one connection per destination, written by its own thread from a queue, so a step never waits
on the network: blocks read after chunk k's step travel while chunk k+1 is computed. Frames are
``magic, kind, transfer id, body``: a BLOCK's body is its chain hash, its tokens and the tiers'
entry (fingerprint, tokens, sha256, payload), checked on arrival; DONE carries the block count;
CANCEL drops what the transfer sent. The receiver keeps the checked payloads in memory (bounded, LRU)
as a tier the decode engine's prefix lookup reads (``ReceivedBlocks``); a corrupt or foreign block
fails its transfer, so the decode side stops waiting and recomputes. A destination that cannot be
reached loses its transfers (one warning); the decode side's wait times out and it recomputes.

With ``--api-key``, a receiver takes blocks only from senders that know it (else anyone who reaches
the port could plant KV that later prompts would reuse): on every connection it first sends a random
nonce, and the sender's first frame must be AUTH with HMAC-SHA256(key, nonce); any other first frame
closes the connection. No torch here.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from kvserve.kv.connector import DONE, FAILED, PENDING
from kvserve.kv.tiers import HostTier, decode_entry, encode_entry

log = logging.getLogger("kvserve.kv.connector")

_FRAME = struct.Struct("<4sBHI")  # magic, kind, transfer id length, body length
_MAGIC = b"KVX1"
BLOCK, FINISH, CANCEL, AUTH = 1, 2, 3, 4
NONCE_BYTES = 16
QUEUE_FRAMES = 4096  # per destination; a full queue fails the transfer rather than block a step
STATES_KEPT = 10_000  # transfer states remembered by a receiver
TIMELINE_KEPT = 4096  # (transfer id, key, time sent) entries a sender keeps, for tests and benchmarks


def _frame(kind: int, tid: str, body: bytes = b"") -> bytes:
    t = tid.encode()
    return _FRAME.pack(_MAGIC, kind, len(t), len(body)) + t + body


def auth_digest(api_key: str, nonce: bytes) -> bytes:
    return hmac.new(api_key.encode(), nonce, hashlib.sha256).digest()


def block_body(key: bytes, tokens: Sequence[int], entry: bytes) -> bytes:
    return bytes([len(key)]) + key + struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens) + entry


class ReceivedBlocks(HostTier):
    """The blocks that arrived, as a tier of the decode engine (host memory, LRU, bounded in bytes)."""

    name = "transfer"

    def __init__(self, capacity_bytes: int):
        super().__init__(capacity_bytes)
        self._tokens: dict[bytes, tuple[int, ...]] = {}
        self.lock = threading.Lock()  # the receiver's threads write, the engine reads

    def __contains__(self, key: bytes) -> bool:
        with self.lock:
            return super().__contains__(key)

    def get(self, key: bytes, tokens: Sequence[int]) -> bytes | None:
        with self.lock:  # a block is restored once: the device cache holds it from then on
            if self._tokens.get(key) != tuple(tokens):
                return None
            self._tokens.pop(key, None)
            payload = self._entries.pop(key, None)
            if payload is not None:
                self.used_bytes -= len(payload)
            return payload

    def add(self, key: bytes, tokens: tuple[int, ...], payload: bytes) -> None:
        with self.lock:
            super().put(key, tokens, payload)
            self._tokens[key] = tokens
            for k in [k for k in self._tokens if k not in self._entries]:  # those the LRU dropped
                del self._tokens[k]

    def put(self, key: bytes, tokens: Sequence[int], payload: bytes) -> None:
        pass  # evicted device blocks do not come here: only what a prefill replica sent

    def discard(self, keys: Sequence[bytes]) -> None:
        with self.lock:
            for k in keys:
                self._tokens.pop(k, None)
                payload = self._entries.pop(k, None)
                if payload is not None:
                    self.used_bytes -= len(payload)


class TCPConnector:
    """Sends to other replicas' connectors and, with ``port`` given (0: any free port), receives."""

    stream_blocks = True

    def __init__(self, fingerprint: bytes, *, host: str = "127.0.0.1", port: int | None = None,
                 buffer_bytes: int = 1 << 30, connect_timeout_s: float = 3.0, api_key: str | None = None):
        self.fingerprint = fingerprint
        self.api_key = api_key
        self.connect_timeout_s = connect_timeout_s
        self.received = ReceivedBlocks(buffer_bytes)
        self._states: OrderedDict[str, str] = OrderedDict()
        self._keys: dict[str, list[bytes]] = {}  # transfer -> blocks received for it
        self._counts: dict[str, tuple[int, int]] = {}  # transfer -> (blocks received, blocks announced or -1)
        self._lock = threading.Lock()
        self._senders: dict[str, _Sender] = {}
        self.timeline: list[tuple[str, bytes, float]] = []  # (transfer id, key, when its frame was written)
        self.stats = {"blocks_sent": 0, "bytes_sent": 0, "blocks_received": 0, "corrupt": 0, "send_failures": 0,
                      "unauthorized": 0}
        self._closed = False
        self._listener: socket.socket | None = None
        self.address = ""
        if port is not None:
            self._listener = socket.create_server((host, port))
            self.address = f"{host}:{self._listener.getsockname()[1]}"
            threading.Thread(target=self._accept, name="kv-receiver", daemon=True).start()

    # -- sending ------------------------------------------------------------------------------
    def _sender(self, dest: str) -> _Sender:
        s = self._senders.get(dest)
        if s is None:
            s = self._senders[dest] = _Sender(self, dest)
        return s

    def send(self, dest: str, transfer_id: str, key: bytes, tokens: Sequence[int], payload: bytes) -> None:
        entry = encode_entry(self.fingerprint, tokens, payload)
        self._sender(dest).put(transfer_id, key, _frame(BLOCK, transfer_id, block_body(key, tokens, entry)))

    def finish(self, dest: str, transfer_id: str, num_blocks: int) -> None:
        self._sender(dest).put(transfer_id, b"", _frame(FINISH, transfer_id, struct.pack("<I", num_blocks)))

    def cancel(self, dest: str, transfer_id: str) -> None:
        self._sender(dest).cancel(transfer_id)

    # -- receiving ----------------------------------------------------------------------------
    def state(self, transfer_id: str) -> str:
        with self._lock:
            return self._states.get(transfer_id, PENDING)

    def drop(self, transfer_id: str) -> None:
        """Forget a transfer's blocks; later frames of it are ignored (its state stays, as failed if pending)."""
        with self._lock:
            self.received.discard(self._keys.pop(transfer_id, []))
            self._counts.pop(transfer_id, None)
            if self._states.get(transfer_id, PENDING) == PENDING:
                self._set(transfer_id, FAILED)

    def tiers(self) -> list[HostTier]:
        return [self.received] if self._listener is not None else []

    def _set(self, tid: str, state: str) -> None:
        self._states[tid] = state
        self._states.move_to_end(tid)
        while len(self._states) > STATES_KEPT:
            self._states.popitem(last=False)

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kv-receiver-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        nonce = os.urandom(NONCE_BYTES)
        try:
            conn.sendall(nonce)
        except OSError:
            conn.close()
            return
        authorized = self.api_key is None
        with conn, conn.makefile("rb") as f:
            while True:
                head = f.read(_FRAME.size)
                if len(head) < _FRAME.size:
                    return
                magic, kind, tlen, blen = _FRAME.unpack(head)
                if magic != _MAGIC:
                    log.warning("KV connector: a connection sent something that is not a KV frame; closed")
                    return
                tid = f.read(tlen).decode(errors="replace")
                body = f.read(blen)
                if len(body) < blen:
                    return
                if not authorized:
                    if kind != AUTH or not hmac.compare_digest(body, auth_digest(self.api_key or "", nonce)):
                        self.stats["unauthorized"] += 1
                        log.warning("KV connector: a sender without the API key was refused")
                        return
                    authorized = True
                    continue
                if kind != AUTH:
                    self._on_frame(kind, tid, body)

    def _on_frame(self, kind: int, tid: str, body: bytes) -> None:
        with self._lock:
            if self._states.get(tid, PENDING) != PENDING:
                return  # cancelled, failed or done already: late frames are dropped
            got, want = self._counts.get(tid, (0, -1))
            if kind == CANCEL:
                self.received.discard(self._keys.pop(tid, []))
                self._set(tid, FAILED)
            elif kind == FINISH:
                want = struct.unpack("<I", body[:4])[0]
            elif kind == BLOCK:
                parsed = _parse_block(body, self.fingerprint)
                if parsed is None:
                    self.stats["corrupt"] += 1
                    log.warning("KV connector: transfer %s sent a corrupt or foreign block: it will be recomputed", tid)
                    self._set(tid, FAILED)
                    return
                key, tokens, payload = parsed
                self.received.add(key, tokens, payload)
                self._keys.setdefault(tid, []).append(key)
                self.stats["blocks_received"] += 1
                got += 1
            self._counts[tid] = (got, want)
            if want >= 0 and got >= want:
                self._set(tid, DONE)

    def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            self._listener.close()
        for s in self._senders.values():
            s.close()


def _parse_block(body: bytes, fingerprint: bytes) -> tuple[bytes, tuple[int, ...], bytes] | None:
    try:
        klen = body[0]
        key = body[1 : 1 + klen]
        (n,) = struct.unpack_from("<I", body, 1 + klen)
        tokens = struct.unpack_from(f"<{n}I", body, 5 + klen)
        entry = body[5 + klen + 4 * n :]
    except (IndexError, struct.error):
        return None
    payload = decode_entry(entry, fingerprint, tokens)
    return None if payload is None else (key, tokens, payload)


class _Sender:
    """One destination: a queue of frames and the thread that writes them to one connection."""

    def __init__(self, owner: TCPConnector, dest: str):
        self.owner, self.dest = owner, dest
        self.q: queue.Queue[tuple[str, bytes, bytes] | None] = queue.Queue(QUEUE_FRAMES)
        self.cancelled: set[str] = set()
        self.sock: socket.socket | None = None
        self.warned = False
        threading.Thread(target=self._run, name=f"kv-sender-{dest}", daemon=True).start()

    def put(self, tid: str, key: bytes, frame: bytes) -> None:
        try:
            self.q.put_nowait((tid, key, frame))
        except queue.Full:  # a stalled destination: this block is lost, the decode side recomputes it
            self.owner.stats["send_failures"] += 1

    def cancel(self, tid: str) -> None:
        self.cancelled.add(tid)
        self.put(tid, b"", _frame(CANCEL, tid))

    def _connect(self) -> socket.socket:
        host, _, port = self.dest.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=self.owner.connect_timeout_s)
        try:
            nonce = b""
            while len(nonce) < NONCE_BYTES:  # the receiver's challenge
                got = sock.recv(NONCE_BYTES - len(nonce))
                if not got:
                    raise ConnectionError("the receiver closed the connection")
                nonce += got
            sock.settimeout(30.0)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.owner.api_key is not None:
                sock.sendall(_frame(AUTH, "", auth_digest(self.owner.api_key, nonce)))
        except OSError:
            sock.close()
            raise
        return sock

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            tid, key, frame = item
            if tid in self.cancelled and frame[4] != CANCEL:
                continue
            try:
                if self.sock is None:
                    self.sock = self._connect()
                self.sock.sendall(frame)
                self.warned = False
            except (OSError, ValueError) as e:
                self.owner.stats["send_failures"] += 1
                if not self.warned:
                    log.warning("KV connector: cannot send to %s (%s): its transfers will be recomputed there",
                                self.dest, e)
                    self.warned = True
                if self.sock is not None:
                    self.sock.close()
                    self.sock = None
                continue
            if key:
                self.owner.stats["blocks_sent"] += 1
                self.owner.stats["bytes_sent"] += len(frame)
                tl = self.owner.timeline
                tl.append((tid, key, time.monotonic()))
                if len(tl) > TIMELINE_KEPT:
                    del tl[: len(tl) - TIMELINE_KEPT]

    def close(self) -> None:
        self.q.put(None)
        if self.sock is not None:
            self.sock.close()
