"""The radix prefix cache: a tree over token ids whose nodes own full KV blocks.

Each node is one full block of ``block_size`` tokens under its parent, so a path from the
root spells a prefix and lists the blocks holding its KV. A request that starts with that
prefix shares those blocks instead of computing them again (matching is at block
granularity; with ``--block-size 1`` it is token-exact).

Locking is the block pool's reference count: the tree holds one reference on each of its
blocks and every request using a block holds another, so a block whose count is 1 is held
by the tree alone and may be evicted. Eviction is LRU, leaves first; dropping a node drops
its subtree, whose in-use blocks simply stay with their requests.

Every node also carries a chain hash of its whole prefix (and of the model fingerprint),
the key under which evicted blocks are kept by the host and disk tiers, and the name under which
the cache reports what it stores and drops (``events``, for a router's view of the replica).
"""

from __future__ import annotations

import hashlib
import heapq
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvserve.kv.block_pool import NO_BLOCK, BlockPool
from kvserve.kv.events import CacheEvents


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block: its tokens and, through ``parent``, every token before them."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


@dataclass(eq=False)
class RadixNode:
    tokens: tuple[int, ...]
    block: int
    key: bytes
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    last_access: int = 0
    depth: int = 0  # blocks from the root, this one included
    hits: int = 0  # admissions that reused this block (for the live view: kv/prefix_view.py)
    last_used: float = 0.0  # the cache's clock when it was last matched or inserted


@dataclass
class RadixStats:
    inserted_blocks: int = 0
    evicted_blocks: int = 0  # blocks returned to the free list by eviction


