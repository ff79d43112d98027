"""Disaggregated prefill and decode in-process: a prefill engine hands a prompt's KV to a decode engine
over the TCP connector (or a shared directory tier); greedy answers equal one engine's; a corrupt or
failed transfer falls back to recomputing; cancels free the KV on both sides; the transfer overlaps
the prefill (its timeline, not wall-clock thresholds)."""

from __future__ import annotations

import random
import time

import pytest

from conftest import check_every_step, tiny_weights
from kvserve import SamplingParams
from kvserve.engine.messages import AbortRequests, AddRequest
from kvserve.kv.connector import DONE, FAILED, KVTransferParams
from kvserve.kv.tcp_connector import _parse_block
from kvserve.llm import LLM

BS = 4
_RNG = random.Random(7)
PROMPT = [_RNG.randrange(3, 97) for _ in range(45)]  # 11 full blocks and one token more


def replica(**kw) -> LLM:
    cfg, w = tiny_weights()
    kw.setdefault("max_num_batched_tokens", 12)  # the prompt's prefill takes four chunks
    llm = LLM.from_weights(cfg, w, dtype="float32", quantization="none", num_kv_blocks=96, block_size=BS,
                           attention_backend="gather-sdpa", **kw)
    check_every_step(llm)
    return llm


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def want() -> list[int]:
    return replica().generate([PROMPT], greedy(8))[0].token_ids


def prefill(p: LLM, dest: str, tid: str, prompt=PROMPT) -> int:
    out = p.generate([prompt], greedy(1, kv_transfer=KVTransferParams(tid, send_to=dest)))[0]
    return out.token_ids[0]


def decode(d: LLM, tid: str, first: int, n: int = 8, prompt=PROMPT):
    return d.generate([prompt], greedy(n, kv_transfer=KVTransferParams(tid, first_token_ids=[first])))[0]


def wait_state(d: LLM, tid: str) -> str:
    conn = d.core.handoff.connector
    deadline = time.monotonic() + 30
    while conn.state(tid) not in (DONE, FAILED) and time.monotonic() < deadline:
        time.sleep(0.01)
    return conn.state(tid)


def test_split_equals_one_engine_and_restores_every_block(want):
    p, d = replica(role="prefill"), replica(role="decode")
    first = prefill(p, d.core.handoff.connector.address, "t1")
    assert first == want[0]
    out = decode(d, "t1", first)
    assert out.token_ids == want
    assert out.num_cached_tokens == 44  # every full block came over; only the last block is computed here
    assert d.engine.kv.stats.tier_hits["transfer"] == 44
    assert d.core.handoff.stats["received_transfers"] == 1
    assert p.engine.kv.pool.num_free + p.engine.kv.pool.num_evictable == p.engine.kv.pool.num_blocks


def test_prefix_cached_on_the_prefill_side_is_sent_too(want):
    """Blocks the prefill replica had cached before (a prefix hit there) go over as well."""
    p, d = replica(role="prefill"), replica(role="decode")
    p.generate([PROMPT], greedy(1))  # now cached on p
    first = prefill(p, d.core.handoff.connector.address, "t2")
    assert wait_state(d, "t2") == DONE
    out = decode(d, "t2", first)
    assert out.token_ids == want and out.num_cached_tokens == 44


def test_transfer_overlaps_the_prefill():
    """The first blocks were handed to the connector before the prompt's last chunk was computed, and
    each went on the wire once handed over (when the sender thread runs is up to the OS, so the
    overlap is checked at the hand-over, which the engine decides)."""
    p, d = replica(role="prefill"), replica(role="decode")
    conn, handed = p.core.handoff.connector, []
    send = conn.send

    def recording_send(dest, tid, key, tokens, payload):
        handed.append(time.monotonic())
        send(dest, tid, key, tokens, payload)

    conn.send = recording_send
    prefill(p, d.core.handoff.connector.address, "t3")
    assert wait_state(d, "t3") == DONE
    computed = p.core.handoff.sent_timelines["t3"]  # when each block was found computed (step ends)
    sent = sorted(t for tid, _, t in conn.timeline if tid == "t3")
    assert len(computed) == len(sent) == len(handed) == 11
    assert len(set(computed)) == 4  # four chunks, so four step ends
    assert handed[0] < computed[-1]  # handed over while the later chunks were still to be computed
    assert all(h <= s for h, s in zip(sorted(handed), sent))


def test_corrupt_block_falls_back_to_recompute(want, monkeypatch):
    import kvserve.kv.tcp_connector as tcp

    p, d = replica(role="prefill"), replica(role="decode")
    real = tcp.encode_entry

    def corrupted_in_transit(fingerprint, tokens, payload):
        entry = bytearray(real(fingerprint, tokens, payload))
        entry[-1] ^= 0xFF  # a flipped bit in the payload, after its checksum was taken
        return bytes(entry)

    monkeypatch.setattr(tcp, "encode_entry", corrupted_in_transit)
    first = prefill(p, d.core.handoff.connector.address, "t4")
    assert wait_state(d, "t4") == FAILED
    out = decode(d, "t4", first)
    assert out.token_ids == want
    assert out.num_cached_tokens == 0 and d.core.handoff.connector.stats["corrupt"] >= 1
    assert d.core.handoff.stats["recomputed_transfers"] == 1


