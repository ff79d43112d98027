"""bench roofline: the ceilings' arithmetic by hand on a made-up model, the kernel path, and the CLI end to end.
No timing is asserted: the measured figures only have to exist and be positive."""

import json

import pytest
import torch

from conftest import onednn_packs_bf16
from kvserve.bench import gemm_timing as gt
from kvserve.bench import roofline as rf
from kvserve.cli import main
from kvserve.model.config import ModelConfig

# layers 2, hidden 8, intermediate 16, heads 2 (head_dim 4), 1 KV head, vocab 100
CFG = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1)


def test_linear_shapes_follow_the_fused_decoder():
    shapes = {s.name: (s.k, s.n, s.count) for s in rf.linear_shapes(CFG)}
    assert shapes == {"qkv": (8, 16, 2), "o_proj": (8, 8, 2), "gate_up": (8, 32, 2), "down": (16, 8, 2),
                      "lm_head": (8, 100, 1)}
    # linear params: 2 * (128 + 64 + 256 + 128) + 800 = 1952; 2 FLOPs each per row
    assert rf.forward_flops(rf.linear_shapes(CFG), 1) == 3904
    assert rf.forward_flops(rf.linear_shapes(CFG), 4) == 4 * 3904


def test_weight_and_kv_bytes():
    # 1952 linear params + (2 norms per layer + final) * hidden = 1952 + 40
    assert rf.weight_bytes(CFG, "float32") == 1992 * 4
    assert rf.weight_bytes(CFG, "bfloat16") == 1992 * 2
    # K and V, 2 layers, 1 KV head of 4, float32
    assert rf.kv_layout(CFG, "float32").bytes_per_token == 2 * 2 * 1 * 4 * 4


def test_gemm_rate_sums_every_linear_of_a_forward():
    per_call = {name: 1e-6 for name in ("qkv", "o_proj", "gate_up", "down", "lm_head")}
    # 4 decoder linears x 2 layers + the head = 9 calls of 1 us; 3904 FLOPs at M=1
    assert rf.gemm_rate(rf.linear_shapes(CFG), 1, per_call) == pytest.approx(3904 / 9e-6 / 1e9)


def test_ceilings_by_hand():
    c = rf.ceilings(CFG, "float32", bandwidth_gbs=1.0, gflops_at_batch=0.001, batch=4, context_len=10)
    w, kv = 7968, 640  # weights; 64 B of KV per token x 10 tokens
    assert c["weight_bytes"] == w and c["kv_bytes_per_sequence"] == kv
    b1 = c["batch1"]
    assert b1["bytes_per_token"] == w + kv
    assert b1["min_ms_per_token"] == pytest.approx((w + kv) / 1e9 * 1e3)
    assert b1["max_tokens_per_s"] == pytest.approx(1e9 / (w + kv))
    bn = c["batch"]
    assert bn["flops_per_step"] == 4 * 3904
    assert bn["gemm_ms"] == pytest.approx(4 * 3904 / 1e6 * 1e3)  # 1 MFLOP/s
    assert bn["bytes_ms"] == pytest.approx((w + 4 * kv) / 1e9 * 1e3)
    assert bn["bound"] == "compute" and bn["min_step_ms"] == pytest.approx(bn["gemm_ms"])
    assert bn["max_tokens_per_s"] == pytest.approx(4 / (4 * 3904 / 1e6))
    # a fast GEMM and slow memory: the bytes bound the step
    m = rf.ceilings(CFG, "float32", bandwidth_gbs=1e-6, gflops_at_batch=1e6, batch=4, context_len=10)["batch"]
    assert m["bound"] == "memory" and m["min_step_ms"] == pytest.approx(m["bytes_ms"])
    # the KV may be stored in another dtype than the weights
    assert rf.ceilings(CFG, "float32", 1.0, 1.0, 1, 10, kv_dtype="bfloat16")["kv_bytes_per_sequence"] == 320


def test_a_many_row_batch_on_amx_reads_the_quantized_linears_bf16_copies():
    """On an AMX CPU a step of 16+ rows runs quantized linears on bf16 copies: the batch ceiling counts
    their bytes, the batch-1 ceiling the quantized ones."""
    formats = {"qkv": "q4_1", "o_proj": "q4_1", "gate_up": "q4_1", "down": "q4_1", "lm_head": "q8_0"}
    bf16 = rf.weight_bytes(CFG, "float32", dict.fromkeys(formats, "bf16"))
    assert bf16 == rf.weight_bytes(CFG, "bfloat16") + (2 * CFG.num_hidden_layers + 1) * CFG.hidden_size * 2  # norms in fp32
    assert rf.batch_weight_bytes(CFG, "float32", formats, 64, amx=True) == bf16
    assert rf.batch_weight_bytes(CFG, "float32", formats, 8, amx=True) is None  # the integer kernels
    assert rf.batch_weight_bytes(CFG, "float32", formats, 64, amx=False) is None
    assert rf.batch_weight_bytes(CFG, "float32", dict.fromkeys(formats), 64, amx=True) is None  # dense weights
    c = rf.ceilings(CFG, "float32", 1.0, 1.0, 64, 10, formats=formats, batch_weight_bytes=bf16)
    assert c["weight_bytes"] == rf.weight_bytes(CFG, "float32", formats) < c["batch_weight_bytes"] == bf16
    assert c["batch"]["bytes_ms"] == pytest.approx((bf16 + 64 * 640) / 1e9 * 1e3)
    assert c["batch1"]["bytes_per_token"] == c["weight_bytes"] + 640


