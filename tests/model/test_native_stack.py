"""The native decode stack (kvserve.model.native_stack): on one step it gives the Python layers'
hidden states and cache writes bit for bit (Llama's layers, Qwen3's, with sliding windows, soft
caps and sinks, and the layer options of Gemma 1/2/3, OLMo 2, Granite and SmolLM3: sandwich and post norms,
whole-projection q/k norms, GELU-tanh, residual scales, biases, local and no rotary); end to end the
same greedy tokens; and the Python layers run wherever it does not apply (fresh prefills, dense or
bfloat16 weights)."""

from __future__ import annotations

import dataclasses
import random
import shutil

import pytest
import torch

from kvserve import SamplingParams
from kvserve.attention import LayerKV, SeqRows
from kvserve.config import CacheConfig
from kvserve.llm import LLM
from kvserve.model.config import FULL, SLIDING
from kvserve.runner.inputs import build_inputs
from kvserve.runner.torch_runner import TorchRunner
from test_architectures import GREEDY, CASES, assert_logprobs_close, checkpoint, expected, hf_model, make_llm, prompts
from tests.conftest import hf_weights, kvserve_config, needs_onednn_bf16, tiny_hf_model

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    from kvserve.kernels import load_kernels

    if not load_kernels():
        pytest.skip("native kernels did not build")
    # bit-for-bit equality is the integer kernels' property; on an AMX CPU the Python layers' linears
    # would take oneDNN's bf16 GEMM from 16 rows (kvserve.model.quant_linear)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSERVE_AMX", "0")
        yield


def _qwen3():
    """A tiny random Qwen3 (q/k norms per head, which the stack applies before rotary)."""
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, tie_word_embeddings=False)
    cfg.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.2)
    return hf.eval()


# Llama's layers with attention options the stack takes per layer: Mistral's window on every layer
# (shorter than most contexts below, ending mid-block), or a window on the first layer only and a soft
# cap on both (two attention plans in one step)
ATTENTION = {"llama": {}, "qwen3": {}, "window": dict(sliding_window=9),
             "window+cap": dict(sliding_window=21, layer_types=[SLIDING, FULL], attn_logit_softcap=1.5),
             "sinks": dict(attn_sinks=True, sliding_window=21, layer_types=[SLIDING, FULL])}


# architectures whose layer options the stack runs, as test_architectures.py writes them (its CASES), and
# variants: a residual scale that rounds (not a power of two) and biases on every linear (Granite); one KV
# head (OLMo 2: a whole-projection k norm as wide as a head; Gemma 3: its per-head k norm over a strided view)
OPTIONS = {"GemmaForCausalLM": {}, "Gemma2ForCausalLM": {}, "Gemma3ForCausalLM": {}, "Olmo2ForCausalLM": {},
           "SmolLM3ForCausalLM": {}, "SmolLM3ForCausalLM:sliding_window": {},
           "LlamaForCausalLM:head_dim,biases,tied": {},
           "GraniteForCausalLM": dict(residual_multiplier=0.37, mlp_bias=True),
           "Olmo2ForCausalLM:kv1": dict(num_key_value_heads=1), "Gemma3ForCausalLM:kv1": dict(num_key_value_heads=1),
           # mixtures of experts (the MoEBlock MoE.forward runs): top-k renormalised or not, whole-projection q/k
           # norms (OLMoE), a window (Mixtral), a shared expert and a dense layer (Qwen2-MoE, its shared expert
           # widened to whole quantized blocks), gpt-oss's router and expert biases, clamped SwiGLU and sinks
           "Qwen3MoeForCausalLM": {}, "MixtralForCausalLM": {}, "OlmoeForCausalLM": {},
           "Qwen2MoeForCausalLM": dict(shared_expert_intermediate_size=64), "GptOssForCausalLM": {},
           # experts chosen with a bias, an ungated shared expert, a dense first layer, interleaved rotary (ERNIE MoE);
           # post norms with per-head q/k norms, global layers without rotary (EXAONE 4); local layers rotating
           # unscaled beside yarn ones (OLMo 3)
           "Ernie4_5_MoeForCausalLM": {}, "Exaone4ForCausalLM": {}, "Olmo3ForCausalLM": {}}
MOE = ["Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM", "Qwen2MoeForCausalLM", "GptOssForCausalLM",
       "Ernie4_5_MoeForCausalLM"]


def _options_model(arch: str):
    return hf_model(arch if arch in CASES else arch.partition(":")[0], **OPTIONS[arch])


