"""LoRA in the engine: the prefix cache never hits across adapters (nor between an adapter and the base model)
and hits within one; adapters loaded, unloaded and evicted while requests run lose none of them."""

from __future__ import annotations

import pytest

from conftest import check_every_step
from kvserve import SamplingParams
from lora_utils import write_adapter
from model.test_architectures import checkpoint, make_llm, prompts

pytest.importorskip("peft")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, folder = checkpoint("LlamaForCausalLM", tmp_path_factory)
    paths = {}
    for i, n in enumerate("abc"):
        paths[n] = tmp_path_factory.mktemp(f"eng-{n}")
        write_adapter(model, paths[n], seed=30 + i)
    return folder, paths


def test_no_prefix_hit_across_adapters(setup):
    folder, paths = setup
    llm = make_llm(folder, enable_lora=True, block_size=4)
    check_every_step(llm)
    for n in "ab":
        llm.load_lora_adapter(n, str(paths[n]))
    prompt = list(range(3, 40))
    cached = []
    for name in ["a", "b", None, "a", "b", None]:
        out = llm.generate([prompt], GREEDY, lora=name)[0]
        cached.append(out.num_cached_tokens)
    assert cached[:3] == [0, 0, 0]  # each namespace computes the prompt once
    assert all(c >= 32 for c in cached[3:])  # and then hits its own blocks
    alone = make_llm(folder, enable_lora=True, block_size=4, enable_prefix_caching=False)
    alone.load_lora_adapter("b", str(paths["b"]))
    want = alone.generate([prompt], GREEDY, lora="b")[0].token_ids
    assert llm.generate([prompt], GREEDY, lora="b")[0].token_ids == want  # a hit gives what a full prefill gives


