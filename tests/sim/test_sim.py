"""The simulator: the engine's own scheduler and caches on a virtual clock, roofline arithmetic,
footprint and cost, and agreement with the real engine on the same token trace."""

import ast
import random
import subprocess
import sys
from pathlib import Path

import pytest

import kvserve.sim
from kvserve.bench.datasets import Session, Turn, Workload
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.manager import KVManager
from kvserve.kv.radix_cache import RadixCache
from kvserve.sim import planner
from kvserve.sim.cost_model import ChunkShape, Roofline
from kvserve.sim.hardware import get_hardware, load_catalog
from kvserve.sim.models import PRESETS, ModelSpec, get_model
from kvserve.sim.profiles import get_profile
from kvserve.sim.simulate import SimResult, build_sim_engine, simulate

TINY = ModelSpec("tiny", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=100)


def test_simulator_drives_the_engines_own_scheduler_and_caches():
    engine, runner, clock = build_sim_engine(PRESETS["llama-3.1-8b"], get_hardware("h100-sxm"), get_profile("sglang"))
    assert type(engine.scheduler) is Scheduler and type(engine.kv) is KVManager and type(engine.kv.cache) is RadixCache
    assert engine.scheduler.clock is clock and engine.clock is clock
    # and kvserve/sim defines no scheduler, pool, tree or KV manager of its own
    own = set()
    for f in Path(kvserve.sim.__file__).parent.glob("*.py"):
        own |= {n.name for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.ClassDef)}
    assert not own & {"Scheduler", "KVManager", "RadixCache", "BlockPool", "Engine", "Request"}


def test_sim_imports_no_torch():
    code = "import sys, kvserve.sim.planner, kvserve.sim.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_roofline_hand_computed():
    hw = get_hardware("h100-sxm")
    rf = Roofline(TINY, hw, "bf16", "bf16")
    c = rf.step([ChunkShape(0, 10, True)])
    # per layer: q 64x64 + k,v 2 x 64x32 + o 64x64 = 12288; MLP 3 x 64 x 128 = 24576; two layers
    assert c.linear_flops == 2 * 73728 * 10 + 2 * 64 * 100
    assert c.attention_flops == 4 * 2 * 4 * 16 * (10 * 11 / 2)  # causal: 55 query-key pairs per head
    assert c.weight_bytes == 73728 * 2 + 64 * 100 * 2  # layers + lm_head, bf16
    kv_tok = 2 * 2 * 2 * 16 * 2
    assert c.kv_bytes == kv_tok * 10 + kv_tok * 10  # read the context, write the new tokens
    assert c.memory_s == pytest.approx((c.weight_bytes + c.kv_bytes) / (3.35e12 * hw.mbu))
    assert c.compute_s == pytest.approx((c.linear_flops + c.attention_flops) / (989e12 * hw.mfu))
    assert c.seconds == pytest.approx(hw.overhead_s + hw.per_seq_s + max(c.compute_s, c.memory_s))


def test_decode_scales_with_bytes_and_prefill_with_flops():
    m, hw = PRESETS["llama-3.1-8b"], get_hardware("h100-sxm")
    decode = [ChunkShape(1000, 1, True)] * 8
    bf16, fp8 = Roofline(m, hw, "bf16", "bf16").step(decode), Roofline(m, hw, "fp8", "fp8").step(decode)
    assert bf16.bound == "memory" and fp8.bound == "memory"
    assert fp8.memory_s / bf16.memory_s == pytest.approx((fp8.weight_bytes + fp8.kv_bytes)
                                                         / (bf16.weight_bytes + bf16.kv_bytes))
    assert 0.5 < fp8.memory_s / bf16.memory_s < 0.6  # weights halve; the 16-bit lm_head does not
    rf = Roofline(m, hw, "bf16", "bf16")
    p1, p2 = rf.step([ChunkShape(0, 4096, True)]), rf.step([ChunkShape(0, 8192, True)])
    assert p1.bound == "compute"
    assert p2.linear_flops / p1.linear_flops == pytest.approx(2.0, rel=1e-3)
    assert p2.attention_flops / p1.attention_flops == pytest.approx(4.0, rel=1e-3)  # quadratic
    # tensor parallelism splits the work and adds all-reduces
    tp2 = Roofline(m, hw, "bf16", "bf16", tp=2).step([ChunkShape(0, 4096, True)])
    assert tp2.compute_s == pytest.approx(p1.compute_s / 2) and tp2.comm_s > 0