def _saved(hf):
    """(config, weights) of ``hf`` as kvserve loads its saved folder."""
    import tempfile

    from kvserve.model.loader import load_model

    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        loaded = load_model(folder, with_tokenizer=False)
    return loaded.config, loaded.weights


def _runner(quantization: str, *, bias: bool = False, dtype=torch.float32, backend: str = "auto",
            kv: str = "auto", arch: str = "llama") -> TorchRunner:
    if arch in MOE:  # through a saved checkpoint: transformers' in-memory experts are not the files' layout
        cfg, weights = _saved(_options_model(arch))
        return TorchRunner(cfg, weights, CacheConfig(num_kv_blocks=64, attention_backend=backend, kv_cache_dtype=kv),
                           dtype=dtype, quantization=quantization)
    if arch in OPTIONS:
        hf = _options_model(arch)
        cfg = kvserve_config(hf)
        return TorchRunner(cfg, hf_weights(hf), CacheConfig(num_kv_blocks=64, attention_backend=backend, kv_cache_dtype=kv),
                           dtype=dtype, quantization=quantization)
    hf = _qwen3() if arch == "qwen3" else tiny_hf_model(bias=bias, kv_heads=2, hidden=64, layers=2)
    cfg = dataclasses.replace(kvserve_config(hf), **ATTENTION[arch])
    weights = hf_weights(hf)
    if cfg.attn_sinks:  # gpt-oss's sinks on Llama's layers: from below the scores to above them
        for i in range(cfg.num_hidden_layers):
            weights[f"model.layers.{i}.self_attn.sinks"] = torch.linspace(-3.0 + i, 4.0, cfg.num_attention_heads)
    return TorchRunner(cfg, weights,
                       CacheConfig(num_kv_blocks=64, attention_backend=backend, kv_cache_dtype=kv),
                       dtype=dtype, quantization=quantization)


