"""gpt-oss's MXFP4 experts: kept as q8_0 blocks (the same values, 8.5 bits a weight) or dequantized.

The conversion against ``dequantize_mxfp4`` over every code and every scale q8_0 holds; then a tiny gpt-oss
whose experts are stored in MXFP4 (``<name>_blocks``/``_scales``, as published): dequantized with
``--quantization none`` its greedy tokens equal transformers'; kept (the default), every expert loads as a
q8_0 weight equal bit for bit to the dequantized one, runs on the q8_0 GEMM in 8.5 bits a weight, and stays
within the logprob closeness of the dequantized model.
"""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy
from kvserve import SamplingParams
from kvserve.kernels import load_kernels
from kvserve.model.loader import load_model
from kvserve.model.mxfp4 import dequantize_mxfp4, mxfp4_experts_q8_0
from kvserve.model.quant import QuantExperts, from_mxfp4
from kvserve.model.weight_layout import unstack_experts
from test_architectures import COMMON, GREEDY, assert_logprobs_close, hf_model, make_llm, prompts, word_tokenizer


def _random_mxfp4(experts: int, rows: int, cols: int, exponents: tuple[int, int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(*exponents, (experts, rows, cols // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


@pytest.mark.parametrize("interleaved", [False, True])
def test_q8_0_holds_the_mxfp4_values_exactly(interleaved):
    """Every code under every scale q8_0's fp16 holds (2^-23 .. 2^16): each expert's q8_0 weight dequantizes
    to dequantize_mxfp4's values, bit for bit in float32 (gate's rows first where they alternate)."""
    blocks, scales = _random_mxfp4(3, 8, 64, (104, 144))
    scales[0, 0, 0], scales[0, 0, 1] = 104, 143  # both ends
    dense = dequantize_mxfp4(blocks, scales, torch.float32)  # [E, in, out]
    kept = mxfp4_experts_q8_0(blocks, scales, interleaved)
    assert isinstance(kept, QuantExperts) and kept.shape == dense.shape
    for e, qw in enumerate(kept.experts):
        want = dense[e].t()
        if interleaved:
            want = torch.cat([want[0::2], want[1::2]])
        assert qw.kind == "q8_0" and torch.equal(qw.dequantize(torch.float32), want)


def test_scales_q8_0_cannot_hold_are_refused_unless_the_block_is_zero():
    codes = torch.randint(1, 8, (2, 64), dtype=torch.uint8)
    with pytest.raises(ValueError, match="outside"):
        from_mxfp4(codes, torch.full((2, 2), 100, dtype=torch.uint8))
    codes[:, :32] = 8  # -0.0 in every code of the first blocks: any scale gives zeros
    exponents = torch.tensor([[0, 127], [255, 120]], dtype=torch.uint8)
    qw = from_mxfp4(codes, exponents)
    assert torch.equal(qw.dequantize()[:, :32], torch.zeros(2, 32))
    assert torch.equal(qw.dequantize()[:, 32:], dequantize_mxfp4(
        torch.zeros(1, 2, 1, 16, dtype=torch.uint8) | (codes[:, 32::2] | codes[:, 33::2] << 4).view(1, 2, 1, 16),
        exponents[:, 1].view(1, 2, 1), torch.float32)[0].t())


_folder: list = []


def mxfp4_experts(model, seed: int = 3) -> dict[str, torch.Tensor]:
    """Random MXFP4 experts for a transformers gpt-oss: its expert weights set to their values (as transformers
    dequantizes them), and the checkpoint's ``<name>_blocks``/``_scales`` tensors returned."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = {}
    for i, layer in enumerate(model.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(layer.mlp.experts, proj)  # [experts, in, out]; MXFP4 stores [experts, out, in / 32, 16]
            experts, cols, rows = param.shape
            blocks, scales = _random_mxfp4(experts, rows, cols, (122, 125), seed=seed + len(tensors))
            with torch.no_grad():
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            tensors[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = blocks
            tensors[f"model.layers.{i}.mlp.experts.{proj}_scales"] = scales
    return tensors


def mxfp4_checkpoint(tmp_path_factory):
    """(transformers model holding the dequantized experts, its folder with the experts in MXFP4)."""
    from safetensors.torch import load_file, save_file

    if _folder:
        return _folder[0]
    model = hf_model("GptOssForCausalLM")
    tensors = mxfp4_experts(model)
    folder = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    model.save_pretrained(folder)
    word_tokenizer(COMMON["vocab_size"]).save_pretrained(folder)
    stored = load_file(folder / "model.safetensors")
    stored = {k: v for k, v in stored.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**stored, **tensors}, folder / "model.safetensors", metadata={"format": "pt"})
    _folder.append((model, folder))
    return _folder[0]


def test_gpt_oss_mxfp4_experts_load_dequantized(tmp_path_factory):
    """--quantization none: the experts dequantized at load (as transformers does: the same values), and the
    answers of transformers with those weights."""
    model, folder = mxfp4_checkpoint(tmp_path_factory)
    loaded = load_model(folder)
    assert loaded.weights["model.layers.0.mlp.experts.down_proj"].dtype == torch.bfloat16
    llm = make_llm(folder, max_num_batched_tokens=512)
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == [hf_greedy(model, p, GREEDY.max_tokens)
                                                                    for p in prompts()]


def test_gpt_oss_mxfp4_experts_kept_as_q8_0(tmp_path_factory):
    """Kept quantized (the default): each expert is a q8_0 weight holding the dequantized path's values bit for
    bit, 8.5 bits a weight against bf16's 16; the model runs them on the q8_0 GEMM and stays within the logprob
    closeness of the dequantized model."""
    _, folder = mxfp4_checkpoint(tmp_path_factory)
    cfg = load_model(folder).config
    dense = unstack_experts(cfg, load_model(folder).weights)
    kept = load_model(folder, keep_quantized=True).weights
    stacked = [w for w in kept.values() if isinstance(w, QuantExperts)]
    assert len(stacked) == 2 * cfg.num_hidden_layers
    weights = sum(e.shape.numel() for e in stacked)
    assert sum(e.nbytes for e in stacked) * 8 / weights == 8.5
    for name, w in unstack_experts(cfg, kept).items():
        if ".unstacked." in name and name.endswith(".weight"):
            assert torch.equal(w.dequantize(torch.float32), dense[name].float()), name

    # top 5, not 3: this random model has steps with four tokens within 0.03, which activation rounding reorders
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    quant_llm = make_llm(folder, quantization="auto", max_num_batched_tokens=512)
    expert = quant_llm.engine.runner.model.layers[0].mlp.experts[1]
    for linear in (expert.gate_up, expert.down):
        assert type(linear).__name__ == "QuantLinear" and linear.kind == "q8_0"
        if load_kernels():  # the packed copy the GEMM reads is all it keeps (no dense one; no AMX copy here)
            assert linear.dense is None
            if linear.amx is None:
                assert linear.packed.nbytes * 8 / (linear.out_features * linear.in_features) == 8.5
    dense_out = make_llm(folder, max_num_batched_tokens=512).generate(prompts(), params)
    assert_logprobs_close(dense_out, quant_llm.generate(prompts(), params), "gpt-oss mxfp4")


def test_gpt_oss_mxfp4_experts_under_int4_are_requantized(tmp_path_factory):
    """--quantization int4 asks for 4-bit weights: the experts' q8_0 (MXFP4's values) is requantized to Q4_1."""
    _, folder = mxfp4_checkpoint(tmp_path_factory)
    expert = make_llm(folder, quantization="int4").engine.runner.model.layers[1].mlp.experts[0]
    assert (expert.gate_up.kind, expert.down.kind) == ("q4_1", "q4_1")