def test_load_unload_evict_under_load(setup):
    """Requests of an adapter unloaded mid-run finish on its weights; a CPU LRU of one adapter re-reads the
    others as they are needed; every request finishes with the tokens it gets alone."""
    folder, paths = setup
    llm = make_llm(folder, enable_lora=True, max_loras=2, max_cpu_loras=2, block_size=4)
    check_every_step(llm)
    for n in "ab":
        llm.load_lora_adapter(n, str(paths[n]))
    ps = prompts()
    alone = {n: [o.token_ids for o in llm.generate(ps, GREEDY, lora=n)] for n in "ab"}
    from kvserve.text.output import OutputProcessor

    processor, ids = OutputProcessor(None), []
    names = ["a", "b"] * len(ps)
    for k, name in enumerate(names):
        rid = llm._add(processor, ps[k // 2], GREEDY, name)
        ids.append(rid)
    finals, steps = {}, 0
    while llm._busy():
        for out in llm._step(processor):
            if out.finished:
                finals[out.request_id] = out.token_ids
        steps += 1
        if steps == 2:
            llm.unload_lora_adapter("a")  # its requests keep running
            llm.load_lora_adapter("c", str(paths["c"]))  # over the LRU's bound: one is dropped, read again on use
    assert [finals[r] for r in ids] == [alone[n][k // 2] for k, n in enumerate(names)]
    assert "a" not in llm.engine.runner.lora.names
    with pytest.raises(Exception, match="'a' does not exist"):
        llm.generate(ps[:1], GREEDY, lora="a")


def test_dfs_weight_order_keeps_every_adapter_request(setup):
    """dfs-weight walks the prefix tree from every namespace's root: no waiting request of an adapter is lost."""
    folder, paths = setup
    llm = make_llm(folder, enable_lora=True, block_size=4, schedule_policy="dfs-weight", max_num_seqs=2)
    llm.load_lora_adapter("a", str(paths["a"]))
    shared = list(range(3, 20))
    ps = [shared + [30 + i] for i in range(6)]
    names = ["a", None] * 3
    out = llm.generate(ps, GREEDY, lora=names)
    assert [o.token_ids for o in out] == [llm.generate([p], GREEDY, lora=n)[0].token_ids for p, n in zip(ps, names)]


def test_lora_flags():
    from kvserve.cli import build_parser
    from kvserve.config import KVServeConfig
    from kvserve.errors import InvalidArgumentError

    args = build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a=/x", "b=/y", "--max-loras", "2",
                                      "--max-lora-rank", "16", "--max-cpu-loras", "3", "--lora-dir", "/adapters"])
    config = KVServeConfig.from_cli_args(args)
    assert config.lora.lora_modules == ["a=/x", "b=/y"] and config.lora.cpu_loras == 3
    assert KVServeConfig.from_cli_args(build_parser().parse_args(["serve", *config.to_cli_args()])) == config
    for bad, why in ((dict(enable_lora=True, lora_modules=["a"]), "name=path"),
                     (dict(enable_lora=True, lora_modules=["a=/x", "a=/y"]), "twice"),
                     (dict(lora_modules=["a=/x"]), "need --enable-lora"),
                     (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "at least --max-loras"),
                     (dict(enable_lora=True, max_lora_rank=0), "max-lora-rank")):
        with pytest.raises(InvalidArgumentError, match=why):
            KVServeConfig.from_kwargs(**bad)


def test_tier_entries_are_keyed_by_adapter(setup):
    """Blocks evicted to the host tier come back for their adapter only."""
    folder, paths = setup
    llm = make_llm(folder, enable_lora=True, block_size=4, num_kv_blocks=24, kv_offload_memory_gb=0.01)
    check_every_step(llm)
    for n in "ab":
        llm.load_lora_adapter(n, str(paths[n]))
    prompt = list(range(3, 40))
    llm.generate([prompt], GREEDY, lora="a")
    for i in range(4):  # other prompts push the adapter's blocks out of the device cache, into the tier
        llm.generate([[50 + i] * 37], GREEDY)
    assert llm.engine.kv.stats.evicted_blocks > 0
    assert llm.generate([prompt], GREEDY, lora="b")[0].num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0
    before = llm.engine.kv.stats.tier_hits["host"]
    assert llm.generate([prompt], GREEDY, lora="a")[0].num_cached_tokens >= 32
    assert llm.engine.kv.stats.tier_hits["host"] > before


def test_adapters_follow_new_base_weights(setup, tmp_path):
    """After update_weights_from_disk the adapters apply to the new base model: an adapter's answer equals a
    fresh engine's on the new weights with the same adapter."""
    import torch

    folder, paths = setup
    model, _ = checkpoint("LlamaForCausalLM", None)
    with torch.no_grad():
        for p in model.parameters():  # other weights of the same shapes
            p.mul_(-1.5)
    newer = tmp_path / "newer"
    model.save_pretrained(newer)
    with torch.no_grad():
        for p in model.parameters():
            p.div_(-1.5)
    for f in folder.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (newer / f.name).write_bytes(f.read_bytes())
    prompt = list(range(3, 30))
    llm = make_llm(folder, enable_lora=True, block_size=4)
    llm.load_lora_adapter("a", str(paths["a"]))
    before = llm.generate([prompt], GREEDY, lora="a")[0].token_ids
    llm.update_weights_from_disk(str(newer))
    after = llm.generate([prompt], GREEDY, lora="a")[0].token_ids
    fresh = make_llm(newer, enable_lora=True, block_size=4)
    fresh.load_lora_adapter("a", str(paths["a"]))
    assert after == fresh.generate([prompt], GREEDY, lora="a")[0].token_ids
    assert after != before
    assert after != fresh.generate([prompt], GREEDY)[0].token_ids  # the adapter still changes the answer


def test_an_adapter_whose_folder_vanished_fails_only_its_new_requests(setup, tmp_path):
    """Adapter weights dropped from memory (an LRU of one) and their folder removed: a new request for that
    adapter is refused with the reason, every other request runs on, and the engine serves after it. Requests
    already admitted keep their adapter's weights in memory until they finish, folder or not."""
    import shutil

    from kvserve.errors import InvalidArgumentError
    from kvserve.text.output import OutputProcessor

    folder, paths = setup
    gone = tmp_path / "a"
    shutil.copytree(paths["a"], gone)
    llm = make_llm(folder, enable_lora=True, max_loras=1, max_cpu_loras=1, block_size=4)
    llm.load_lora_adapter("a", str(gone))
    llm.load_lora_adapter("b", str(paths["b"]))
    ps = prompts()
    alone = {n: [o.token_ids for o in llm.generate(ps[:2], GREEDY, lora=n)] for n in ("a", "b", None)}
    # admitted with a's weights in memory, then the folder goes while b's requests compete for the one CPU copy
    processor = OutputProcessor(None)
    ids = [llm._add(processor, p, GREEDY, n) for n in ("a", "b", None) for p in ps[:2]]
    shutil.rmtree(gone)
    finals = {}
    while llm._busy():
        for out in llm._step(processor):
            if out.finished:
                finals[out.request_id] = out.token_ids
    assert [finals[r] for r in ids] == alone["a"] + alone["b"] + alone[None]
    llm.generate(ps[:1], GREEDY, lora="b")  # b's weights in, a's dropped: a now needs its folder
    with pytest.raises(InvalidArgumentError, match="adapter_config.json|no such|not a folder|does not exist"):
        llm.generate(ps[:1], GREEDY, lora="a")
    assert [o.token_ids for o in llm.generate(ps[:2], GREEDY, lora="b")] == alone["b"]
    assert [o.token_ids for o in llm.generate(ps[:2], GREEDY)] == alone[None]