def _step(runner: TorchRunner, rows: list[tuple[int, int]], seed: int = 0):
    """Random cached K/V and one step of (tokens, start) rows over shuffled block tables."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    pool = runner.kv_pool
    for k, v in pool.layers:
        k[: pool.null_slot] = torch.randn(k[: pool.null_slot].shape, generator=g)
        v[: pool.null_slot] = torch.randn(v[: pool.null_slot].shape, generator=g)
    free = list(range(pool.num_blocks))
    rng.shuffle(free)
    bs = pool.block_size
    vocab = runner.cfg.vocab_size
    return [SeqRows([rng.randrange(vocab) for _ in range(n)], start, [free.pop() for _ in range(-(-(start + n) // bs))])
            for n, start in rows]


def _forward(runner: TorchRunner, seqs: list[SeqRows], native: bool):
    model = runner.model
    stack = model.native_stack
    caches = [LayerKV(k.clone(), v.clone(), layer.k_scale, layer.v_scale) for layer in runner.kv_pool.layers
              for k, v in [layer]]
    inputs = build_inputs(seqs, runner.attention)
    model.native_stack = stack if native else None
    try:
        hidden = model(inputs.input_ids, inputs.positions, runner.attention, inputs.meta, caches)
    finally:
        model.native_stack = stack
    return hidden, caches


# decodes over ragged contexts and a 20-token chunk continuing a context (every row in the paged
# kernel); one long decode alone, which the kernel splits along its keys when threads allow
STEPS = {"mixed": [(1, 3), (1, 17), (1, 150), (20, 40), (1, 33)], "long": [(1, 500)]}


def _check_one_step_on(runner, seqs, threads: int) -> None:
    """``_check_one_step`` with torch on ``threads`` threads (the stack splits its work across them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_one_step(runner, seqs)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", STEPS)
@pytest.mark.parametrize("quantization,bias,arch", [("int4", False, "llama"), ("int8", False, "llama"),
                                                    ("int4", True, "llama"), ("int8", False, "qwen3"),
                                                    ("int4", False, "window"), ("int8", False, "window+cap"),
                                                    ("int8", False, "sinks")])
def test_one_step_equals_the_python_layers(quantization, bias, arch, rows, threads):
    runner = _runner(quantization, bias=bias, arch=arch)
    assert runner.model.native_stack is not None and runner.model.native_stack.num_layers() == 2
    seqs = _step(runner, STEPS[rows])
    _check_one_step_on(runner, seqs, threads)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", STEPS)
@pytest.mark.parametrize("arch", sorted(OPTIONS))
def test_one_step_of_each_architectures_options_equals_the_python_layers(arch, rows, threads):
    runner = _runner("int8" if threads == 1 else "int4", arch=arch)
    stack = runner.model.native_stack
    assert stack is not None and stack.num_layers() == runner.cfg.num_hidden_layers
    seqs = _step(runner, STEPS[rows])
    _check_one_step_on(runner, seqs, threads)


@pytest.mark.parametrize("arch", ["llama", "window+cap", "sinks", "Gemma3ForCausalLM", "Olmo2ForCausalLM"])
@pytest.mark.parametrize("rows", STEPS)
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2", "int8", "bfloat16"])
def test_one_step_over_a_narrower_cache_equals_the_python_layers(kv, rows, arch):
    """The stack stores new K/V as the pool does (the same bytes: quantized, or rounded to bf16)
    and its kernel reads them with the same scales."""
    runner = _runner("int8", kv=kv, arch=arch)
    seqs = _step(runner, STEPS[rows])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check_one_step(runner, seqs)
    finally:
        torch.set_num_threads(before)


def _check_one_step(runner: TorchRunner, seqs: list[SeqRows]) -> None:
    assert runner.attention.native_step(build_inputs(seqs, runner.attention).meta) is not None
    ref, ref_caches = _forward(runner, seqs, native=False)
    got, got_caches = _forward(runner, seqs, native=True)
    assert torch.equal(got, ref)
    for (k1, v1), (k2, v2) in zip(got_caches, ref_caches):
        assert torch.equal(k1.view(torch.uint8), k2.view(torch.uint8)) and torch.equal(v1.view(torch.uint8), v2.view(torch.uint8))


def test_steps_with_a_fresh_prefill_run_the_python_layers():
    runner = _runner("int4")
    seqs = _step(runner, [(1, 20), (12, 0)])  # the fresh 12-token prompt goes to SDPA
    meta = build_inputs(seqs, runner.attention).meta
    assert runner.attention.native_step(meta) is None
    seqs = _step(runner, [(1, 20), (3, 16)])
    assert runner.attention.native_step(build_inputs(seqs, runner.attention).meta) is not None


@pytest.mark.parametrize("quantization,dtype,backend", [("none", torch.float32, "auto"),
                                                        ("int4", torch.bfloat16, "auto"),
                                                        ("int4", torch.float32, "gather-sdpa")])
def test_no_stack_or_no_native_steps_where_it_cannot_run(quantization, dtype, backend):
    runner = _runner(quantization, dtype=dtype, backend=backend)
    seqs = _step(runner, [(1, 20), (1, 5)]) if dtype == torch.float32 else None
    usable = runner.model.native_stack is not None and runner.attention.native_step(
        build_inputs(seqs, runner.attention).meta) is not None
    assert not usable


def test_greedy_tokens_equal_the_python_layers_end_to_end():
    hf = tiny_hf_model(kv_heads=2, hidden=64, layers=2)
    cfg, weights = kvserve_config(hf), hf_weights(hf)
    prompts = [[random.Random(i).randrange(3, 97) for _ in range(5 + 7 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = []
    for native in (True, False):
        llm = LLM.from_weights(cfg, weights, dtype="float32", quantization="int4", num_kv_blocks=64)
        assert llm.engine.runner.model.native_stack is not None
        if not native:
            llm.engine.runner.model.native_stack = None
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("name", ["GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM",
                                  "GraniteForCausalLM", "SmolLM3ForCausalLM", "LlamaForCausalLM:head_dim,biases,tied",
                                  "Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM", "GptOssForCausalLM",
                                  "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", "Ernie4_5_MoeForCausalLM",
                                  "Exaone4ForCausalLM", "Olmo3ForCausalLM"])
def test_each_architecture_decodes_on_the_stack_with_the_python_layers_tokens(name, tmp_path_factory, monkeypatch):
    """A checkpoint as test_architectures.py writes it, end to end: the stack serves the decode steps
    (counted) and gives the Python layers' greedy tokens (int8, the weights the stack runs over); those
    stay within check_logprobs_close of the dense model, whose tokens are transformers'."""
    import kvserve.model.decoder as decoder

    _, folder = checkpoint(name, tmp_path_factory)
    served = [0]
    real = decoder.run_native_stack

    def counted(*args):
        ran = real(*args)
        served[0] += ran
        return ran

    monkeypatch.setattr(decoder, "run_native_stack", counted)
    params = dataclasses.replace(GREEDY, logprobs=3)
    outs = []
    for native in (True, False):
        llm = make_llm(folder, quantization="int8", max_num_batched_tokens=512)
        assert llm.engine.runner.model.native_stack is not None
        if not native:
            llm.engine.runner.model.native_stack = None
        outs.append(llm.generate(prompts(), params))
        if native:
            assert served[0] >= GREEDY.max_tokens - 1  # every decode step after the prompts' prefill
    stack_tokens, python_tokens = ([o.token_ids for o in out] for out in outs)
    assert stack_tokens == python_tokens
    dense = make_llm(folder, max_num_batched_tokens=512).generate(prompts(), params)
    assert [o.token_ids for o in dense] == expected(name, tmp_path_factory)
    assert_logprobs_close(dense, outs[0], name)


@pytest.mark.parametrize("arch", ["llama", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM",
                                  "GraniteForCausalLM", "LlamaForCausalLM:head_dim,biases,tied", "Qwen3MoeForCausalLM",
                                  "Qwen2MoeForCausalLM"])
@needs_onednn_bf16
def test_a_many_row_step_on_the_amx_path_equals_the_python_layers_on_it(monkeypatch, arch):
    """On an AMX CPU a step of AMX_MIN_ROWS+ rows runs its linears in oneDNN's bf16 GEMM, in the
    stack as in the Python layers (forced here: bf16 emulated where the CPU lacks it, same maths), with
    each architecture's options between the GEMMs (the bf16 GELU-tanh, biases, out norms, scales)."""
    import kvserve.model.quant_linear as ql

    monkeypatch.setattr(ql, "amx_gemm_available", lambda: True)
    runner = _runner("int4", bias=True, arch=arch)
    stack = runner.model.native_stack
    assert stack.has_amx_weights()
    assert stack.has_tile_weights() == torch.ops.kvserve.amx_gemm_available()  # real AMX: the tile kernel in both
    rows = [(1, 3 + 2 * i) for i in range(ql.AMX_MIN_ROWS + 3)]  # 19 decodes over ragged contexts
    seqs = _step(runner, rows)
    _check_one_step(runner, seqs)
    few = _step(runner, rows[: ql.AMX_MIN_ROWS - 1])  # below the switch: the integer kernels, still equal
    _check_one_step(runner, few)


@needs_onednn_bf16
def test_an_amx_prefill_keeps_q_k_v_in_bf16_and_agrees_with_the_float32_path(monkeypatch):
    """A fresh prompt on the AMX path (bf16 GEMMs, bf16 attention and KV cache): q/k/v stay bf16 from
    the qkv GEMM into o_proj, and the hidden states and cache writes agree with the float32 round
    trips to bf16 precision. (Decode steps keep the stack's float32 arithmetic: the test above.)"""
    import kvserve.model.quant_linear as ql

    monkeypatch.setattr(ql, "amx_gemm_available", lambda: True)
    runner = _runner("int4", kv="bfloat16")
    assert runner.attention.prefill_dtype == torch.bfloat16
    seqs = _step(runner, [(40, 0)])  # one fresh prompt: not a step the native stack runs
    attn = runner.model.layers[0].self_attn
    seen: dict[str, torch.dtype] = {}
    mlp = runner.model.layers[0].mlp
    hooks = [attn.qkv.register_forward_hook(lambda m, i, o: seen.update(qkv_in=i[0].dtype, qkv_out=o.dtype)),
             attn.o_proj.register_forward_hook(lambda m, i, o: seen.update(o_in=i[0].dtype, o_out=o.dtype)),
             mlp.gate_up.register_forward_hook(lambda m, i, o: seen.update(mlp_in=i[0].dtype)),
             mlp.down.register_forward_hook(lambda m, i, o: seen.update(mlp_out=o.dtype))]
    try:
        got, got_caches = _forward(runner, seqs, native=True)
        # the norms write the bf16 the GEMMs read, whose bf16 outputs go into the float32 residual as they are
        assert set(seen.values()) == {torch.bfloat16} and len(seen) == 6
        runner.attention.prefill_dtype = None  # the float32 round trips (attention in float32)
        ref, ref_caches = _forward(runner, seqs, native=True)
        assert seen["qkv_out"] == torch.float32
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(got, ref, atol=0.05, rtol=0.05)
    for (gk, gv), (rk, rv) in zip(got_caches, ref_caches):
        torch.testing.assert_close(gk.float(), rk.float(), atol=0.05, rtol=0.05)
        torch.testing.assert_close(gv.float(), rv.float(), atol=0.05, rtol=0.05)


@needs_onednn_bf16
def test_warm_up_compiles_each_amx_linear_shape_at_each_row_bucket(monkeypatch):
    """The start-up warm-up runs every distinct AMX linear shape once per row count ``padded_rows``
    can hand it (the LM head up to the sampled rows): what the first steps would compile otherwise."""
    import kvserve.model.quant_linear as ql
    from kvserve.model.layers import padded_rows

    monkeypatch.setattr(ql, "amx_gemm_available", lambda: True)
    model = _runner("int4").model
    shapes = {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, ql.QuantLinear)
              and m is not model.lm_head}
    tile_rows = model.layers[0].mlp.down.tile_rows  # the decoder's tile copies (AMX CPUs) take these rows
    assert tile_rows == (torch.ops.kvserve.amx_linear_max_rows() if torch.ops.kvserve.amx_gemm_available() else 0)
    buckets = len({padded_rows(r) for r in range(max(ql.AMX_MIN_ROWS, tile_rows + 1), 301)})
    head = len({padded_rows(r) for r in range(ql.AMX_MIN_ROWS, 21)}) if isinstance(model.lm_head, ql.QuantLinear) else 0
    assert model.warm_up(300, 20) == len(shapes) * buckets + head
    monkeypatch.setattr(ql, "amx_gemm_available", lambda: False)
    assert _runner("int4").model.warm_up(300, 20) == 0  # nothing to compile off AMX


@needs_onednn_bf16
def test_an_amx_lm_head_hands_its_bf16_logits_to_native_draws_only(monkeypatch):
    """On the AMX path the LM head's GEMM writes bf16 logits: ``logits(keep_bf16=True)`` returns
    them unconverted (the float32 ones are exactly their conversion), and the runner asks for them
    only when the sampler's native draws are all that read them."""
    import kvserve.model.quant_linear as ql

    monkeypatch.setattr(ql, "amx_gemm_available", lambda: True)
    hf = tiny_hf_model(kv_heads=2, hidden=64, layers=2)
    llm = LLM.from_weights(kvserve_config(hf), hf_weights(hf), dtype="float32", quantization="int8", num_kv_blocks=64,
                           deterministic=False)  # the AMX paths are what this checks
    runner = llm.engine.runner
    hidden = torch.randn(ql.AMX_MIN_ROWS + 2, runner.cfg.hidden_size)
    kept = runner.model.logits(hidden, keep_bf16=True)
    assert kept.dtype == torch.bfloat16 and torch.equal(kept.float(), runner.model.logits(hidden))
    few = hidden[: ql.AMX_MIN_ROWS - 1]  # the integer kernel: float32 either way
    assert runner.model.logits(few, keep_bf16=True).dtype == torch.float32
    seen: list[torch.dtype] = []
    sampler = runner.sampler

    class Spy:  # the runner calls self.sampler(...): record the logits' dtype on the way
        def __getattr__(self, name):
            return getattr(sampler, name)

        def __call__(self, logits, reqs):
            seen.append(logits.dtype)
            return sampler(logits, reqs)

    runner.sampler = Spy()
    # an AMX build draws such steps inside the head, with no logits (tests/sampling/test_head_draw.py)
    monkeypatch.setattr(runner.model, "draws_in_head", lambda *a: False)
    prompts = [[3 + i, 4, 5] for i in range(ql.AMX_MIN_ROWS + 2)]
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, greedy)
    assert torch.bfloat16 in seen
    seen.clear()
    llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1))
    assert seen and torch.bfloat16 not in seen


