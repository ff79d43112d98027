"""The KV manager: block tables per sequence over one pool, the prefix cache, the offload tiers.

The scheduler asks it to give a new sequence its cached prefix, to make room for a
sequence's next tokens (evicting cached blocks when the free list runs short), to cache
the blocks a step filled, and to free a sequence. For a model whose every layer attends a
sliding window, a sequence also lets go of the blocks wholly behind the window of the next token
it computes (``slide``); their table entries become ``NO_BLOCK``, so a table still maps positions.
For a model with recurrent layers (Mamba), a sequence also holds one state slot from its first blocks until it is
freed (finished or preempted): the runner keeps that layer state there, restarting it at position 0.
Copies between device blocks and the tiers are queued as ``KVTransfer``s that ride on the step's
batch, in order, so the runner performs them before the forward pass that may overwrite a reused
block. No torch here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvserve.kv.block_pool import NO_BLOCK, BlockPool
from kvserve.kv.events import CacheEvents
from kvserve.kv.radix_cache import RadixCache, RadixNode, chain_hash
from kvserve.kv.tiers import Tier, TieredStore


def window_tokens(window: int, block_size: int, max_chunk: int) -> int:
    """The most KV (in tokens, whole blocks) one sequence holds when every layer has ``window``: the
    blocks of its chunk's first row's window and of the chunk's ``max_chunk`` rows (``slide`` frees
    those behind the window). A pool that holds this much runs a sequence of any length alone."""
    return (-(-(window - 1 + max_chunk) // block_size) + 1) * block_size


@dataclass
class KVTransfer:
    """Copy one block between the device cache and a tier: ``save`` reads it (the payload comes
    back in the step's output under ``key``), ``load`` writes ``payload`` into it; ``send`` reads it
    for the KV connector (``on_send``), not the tiers."""

    kind: str  # "save" | "load" | "send"
    block: int
    key: bytes = b""
    tokens: tuple[int, ...] = ()
    payload: bytes | None = None


@dataclass
class PrefixMatch:
    num_tokens: int = 0  # tokens of the prompt whose KV the sequence now has
    device_tokens: int = 0
    tier_tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (once per admission)
    hits: int = 0  # of which found, in any tier
    device_hits: int = 0
    tier_hits: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0, "redis": 0})
    evicted_blocks: int = 0
    offload_bytes_out: int = 0  # device -> tiers
    offload_bytes_in: int = 0  # tiers -> device
    restores_skipped: int = 0  # tier hits left alone because prefilling again was cheaper


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 tiers: Sequence[Tier] = (), fingerprint: bytes = b"", block_bytes: int = 0,
                 sliding_window: int | None = None, state_slots: int = 0):
        """``sliding_window``: the window every layer of the model attends (``ModelConfig.kv_window``);
        None keeps every block of a sequence. ``state_slots``: how many sequences may hold a recurrent state at
        once (0: the model has none). A recurrent state describes a whole sequence, not a prefix of it, so such a
        model runs without the prefix cache."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError("sliding_window must be positive")
        if state_slots and enable_prefix_caching:
            raise ValueError("a recurrent state per sequence rules out the prefix cache")
        self.state_slots = state_slots
        self._free_states = list(range(state_slots - 1, -1, -1))
        self.states: dict[str, int] = {}  # seq -> its state slot
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.tables: dict[str, list[int]] = {}
        self.cache = RadixCache(self.pool, fingerprint) if enable_prefix_caching else None
        self.tiers = TieredStore(tiers if self.cache else ())
        self._shared_tiers = [t for t in self.tiers.tiers if getattr(t, "write_through", False)]
        self.block_bytes = block_bytes
        self.stats = PrefixCacheStats()
        self._cached_upto: dict[str, tuple[RadixNode, int]] = {}  # seq -> (deepest node, blocks cached)
        self._transfers: list[KVTransfer] = []
        # Seconds to prefill n tokens after ``start`` (the scheduler's learned step-time model);
        # None while unknown. Decides whether restoring from a tier beats computing again.
        self.prefill_seconds: Callable[[int, int], float | None] = lambda start, n: None
        # where ``send`` payloads go (kvserve.engine.handoff: a prefill replica's KV connector)
        self.on_send: Callable[[bytes, tuple[int, ...], bytes], None] | None = None

    # -- capacity ----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        return self.cache.num_nodes if self.cache else 0

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus cached blocks that eviction could free."""
        return self.pool.num_free + self.pool.num_evictable

    def usage(self) -> float:
        """Fraction of blocks held by running sequences (cached-only blocks count as free)."""
        return 1.0 - self.num_available_blocks / self.pool.num_blocks

    def table(self, seq_id: str) -> list[int]:
        return self.tables.get(seq_id, [])

    def num_held(self, seq_id: str) -> int:
        """Blocks the sequence holds (its table less the entries a window let go of)."""
        return sum(1 for b in self.table(seq_id) if b != NO_BLOCK)

    def slide(self, seq_id: str, position: int) -> int:
        """With a sliding window: release the sequence's blocks that lie wholly before the window of
        ``position`` (the first token the next step computes: every later row's window starts later),
        their entries set to ``NO_BLOCK``. The prefix cache keeps its own references, so a cached block
        stays cached (and becomes evictable). Returns how many blocks were released."""
        table = self.tables.get(seq_id)
        if self.sliding_window is None or not table:
            return 0
        end = min(len(table), max(0, position - self.sliding_window + 1) // self.block_size)
        start = end  # entries before the first placeholder back from ``end`` are placeholders already
        while start > 0 and table[start - 1] != NO_BLOCK:
            start -= 1
        if start == end:
            return 0
        self.pool.release(table[start:end])
        table[start:end] = [NO_BLOCK] * (end - start)
        return end - start

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Extra blocks a sequence needs so that it can hold ``num_tokens`` tokens in total."""
        return max(0, self.pool.blocks_for(num_tokens) - len(self.table(seq_id)))

    def can_grow(self, seq_id: str, num_tokens: int) -> bool:
        if self.state_slots and seq_id not in self.states and not self._free_states:
            return False
        return self.blocks_needed(seq_id, num_tokens) <= self.num_available_blocks

    def grow(self, seq_id: str, num_tokens: int) -> None:
        """Make the sequence's table cover ``num_tokens`` tokens (and give it a state slot where the model has
        recurrent layers); caller checked ``can_grow``."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need:
            self.tables.setdefault(seq_id, []).extend(self._allocate(need))
        if self.state_slots and seq_id not in self.states:
            self.states[seq_id] = self._free_states.pop()

    def state_slot(self, seq_id: str) -> int:
        """The sequence's recurrent state slot; -1 where the model has none."""
        return self.states.get(seq_id, -1)

    def _allocate(self, n: int) -> list[int]:
        short = n - self.pool.num_free
        if short > 0 and self.cache is not None:
            # Evict a little ahead (1/64 of the pool): finding LRU leaves scans the tree, and a pool
            # that runs full would otherwise rescan it for every block a decode step adds.
            for node in self.cache.evict(max(short, self.pool.num_blocks // 64)):
                self.stats.evicted_blocks += 1
                if self.tiers:
                    self._transfers.append(KVTransfer("save", node.block, node.key, node.tokens))
        return self.pool.allocate(n)

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` tokens (rejected speculative slots)."""
        table = self.tables.get(seq_id)
        keep = self.pool.blocks_for(num_tokens)
        if table and len(table) > keep:
            self.pool.release([b for b in table[keep:] if b != NO_BLOCK])
            del table[keep:]

    def free(self, seq_id: str) -> None:
        self._cached_upto.pop(seq_id, None)
        slot = self.states.pop(seq_id, None)
        if slot is not None:
            self._free_states.append(slot)
        blocks = self.tables.pop(seq_id, None)
        if blocks:
            self.pool.release([b for b in blocks if b != NO_BLOCK])

    # -- the prefix cache --------------------------------------------------------------
    def match_prefix(self, seq_id: str, token_ids: Sequence[int], seed: bytes = b"") -> PrefixMatch:
        """Start a sequence with the KV of its longest cached prefix: device blocks are shared,
        tier blocks restored. At least the last token is left to compute (its logits are needed).
        ``seed``: the sequence's namespace (a LoRA adapter's, ``RadixCache.root_for``): no hit across them."""
        m = PrefixMatch()
        if self.cache is None or seq_id in self.tables:
            return m
        limit = len(token_ids) - 1
        path = self.cache.match(token_ids[:limit], seed)
        table = [n.block for n in path]
        for b in table:
            self.pool.share(b)
        self.tables[seq_id] = table
        node = path[-1] if path else self.cache.root_for(seed)
        m.device_tokens = len(table) * self.block_size
        if self.tiers:
            node = self._restore(seq_id, token_ids, limit, node, m)
        m.num_tokens = len(table) * self.block_size
        self._cached_upto[seq_id] = (node, len(table))
        return m

    def share_computing(self, seq_id: str, blocks: Sequence[int], m: PrefixMatch) -> None:
        """Extend a just-matched sequence's table with ``blocks`` that another sequence fills with the
        same tokens in the step being scheduled (none ``NO_BLOCK``); they count as device hits. The
        runner writes every row's K/V in a layer before any row reads the cache, so the sequence's own
        rows in that step see them. (They enter the prefix cache when the step is done, as the other's blocks.)"""
        table = self.tables[seq_id]
        assert NO_BLOCK not in blocks, "sharing a block a window let go of"
        for b in blocks:
            self.pool.share(b)
        table.extend(blocks)
        m.device_tokens += len(blocks) * self.block_size
        m.num_tokens = len(table) * self.block_size

    def _restore(self, seq_id: str, token_ids: Sequence[int], limit: int, node: RadixNode, m: PrefixMatch) -> RadixNode:
        bs, table = self.block_size, self.tables[seq_id]
        keys: list[bytes] = []
        chunks: list[tuple[int, ...]] = []
        key, i = node.key, len(table)
        room = self.num_available_blocks
        while (i + 1) * bs <= limit and len(keys) < room:
            chunks.append(tuple(token_ids[i * bs : (i + 1) * bs]))
            key = chain_hash(key, chunks[-1])
            keys.append(key)
            i += 1
        tiers = self.tiers.find_chain(keys)
        if not tiers:
            return node
        found = list(zip(keys, chunks, tiers))
        copy_s = sum(t.read_seconds(self.block_bytes * n, n) for t, n in Counter(tiers).items())
        prefill_s = self.prefill_seconds(len(table) * bs, len(found) * bs)
        if prefill_s is not None and copy_s >= prefill_s:
            self.stats.restores_skipped += len(found)
            return node
        for (key, tokens, tier), payload in zip(found, self.tiers.fetch(found)):
            if payload is None:  # corrupt or vanished: a miss from here on
                break
            block = self._allocate(1)[0]
            table.append(block)
            node = self.cache.attach(node, tokens, block, key)  # type: ignore[union-attr]
            self._transfers.append(KVTransfer("load", block, key, tokens, payload))
            tier.stats.hits += 1
            tier.stats.bytes_out += len(payload)
            self.stats.offload_bytes_in += len(payload)
            m.tier_tokens[tier.name] = m.tier_tokens.get(tier.name, 0) + bs
        return node

    def record_admission(self, num_prompt_tokens: int, m: PrefixMatch) -> None:
        """Count a lookup once the sequence is actually admitted."""
        self.stats.queries += num_prompt_tokens
        self.stats.hits += m.num_tokens
        self.stats.device_hits += m.device_tokens
        for tier, n in m.tier_tokens.items():
            self.stats.tier_hits[tier] = self.stats.tier_hits.get(tier, 0) + n

    def cache_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed: int, seed: bytes = b"") -> None:
        """Put the sequence's newly filled full blocks into the prefix cache (under namespace ``seed``)."""
        if self.cache is None:
            return
        node, done = self._cached_upto.get(seq_id, (self.cache.root_for(seed), 0))
        full = num_computed // self.block_size
        if full <= done:
            return
        if not self.cache.is_attached(node):  # evicted since: walk again from the root
            node, done = self.cache.root_for(seed), 0
        # stops early at a block a window let go of whose node was evicted: the chain breaks there
        node = self.cache.insert(token_ids[: full * self.block_size], self.tables[seq_id], node, done)
        self._cached_upto[seq_id] = (node, node.depth)
        if self._shared_tiers:  # a tier other replicas read: save each block once it is computed
            new = []
            walk = node
            while walk is not None and walk.parent is not None and len(new) < node.depth - done:
                new.append(walk)
                walk = walk.parent
            for n in reversed(new):
                if not any(t.knows(n.key) for t in self._shared_tiers):
                    self._transfers.append(KVTransfer("save", n.block, n.key, n.tokens))

    def reset(self, fingerprint: bytes | None = None) -> None:
        """Drop the whole prefix cache: a sleep freed the KV it held, or new weights made it stale. With a
        new ``fingerprint`` every tier entry of the old one becomes a miss (chain hashes are seeded with it,
        and the disk and Redis tiers check it), and the host tier, this engine's alone, is emptied.
        No sequence may hold blocks (the engine drains first)."""
        assert not self.tables, "resetting the KV cache under running sequences"
        self._cached_upto.clear()
        self._transfers.clear()
        if self.cache is None:
            return
        self.cache.evict(self.cache.num_nodes)
        if fingerprint is None or fingerprint == self.cache.root.key:
            return
        self.cache.root.key = fingerprint
        for t in self.tiers.tiers:
            if hasattr(t, "fingerprint"):
                t.fingerprint = fingerprint
            else:
                t.clear()

    # -- what the cache holds, for a router ----------------------------------------------
    @property
    def cache_root_key(self) -> bytes:
        """The seed of every block's chain hash (the model fingerprint); b"" without a prefix cache."""
        return self.cache.root.key if self.cache is not None else b""

    def record_events(self) -> None:
        """Start recording the chain hashes the prefix cache stores and removes (``take_events``)."""
        if self.cache is not None and self.cache.events is None:
            self.cache.events = CacheEvents()

    def take_events(self) -> tuple[list[bytes], list[bytes]]:
        """Hashes stored and removed since the last call (both empty unless ``record_events`` was called)."""
        events = self.cache.events if self.cache is not None else None
        return events.take() if events else ([], [])

    # -- transfers -------------------------------------------------------------------------
    @property
    def has_pending_transfers(self) -> bool:
        return bool(self._transfers)

    def take_transfers(self) -> list[KVTransfer]:
        out, self._transfers = self._transfers, []
        return out

    def queue_send(self, block: int, key: bytes, tokens: tuple[int, ...]) -> None:
        """Read a cached block at the next step, for ``on_send`` (before any forward may reuse it)."""
        self._transfers.append(KVTransfer("send", block, key, tokens))

    def complete_saves(self, transfers: Sequence[KVTransfer], payloads: dict[bytes, bytes]) -> None:
        """Store what the runner read for this step's ``save`` transfers into the tiers (``send``: hand it on)."""
        for t in transfers:
            if t.kind == "send" and t.key in payloads and self.on_send is not None:
                self.on_send(t.key, t.tokens, payloads[t.key])
            elif t.kind == "save" and t.key in payloads:
                payload = payloads[t.key]
                self.tiers.put(t.key, t.tokens, payload)
                self.stats.offload_bytes_out += len(payload)

    def check(self) -> None:
        """Assert the block accounting is exact (tests call this after every step)."""
        refs = [0] * self.pool.num_blocks
        for seq_id, table in self.tables.items():
            gone = table.count(NO_BLOCK)
            assert gone == 0 or self.sliding_window is not None, f"{seq_id}: placeholders without a window"
            assert all(b == NO_BLOCK for b in table[:gone]), f"{seq_id}: placeholders not a prefix of its table"
            for b in table[gone:]:
                refs[b] += 1
        cached = set()
        if self.cache is not None:
            for n in self.cache._nodes():
                refs[n.block] += 1
                cached.add(n.block)
        for b in range(self.pool.num_blocks):
            assert refs[b] == self.pool.ref_count(b), f"block {b}: {refs[b]} holders, refcount {self.pool.ref_count(b)}"
            assert self.pool.is_cached(b) == (b in cached), f"block {b}: cached flag wrong"
        evictable = sum(1 for b in cached if self.pool.ref_count(b) == 1)
        assert evictable == self.pool.num_evictable, (evictable, self.pool.num_evictable)
        free = sum(1 for r in refs if r == 0)
        assert free == self.pool.num_free, (free, self.pool.num_free)
        slots = [*self.states.values(), *self._free_states]
        assert len(slots) == len(set(slots)), "a state slot held twice"
        assert set(self.states) <= set(self.tables), "a state slot held by a sequence without blocks"