def test_achieved_fractions():
    a = rf.achieved({"decode_step_ms_p50": 20.0, "output_tokens_per_s": 128.0}, gemm_step_ms=15.616,
                    ceiling_tokens_per_s=256.0)
    assert a["step_fraction"] == pytest.approx(15.616 / 20.0)
    assert a["tokens_fraction"] == pytest.approx(0.5)
    none = rf.achieved({"decode_step_ms_p50": None}, 1.0, 1.0)
    assert none["step_fraction"] is None and none["tokens_fraction"] is None


def test_row_counts():
    assert rf.row_counts(64, 2048) == [1, 8, 64]  # a large token budget is left out
    assert rf.row_counts(16, 256, [3]) == [1, 3, 8, 16, 64, 256]


def test_make_linear_is_the_engines_linear():
    torch.manual_seed(0)
    w, b, x = torch.randn(24, 16), torch.randn(24), torch.randn(3, 16)
    torch.testing.assert_close(gt.make_linear(w, b)(x), torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_measure_gemms_and_bandwidth_give_positive_figures():
    times = gt.measure_gemms(rf.linear_shapes(CFG), CFG.num_hidden_layers, torch.float32, [1, 5], repeats=1,
                              min_time_s=0.0)
    assert set(times) == {1, 5}
    assert all(t > 0 for per in times.values() for t in per.values())
    assert set(times[1]) == {"qkv", "o_proj", "gate_up", "down", "lm_head"}
    gbs, how = gt.measure_bandwidth(8, 1)
    assert gbs > 0 and how in ("streamed", "float32 summed")


def test_cli_end_to_end_with_an_offline_result(tiny_model_dir, tmp_path):
    offline = tmp_path / "offline.json"
    offline.write_text(json.dumps({"num_prompts": 4, "input_len": 8, "output_len": 8, "dtype": "float32",
                                   "output_tokens_per_s": 100.0, "decode_step_ms_p50": 5.0}))
    out = tmp_path / "roof.json"
    rc = main(["bench", "roofline", "--model", str(tiny_model_dir), "--bandwidth-mib", "64", "--repeats", "1",
               "--min-time-ms", "1", "--batch", "2", "--max-num-batched-tokens", "32",
               "--offline-json", str(offline), "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["dtype"] == "float32" and r["kv_dtype"] == "float32"
    assert r["model"] == {"layers": 2, "hidden": 64, "intermediate": 128, "vocab": 49152}
    assert set(r["gemm"]) == {"1", "2", "4", "8", "32", "64"}  # defaults, --batch, the offline batch, the budget
    assert all(g["gflops"] > 0 and g["forward_gemm_ms"] > 0 for g in r["gemm"].values())
    assert r["bandwidth_gbs"] > 0
    c = r["ceilings"]
    assert c["context_len"] == 12  # input_len + output_len / 2 of the offline run
    assert c["batch"]["n"] == 2 and c["batch1"]["max_tokens_per_s"] > 0
    assert r["offline"]["batch"] == 4 and r["offline"]["decode_step_ms_p50"] == 5.0
    assert r["offline"]["step_fraction"] == pytest.approx(r["offline"]["gemm_only_step_ms"] / 5.0)
    assert r["offline"]["tokens_fraction"] == pytest.approx(100.0 / r["offline"]["ceiling_tokens_per_s"])


def test_cli_refuses_an_unreadable_offline_result(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["bench", "roofline", "--offline-json", str(bad)]) == 2
    assert "cannot read --offline-json" in capsys.readouterr().err


def test_step_timer_splits_full_batch_decode_steps():
    from conftest import hf_weights, kvserve_config, tiny_hf_model

    from kvserve import SamplingParams
    from kvserve.bench.step_split import PARTS, StepTimer
    from kvserve.llm import LLM

    hf = tiny_hf_model()
    llm = LLM.from_weights(kvserve_config(hf), hf_weights(hf), dtype="float32", num_kv_blocks=64, block_size=4)
    timer = StepTimer(llm.engine.runner, batch=3)
    outs = llm.generate([[1, 2, 3], [4, 5, 6, 7], [8, 9]], SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in outs)  # the timers change nothing the runner returns
    assert len(timer.steps) == 5  # the first token comes from the prefill step; 5 decode steps follow
    for step in timer.steps:
        # a dense model's head writes logits: no draw in the head (tests/sampling/test_head_draw.py)
        assert all(step[p] > 0 for p in PARTS if p not in ("native_layers", "head_draw"))
        assert step["native_layers"] == 0 and step["head_draw"] == 0
        assert step["total"] >= step["gemm"] + step["attention"] + step["sampling"]
        assert step["rest"] == pytest.approx(step["total"] - sum(step[p] for p in PARTS))


def test_step_timer_times_the_native_decode_stack_as_one_part():
    from kvserve.kernels import load_kernels

    if not load_kernels():
        pytest.skip("native kernels did not build")
    from conftest import hf_weights, kvserve_config, tiny_hf_model

    from kvserve import SamplingParams
    from kvserve.bench.step_split import StepTimer
    from kvserve.llm import LLM

    hf = tiny_hf_model()
    llm = LLM.from_weights(kvserve_config(hf), hf_weights(hf), dtype="float32", quantization="int4", num_kv_blocks=64,
                           block_size=4)
    assert llm.engine.runner.model.native_stack is not None
    timer = StepTimer(llm.engine.runner, batch=2)
    llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True))
    assert len(timer.steps) == 4
    for step in timer.steps:  # the layers run natively: only the LM head is a Python linear
        assert step["native_layers"] > 0 and step["gemm"] > 0 and step["attention"] == 0


def test_quantized_formats_lower_the_bytes_and_follow_the_mode(tmp_path):
    dense = rf.weight_bytes(CFG, "float32")
    q4 = rf.weight_formats("int4", "unused")
    assert q4["lm_head"] == "q8_0" and q4["qkv"] == "q4_1"
    # linears: 1152 params at 20/32 bytes + the 800-param head at 34/32; the 40 norm params stay float32
    assert rf.weight_bytes(CFG, "float32", q4) == int(1152 * 20 / 32 + 800 * 34 / 32 + 40 * 4)
    assert rf.weight_bytes(CFG, "float32", rf.weight_formats("none", "m.gguf")) == dense
    assert rf.weight_formats("auto", str(tmp_path)) == dict.fromkeys(["qkv", "o_proj", "gate_up", "down", "lm_head"])


def test_int4_over_a_gguf_keeps_its_q4_0_linears(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    blocks = np.zeros((4, 18), dtype=np.uint8)  # 4 rows of one 32-block: fp16 d + 16 bytes of nibbles
    w.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.add_tensor("blk.0.ffn_down.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert rf.weight_formats("auto", str(path))["qkv"] == "q4_0"
    q4 = rf.weight_formats("int4", str(path))  # as quant_linear._group: Q4_0 stays, the rest becomes Q4_1
    assert (q4["qkv"], q4["down"], q4["lm_head"]) == ("q4_0", "q4_1", "q8_0")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q4_0"])  # q4_0: a GGUF's Q4_0 linears, as kept
def test_quantized_linear_timing_runs_through_the_kernel_path(fmt):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)  # K a multiple of the 32-value blocks
    times = gt.measure_gemms(rf.linear_shapes(cfg), cfg.num_hidden_layers, torch.float32, [1, 3], repeats=1,
                             min_time_s=0.001, formats={**rf.weight_formats("int8", "unused"), "qkv": fmt, "down": fmt})
    assert set(times) == {1, 3} and all(t > 0 for per in times.values() for t in per.values())


def test_step_timer_counts_a_linear_inside_a_linear_once(monkeypatch):
    import itertools

    from kvserve.bench import step_split

    timer = step_split.StepTimer.__new__(step_split.StepTimer)  # the timers alone, no runner
    timer._acc, timer._inside = {"gemm": 0.0}, set()
    clock = itertools.count()
    monkeypatch.setattr(step_split.time, "perf_counter", lambda: float(next(clock)))
    inner = timer._timed(lambda: None, "gemm")  # as QuantLinear's bf16 PackedLinear
    outer = timer._timed(lambda: inner(), "gemm")
    outer()
    assert timer._acc["gemm"] == 1.0  # one reading before, one after: the inner call adds nothing


def test_the_gemm_timing_sizes_its_weight_copies_in_the_bytes_the_kernels_read():
    """A QuantLinear with a bf16 copy (AMX) reads 2 bytes a weight at many rows, one without reads its
    packed quantized weight; a dense linear reads its dtype's bytes."""
    import shutil

    from kvserve.kernels import load_kernels
    from kvserve.model.quant import quantize
    from kvserve.model.quant_linear import QuantLinear

    shape = rf.LinearShape("gate_up", 64, 96, 2)
    w = torch.randn(96, 64)
    assert gt.held_bytes(lambda x: x, shape, torch.float32) == 96 * 64 * 4
    if shutil.which("c++") is None or not load_kernels():
        pytest.skip("native kernels did not build")
    if onednn_packs_bf16():
        assert gt.held_bytes(QuantLinear(quantize(w, "q4_1"), None, torch.float32, amx=True), shape, torch.float32) == 96 * 64 * 2
    plain = QuantLinear(quantize(w, "q4_1"), None, torch.float32, amx=False)
    assert gt.held_bytes(plain, shape, torch.float32) == plain.packed.numel() == 96 * 64 * 20 // 32