@needs_onednn_bf16
def test_on_amx_an_moe_step_whose_experts_take_their_bf16_copies_runs_the_python_layers(monkeypatch):
    """A step whose experts average AMX_MIN_ROWS rows or more runs them on their bf16 AMX copies in the Python
    layers' loop (MoE.loop_takes); the stack, whose experts stay on the integer kernels, leaves such steps to
    the Python layers, and takes the smaller ones (forced AMX: emulated where the CPU lacks it)."""
    import kvserve.model.decoder as decoder
    import kvserve.model.quant_linear as ql

    monkeypatch.setattr(ql, "amx_gemm_available", lambda: True)
    runner = _runner("int8", arch="Qwen3MoeForCausalLM")  # 4 experts, top-2: 32 rows average 16 an expert
    assert runner.model.native_stack is not None
    ran: list[bool] = []
    real = decoder.run_native_stack
    monkeypatch.setattr(decoder, "run_native_stack", lambda *a: ran.append(real(*a)) or ran[-1])
    for rows in (2 * ql.AMX_MIN_ROWS - 1, 2 * ql.AMX_MIN_ROWS):
        _check_one_step(runner, _step(runner, [(1, 3 + i % 5) for i in range(rows)]))
    assert ran == [True, False]  # the stack ran the first step, not the second