def test_footprint_and_cost_hand_computed():
    r = planner.hbm_footprint_gb(8, 8, 8192, "vllm")
    # Llama-3.1-8B: 2 (K,V) x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB per token
    assert r.kv_gb_per_sequence == pytest.approx(131072 * 8192 / 1e9, rel=1e-3)
    assert r.weights_gb == pytest.approx(8.03e9 * 2 / 1e9, rel=0.01)
    fp8 = planner.hbm_footprint_gb(8, 8, 8192, "trtllm")
    assert fp8.kv_gb_per_sequence == pytest.approx(r.kv_gb_per_sequence / 2, rel=1e-3)
    assert fp8.sequences_that_fit > r.sequences_that_fit
    assert r.sequences_that_fit == int((80 - r.weights_gb - r.activations_gb) // r.kv_gb_per_sequence)
    slots = planner.hbm_footprint_gb(8, 8, 8192, "llamacpp")
    assert slots.sequences_that_fit == 4  # its slots, not its memory, bound it
    big = planner.hbm_footprint_gb(70, 70, 8192, "vllm")
    assert big.sequences_that_fit == 0  # 140 GB of bf16 weights do not fit one 80 GB device
    res = SimResult("x", "h100-sxm", "m", 1, 1, 1, 0, 1.0, 1.0, 0, 0, 1000.0, 1.0, None, None, None, None, 0.0, 0,
                    1, 16, 3.0)
    assert res.cost_per_million_output_tokens() == pytest.approx(3.0 / 3.6e6 * 1e6)
    assert res.cost_per_million_output_tokens(0.5) == pytest.approx(2 * 3.0 / 3.6e6 * 1e6)


def test_moe_active_and_total_params():
    m = ModelSpec.from_hf_config({"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                                  "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                                  "num_local_experts": 8, "num_experts_per_tok": 2})
    assert m.total_params / 1e9 == pytest.approx(46.7, rel=0.01)  # Mixtral-8x7B
    assert m.active_params / 1e9 == pytest.approx(12.9, rel=0.01)
    # gpt-oss-20b (its config.json's shape keys): 20.9B in all; 3.6B active by its card, which counts the
    # LM head but not the embeddings (0.58B), which the simulator counts too
    oss = ModelSpec.from_hf_config({"architectures": ["GptOssForCausalLM"], "hidden_size": 2880, "num_hidden_layers": 24,
                                    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
                                    "intermediate_size": 2880, "vocab_size": 201088, "num_local_experts": 32,
                                    "num_experts_per_tok": 4, "sliding_window": 128, "swiglu_limit": 7.0,
                                    "quantization_config": {"quant_method": "mxfp4"}})
    assert (oss.experts, oss.experts_per_token, oss.expert_intermediate, oss.head_dim) == (32, 4, 2880, 64)
    assert oss.total_params / 1e9 == pytest.approx(20.9, rel=0.01)
    assert (oss.active_params - oss.embed_params) / 1e9 == pytest.approx(3.6, rel=0.01)
    # DeepSeek-V2-Lite: latent attention's projections, one dense layer then experts; 15.7B in all, 2.4B active by
    # its card (which, as gpt-oss's, leaves the embeddings out)
    lite = ModelSpec.from_hf_config({"architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048,
                                     "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
                                     "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 64,
                                     "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
                                     "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
                                     "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400})
    assert (lite.dense_layers, lite.head_dim, lite.kv_heads) == (1, 192, 16)  # the cache holds the expanded heads
    assert lite.total_params / 1e9 == pytest.approx(15.7, rel=0.01)
    assert (lite.active_params - lite.embed_params) / 1e9 == pytest.approx(2.4, rel=0.03)
    synth = planner.model_for_params(100, 10)
    assert synth.total_params / 1e9 == pytest.approx(100, rel=0.15)
    assert synth.active_params / 1e9 == pytest.approx(10, rel=0.15)


def _trace(seed=0):
    """Prompts over four shared prefixes, some repeated, in a fixed order."""
    rng = random.Random(seed)
    docs = [[rng.randrange(3, 90) for _ in range(40)] for _ in range(4)]
    return [docs[rng.randrange(4)] + [rng.randrange(3, 90) for _ in range(rng.randrange(2, 12))] for _ in range(24)]


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_radix_hit_rate_equals_the_real_engine(policy):
    """The same token trace, the same pool, the same policy: the simulator's tree makes the same hits.
    (One output token each: what the model would generate is the one thing the simulator does not know.)"""
    from conftest import hf_weights, kvserve_config, tiny_hf_model
    from kvserve import SamplingParams
    from kvserve.llm import LLM

    prompts = _trace()
    hf = tiny_hf_model(kv_heads=2)
    llm = LLM.from_weights(kvserve_config(hf), hf_weights(hf), dtype="float32", num_kv_blocks=40, block_size=4,
                           max_num_seqs=4, max_num_batched_tokens=64, schedule_policy=policy, prefill_step_factor=0)
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
    real = llm.engine.kv.stats

    prof = get_profile("vllm").with_(schedule_policy=policy, max_num_seqs=4, max_num_batched_tokens=64, block_size=4,
                                     share_prefix_in_step=True)  # as the real engine (kvserve's default)
    wl = Workload("trace", [Session([Turn(p, 1)]) for p in prompts])
    engine, _, _ = build_sim_engine(TINY, get_hardware("h100-sxm"), prof, num_kv_blocks=40)
    for i, p in enumerate(prompts):
        from kvserve.engine.request import SamplingParams as SP

        engine.add_request(str(i), p, SP(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    sim = engine.kv.stats
    assert real.hits > 0
    assert (sim.queries, sim.hits, sim.evicted_blocks) == (real.queries, real.hits, real.evicted_blocks)
    assert simulate(wl, TINY, get_hardware("h100-sxm"), prof, num_kv_blocks=40).prefix_hit_rate == pytest.approx(
        real.hits / real.queries, abs=0.02)


def test_continuous_beats_static_and_chunking_smooths_decodes():
    c = planner.static_vs_continuous("llama-3.1-8b", "h100-sxm", request_rate=20.0, workload="chat", num_prompts=120)
    static, nochunk, chunked = (c.results[k] for k in ("static", "continuous, no chunked prefill",
                                                       "continuous + chunked prefill"))
    assert chunked.ttft_ms.p50 < static.ttft_ms.p50
    assert chunked.itl_ms.p99 <= nochunk.itl_ms.p99
    assert all(r.completed == r.requests for r in c.results.values())


def test_pick_engine_returns_reasons_with_figures():
    pick = planner.pick_engine("h100-sxm", 1, "batch", num_prompts=24, input_len=256, output_len=32)
    assert pick.engine in pick.comparison.results
    assert any("tok/s" in r for r in pick.reasons)


def test_catalog_has_the_named_devices_and_a_clear_error():
    cat = load_catalog()
    for k in ("h100-sxm", "h100-pcie", "h200", "b200", "gb200", "a100", "l4", "l40s", "mi300x", "cpu"):
        assert cat[k].hbm_gb > 0 and cat[k].price_per_hour > 0
    from kvserve.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="unknown hardware"):
        get_hardware("tpu-v9")
    with pytest.raises(InvalidArgumentError, match="does not fit"):
        build_sim_engine(get_model("llama-3.1-70b"), get_hardware("l4"), get_profile("vllm"))


def test_cli_sim_and_plan(capsys, tmp_path):
    from kvserve.cli import main

    png = tmp_path / "fp.png"
    assert main(["sim", "footprint", "--params-b", "8", "--seq-len", "4096", "--stacks", "vllm", "trtllm",
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| vllm |" in out and "| trtllm |" in out and png.stat().st_size > 0
    assert main(["sim", "run", "--profiles", "vllm", "sglang", "--dataset", "prefix-rag", "--num-prompts", "20",
                 "--system-len", "200", "--tools-len", "50", "--doc-len", "300", "--output-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "| vllm |" in out and "| sglang |" in out
    assert main(["sim", "run", "--hardware", "nope"]) == 2  # a one-line error, not a traceback
    assert "unknown hardware" in capsys.readouterr().err
