"""GGUF files of more of llama.cpp's families (its older, GPT-2-shaped ones first), against transformers.

As test_gguf_families.py: a tiny random checkpoint from test_architectures.py written the way llama.cpp's
convert_hf_to_gguf.py writes that family (names through gguf-py's own tensor map, only the metadata keys its
converter writes, its tensor transforms: fused q/k/v reordered to q, k, v, GPT-2's Conv1D weights transposed back);
kvserve's loader gets the checkpoint's weights back (in the layout the Hugging Face loader gives them), the same
``ModelConfig`` as from config.json, and greedy tokens equal to transformers'; transformers' own GGUF reader gets the
original weights back where it reads the family.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file

from conftest import hf_greedy
from kvserve import SamplingParams
from kvserve.model.architectures import get_architecture
from kvserve.model.loader import load_model, load_model_config
from kvserve.model.quant import QuantWeight
from kvserve.model.weight_layout import standard_layout
from test_architectures import CASES as ARCH_CASES
from test_architectures import GREEDY, assert_logprobs_close, hf_model, prompts
from test_gguf_families import _add_tokenizer, _llm, _permute, _stack_experts

# case -> (test_architectures case, overrides of it, llama.cpp's architecture)
CASES: dict[str, tuple[str, dict, str]] = {
    # parallel: a norm each for attention and the MLP (the converter's use_parallel_residual key says which form)
    "gptneox": ("GPTNeoXForCausalLM", {}, "gptneox"),
    "gptneox:sequential": ("GPTNeoXForCausalLM:sequential", {}, "gptneox"),
    # tied as GPT-2 is; the converter writes the embedding again as the output tensor (so the file is untied)
    "gpt2": ("GPT2LMHeadModel", dict(tie_word_embeddings=True), "gpt2"),
    "starcoder": ("GPTBigCodeForCausalLM", {}, "starcoder"),  # one KV head
    # llama.cpp's falcon graph runs the parallel, rotary forms: the new decoder (two KV heads, a norm each for attention
    # and the MLP; the converter's MLP size is 4 x hidden), with one norm, and the old multi-query one (no biases: the
    # converter's q/k/v reshape takes a weight's 4 dimensions only)
    "falcon": ("FalconForCausalLM", dict(ffn_hidden_size=None), "falcon"),
    "falcon:one_norm": ("FalconForCausalLM:one_norm", dict(bias=False), "falcon"),
    "falcon:multi_query": ("FalconForCausalLM:multi_query", {}, "falcon"),
    "bloom": ("BloomForCausalLM", dict(tie_word_embeddings=True), "bloom"),  # tied, as BLOOM is
    "mpt": ("MptForCausalLM", {}, "mpt"),  # ALiBi's bias max and the q/k/v clamp as their keys
    "olmo": ("OlmoForCausalLM", {}, "olmo"),  # norms without weights (no tensors), the clamp; q/k rows permuted
    # longrope's factors as tensors and the attention factor Phi-3's converter derives (llama.cpp's, in place of
    # Phi-3.5-MoE's short and long mscale: here both that factor, so transformers' model is the file's)
    "phimoe": ("PhimoeForCausalLM", dict(rope_scaling={
        **ARCH_CASES["PhimoeForCausalLM"][1]["rope_scaling"], "short_mscale": math.sqrt(1.5),
        "long_mscale": math.sqrt(1.5)}), "phimoe"),
    # experts restacked flat from the file's [experts, rows, cols]; renormalised top-k weights (llama.cpp's graph has
    # no other form: not the ":plain" case)
    "dbrx": ("DbrxForCausalLM", {}, "dbrx"),
    # the NTK alpha folded into the rope base by the converter (no scaling left), the context 256K
    "hunyuan-dense": ("HunYuanDenseV1ForCausalLM", {}, "hunyuan-dense"),
    "hunyuan-moe": ("HunYuanMoEV1ForCausalLM", {}, "hunyuan-moe"),  # and experts beside one shared MLP
    # sigmoid scores chosen with exp_probs_b, shared experts, a dense layer first; llama.cpp's dots1 graph has neither
    # expert groups nor a window (nor does dots.llm1 use them)
    "dots1": ("Dots1ForCausalLM", dict(n_group=1, topk_group=1, sliding_window=None), "dots1"),
    # sigmoid scores chosen with exp_probs_b, whole-projection q/k norms, the rotating dims
    "minimax-m2": ("MiniMaxM2ForCausalLM", {}, "minimax-m2"),
    # LayerNorms, a relu2 MLP, biases (the file has no activation key: llama.cpp's graph is relu2's)
    "jais2": ("Jais2ForCausalLM", {}, "jais2"),
    # latent attention (kv_b whole), no rope scaling; llama.cpp's graph fixes MiniCPM's multipliers (scale_emb 12,
    # scale_depth 1.4, dim_model_base 256) and v's width (hidden / heads): the test model takes them
    "minicpm3": ("MiniCPM3ForCausalLM", dict(scale_emb=12.0, dim_model_base=256, v_head_dim=16), "minicpm3"),
    # EXAONE 4's window pattern (a bool a layer) over DeepSeek-V3's router keys (groups, exp_probs_b, shared experts,
    # a dense layer first)
    "exaone-moe": ("ExaoneMoeForCausalLM", {}, "exaone-moe"),
}
# the ModelConfig fields a case's file sets otherwise than its config.json, on purpose (field -> the file's value)
CONFIG_DIFFERS: dict[str, dict] = {"gpt2": {"tie_word_embeddings": False},
                                   # the converter writes a context of 2048 whatever the model's
                                   **{c: {"max_position_embeddings": 2048} for c in CASES if c.startswith("falcon")},
                                   "bloom": {"max_position_embeddings": 48},  # (BLOOM's converter: the hidden size)
                                   # the experts' size (unused: every layer is MoE; the test config's is COMMON's)
                                   "dbrx": {"intermediate_size": 32},
                                   **{c: {"max_position_embeddings": 256 * 1024, "rope_theta": 10000 * 1000 ** (16 / 14)}
                                      for c in ("hunyuan-dense", "hunyuan-moe")}}
ROPE_FOLDED = {"hunyuan-dense", "hunyuan-moe"}  # the file's rope base is the scaled one: no scaling dict
TRANSFORMERS_READS = {"gpt2", "bloom", "minimax-m2"}  # the cases transformers' GGUF reader has the architecture of


def _text_model(w: gguf.GGUFWriter, d: dict) -> None:
    """TextModel.set_gguf_parameters, the keys most converters start from (each where config.json has its key)."""
    rope = d.get("rope_parameters") or {}
    w.add_block_count(d["num_hidden_layers"])
    w.add_context_length(d["max_position_embeddings"])
    w.add_embedding_length(d["hidden_size"])
    w.add_feed_forward_length(d["intermediate_size"])
    w.add_head_count(d["num_attention_heads"])
    if d.get("num_key_value_heads") is not None:
        w.add_head_count_kv(d["num_key_value_heads"])
    if rope.get("rope_theta") is not None:
        w.add_rope_freq_base(rope["rope_theta"])
    if d.get("rms_norm_eps") is not None:
        w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    experts = d.get("num_local_experts") or d.get("num_experts")
    if experts:
        w.add_expert_count(experts)
    if d.get("num_experts_per_tok"):
        w.add_expert_used_count(d["num_experts_per_tok"])
    if d.get("head_dim") is not None:
        w.add_key_length(d["head_dim"])
        w.add_value_length(d["head_dim"])


def _permuted_qk(state: dict[str, torch.Tensor], d: dict) -> dict[str, torch.Tensor]:
    """LlamaModel.permute on q's and k's weights (not their biases), for GGML's rope on adjacent pairs."""
    heads, kv_heads = d["num_attention_heads"], d["num_key_value_heads"]
    return {n: _permute(t, heads) if n.endswith("q_proj.weight") else _permute(t, kv_heads)
            if n.endswith("k_proj.weight") else t for n, t in state.items()}


