"""The paged attention backend: same outputs and cache writes as gather-sdpa on one step's mixed
rows, the same greedy tokens end to end (chunked prefill, prefix-cache hits, speculative verify
rows, a draft model), and ``auto`` choosing it only where its kernel runs."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import tiny_weights
from kvserve import SamplingParams
from kvserve.attention import KVPool, SeqRows, choose_attention_backend, get_attention_backend
from kvserve.attention.paged import PagedBackend
from kvserve.attention.sdpa import GatherSdpaBackend
from kvserve.errors import InvalidArgumentError
from kvserve.kv.layout import KVLayout
from kvserve.llm import LLM

needs_kernels = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernels():
    from kvserve.kernels import load_kernels

    if not load_kernels():
        pytest.skip("native kernels did not build")


def step_case(dtype=torch.float32, heads=9, kv_heads=3, d=64, bs=16, seed=0):
    """A pool with cached context and one step: decodes (sorted by context), a chunk continuing a
    context, a fresh prefill, a one-token fresh prompt; block tables drawn from a shuffled pool."""
    rng = random.Random(seed)
    layout = KVLayout(1, kv_heads, d, bs, str(dtype).removeprefix("torch."))
    pool = KVPool(layout, num_blocks=200, device=CPU)
    g = torch.Generator().manual_seed(seed)
    for t in pool.layers[0]:
        t[: pool.null_slot] = torch.randn(pool.null_slot, kv_heads, d, generator=g).to(dtype)
    free = list(range(200))
    rng.shuffle(free)
    rows = [(1, 5), (1, 17), (1, 130), (1, 700), (40, 90), (25, 0), (1, 0)]  # (tokens, start)
    seqs = [SeqRows([1] * n, start, [free.pop() for _ in range(-(-(start + n) // bs))]) for n, start in rows]
    t = sum(n for n, _ in rows)
    q = torch.randn(t, heads, d, generator=g).to(dtype)
    k = torch.randn(t, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(t, kv_heads, d, generator=g).to(dtype)
    return pool, seqs, 4, q, k, v


@needs_kernels
@pytest.mark.parametrize("fresh_sdpa", [True, False])
@pytest.mark.parametrize("long_chunk", [30, 1000])  # the 40-token continuing chunk: gathered + SDPA, or the kernel
def test_one_step_matches_gather_sdpa(kernels, fresh_sdpa, long_chunk, monkeypatch):
    import kvserve.attention.paged as paged

    monkeypatch.setattr(PagedBackend, "fresh_prefill_sdpa", fresh_sdpa)
    monkeypatch.setattr(paged, "LONG_CHUNK", long_chunk)
    pool, seqs, nd, q, k, v = step_case()
    results = []
    for cls in (GatherSdpaBackend, PagedBackend):
        layer = tuple(t.clone() for t in pool.layers[0])
        backend = cls(pool, torch.float32)
        out = backend.forward(q, k, v, layer, backend.build_metadata(seqs, nd))
        results.append((out, layer))
    (want, want_kv), (got, got_kv) = results
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(got_kv, want_kv))  # the same slots written


@needs_kernels
def test_one_step_in_bfloat16(kernels):
    pool, seqs, nd, q, k, v = step_case(torch.bfloat16)
    want = GatherSdpaBackend(pool, torch.bfloat16)
    got = PagedBackend(pool, torch.bfloat16)
    layer = pool.layers[0]
    a = want.forward(q, k, v, layer, want.build_metadata(seqs, nd))
    b = got.forward(q, k, v, layer, got.build_metadata(seqs, nd))
    torch.testing.assert_close(b.float(), a.float(), atol=3e-2, rtol=3e-2)


@needs_kernels
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_forward_rows_attends_only_the_rows_asked_for(kernels, dtype, tol):
    """The model's last layer asks for the rows it samples: every row's K/V is still written, and each
    asked row's attention is what the whole step's would have been (a decode; a fresh chunk's last
    row; a verify chunk's last three; a one-token prompt), or nothing at all."""
    pool, seqs, nd, q, k, v = step_case(dtype)
    backend = PagedBackend(pool, dtype)
    meta = backend.build_metadata(seqs, nd)
    full_kv = tuple(t.clone() for t in pool.layers[0])
    full = backend.forward(q, k, v, full_kv, meta)
    # rows: decodes 0-3, the 40-token chunk 4-43, the 25-token prompt 44-68, the one-token prompt 69
    for rows in ([1, 3, 41, 42, 43, 68, 69], [0, 1, 2, 3], [68], []):
        layer = tuple(t.clone() for t in pool.layers[0])
        idx = torch.tensor(rows, dtype=torch.long)
        got = backend.forward_rows(q, k, v, layer, meta, idx)
        assert got.shape == (len(rows), *q.shape[1:])
        torch.testing.assert_close(got.float(), full[idx].float(), atol=tol, rtol=tol)
        assert all(torch.equal(a, b) for a, b in zip(layer, full_kv))  # every row's K/V written


def shared_prefix_case(dtype=torch.float32, heads=9, kv_heads=3, d=64, bs=16, seed=3):
    """Three chunks continuing contexts that begin with the same 6 cached blocks (one cached further
    than the others), a long chunk with its own context, and two decodes; tables otherwise shuffled."""
    rng = random.Random(seed)
    pool = KVPool(KVLayout(1, kv_heads, d, bs, str(dtype).removeprefix("torch.")), num_blocks=120, device=CPU)
    g = torch.Generator().manual_seed(seed)
    for t in pool.layers[0]:
        t[: pool.null_slot] = torch.randn(pool.null_slot, kv_heads, d, generator=g).to(dtype)
    free = list(range(120))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(6)]
    rows = [(1, 40), (1, 300), (40, 100, True), (200, 0, False), (37, 96, True), (70, 130, True), (50, 60, False)]
    seqs = []
    for n, start, *sharing in rows:
        blocks = -(-(start + n) // bs)
        table = (shared + [free.pop() for _ in range(blocks - 6)]) if sharing and sharing[0] else [
            free.pop() for _ in range(blocks)]
        seqs.append(SeqRows([1] * n, start, table))
    t = sum(r[0] for r in rows)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    return pool, seqs, 2, q, k, v


@needs_kernels
@pytest.mark.parametrize("prefill_dtype", [None, torch.bfloat16])
def test_chunks_sharing_a_prefix_attend_it_once(kernels, prefill_dtype, monkeypatch):
    """Cascade attention over a shared cached prefix gives what each chunk's own attention gives."""
    import kvserve.attention.paged as paged

    monkeypatch.setattr(paged, "LONG_CHUNK", 30)  # every continuing chunk here goes to SDPA
    pool, seqs, nd, q, k, v = shared_prefix_case()
    want_backend = GatherSdpaBackend(pool, torch.float32)
    want = want_backend.forward(q, k, v, tuple(t.clone() for t in pool.layers[0]), want_backend.build_metadata(seqs, nd))
    backend = PagedBackend(pool, torch.float32)
    backend.prefill_dtype = prefill_dtype
    meta = backend.build_metadata(seqs, nd)
    groups = sorted((gr.prefix, len(gr.chunks)) for gr in meta.gathered)
    # the three sharing 6 blocks (96 tokens, all before each of their chunks) form one group; the
    # fourth continuing chunk attends alone; the fresh prompt and the decodes are not in a group
    assert groups == [(0, 1), (96, 3)]
    got = backend.forward(q, k, v, tuple(t.clone() for t in pool.layers[0]), meta)
    tol = 2e-2 if prefill_dtype else 1e-5
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


# -- end to end: a tiny random model, greedy, float32 -------------------------------------------
GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)