def test_failed_transfer_times_out_and_recomputes(want):
    p, d = replica(role="prefill"), replica(role="decode", kv_transfer_timeout_s=0.3)
    first = prefill(p, "127.0.0.1:1", "t5")  # nobody listens there
    out = decode(d, "t5", first)
    assert out.token_ids == want and out.num_cached_tokens == 0
    assert p.core.handoff.connector.stats["send_failures"] >= 1


def test_parse_block_rejects_foreign_fingerprint():
    from kvserve.kv.tcp_connector import block_body
    from kvserve.kv.tiers import encode_entry

    body = block_body(b"k" * 16, (1, 2), encode_entry(b"other", (1, 2), b"xyz"))
    assert _parse_block(body, b"mine") is None
    assert _parse_block(body, b"other") == (b"k" * 16, (1, 2), b"xyz")
    assert _parse_block(b"\x10", b"mine") is None  # truncated


def test_cancel_on_the_decode_side_frees_everything():
    p, d = replica(role="prefill"), replica(role="decode", kv_transfer_timeout_s=30)
    first = prefill(p, d.core.handoff.connector.address, "t6")
    assert wait_state(d, "t6") == DONE
    params = greedy(8, kv_transfer=KVTransferParams("t6", first_token_ids=[first]))
    d.core.add(AddRequest("r", list(PROMPT), params))
    msg = d.core.step()  # the first token goes out at once; the request is admitted and restores
    assert msg.deltas[0].new_token_ids == [first]
    d.core.handle(AbortRequests(["r"]))
    while d.core.has_work:
        d.core.step()
    kv = d.engine.kv
    assert kv.pool.num_free + kv.pool.num_evictable == kv.pool.num_blocks and not kv.tables
    assert len(d.core.handoff.connector.received) == 0


def test_cancel_while_parked_drops_received_blocks():
    d = replica(role="decode", kv_transfer_timeout_s=30)
    params = greedy(8, kv_transfer=KVTransferParams("t7", first_token_ids=[5]))
    d.core.add(AddRequest("r", list(PROMPT), params))
    d.core.step()
    assert d.core.handoff.has_parked
    d.core.handle(AbortRequests(["r"]))
    assert not d.core.handoff.has_parked and not d.core.has_work
    assert d.core.handoff.connector.state("t7") == FAILED  # late blocks of it are dropped


def test_cancel_on_the_prefill_side_cancels_the_transfer():
    p, d = replica(role="prefill"), replica(role="decode")
    params = greedy(1, kv_transfer=KVTransferParams("t8", send_to=d.core.handoff.connector.address))
    p.core.add(AddRequest("r", list(PROMPT), params))
    p.core.step()  # the first chunk: its blocks are queued for sending
    p.core.handle(AbortRequests(["r"]))
    while p.core.has_work:
        p.core.step()
    kv = p.engine.kv
    assert kv.pool.num_free + kv.pool.num_evictable == kv.pool.num_blocks and not kv.tables
    assert wait_state(d, "t8") == FAILED
    assert len(d.core.handoff.connector.received) == 0


def test_first_token_that_ends_the_request(want):
    d = replica(role="decode")
    out = decode(d, "t9", want[0], n=1)
    assert out.token_ids == [want[0]] and out.finished and out.finish_reason == "length"
    assert not d.core.handoff.has_parked


def test_shared_directory_connector(want, tmp_path):
    kw = dict(kv_offload_dir=str(tmp_path), kv_offload_dir_shared=True, kv_connector="shared-tier")
    p, d = replica(role="prefill", **kw), replica(role="decode", **kw)
    first = prefill(p, "", "t10")
    out = decode(d, "t10", first)
    assert out.token_ids == want and out.num_cached_tokens == 44
    assert d.engine.kv.stats.tier_hits["disk"] == 44


def test_kv_transfer_params_are_checked():
    from kvserve.errors import InvalidArgumentError

    for raw in ("x", {"transfer_id": ""}, {"transfer_id": "a"}, {"transfer_id": "a", "send_to": "h:1",
                                                                   "first_token_ids": [1]},
                {"transfer_id": "a", "first_token_ids": [-1]}):
        with pytest.raises(InvalidArgumentError):
            KVTransferParams.parse(raw)
    d = replica()  # --role both: no connector
    with pytest.raises(InvalidArgumentError, match="no KV connector"):
        decode(d, "t11", 5)


def test_receiver_with_an_api_key_takes_blocks_only_from_senders_that_know_it(want):
    """With --api-key, a decode replica's connector refuses a sender without the key (its blocks would
    be reused by later prompts), so that transfer is recomputed; a sender with the key is taken."""
    for tid, key in (("a1", None), ("a2", "wrong"), ("a3", "k")):
        d = replica(role="decode", api_key="k", kv_transfer_timeout_s=0.5)  # a fresh cache for each
        first = prefill(replica(role="prefill", api_key=key), d.core.handoff.connector.address, tid)
        out = decode(d, tid, first)
        conn = d.core.handoff.connector
        assert out.token_ids == want
        if key == "k":
            assert out.num_cached_tokens == 44 and conn.stats["unauthorized"] == 0
        else:
            assert out.num_cached_tokens == 0 and conn.stats["unauthorized"] >= 1  # (it retries per frame)
            assert conn.stats["blocks_received"] == 0
