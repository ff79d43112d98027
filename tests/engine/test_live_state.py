"""The engine's live state (kvserve/engine/live_state.py): asked for with ReportState, it comes in the
next step message and says which requests run or wait, how far each got, and where the blocks are."""

from conftest import tiny_weights
from kvserve import SamplingParams
from kvserve.engine.messages import AddRequest, ReportState
from kvserve.llm import LLM


def test_report_state_describes_requests_blocks_and_the_prefix_tree():
    cfg, w = tiny_weights()
    llm = LLM.from_weights(cfg, w, dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=2,
                           max_num_batched_tokens=64)
    core = llm.core
    shared = list(range(3, 35))  # 8 blocks every prompt starts with
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i in range(3):
        core.add(AddRequest(f"r{i}", shared + [40 + i] * 6, params))

    core.tree_interval_s = 3600.0  # the tree's summary is reused until it is this old (below: 0)
    msg = core.step()
    assert msg.state is None  # nobody asked
    core.handle(ReportState())
    msg = core.step()
    s = msg.state
    # two slots (max_num_seqs=2): two run, one waits
    assert (s.num_running, s.num_waiting) == (2, 1)
    assert sorted(r.request_id for r in s.running) == ["r0", "r1"] and [r.request_id for r in s.waiting] == ["r2"]
    for r in s.running:
        assert r.num_prompt_tokens == 38 and r.max_output_tokens == 20
        assert r.num_computed_tokens == 38 + r.num_output_tokens - 1  # prefilled, decoding
    b = s.blocks
    assert b.used + b.cached + b.free == b.total == 64 and b.used > 0
    assert s.prefix_tree is not None and s.prefix_tree.num_blocks > 0
    assert core.step().state is None  # one answer per ask
    # asked again: requests and blocks are new, the tree's summary (a walk) is reused while recent
    core.handle(ReportState())
    again = core.step().state
    assert again.prefix_tree is s.prefix_tree and again.running[0].num_output_tokens > s.running[0].num_output_tokens

    core.tree_interval_s = 0.0
    while core.has_work:  # r2 is admitted after r0 and r1 finish, and reuses their shared prefix
        core.step()
    core.handle(ReportState())
    s = core.step().state
    assert s.num_running == s.num_waiting == 0 and s.blocks.used == 0
    (root,) = s.prefix_tree.roots
    assert root.num_tokens == len(shared) and root.hits >= 1 and len(root.children) == 3
