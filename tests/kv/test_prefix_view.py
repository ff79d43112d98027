"""The prefix tree's summary for the live view (kvserve/kv/prefix_view.py): shared prefixes merged
into one segment with their hits, branches largest first, what is left out counted, the walk capped."""

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.prefix_view import summarize
from kvserve.kv.radix_cache import RadixCache

BS = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def cache_with(prompts: list[list[int]], clock: FakeClock | None = None) -> RadixCache:
    """A tree holding each prompt's full blocks, inserted the way the KV manager does: matched first
    (a hit on what is already cached), then its blocks inserted."""
    pool = BlockPool(256, BS)
    cache = RadixCache(pool)
    if clock is not None:
        cache.clock = clock
    for p in prompts:
        cache.match(p)
        blocks = pool.allocate(len(p) // BS)
        cache.insert(p, blocks)
        pool.release(blocks)  # the request finished: the tree alone holds them
    return cache


def test_a_shared_prefix_is_one_segment_with_its_hits_and_branches_below_it():
    system = list(range(100, 132))  # 8 blocks every prompt starts with
    prompts = [system + [i] * 4 * (i + 1) for i in range(1, 4)]  # then 2, 3, 4 blocks of their own
    view = summarize(cache_with(prompts))
    assert view.num_blocks == 8 + 2 + 3 + 4 and view.complete
    (root,) = view.roots
    # the shared blocks merge into one segment; two later prompts reused it
    assert (root.start_token, root.num_tokens, root.hits) == (0, 32, 2)
    assert root.subtree_tokens == view.num_blocks * BS
    # the three tails, largest first, each one segment starting where the shared part ends
    assert [(c.start_token, c.num_tokens, c.hits) for c in root.children] == [(32, 16, 0), (32, 12, 0), (32, 8, 0)]
    assert root.in_use == 0


def test_branches_past_the_limits_are_counted_not_lost():
    prompts = [[i] * BS * (1 + i % 3) for i in range(1, 11)]  # ten unrelated prompts
    view = summarize(cache_with(prompts), max_children=4)
    assert len(view.roots) == 4 and view.hidden_branches == 6
    drawn = sum(r.subtree_tokens for r in view.roots)
    assert drawn + view.hidden_tokens == view.num_blocks * BS
    assert [r.subtree_tokens for r in view.roots] == sorted((r.subtree_tokens for r in view.roots), reverse=True)

    deep = [[1] * BS + [k] * BS * 3 + [j] * BS for k in (2, 3) for j in (4, 5)]
    view = summarize(cache_with(deep), max_depth=1)
    (root,) = view.roots
    assert root.children == [] and root.hidden_branches == 2 and root.hidden_tokens == root.subtree_tokens - root.num_tokens


def test_in_use_and_idle_time_come_from_the_tree():
    clock = FakeClock()
    cache = cache_with([[7] * BS * 2], clock)
    held = [n.block for n in cache.match([7] * BS * 2)]  # a request holding the prefix now
    for b in held:
        cache.pool.share(b)
    clock.now += 30
    (root,) = summarize(cache).roots
    assert root.in_use == 1 and root.hits == 1 and root.idle_s == 30.0


def test_the_walk_stops_at_its_cap():
    prompts = [[i] * BS * 5 for i in range(1, 21)]  # 100 nodes
    view = summarize(cache_with(prompts), max_nodes=30)
    assert not view.complete
    assert sum(r.subtree_tokens for r in view.roots) + view.hidden_tokens == 30 * BS
