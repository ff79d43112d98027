"""Sleep, wake and weight updates through the in-process API (``LLM.sleep``, ``wake_up``,
``update_weights_from_disk``): the same greedy answers after a sleep, the memory let go, the new weights'
own answers after an update with no prefix-cache or tier entry of the old ones reused, and refusals that
keep the served weights."""

from __future__ import annotations

import random

import pytest

from conftest import tiny_hf_model
from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidArgumentError, ModelLoadError, ServiceUnavailableError
from model.test_architectures import word_tokenizer

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ENGINE = dict(dtype="float32", quantization="none", num_threads=1, block_size=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Checkpoints of one shape with other weights (a, b), one layer more (deep), another architecture (qwen2)."""
    root = tmp_path_factory.mktemp("weights")
    for name, kw in {"a": dict(seed=3), "b": dict(seed=4), "deep": dict(seed=3, layers=3),
                     "qwen2": dict(seed=3, bias=True)}.items():
        tiny_hf_model(vocab=97, **kw).save_pretrained(root / name)
        word_tokenizer(97).save_pretrained(root / name)
    return root


def prompt(seed: int, n: int = 33) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 97) for _ in range(n)]


def tokens(llm: LLM, p: list[int]) -> tuple[list[int], int]:
    out = llm.generate([p], GREEDY)[0]
    return out.token_ids, out.num_cached_tokens


def test_sleep_then_wake_gives_the_same_greedy_answers(folders):
    llm = LLM(str(folders / "a"), num_kv_blocks=64, **ENGINE)
    p = prompt(1)
    want, _ = tokens(llm, p)
    runner = llm.engine.runner
    for level in (1, 2):
        llm.sleep(level)
        assert llm.is_sleeping and runner.kv_pool.layers == []  # the KV tensors are gone
        assert (runner.model is None) == (level == 2)  # level 2 drops the weights too
        assert llm.engine.kv.num_cached_blocks == 0  # the prefix cache lost its blocks with them
        with pytest.raises(ServiceUnavailableError, match="asleep"):
            llm.generate([p], GREEDY)
        llm.wake_up()
        assert not llm.is_sleeping and len(runner.kv_pool.layers) == 2
        assert tokens(llm, p) == (want, 0)  # same answer, computed again
        assert tokens(llm, p) == (want, 32)  # and cached again


def test_level_two_needs_weights_from_disk(folders):
    a = LLM(str(folders / "a"), num_kv_blocks=64, **ENGINE)
    in_memory = LLM.from_weights(a.engine.runner.cfg, {k: v for k, v in _checkpoint(folders / "a").items()},
                                 num_kv_blocks=64, **ENGINE)
    with pytest.raises(InvalidArgumentError, match="level 1"):
        in_memory.sleep(2)
    assert not in_memory.is_sleeping and in_memory.engine.runner.kv_pool.layers


def _checkpoint(folder):
    from kvserve.model.loader import load_model

    return load_model(folder).weights


def _fill_tiers(llm: LLM, p: list[int], seed: int) -> None:
    """Run ``p``, then enough other prompts that its blocks leave the device for the tiers."""
    tokens(llm, p)
    rng = random.Random(seed)
    for _ in range(6):
        tokens(llm, [rng.randrange(3, 97) for _ in range(40)])
    assert llm.engine.kv.cache.match_length(p) == 0


def test_an_update_serves_the_new_weights_and_reuses_no_kv_of_the_old(folders, tmp_path):
    p = prompt(2)
    want_b, _ = tokens(LLM(str(folders / "b"), num_kv_blocks=64, **ENGINE), p)
    llm = LLM(str(folders / "a"), num_kv_blocks=24, kv_offload_memory_gb=0.01, kv_offload_dir=str(tmp_path), **ENGINE)
    want_a, _ = tokens(llm, p)
    assert want_a != want_b
    kv = llm.engine.kv
    _fill_tiers(llm, p, 10)
    assert tokens(llm, p) == (want_a, 32) and kv.stats.tier_hits["host"] == 32  # the tiers hold p's blocks
    assert tokens(llm, p) == (want_a, 32)  # and the device has them again
    old_root = kv.cache_root_key
    _fill_tiers(llm, p, 11)  # p's blocks in the host and disk tiers only

    llm.update_weights_from_disk(str(folders / "b"))
    assert kv.cache_root_key != old_root and kv.num_cached_blocks == 0
    assert len(kv.tiers.tiers[0]) == 0  # the host tier held only the old weights' KV
    hits = dict(kv.stats.tier_hits)
    assert tokens(llm, p) == (want_b, 0)  # no device, host or disk hit: computed by the new weights
    assert kv.stats.tier_hits == hits and list(tmp_path.glob("*.kvb"))  # the disk's old entries are there, unread
    assert tokens(llm, p) == (want_b, 32)  # the new weights' own blocks are cached

    llm.update_weights_from_disk(str(folders / "a"))  # back: the old entries are the served weights' again
    assert tokens(llm, p)[0] == want_a


@pytest.mark.parametrize("name, error, match", [
    ("deep", InvalidArgumentError, "model.layers.2.* has shape .* none in the served model"),
    ("qwen2", InvalidArgumentError, "architecture is Qwen2ForCausalLM"),
    ("missing", ModelLoadError, "no such file or folder"),
    (".", ModelLoadError, "no config.json"),
])
def test_a_checkpoint_that_cannot_replace_the_served_one_is_refused(folders, name, error, match):
    llm = LLM(str(folders / "a"), num_kv_blocks=64, **ENGINE)
    p = prompt(3)
    want = tokens(llm, p)[0]
    with pytest.raises(error, match=match):
        llm.update_weights_from_disk(str(folders / name))
    assert tokens(llm, p) == (want, 32)  # the same weights, and their cache kept
