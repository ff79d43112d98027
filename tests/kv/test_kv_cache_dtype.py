"""8-bit KV cache (``--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2 | int8``) on tiny random models:
the memory it saves, the quantization's error bounds, attention against a reference computed from
the dequantized cache, tier payloads that carry their scales, fingerprints, start-up calibration,
what the log, /metrics and the simulator report, and clear errors for bad values."""

from __future__ import annotations

import logging
import math
import subprocess
import sys

import pytest
import torch

from conftest import onednn_packs_bf16, tiny_weights
from kvserve.attention import SeqRows, get_attention_backend, get_kv_pool
from kvserve.config import CacheConfig
from kvserve.errors import InvalidArgumentError
from kvserve.kv.layout import KVLayout
from kvserve.runner.torch_runner import TorchRunner

EIGHT_BIT = ["fp8", "fp8_e5m2", "int8"]
CPU = torch.device("cpu")


def _runner(kv: str, dtype: torch.dtype = torch.float32, **cache) -> TorchRunner:
    cfg, weights = tiny_weights()
    cache.setdefault("num_kv_blocks", 64)
    return TorchRunner(cfg, weights, CacheConfig(kv_cache_dtype=kv, **cache), dtype=dtype)


def _pool(kv: str, num_blocks: int = 16, heads: int = 2, d: int = 16, bs: int = 4):
    cls = get_kv_pool(kv)
    return cls(cls.layout_for(_cfg(heads, d), torch.float32, bs), num_blocks, CPU)


def _cfg(heads: int, d: int):
    cfg, _ = tiny_weights()
    from dataclasses import replace

    return replace(cfg, num_key_value_heads=heads, head_dim=d, num_attention_heads=2 * heads, num_hidden_layers=1)


@pytest.mark.parametrize("model_dtype,ratio", [(torch.float32, 4), (torch.bfloat16, 2)])
@pytest.mark.parametrize("kv", EIGHT_BIT)
def test_the_same_memory_holds_at_least_1_9x_the_blocks(kv, model_dtype, ratio):
    full = _runner("auto", model_dtype, num_kv_blocks=None, kv_cache_memory_gb=0.01)
    eight = _runner(kv, model_dtype, num_kv_blocks=None, kv_cache_memory_gb=0.01)
    assert eight.num_kv_blocks >= 1.9 * full.num_kv_blocks
    assert eight.kv_bytes_per_token * ratio == full.kv_bytes_per_token
    k, v = eight.kv_pool.layers[0]
    assert k.element_size() == v.element_size() == 1 and k.shape[0] == (eight.num_kv_blocks + 1) * eight.block_size


def test_the_simulator_counts_the_same_bytes_per_token():
    from kvserve.sim.models import ModelSpec
    from kvserve.sim.profiles import get_profile

    cfg, _ = tiny_weights()
    spec = ModelSpec.from_hf_config({"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
                                     "num_attention_heads": cfg.num_attention_heads,
                                     "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                                     "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size})
    for kv in EIGHT_BIT:
        assert spec.kv_bytes_per_token(kv) == _runner(kv).kv_bytes_per_token
    assert spec.kv_bytes_per_token("fp32") == _runner("auto").kv_bytes_per_token
    assert get_profile("vllm").with_(kv="fp8").to_config().cache.kv_cache_dtype == "fp8"


@pytest.mark.parametrize("kv", EIGHT_BIT)
def test_quantize_round_trip_error_is_bounded(kv):
    pool = _pool(kv)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 2, 16, generator=g) * torch.tensor([0.5, 8.0])[:, None]  # heads of unlike magnitude
    pool.set_scales(x.abs().amax(0)[None], x.abs().amax(0)[None], headroom=1.0)
    scale = pool.k_scales[0]
    amax = x.abs().amax(0) if kv == "int8" else x.abs().amax((0, 2))[:, None].expand(2, 16)  # per channel / head
    assert torch.all(scale * pool.qmax >= amax) and torch.allclose(scale * pool.qmax, amax, rtol=2 ** -6)
    back = pool.dequantize(pool.quantize(x, scale), scale, torch.float32)
    err = (back - x).abs()
    if kv == "int8":  # half a step
        assert torch.all(err <= scale / 2 * (1 + 1e-5))
    else:  # half an ulp: 3 (e4m3) or 2 (e5m2) mantissa bits, plus the subnormals' absolute step
        mantissa = 3 if kv == "fp8" else 2
        tiny = torch.finfo(pool.storage).smallest_normal * 2.0 ** -mantissa
        assert torch.all(err <= x.abs() * 2.0 ** -(mantissa + 1) + tiny * scale / 2 + 1e-7)
    big = pool.dequantize(pool.quantize(x * 100, scale), scale, torch.float32)  # saturates, never inf or NaN
    assert torch.all(big.abs() <= pool.qmax * scale * (1 + 1e-6)) and torch.isfinite(big).all()


