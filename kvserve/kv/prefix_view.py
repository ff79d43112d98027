"""A small picture of the radix prefix cache for people: its largest cached prefixes, bounded in cost.

``summarize`` walks at most ``max_nodes`` nodes of the tree (a tree over a large pool can hold
hundreds of thousands; past the cap the sizes it reports are lower bounds and ``complete`` is
False), then merges each unbranched run of blocks with the same hit count into one
``PrefixSegment`` (a shared system prompt is one segment, not sixty nodes) and keeps the largest
``max_children`` branches per segment, ``max_depth`` levels deep. What is left out is counted, so
the picture still adds up. The live view (``kvserve/server/ui``) draws it as an icicle: width is
cached tokens, a row per level, so a prefix many requests share is one wide bar.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kv.radix_cache import RadixCache, RadixNode

MAX_NODES = 10_000  # nodes walked per summary: ~15 ms here (docs/ui.md); the engine core redoes it once a second
MAX_CHILDREN = 6
MAX_DEPTH = 6


@dataclass
class PrefixSegment:
    """An unbranched run of cached blocks: a prefix's next ``num_tokens`` tokens after ``start_token``."""

    start_token: int  # tokens of the prefix before this segment
    num_tokens: int
    subtree_tokens: int  # cached tokens in this segment and every branch below it
    hits: int  # admissions that reused the segment's first block
    idle_s: float  # since anything in the segment or below was last matched or inserted
    in_use: int  # sequences holding the segment's first block now
    key: str  # the first block's chain hash (hex, shortened): a stable id for drawing
    children: list[PrefixSegment] = field(default_factory=list)
    hidden_branches: int = 0  # branches below left out (smaller ones, or past the depth limit)
    hidden_tokens: int = 0


@dataclass
class PrefixTreeView:
    num_blocks: int  # blocks the tree holds
    block_size: int
    roots: list[PrefixSegment]
    hidden_branches: int = 0
    hidden_tokens: int = 0
    complete: bool = True  # False when the walk stopped at the node cap


def summarize(cache: RadixCache, *, max_nodes: int = MAX_NODES, max_children: int = MAX_CHILDREN,
              max_depth: int = MAX_DEPTH) -> PrefixTreeView:
    """The tree's largest prefixes, as segments (see the module docstring)."""
    bs = cache.block_size
    root = cache.root
    # one capped walk, parents before children; then, children first, each node's subtree block count
    # and latest use (nodes hash by identity)
    order: list[RadixNode] = []
    stack = list(root.children.values())
    while stack and len(order) < max_nodes:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children.values())
    complete = not stack
    size: dict[RadixNode, int] = {}
    latest: dict[RadixNode, float] = {}
    for node in reversed(order):
        n = size.get(node, 0) + 1
        size[node] = n
        t = max(latest.get(node, 0.0), node.last_used)
        latest[node] = t
        parent = node.parent
        if parent is not root:
            size[parent] = size.get(parent, 0) + n
            if latest.get(parent, 0.0) < t:
                latest[parent] = t
    now = cache.clock()

    def visited(nodes: list[RadixNode]) -> list[RadixNode]:
        return sorted((n for n in nodes if n in size), key=lambda n: -size[n])

    def segment(first: RadixNode, level: int) -> PrefixSegment:
        node, length = first, 1
        while True:  # extend through single children with the same hit count
            kids = visited(list(node.children.values()))
            if len(kids) != 1 or kids[0].hits != first.hits:
                break
            node, length = kids[0], length + 1
        seg = PrefixSegment((first.depth - 1) * bs, length * bs, size[first] * bs, first.hits,
                            max(0.0, now - latest[first]), max(0, cache.pool.ref_count(first.block) - 1),
                            first.key.hex()[:8])
        shown = kids[:max_children] if level + 1 < max_depth else []
        seg.children = [segment(k, level + 1) for k in shown]
        seg.hidden_branches = len(kids) - len(shown)
        seg.hidden_tokens = sum(size[k] for k in kids[len(shown):]) * bs
        return seg

    tops = visited(list(cache.root.children.values()))
    shown = tops[:max_children]
    return PrefixTreeView(cache.num_nodes, bs, [segment(n, 0) for n in shown], len(tops) - len(shown),
                          sum(size[n] for n in tops[len(shown):]) * bs, complete)