class RadixCache:
    def __init__(self, pool: BlockPool, root_key: bytes = b""):
        self.pool = pool
        self.block_size = pool.block_size
        self.root = RadixNode((), -1, root_key, None)
        # other namespaces (a LoRA adapter's), each a tree of its own under a root keyed by its seed
        self._roots: dict[bytes, RadixNode] = {}
        self._clock = 0
        self.num_nodes = 0
        self.stats = RadixStats()
        self.events: CacheEvents | None = None  # set to record what is stored and removed
        self.clock: Callable[[], float] = time.monotonic  # stamps last_used (the engine sets its own)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _blocks_of(self, token_ids: Sequence[int]) -> Iterator[tuple[int, ...]]:
        bs = self.block_size
        for i in range(len(token_ids) // bs):
            yield tuple(token_ids[i * bs : (i + 1) * bs])

    def root_for(self, seed: bytes = b"") -> RadixNode:
        """The root of namespace ``seed`` (b"": the base model's): its blocks' chain hashes start from it."""
        if not seed:
            return self.root
        if seed not in self._roots:
            self._roots[seed] = RadixNode((), -1, seed, None)
        return self._roots[seed]

    def roots(self) -> list[RadixNode]:
        return [self.root, *self._roots.values()]

    # -- lookup ------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int], seed: bytes = b"") -> list[RadixNode]:
        """The nodes of the longest cached block-prefix of ``token_ids`` (marked as just used)."""
        path: list[RadixNode] = []
        node = self.root_for(seed)
        now, when = self._tick(), self.clock()
        for tokens in self._blocks_of(token_ids):
            child = node.children.get(tokens)
            if child is None:
                break
            child.last_access, child.last_used = now, when
            child.hits += 1
            path.append(child)
            node = child
        return path

    def match_length(self, token_ids: Sequence[int], seed: bytes = b"") -> int:
        """Cached tokens at the start of ``token_ids``, without touching recency (for ordering)."""
        node, n = self._roots.get(seed) if seed else self.root, 0
        if node is None:  # a namespace with nothing cached yet
            return 0
        for tokens in self._blocks_of(token_ids):
            node = node.children.get(tokens)  # type: ignore[assignment]
            if node is None:
                break
            n += self.block_size
        return n

    def deepest(self, token_ids: Sequence[int], seed: bytes = b"") -> RadixNode:
        """The last node on the cached path of ``token_ids`` (the root when nothing matches)."""
        node = self.root_for(seed)
        for tokens in self._blocks_of(token_ids):
            child = node.children.get(tokens)
            if child is None:
                break
            node = child
        return node

    # -- insertion ---------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], blocks: Sequence[int], start_node: RadixNode | None = None,
               start_block: int = 0) -> RadixNode:
        """Cache the full blocks of ``token_ids`` whose KV is in ``blocks`` (a request's table).

        Walks from ``start_node`` (the node of block ``start_block - 1``; the root for 0) so a
        growing request inserts only its new blocks. Where the tree already has a block for the
        same tokens (another request computed them first) the tree keeps its own. A ``NO_BLOCK`` the
        tree has no node for (a window let go of it after its node was evicted) ends the walk: no
        block after it can be reached. Returns the deepest node, for the next call.
        """
        node = start_node or self.root
        now, when = self._tick(), self.clock()
        bs = self.block_size
        for i in range(start_block, len(token_ids) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            child = node.children.get(tokens)
            if child is None:
                if blocks[i] == NO_BLOCK:
                    break
                child = RadixNode(tokens, blocks[i], chain_hash(node.key, tokens), node, depth=node.depth + 1)
                node.children[tokens] = child
                self.pool.share(blocks[i])
                self.pool.mark_cached(blocks[i], True)
                self.num_nodes += 1
                self.stats.inserted_blocks += 1
                if self.events is not None:
                    self.events.stored(child.key)
            child.last_access, child.last_used = now, when
            node = child
        return node

    def attach(self, parent: RadixNode, tokens: tuple[int, ...], block: int, key: bytes) -> RadixNode:
        """Add a node for a block restored from a lower tier (the caller holds ``block``)."""
        child = RadixNode(tokens, block, key, parent, last_access=self._tick(), depth=parent.depth + 1,
                          last_used=self.clock())
        parent.children[tokens] = child
        self.pool.share(block)
        self.pool.mark_cached(block, True)
        self.num_nodes += 1
        self.stats.inserted_blocks += 1
        if self.events is not None:
            self.events.stored(key)
        return child

    def is_attached(self, node: RadixNode) -> bool:
        """False once the node (or an ancestor) was evicted."""
        while node.parent is not None:
            if node.parent.children.get(node.tokens) is not node:
                return False
            node = node.parent
        return node is self.root or self._roots.get(node.key) is node

    # -- eviction ----------------------------------------------------------------------
    def evict(self, num_blocks: int) -> list[RadixNode]:
        """Free at least ``num_blocks`` blocks held by the tree alone, least recently used leaves
        first. Returns the nodes whose blocks went back to the free list (for the offload tiers)."""
        freed: list[RadixNode] = []
        if num_blocks <= 0:
            return freed
        # Candidates: tree-only blocks, leaves before inner nodes, oldest first, then deepest first
        # (a path inserted at once shares one access time); block ids make the order deterministic.
        heap = [(bool(n.children), n.last_access, -n.depth, n.block, n) for n in self._nodes()
                if self.pool.ref_count(n.block) == 1]
        heapq.heapify(heap)
        while heap and len(freed) < num_blocks:
            *_, node = heapq.heappop(heap)
            if not self.is_attached(node) or self.pool.ref_count(node.block) != 1:
                continue
            freed.extend(self._drop(node))
        return freed

    def _drop(self, node: RadixNode) -> list[RadixNode]:
        """Remove ``node`` and its subtree; return the nodes whose blocks became free."""
        assert node.parent is not None
        del node.parent.children[node.tokens]
        freed: list[RadixNode] = []
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            self.pool.mark_cached(n.block, False)
            if self.pool.ref_count(n.block) == 1:
                freed.append(n)
            self.pool.release([n.block])
            self.num_nodes -= 1
            if self.events is not None:
                self.events.removed(n.key)
        self.stats.evicted_blocks += len(freed)
        return freed

    def keys(self) -> list[bytes]:
        """The chain hashes of every cached block."""
        return [n.key for n in self._nodes()]

    def _nodes(self) -> Iterator[RadixNode]:
        stack = [n for root in self.roots() for n in root.children.values()]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