def _olmo(w: gguf.GGUFWriter, d: dict) -> None:
    """OlmoModel.set_gguf_parameters: TextModel's, the LayerNorms' eps 1e-5, the clamp."""
    _text_model(w, d)
    w.add_layer_norm_eps(1e-5)
    if d.get("clip_qkv") is not None:
        w.add_clamp_kqv(d["clip_qkv"])


def _gptneox(w: gguf.GGUFWriter, d: dict) -> None:
    """GPTNeoXModel.set_gguf_parameters: no rope base (llama.cpp's default 10000), the rotating dims, the residual's
    form."""
    heads = d["num_attention_heads"]
    w.add_context_length(d["max_position_embeddings"])
    w.add_embedding_length(d["hidden_size"])
    w.add_block_count(d["num_hidden_layers"])
    w.add_feed_forward_length(d["intermediate_size"])
    pct = d.get("rotary_pct") or d["rope_parameters"]["partial_rotary_factor"]  # (transformers 5 moved it)
    w.add_rope_dimension_count(int(pct * (d["hidden_size"] // heads)))
    w.add_head_count(heads)
    w.add_parallel_residual(d.get("use_parallel_residual", True))
    w.add_layer_norm_eps(d["layer_norm_eps"])


def _qkv_per_head_to_qkv(state: dict[str, torch.Tensor], d: dict) -> dict[str, torch.Tensor]:
    """GPTNeoXModel.modify_tensors: the fused q/k/v (head by head: q, k, v of each) as all q's rows, k's, v's."""
    heads = d.get("num_attention_heads") or d["n_head"]
    out = {}
    for name, t in state.items():
        if ".query_key_value." in name:
            t = torch.cat(list(t.reshape(heads, 3, -1, *t.shape[1:]).unbind(1))).reshape(t.shape)
        out[name] = t
    return out


def _gpt2(w: gguf.GGUFWriter, d: dict) -> None:
    """GPT2Model.set_gguf_parameters: the MLP's size always 4 x n_embd (the test model's n_inner is unset)."""
    w.add_block_count(d["n_layer"])
    w.add_context_length(d["n_positions"])  # (n_ctx in the configs the converter was written for)
    w.add_embedding_length(d["n_embd"])
    w.add_feed_forward_length(4 * d["n_embd"])
    w.add_head_count(d["n_head"])
    w.add_layer_norm_eps(d["layer_norm_epsilon"])


def _gpt2_tensors(state: dict[str, torch.Tensor], d: dict) -> dict[str, torch.Tensor]:
    """GPT2Model.modify_tensors: the Conv1D weights ([in, out]) transposed, the masks dropped, and the embedding
    written a second time as the output tensor."""
    out = {}
    for name, t in state.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        out[name] = t.t() if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")) else t
        if name.endswith("wte.weight"):
            out["output.weight"] = t
    return out


def _starcoder(w: gguf.GGUFWriter, d: dict) -> None:
    """StarCoderModel.set_gguf_parameters: GPT-2's keys and one KV head."""
    _gpt2(w, d)
    w.add_head_count_kv(1)


def _falcon(w: gguf.GGUFWriter, d: dict) -> None:
    """FalconModel.set_gguf_parameters: the KV heads from num_kv_heads, else 1 (the old decoder's config.json has no
    such key: transformers' saved one says every head, which the multi-query model does not have)."""
    kv = d["num_kv_heads"] if d.get("new_decoder_architecture") else 1
    w.add_context_length(2048)
    w.add_tensor_data_layout("jploski")
    w.add_embedding_length(d["hidden_size"])
    w.add_feed_forward_length(4 * d["hidden_size"])
    w.add_block_count(d["num_hidden_layers"])
    w.add_head_count(d["num_attention_heads"])
    w.add_head_count_kv(kv)
    w.add_layer_norm_eps(d["layer_norm_epsilon"])


def _falcon_qkv(state: dict[str, torch.Tensor], d: dict) -> dict[str, torch.Tensor]:
    """FalconModel.modify_tensors: query_key_value's KV-head groups (their queries, key, value) as every q row, then
    k's, then v's."""
    heads = d["num_attention_heads"]
    kv = d["num_kv_heads"] if d.get("new_decoder_architecture") else 1
    head_dim = d["hidden_size"] // heads
    out = {}
    for name, t in state.items():
        if "query_key_value" in name:
            qkv = t.view(kv, heads // kv + 2, head_dim, *t.shape[1:])
            t = torch.cat([qkv[:, :-2].reshape(-1, *t.shape[1:]), qkv[:, -2].reshape(-1, *t.shape[1:]),
                           qkv[:, -1].reshape(-1, *t.shape[1:])]).reshape(t.shape)
        out[name] = t
    return out


def _bloom(w: gguf.GGUFWriter, d: dict) -> None:
    """BloomModel.set_gguf_parameters: the context from seq_length, else the hidden size (sic: BLOOM's config.json has
    no context length)."""
    w.add_context_length(d.get("seq_length", d["hidden_size"]))
    w.add_embedding_length(d["hidden_size"])
    w.add_feed_forward_length(4 * d["hidden_size"])
    w.add_block_count(d["n_layer"])
    w.add_head_count(d["n_head"])
    w.add_head_count_kv(d["n_head"])
    w.add_layer_norm_eps(d["layer_norm_epsilon"])


def _bloom_tensors(state: dict[str, torch.Tensor], d: dict) -> dict[str, torch.Tensor]:
    """BloomModel.modify_tensors: the "transformer." prefix dropped (gguf-py maps the embedding norm without it), the
    fused q/k/v as GPT-NeoX's."""
    return _qkv_per_head_to_qkv({n.removeprefix("transformer."): t for n, t in state.items()}, d)


def _mpt(w: gguf.GGUFWriter, d: dict) -> None:
    """MPTModel.set_gguf_parameters: the LayerNorms' eps fixed at 1e-5, the clamp and ALiBi's bias max (0: none)."""
    attn = d["attn_config"]
    w.add_context_length(d["max_seq_len"])
    w.add_embedding_length(d["d_model"])
    w.add_block_count(d["n_layers"])
    w.add_feed_forward_length(4 * d["d_model"])
    w.add_head_count(d["n_heads"])
    if attn.get("kv_n_heads"):
        w.add_head_count_kv(attn["kv_n_heads"])
    w.add_layer_norm_eps(1e-5)
    if attn["clip_qkv"] is not None:
        w.add_clamp_kqv(attn["clip_qkv"])
    w.add_max_alibi_bias(attn["alibi_bias_max"] if attn["alibi"] else 0.0)


def _phimoe(w: gguf.GGUFWriter, d: dict) -> None:
    """PhiMoeModel's keys (Phi3MiniModel's: the rotating dims, the original context, a window of 0 where none;
    longrope's attention factor from the two lengths, its factors as tensors) and the expert counts."""
    rope = d["rope_parameters"]
    heads, hidden, original = d["num_attention_heads"], d["hidden_size"], rope["original_max_position_embeddings"]
    w.add_context_length(d["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(d["intermediate_size"])
    w.add_block_count(d["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(d["num_key_value_heads"])
    w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(d.get("sliding_window") or 0)
    scale = d["max_position_embeddings"] / original
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    w.add_expert_used_count(d["num_experts_per_tok"])
    w.add_expert_count(d["num_local_experts"])


def _experts(state: dict[str, torch.Tensor], d: dict) -> dict[str, torch.Tensor]:
    """Each layer's experts stacked in one tensor per weight, as the MoE converters write them."""
    experts = d.get("num_local_experts") or d.get("num_experts")
    return _stack_experts(state, d["num_hidden_layers"], experts)


def _dbrx(w: gguf.GGUFWriter, d: dict) -> None:
    """DbrxModel.set_gguf_parameters: the nested configs' keys, the LayerNorms' eps fixed at 1e-5."""
    attn, ffn = d["attn_config"], d["ffn_config"]
    w.add_block_count(d["n_layers"])
    w.add_context_length(d["max_seq_len"])
    w.add_embedding_length(d["d_model"])
    w.add_feed_forward_length(ffn["ffn_hidden_size"])
    w.add_head_count(d["n_heads"])
    w.add_head_count_kv(attn["kv_n_heads"])
    w.add_rope_freq_base(attn["rope_theta"])
    w.add_clamp_kqv(attn["clip_qkv"])
    w.add_expert_count(ffn["moe_num_experts"])
    w.add_expert_used_count(ffn["moe_top_k"])
    w.add_layer_norm_eps(1e-5)


def _dbrx_experts(state: dict[str, torch.Tensor], d: dict) -> dict[str, torch.Tensor]:
    """DbrxModel.modify_tensors: each flat expert tensor [experts * ff, d_model] viewed [experts, ff, d_model] (down's
    transposed to [experts, d_model, ff]) and named with a ".weight"."""
    experts, ff = d["ffn_config"]["moe_num_experts"], d["ffn_config"]["ffn_hidden_size"]
    out = {}
    for name, t in state.items():
        if name.rpartition(".")[2] in ("w1", "v1", "w2") and ".experts." in name:
            t = t.view(experts, ff, -1)
            name, t = name + ".weight", t.transpose(1, 2) if name.endswith("w2") else t
        out[name] = t
    return out


def _hunyuan(w: gguf.GGUFWriter, d: dict) -> None:
    """HunYuanModel.set_gguf_parameters: TextModel's; a "dynamic" scaling's alpha folded into the base, no scaling, a
    256K context (its check that the config's is 32K or 256K left out)."""
    _text_model(w, d)
    rope = d["rope_parameters"]
    if rope.get("rope_type") == "dynamic":
        dim = d["head_dim"]
        w.add_rope_freq_base(rope["rope_theta"] * rope.get("alpha", 50) ** (dim / (dim - 2)))
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        w.add_rope_scaling_factor(1)
        w.add_rope_scaling_orig_ctx_len(256 * 1024)
        w.add_context_length(256 * 1024)


def _hunyuan_moe(w: gguf.GGUFWriter, d: dict) -> None:
    """HunYuanMoEModel.set_gguf_parameters: HunYuan's, the experts' counts and sizes (transformers' config has no
    moe_intermediate_size nor num_shared_expert, which the converter reads: its model sizes every expert by
    intermediate_size, with one shared MLP)."""
    _hunyuan(w, d)
    w.add_expert_shared_feed_forward_length(d["intermediate_size"])
    w.add_expert_feed_forward_length(d["intermediate_size"])
    w.add_expert_shared_count(1)
    w.add_expert_used_count(d["moe_topk"])


def _dots1(w: gguf.GGUFWriter, d: dict) -> None:
    """Dots1Model.set_gguf_parameters: Qwen2MoeModel's (TextModel's, the experts' size) and DeepSeek-V3's router keys
    (sigmoid: its only scoring_func)."""
    _text_model(w, {**d, "num_experts": d["n_routed_experts"]})
    w.add_expert_feed_forward_length(d["moe_intermediate_size"])
    w.add_leading_dense_block_count(d["first_k_dense_replace"])
    w.add_expert_shared_count(d["n_shared_experts"])
    w.add_expert_weights_scale(d["routed_scaling_factor"])
    w.add_expert_weights_norm(d["norm_topk_prob"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _selection_bias_experts(state: dict[str, torch.Tensor], d: dict) -> dict[str, torch.Tensor]:
    """The experts stacked, and the router's selection bias named as a bias (as the converters rename it)."""
    state = {n.replace("e_score_correction_bias", "e_score_correction.bias"): t for n, t in state.items()}
    return _experts(state, {**d, "num_experts": d.get("n_routed_experts") or d.get("num_experts")})


def _minimax_m2(w: gguf.GGUFWriter, d: dict) -> None:
    """MiniMaxM2Model.set_gguf_parameters: TextModel's, the scoring function, the experts' size, the rotating dims."""
    _text_model(w, d)
    functions = {"sigmoid": gguf.ExpertGatingFuncType.SIGMOID, "softmax": gguf.ExpertGatingFuncType.SOFTMAX}
    w.add_expert_gating_func(functions[d.get("scoring_func") or "sigmoid"])
    w.add_expert_feed_forward_length(d["intermediate_size"])
    rotary = d.get("rotary_dim") or int(d["rope_parameters"]["partial_rotary_factor"] * d["head_dim"])
    w.add_rope_dimension_count(rotary)


def _layer_norm_text_model(w: gguf.GGUFWriter, d: dict) -> None:
    """TextModel.set_gguf_parameters of a config with LayerNorms (their eps key)."""
    _text_model(w, d)
    w.add_layer_norm_eps(d["layer_norm_eps"])


def _minicpm3(w: gguf.GGUFWriter, d: dict) -> None:
    """MiniCPM3Model.set_gguf_parameters: the latent shapes (q's rank where it has one; the key's length, the rotating
    dims; no value length) (longrope's factors as tensors: not this test model, which has no scaling)."""
    w.add_context_length(d["max_position_embeddings"])
    w.add_embedding_length(d["hidden_size"])
    w.add_block_count(d["num_hidden_layers"])
    w.add_feed_forward_length(d["intermediate_size"])
    w.add_head_count(d["num_attention_heads"])
    w.add_head_count_kv(d["num_key_value_heads"])
    w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    w.add_vocab_size(d["vocab_size"])
    if d.get("q_lora_rank") is not None:
        w.add_q_lora_rank(d["q_lora_rank"])
    w.add_kv_lora_rank(d["kv_lora_rank"])
    w.add_key_length(d["qk_nope_head_dim"] + d["qk_rope_head_dim"])
    w.add_rope_dimension_count(d["qk_rope_head_dim"])


def _exaone_moe(w: gguf.GGUFWriter, d: dict) -> None:
    """The ExaoneMoE converter's keys as we take them to be: TextModel's, EXAONE 4's window and per-layer pattern, the
    DeepSeek-V3 router's (sigmoid), the MTP layers in the block count."""
    _text_model(w, {**d, "num_hidden_layers": d["num_hidden_layers"] + (d.get("num_nextn_predict_layers") or 0)})
    w.add_sliding_window(d["sliding_window"])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in d["layer_types"]])
    w.add_expert_feed_forward_length(d["moe_intermediate_size"])
    w.add_expert_shared_count(d["num_shared_experts"])
    w.add_leading_dense_block_count(d["mlp_layer_types"].index("sparse"))
    w.add_expert_weights_scale(d["routed_scaling_factor"])
    w.add_expert_weights_norm(d["norm_topk_prob"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(d["n_group"])
    w.add_expert_group_used_count(d["topk_group"])
    w.add_nextn_predict_layers(d.get("num_nextn_predict_layers") or 0)


# llama.cpp's architecture -> (its converter's metadata, its tensor transforms)
WRITERS: dict[str, tuple[Callable, Callable | None]] = {
    "gptneox": (_gptneox, _qkv_per_head_to_qkv),
    "gpt2": (_gpt2, _gpt2_tensors),
    "starcoder": (_starcoder, None),
    "falcon": (_falcon, _falcon_qkv),
    "bloom": (_bloom, _bloom_tensors),
    "mpt": (_mpt, None),
    "olmo": (_olmo, _permuted_qk),
    "phimoe": (_phimoe, _experts),
    "dbrx": (_dbrx, _dbrx_experts),
    "hunyuan-dense": (_hunyuan, None),
    "hunyuan-moe": (_hunyuan_moe, _experts),
    "dots1": (_dots1, _selection_bias_experts),
    "minimax-m2": (_minimax_m2, _selection_bias_experts),
    "jais2": (_layer_norm_text_model, None),
    "minicpm3": (_minicpm3, None),
    "exaone-moe": (_exaone_moe, _selection_bias_experts),
}


def write_gguf(model, folder: Path, path: Path, arch: str, linear_type: QT | None = None) -> None:
    """``folder``'s checkpoint as llama.cpp's converter writes it for ``arch`` (``linear_type``: every 2-D weight,
    embeddings included, quantized to that type, as llama-quantize writes them)."""
    d = model.config.to_dict()
    metadata, transform = WRITERS[arch]
    w = gguf.GGUFWriter(str(path), arch=arch)
    metadata(w, d)
    _add_tokenizer(w, d["vocab_size"])
    state = load_file(folder / "model.safetensors")
    if transform is not None:
        state = transform(state, d)
    layers = model.config.num_hidden_layers
    name_map = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], layers)
    for name, t in state.items():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue  # tied; the converter skips it
        gguf_name = name if name.startswith(("blk.", "output.")) else \
            name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        data = t.float().numpy()
        if linear_type is not None and data.ndim == 2 and data.shape[1] % 32 == 0:
            w.add_tensor(gguf_name, gguf.quants.quantize(data, linear_type), raw_dtype=linear_type)
        else:
            w.add_tensor(gguf_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_files: dict[tuple, tuple] = {}


def gguf_case(case: str, tmp_path_factory, linear_type: QT | None = None) -> tuple:
    """(transformers model, its checkpoint folder, the GGUF file) for ``case``, built once per session."""
    key = (case, linear_type)
    if key not in _files:
        name, overrides, arch = CASES[case]
        model = hf_model(name, **overrides)
        folder = tmp_path_factory.mktemp(f"gguf-{case.replace(':', '-')}")
        model.save_pretrained(folder)
        path = folder / f"{case.replace(':', '-')}.gguf"
        write_gguf(model, folder, path, arch, linear_type)
        _files[key] = (model, folder, path)
    return _files[key]


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_loads_the_checkpoint_weights(case, tmp_path_factory, monkeypatch):
    model, folder, path = gguf_case(case, tmp_path_factory)
    loaded = load_model(path)
    hf = load_model_config(folder)
    assert loaded.config.architecture == hf.architecture
    arch = get_architecture(hf.architecture)
    original = {arch.checkpoint_name(n): t for n, t in load_file(folder / "model.safetensors").items()}
    if model.config.tie_word_embeddings:
        original.pop("lm_head.weight", None)
    original = standard_layout(hf, original)  # the converter's layout is the one the HF loader makes
    if CONFIG_DIFFERS.get(case, {}).get("tie_word_embeddings") is False:  # the embedding written again as the output
        original["lm_head.weight"] = original["model.embed_tokens.weight"]
    gguf_config, hf_config = asdict(loaded.config), asdict(hf)
    for key, value in CONFIG_DIFFERS.get(case, {}).items():
        assert gguf_config.pop(key) == pytest.approx(value, rel=1e-6), key
        hf_config.pop(key)
    for key in ("eos_token_ids", "rope_scaling"):
        gguf_config.pop(key), hf_config.pop(key)
    for key in [k for k, v in hf_config.items() if isinstance(v, float)]:  # float32 in the file: eps, multipliers
        assert gguf_config.pop(key) == pytest.approx(hf_config.pop(key), rel=1e-6), key
    assert gguf_config == hf_config
    for key, value in ({} if case in ROPE_FOLDED else hf.rope_scaling or {}).items():
        if key in ("rope_type", "factor", "short_factor", "long_factor", "original_max_position_embeddings"):
            assert loaded.config.rope_scaling[key] == pytest.approx(value), key
    assert set(loaded.weights) == set(original)
    for name, t in original.items():
        got = loaded.weights[name]
        if got.shape != t.shape and got.numel() == t.numel():  # viewed in the engine's shape (a [1, experts] bias)
            got = got.reshape(t.shape)
        assert torch.equal(got, t), name

    if case not in TRANSFORMERS_READS:
        return
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    state = model.state_dict()
    if model.config.tie_word_embeddings and "lm_head.weight" not in theirs:
        state.pop("lm_head.weight")
    assert set(theirs) == set(state)
    for name, t in state.items():
        torch.testing.assert_close(theirs[name].reshape(t.shape), t, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_greedy_equals_transformers(case, tmp_path_factory):
    model, _, path = gguf_case(case, tmp_path_factory)
    want = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts()]
    got = [o.token_ids for o in _llm(path).generate(prompts(), GREEDY)]
    assert got == want


# the fused q/k/v families (their converters reorder q/k/v; GPT-2's transposed) and Falcon's renamed norms
DENSE_Q8_0 = ["gptneox", "gpt2", "falcon", "bloom", "mpt"]


@pytest.mark.parametrize("case", DENSE_Q8_0)
def test_gguf_q8_0_linears_stay_quantized_and_close(case, tmp_path_factory):
    """A file whose linears and embeddings are all Q8_0: they load as QuantWeights and run quantized, within the
    logprob closeness of the float32 file."""
    _, _, dense_path = gguf_case(case, tmp_path_factory)
    _, _, path = gguf_case(case, tmp_path_factory, linear_type=QT.Q8_0)
    loaded = load_model(path, keep_quantized=True)
    linears = [n for n, w in load_model(dense_path).weights.items() if w.dim() == 2 and w.shape[1] % 32 == 0]
    assert linears and all(isinstance(loaded.weights[n], QuantWeight) for n in linears)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    dense = _llm(dense_path).generate(prompts(), params)
    assert_logprobs_close(dense, _llm(path, quantization="auto").generate(prompts(), params), case)