def tiny():
    return tiny_weights(kv_heads=2)


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 97) for _ in range(21)]  # a prefix the second round finds cached
    own = [[rng.randrange(3, 97) for _ in range(n)] for n in (1, 6, 17, 40, 9)]
    return own + [shared + p for p in own[1:3]] + [shared + [5, 6, 7, 5, 6, 7, 5, 6]]


def generate(backend: str, **kw) -> list[list[int]]:
    cfg, w = tiny()
    llm = LLM.from_weights(cfg, w, dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=24,
                           attention_backend=backend, **kw)
    first = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
    again = [o.token_ids for o in llm.generate(prompts()[::-1], GREEDY)]  # prefix-cache hits, other order
    assert type(llm.engine.runner.attention) is get_attention_backend(backend)
    return first + again


@needs_kernels
@pytest.mark.parametrize("spec", [{}, {"speculative_method": "ngram"}], ids=["plain", "ngram"])
def test_greedy_tokens_equal_gather_sdpa(kernels, spec):
    assert generate("paged", **spec) == generate("gather-sdpa", **spec)


@needs_kernels
def test_draft_model_uses_paged_too(kernels):
    cfg, w = tiny()
    spec = dict(speculative_method="draft", speculative_model="in-memory", draft=(cfg, w))
    assert generate("paged", **spec) == generate("gather-sdpa", **spec)