def _fill(pool, g: torch.Generator) -> None:
    """Scales, then random K/V in every slot of layer 0, written through the pool."""
    layer = pool.layers[0]
    n, (h, d) = pool.null_slot, layer[0].shape[1:]
    if pool.quantized:
        pool.set_scales(torch.rand(1, h, d, generator=g) + 0.5, torch.rand(1, h, d, generator=g) + 0.5)
    pool.store(layer, torch.arange(n), torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g))


def _reference(q, pool, seqs, scale) -> torch.Tensor:
    """Causal attention of each sequence's rows over its K/V as the pool gives them back."""
    out = torch.empty_like(q)
    row, bs = 0, pool.block_size
    for s in seqs:
        slots = torch.tensor([s.block_table[p // bs] * bs + p % bs for p in range(s.end)])
        k, v = pool.gather(pool.layers[0], slots, torch.float32)
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        for i in range(len(s.tokens)):
            pos = s.start + i
            w = torch.softmax(torch.einsum("hd,khd->hk", q[row + i], k[: pos + 1]) * scale, dim=-1)
            out[row + i] = torch.einsum("hk,khd->hd", w, v[: pos + 1])
        row += len(s.tokens)
    return out


@pytest.mark.parametrize("backend", ["gather-sdpa", "paged"])
@pytest.mark.parametrize("kv", EIGHT_BIT + ["bfloat16"])  # bfloat16: a float32 model over a bf16 cache
def test_attention_equals_a_reference_over_the_dequantized_cache(kv, backend):
    if backend == "paged":
        from kvserve.kernels import load_kernels

        if not load_kernels():
            pytest.skip("native kernels did not build")
    pool = _pool(kv, num_blocks=128, heads=2, d=16)
    g = torch.Generator().manual_seed(1)
    _fill(pool, g)
    b = get_attention_backend(backend)(pool, torch.float32)
    perm = torch.randperm(128, generator=g).tolist()
    # decodes over ragged contexts (the longest split along its keys), a chunk continuing a context,
    # a long chunk continuing one (gathered for SDPA), and a fresh prompt (its own K/V, as stored)
    shapes = [(1, 3), (1, 40), (1, 130), (6, 20), (140, 10), (9, 0)]
    seqs = [SeqRows([0] * n, start, [perm.pop() for _ in range(-(-(start + n) // 4))]) for n, start in shapes]
    t = sum(n for n, _ in shapes)
    q, k, v = (torch.randn(t, h, 16, generator=g) for h in (4, 2, 2))
    out = b.forward(q, k, v, pool.layers[0], b.build_metadata(seqs, 3))
    assert torch.allclose(out, _reference(q, pool, seqs, 16 ** -0.5), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv", EIGHT_BIT)
def test_a_tier_payload_carries_its_scales(kv):
    g = torch.Generator().manual_seed(2)
    a, same, other = _pool(kv), _pool(kv), _pool(kv)
    _fill(a, g)
    same.set_scales(a.k_scales * a.qmax, a.v_scales * a.qmax, headroom=1.0)
    other.set_scales(a.k_scales * a.qmax * 1.5, a.v_scales * a.qmax * 1.25, headroom=1.0)
    payload = a.read_block(3)
    per = 16 if kv == "int8" else 1  # scales per head: one per channel, or one
    assert len(payload) == a.block_bytes == a.layout.block_bytes + 2 * 2 * per * 2  # + bfloat16 K, V scales
    slots_a, slots_b = torch.arange(12, 16), torch.arange(20, 24)  # blocks 3 and 5
    same.write_block(5, payload)  # the same scales: the bytes as they were
    assert torch.equal(same.layers[0][0].view(torch.uint8)[slots_b], a.layers[0][0].view(torch.uint8)[slots_a])
    other.write_block(5, payload)  # other scales: requantized, never misread
    want = a.gather(a.layers[0], slots_a, torch.float32)
    got = other.gather(other.layers[0], slots_b, torch.float32)
    for w, x, s in zip(want, got, (other.k_scales[0], other.v_scales[0])):
        if kv == "int8":
            assert torch.all((w - x).abs() <= s / 2 * (1 + 1e-5))
        else:
            assert torch.allclose(w, x, rtol=0.13, atol=1e-3)


def test_auto_stores_bf16_where_prefill_attends_in_bf16(monkeypatch, caplog):
    """On an AMX CPU a quantized float32 model prefills in bf16, and ``auto`` then stores K/V in
    bf16 (half the bytes); elsewhere, or with KVSERVE_AMX=0, ``auto`` keeps the model's dtype."""
    import kvserve.model.quant_linear as ql

    cfg, weights = tiny_weights()
    amx_cases = [(True, torch.bfloat16)] if onednn_packs_bf16() else []
    for amx, want in amx_cases + [(False, torch.float32)]:
        monkeypatch.setattr(ql, "amx_gemm_available", lambda amx=amx: amx)
        with caplog.at_level(logging.INFO, logger="kvserve.runner.torch_runner"):
            r = TorchRunner(cfg, weights, CacheConfig(num_kv_blocks=16), dtype=torch.float32, quantization="int8")
        assert r.kv_pool.dtype == want and r.kv_bytes_per_token == (2 if amx else 4) * 2 * cfg.num_hidden_layers * \
            cfg.num_key_value_heads * cfg.head_dim
        assert r.attention.prefill_dtype == (torch.bfloat16 if amx else None)
        assert ("KV cache dtype auto: bfloat16" in caplog.text) == amx
        caplog.clear()
    dense = TorchRunner(cfg, weights, CacheConfig(num_kv_blocks=16, kv_cache_dtype="bfloat16"), dtype=torch.float32)
    assert dense.kv_pool.dtype == torch.bfloat16  # asked for: any float32 model


def test_fingerprints_tell_kv_dtypes_apart():
    prints = {kv: _runner(kv).kv_fingerprint for kv in ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"]}
    assert prints["fp8"] == prints["fp8_e4m3"]
    assert len({prints[kv] for kv in ["auto", "fp8", "fp8_e5m2", "int8"]}) == 4


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_calibration_gives_the_same_scales_on_every_start(kv):
    a, b = _runner(kv), _runner(kv)
    assert torch.equal(a.kv_pool.k_scales, b.kv_pool.k_scales) and torch.equal(a.kv_pool.v_scales, b.kv_pool.v_scales)
    ks = a.kv_pool.k_scales
    assert torch.all(ks > 0)
    if kv == "fp8":  # one per (layer, head)
        assert torch.all(ks == ks[..., :1]) and len(set(ks[..., 0].flatten().tolist())) == ks.shape[0] * ks.shape[1]
    else:  # one per channel, a rotary pair's two channels alike
        half = ks.shape[-1] // 2
        assert torch.equal(ks[..., :half], ks[..., half:]) and len(set(ks[0, 0].tolist())) > 1


@pytest.mark.parametrize("kv,bound,agree", [("fp8", 0.25, 0.75), ("fp8_e5m2", 0.5, 0.55), ("int8", 0.12, 0.9)])
def test_tiny_model_next_token_logprobs_stay_close_to_full_precision(kv, bound, agree):
    """Mean |log p - log p_ref| and top-1 agreement over 96 positions (every key read as stored); measured
    fp8 0.125 (0.844), fp8_e5m2 0.261 (0.688), int8 0.059 (0.969): random weights of std 0.2 amplify
    any perturbation (the embedded model's figures are in tests/model/test_kv8_accuracy.py)."""
    from kvserve.bench.perplexity import sequence_logits

    ids = [(i * 37 + 11) % 97 for i in range(96)]
    ref = torch.log_softmax(sequence_logits(_runner("auto"), ids), -1)
    got = torch.log_softmax(sequence_logits(_runner(kv), ids), -1)
    mad = (got - ref).abs().mean().item()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert 0 < mad < bound, mad
    assert top1 >= agree


def test_the_log_line_and_metrics_give_blocks_and_bytes_per_token(caplog):
    from types import SimpleNamespace

    from kvserve.config import KVServeConfig, SchedulerConfig
    from kvserve.engine.core import EngineCore
    from kvserve.engine.engine import Engine
    from kvserve.server.metrics import _EngineCollector

    with caplog.at_level(logging.INFO, logger="kvserve.runner.torch_runner"):
        r = _runner("int8", num_kv_blocks=None, kv_cache_memory_gb=0.001)
    assert f"allocating {r.num_kv_blocks} KV blocks" in caplog.text
    assert f"{r.kv_bytes_per_token} bytes per token; --kv-cache-dtype int8" in caplog.text
    snap = EngineCore(Engine(r, SchedulerConfig(), vocab_size=r.cfg.vocab_size), "tiny").snapshot()
    assert (snap.kv_blocks_total, snap.kv_bytes_per_token) == (r.num_kv_blocks, r.kv_bytes_per_token)
    client = SimpleNamespace(stats=snap, config=KVServeConfig())
    metrics = {m.name: m.samples[0].value for m in _EngineCollector(client, "tiny").collect() if m.samples}
    assert metrics["kvserve_kv_cache_bytes_per_token"] == r.kv_bytes_per_token
    assert metrics["kvserve_kv_cache_blocks_capacity"] == r.num_kv_blocks


def test_bad_kv_cache_dtypes_are_clear_errors():
    with pytest.raises(InvalidArgumentError, match="fp8.*int8"):
        _runner("fp4")
    r = subprocess.run([sys.executable, "-m", "kvserve", "generate", "hi", "--kv-cache-dtype", "fp4"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--kv-cache-dtype" in r.stderr and "invalid choice" in r.stderr
    assert "Traceback" not in r.stderr


def test_layout_bytes_per_dtype():
    for dtype, size in [("float32", 4), ("bfloat16", 2), ("float8_e4m3fn", 1), ("float8_e5m2", 1), ("int8", 1)]:
        assert KVLayout(2, 3, 64, 16, dtype).bytes_per_token == 2 * 2 * 3 * 64 * size
    assert math.isclose(KVLayout(2, 3, 64, 16, "int8").block_bytes, 16 * 2 * 2 * 3 * 64)