# -- auto --------------------------------------------------------------------------------------
@needs_kernels
def test_auto_picks_paged_on_cpu_with_a_supported_kv_dtype(kernels):
    assert choose_attention_backend("auto", CPU, torch.float32, torch.float32) is PagedBackend
    assert choose_attention_backend("auto", CPU, torch.bfloat16, torch.bfloat16) is PagedBackend


def test_auto_falls_back_to_gather_sdpa_where_paged_cannot_run():
    gather = GatherSdpaBackend
    assert choose_attention_backend("auto", torch.device("cuda"), torch.bfloat16, torch.bfloat16) is gather
    assert choose_attention_backend("auto", CPU, torch.float32, torch.float16) is gather  # KV stored otherwise
    assert choose_attention_backend("auto", CPU, torch.float16, torch.float16) is gather
    assert choose_attention_backend("gather-sdpa", CPU, torch.float32, torch.float32) is gather


def test_paged_refuses_clearly_where_it_cannot_run():
    pool = KVPool(KVLayout(1, 2, 16, 4, "float16"), num_blocks=2, device=CPU)
    with pytest.raises(InvalidArgumentError, match="paged attention backend cannot run here.*float16") as e:
        PagedBackend(pool, torch.float16)
    assert e.value.param == "attention_backend"


def test_without_kernels_auto_says_gather_sdpa_and_paged_refuses():
    code = ("import logging,torch;logging.basicConfig(level=logging.INFO)\n"
            "from kvserve.attention import KVPool, choose_attention_backend\n"
            "from kvserve.attention.paged import PagedBackend\nfrom kvserve.kv.layout import KVLayout\n"
            "print(choose_attention_backend('auto', torch.device('cpu'), torch.float32, torch.float32).__name__)\n"
            "try:\n PagedBackend(KVPool(KVLayout(1, 2, 16, 4, 'float32'), 2, torch.device('cpu')), torch.float32)\n"
            "except Exception as e:\n print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], env={"KVSERVE_KERNELS": "0", "PATH": ""}, capture_output=True,
                       text=True, timeout=120)
    assert r.stdout.splitlines()[0] == "GatherSdpaBackend", r.stderr
    assert "native kernels are not available" in r.stdout
    assert "attention backend: gather-sdpa (auto: the native kernels are not available" in r.stderr


@needs_kernels
@pytest.mark.parametrize("case", [step_case, shared_prefix_case])
def test_bf16_prompt_chunks_go_to_flash_prefill_and_match_sdpa(kernels, case, monkeypatch):
    """Over a bf16 cache with bf16 prefill (AMX), the prompt chunks (fresh, and continuing a context
    past BF16_LONG_CHUNK) go to flash_prefill; decodes and short chunks stay with the paged kernel;
    the outputs are the SDPA path's within bf16 rounding."""
    import kvserve.attention.paged as paged

    if not torch.ops.kvserve.flash_prefill_available():
        pytest.skip("flash_prefill needs AMX")
    pool, seqs, nd, q, k, v = case(torch.bfloat16)
    outs = []
    for flash in (False, True):
        monkeypatch.setattr(paged, "FLASH_PREFILL", flash)
        backend = PagedBackend(pool, torch.bfloat16)
        backend.prefill_dtype = torch.bfloat16
        backend.warm_up(q.shape[1])  # its own dummy cache: the pool is left as it was
        meta = backend.build_metadata(seqs, nd)
        layer = tuple(t.clone() for t in pool.layers[0])
        if flash:
            assert backend.flash_prefill() and not meta.fresh and not meta.gathered
            chunks = [(s.start, len(s.tokens)) for s in seqs if len(s.tokens) > 1 and (
                s.start == 0 or len(s.tokens) > paged.BF16_LONG_CHUNK)]
            assert [(e - n, n) for _, n, e, _ in meta.flash_info.tolist()] == chunks
            assert backend.native_step(meta) is None
        outs.append(backend.forward(q, k, v, layer, meta))
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=3e-2, rtol=3e-2)
