"""GGUF files of each family llama.cpp's converter writes, against transformers.

Each case is a tiny random checkpoint from test_architectures.py, written to a GGUF file here the way
llama.cpp's convert_hf_to_gguf.py writes it: names through gguf-py's own tensor map, experts stacked
one tensor a layer, q/k rows (and biases) permuted for the converter's Llama lineage ("llama": Mistral,
Mixtral; "granite", "smollm3"), Gemma's norms stored with the 1 added, Phi-3's stacked tensors and longrope factors as tensors, and only the metadata the converter
writes. Then: transformers' own GGUF reader gets the original weights back from the file where it
reads that architecture (so the writer follows llama.cpp's conventions); kvserve's loader gets them
too, and the same ``ModelConfig`` as from the checkpoint's config.json; its greedy tokens equal
transformers' ``generate`` on the original model (float32, ``--quantization none``); and experts
stored quantized stay quantized per expert and close to the dense model, as do dense files whose every
linear is Q8_0.
"""

from __future__ import annotations

import functools
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
from kvserve.llm import LLM
from kvserve.model.architectures import get_architecture
from kvserve.model.loader import load_model, load_model_config
from kvserve.model.quant import QuantExperts, QuantWeight
from kvserve.model.rotary import rope_inv_freq
from kvserve.model.weight_layout import standard_layout
from test_architectures import CASES as ARCH_CASES
from test_architectures import COMMON, GREEDY, assert_logprobs_close, hf_model, prompts
from test_mxfp4 import mxfp4_experts

# case -> (registered architecture, overrides of its test_architectures case, llama.cpp's architecture)
CASES: dict[str, tuple[str, dict, str]] = {
    "qwen3moe": ("Qwen3MoeForCausalLM", {}, "qwen3moe"),
    # a shared expert under its gate; every layer MoE (llama.cpp's qwen2moe has no dense layers)
    "qwen2moe": ("Qwen2MoeForCausalLM", dict(mlp_only_layers=[]), "qwen2moe"),
    "olmoe": ("OlmoeForCausalLM", {}, "olmoe"),
    # the file carries no query scale: llama.cpp's is the head size below the 27B model
    "gemma2": ("Gemma2ForCausalLM", dict(query_pre_attn_scalar=16), "gemma2"),
    # llama.cpp's five local layers to one global: six layers show both
    "gemma3": ("Gemma3ForCausalLM", dict(num_hidden_layers=6, layer_types=None), "gemma3"),
    "phi3": ("Phi3ForCausalLM", {}, "phi3"),
    # llama.cpp's "llama" converter writes no sliding window: Mistral is Llama there
    "mistral": ("MistralForCausalLM", dict(sliding_window=None), "llama"),
    "mixtral": ("MixtralForCausalLM", dict(sliding_window=None), "llama"),
    "gemma": ("GemmaForCausalLM", {}, "gemma"),
    "olmo2": ("Olmo2ForCausalLM", {}, "olmo2"),
    # OLMo 3 is "olmo2" with a window and its per-layer pattern
    "olmo2:olmo3": ("Olmo3ForCausalLM", dict(rope_scaling=None), "olmo2"),
    "seed_oss": ("SeedOssForCausalLM", {}, "seed_oss"),  # q/k/v biases and o_proj's
    "granite": ("GraniteForCausalLM", {}, "granite"),
    # the converter splits the stacked input_linear into gate's and up's expert tensors
    "granitemoe": ("GraniteMoeForCausalLM", {}, "granitemoe"),
    # the same file name; a shared expert's tensors (input_linear split into gate and up) and its size in the metadata
    "granitemoe:shared": ("GraniteMoeSharedForCausalLM", {}, "granitemoe"),
    # Granite 4.0 H: Mamba-2 layers and experts, no rotary; and (":dense") its MLP alone, with rotary (Bamba's form)
    "mamba2": ("Mamba2ForCausalLM", {}, "mamba2"),  # Mamba-2 blocks alone: no head count, no MLP
    "granitehybrid": ("GraniteMoeHybridForCausalLM:mamba", {}, "granitehybrid"),
    "granitehybrid:dense": ("GraniteMoeHybridForCausalLM:mamba", dict(num_local_experts=0, shared_intermediate_size=48,
                                                                     position_embedding_type="rope"), "granitehybrid"),
    # Qwen3.5: gated delta nets (more value heads than key heads: the converter tiles them) and gated attention; the
    # MoE model's experts and gated shared expert; llama.cpp knows the layers only by full_attention_interval (the
    # test cases' layer_types alternate)
    # (value heads of 32: whole Q8_0 blocks, which out_proj's columns permute as they are)
    "qwen35": ("Qwen3_5ForCausalLM", dict(full_attention_interval=2, linear_value_head_dim=32), "qwen35"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", dict(full_attention_interval=2), "qwen35moe"),
    # Qwen3-Next: in_proj_qkvz split by the converter into q, k, v whole and z; b and a grouped; the value heads as the
    # checkpoint orders them; experts with a gated shared expert in every layer (llama.cpp's qwen3next has no dense one)
    "qwen3next": ("Qwen3NextForCausalLM", dict(full_attention_interval=2, mlp_only_layers=[]), "qwen3next"),
    # llama.cpp's graph skips rotary on every 4th layer (no GGUF key): four layers show it
    "smollm3": ("SmolLM3ForCausalLM", dict(no_rope_layer_interval=4), "smollm3"),
    # the converter writes no window for starcoder2 (llama.cpp has none there)
    "starcoder2": ("Starcoder2ForCausalLM", dict(sliding_window=None), "starcoder2"),
    # no bias on any linear: the file's tensors and config.json's use_bias agree
    "starcoder2:no_bias": ("Starcoder2ForCausalLM", dict(sliding_window=None, use_bias=False), "starcoder2"),
    "glm4": ("Glm4ForCausalLM", {}, "glm4"),
    # LayerNorms, partial rotary; the parallel form has no ffn_norm tensors
    "stablelm": ("StableLmForCausalLM", {}, "stablelm"),
    "stablelm:parallel": ("StableLmForCausalLM:parallel", {}, "stablelm"),
    # bias-less LayerNorms, parallel, interleaved rotary (the converter leaves q/k rows as they are), a logit scale
    "command-r": ("CohereForCausalLM", {}, "command-r"),  # tied (gguf-py's command-r has no output tensor)
    # llama.cpp's graph: three windowed layers (rotary) to a global one (none), whatever the file says
    "cohere2": ("Cohere2ForCausalLM", dict(tie_word_embeddings=True), "cohere2"),
    "arcee": ("ArceeForCausalLM", {}, "arcee"),  # no gate: ffn_up and ffn_down only
    # the layers' kinds as one bool each (sliding: rotary; global: none)
    "exaone4": ("Exaone4ForCausalLM", {}, "exaone4"),
    # sigmoid scores, exp_probs_b, a scale, shared experts, a leading dense layer; the block count with an MTP layer
    "glm4moe": ("Glm4MoeForCausalLM:scaled", dict(num_nextn_predict_layers=1), "glm4moe"),
    # LayerNorms, parallel, a non-gated MLP, partial rotary, biases on every linear and the LM head ("output.bias")
    "phi2": ("PhiForCausalLM", {}, "phi2"),
    "ernie4_5": ("Ernie4_5ForCausalLM", {}, "ernie4_5"),
    "ernie4_5:use_bias": ("Ernie4_5ForCausalLM:use_bias", {}, "ernie4_5"),
    # experts chosen with exp_probs_b, shared experts, a leading dense layer
    "ernie4_5-moe": ("Ernie4_5_MoeForCausalLM", {}, "ernie4_5-moe"),
    # experts in MXFP4 (the converter repacks the checkpoint's blocks); what llama.cpp's graph fixes: the SwiGLU's
    # limit 7, yarn's correction range truncated
    "gpt-oss": ("GptOssForCausalLM", dict(swiglu_limit=7.0, rope_parameters={
        **ARCH_CASES["GptOssForCausalLM"][1]["rope_parameters"], "truncate": True}), "gpt-oss"),
    # latent attention as MQA-shaped metadata, kv_b split into k_b (transposed) and v_b; YaRN's mscale_all_dim as its
    # log multiplier; softmax experts from groups, shared experts, a leading dense layer
    "deepseek2": ("DeepseekV2ForCausalLM", {}, "deepseek2"),
    # the sigmoid gating function (V3's router: exp_probs_b, groups by their best two), q from its own latent
    "deepseek2:v3": ("DeepseekV3ForCausalLM", {}, "deepseek2"),
    # short convolutions (kernels squeezed to 2-D) around attention; KV heads per layer (0: a conv layer); the MLP's
    # size as derived; the final norm as token_embd_norm
    "lfm2": ("Lfm2ForCausalLM", {}, "lfm2"),
    # LayerNorm1P stored with the 1 added, partial rotary, a non-gated relu2 MLP, biases
    "nemotron": ("NemotronForCausalLM", {}, "nemotron"),
    # Ministral 3: Llama's lineage (q/k rows permuted), yarn, the query scale's beta as the attention temperature
    "mistral3": ("Ministral3ForCausalLM", {}, "mistral3"),
    # and experts (sigmoid, exp_probs_b, renormalised) after a leading dense layer (no scale: the test case's 1.5 off)
    "lfm2moe": ("Lfm2MoeForCausalLM", dict(routed_scaling_factor=1.0, tie_word_embeddings=True), "lfm2moe"),  # tied
    # Llama 3's rope scaling as the converter writes it: each rotary pair's frequency divisor in rope_freqs
    "llama": ("LlamaForCausalLM", {}, "llama"),
    # Nemotron-H: Mamba-2 blocks, attention without rotary, relu2 MLPs; and (nemotron_h_moe) experts of up and down with
    # a shared expert, sigmoid scores and a selection bias (one expert group: the file names no count to choose; the
    # dense width the experts' as no block is dense)
    "nemotron_h": ("NemotronHForCausalLM", dict(layers_block_type=["mamba", "mlp", "attention", "mlp"], num_hidden_layers=4),
                   "nemotron_h"),
    "nemotron_h_moe": ("NemotronHForCausalLM", dict(layers_block_type=["mamba", "moe", "attention", "moe", "mamba", "moe"],
                                                   n_group=1, topk_group=1, intermediate_size=32),  # (no dense MLP)
                       "nemotron_h_moe"),
    # Falcon-H1: attention beside Mamba-2 in every layer; the gated norm over y * silu(z) (llama.cpp's), its multipliers
    # all 1 (the converter folds them into the weights: test_gguf_falcon_h1_multipliers_are_folded_in)
    "falcon-h1": ("FalconH1ForCausalLM:gated", {}, "falcon-h1"),
    # Mamba-1 (the converter takes only an inner size of twice the width); Falcon Mamba's norms of dt, B and C, which
    # llama.cpp's graph takes with the layers' eps
    "mamba": ("MambaForCausalLM", dict(intermediate_size=128), "mamba"),
    # Mamba-1 layers with norms of dt, B and C; attention without positions; experts every other layer; llama.cpp knows
    # which by their tensors
    "jamba": ("JambaForCausalLM", {}, "jamba"),
    "mamba:falcon": ("FalconMambaForCausalLM", dict(intermediate_size=128, mixer_rms_eps=1e-5), "mamba"),
    # the text models of Qwen2-VL, Qwen3-VL and Qwen3-VL-MoE (flat; their rotary sections: plain rotary for text)
    "qwen2vl": ("Qwen2VLForConditionalGeneration", {}, "qwen2vl"),
    "qwen3vl": ("Qwen3VLForConditionalGeneration", {}, "qwen3vl"),
    "qwen3vlmoe": ("Qwen3VLMoeForConditionalGeneration", {}, "qwen3vlmoe"),
    # Gemma 3n: four AltUp streams (the converter takes no other count), LAuReL, sparse MLP gates on the first layer,
    # K/V shared by the last two layers, per-layer inputs, MLPs of two widths (one a layer)
    "gemma3n": ("Gemma3nForCausalLM", dict(altup_num_inputs=4), "gemma3n"),
    # Llama 4: what llama.cpp's graph fixes (chunks of 8192 on three layers of four, the fourth without rotary, queries
    # scaled past 8192) set in the checkpoint too; experts every other layer, their input scaled, a shared expert
    "llama4": ("Llama4ForCausalLM", dict(no_rope_layer_interval=4, attention_chunk_size=8192, floor_scale=8192,
                                         attn_scale=0.1), "llama4"),
    # global layers with wider heads, one K/V head and values from keys (no attn_v), "proportional" RoPE as rope_freqs
    # factors; K/V shared by the last two layers; per-layer inputs; double-wide MLPs as a per-layer feed_forward_length
    "gemma4": ("Gemma4ForCausalLM", {}, "gemma4"),
    # experts beside the dense MLP: gate and up fused as stored, the router's and each expert's scales as ".scale"
    "gemma4:moe": ("Gemma4ForCausalLM:moe", {}, "gemma4"),
}
# where transformers' GGUF reader has no such architecture, or no stacked experts for it (llama)
NO_TRANSFORMERS_READER = {"deepseek2", "deepseek2:v3", "lfm2", "lfm2moe", "nemotron", "mistral3", "olmoe", "mixtral", "gemma", "olmo2", "granite", "granitemoe", "granitemoe:shared", "smollm3",
                          "granitehybrid", "granitehybrid:dense", "mamba2", "glm4", "ernie4_5", "ernie4_5:use_bias", "gpt-oss", "cohere2", "command-r", "arcee", "exaone4", "ernie4_5-moe", "phi2", "glm4moe", "olmo2:olmo3", "seed_oss",
                          "qwen35", "qwen35moe", "qwen3next", "gemma4", "gemma4:moe", "llama4", "nemotron_h",
                          "nemotron_h_moe", "falcon-h1", "mamba", "mamba:falcon", "jamba", "gemma3n",
                          "qwen2vl", "qwen3vl", "qwen3vlmoe"}
GEMMA = {"gemma", "gemma2", "gemma3"}
# norms that scale by 1 + weight, which the converters store with the 1 added (not Qwen3.5's gated delta-net norm)
PLUS_ONE = GEMMA | {"nemotron", "qwen35", "qwen35moe", "qwen3next"}
# every linear Q8_0; not granite, whose test model's near-flat logits (several tokens within 0.01) Q8_0 reorders
DENSE_Q8_0 = {"gemma", "gemma4", "olmo2", "smollm3", "starcoder2", "glm4", "ernie4_5:use_bias", "command-r", "cohere2", "exaone4", "phi2"}
PERMUTED = {"llama", "granite", "granitemoe", "granitehybrid", "smollm3", "arcee", "mistral3"}  # llama.cpp's LlamaModel lineage reorders q/k rows for GGML's rope
LOADS_AS = {"mistral": "LlamaForCausalLM"}  # without a window, llama.cpp's Mistral is Llama


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's "llama" converter: per head, rows (half, i) -> (i, half) for GGML's rope."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stack_experts(state: dict[str, torch.Tensor], layers: int, experts: int) -> dict[str, torch.Tensor]:
    """Each layer's per-expert weights as one [experts, rows, cols] tensor under the merged name the
    converter maps (``...experts.<w>.weight``), the per-expert ones removed."""
    out = dict(state)
    for i in range(layers):
        for parent in (f"model.layers.{i}.mlp.experts", f"model.layers.{i}.block_sparse_moe.experts"):
            parts = {k.split(".")[-2] for k in state if k.startswith(parent + ".0.")}
            for w in parts:
                names = [f"{parent}.{e}.{w}.weight" for e in range(experts)]
                out[f"{parent}.{w}.weight"] = torch.stack([out.pop(n) for n in names])
    return out


def _ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """A checkpoint's MXFP4 tensor (byte i: codes 2i low, 2i + 1 high) as the converter repacks it for GGML:
    per block the E8M0 byte, then byte j holding code j low and code j + 16 high; [experts, rows, blocks * 17]."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), packed], dim=-1).reshape(*blocks.shape[:2], -1).numpy()


def _gpt_oss_tensors(state: dict[str, torch.Tensor], mxfp4: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """The converter's GptOssModel: sinks named as weights, the stacked biases split into gate's (even columns)
    and up's (odd), and the experts written from their MXFP4 blocks (gate_up's rows split the same way) as
    raw MXFP4 tensors. (the dense tensors by checkpoint name, the raw ones by GGUF name)"""
    out, raw = {}, {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue  # written from the blocks below
        if name.endswith("experts.gate_up_proj_bias"):
            out[name.replace("gate_up_proj_bias", "gate_proj.bias")] = t[..., ::2]
            out[name.replace("gate_up_proj_bias", "up_proj.bias")] = t[..., 1::2]
        elif name.endswith("experts.down_proj_bias"):
            out[name.replace("down_proj_bias", "down_proj.bias")] = t
        else:
            out[name + ".weight" if name.endswith("sinks") else name] = t
    for name, blocks in mxfp4.items():
        if not name.endswith("_blocks"):
            continue
        scales, layer = mxfp4[name.replace("_blocks", "_scales")], name.split(".")[2]
        if "gate_up" in name:
            raw[f"blk.{layer}.ffn_gate_exps.weight"] = _ggml_mxfp4(blocks[:, ::2], scales[:, ::2])
            raw[f"blk.{layer}.ffn_up_exps.weight"] = _ggml_mxfp4(blocks[:, 1::2], scales[:, 1::2])
        else:
            raw[f"blk.{layer}.ffn_down_exps.weight"] = _ggml_mxfp4(blocks, scales)
    return out, raw


def _add_tokenizer(writer: gguf.GGUFWriter, vocab: int) -> None:
    """A byte-level BPE vocabulary of ``vocab`` plain tokens (ids are what the tests feed)."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(["t", "0", "t0"] + [f"w{i}" for i in range(3, vocab)])
    writer.add_token_types([1] * vocab)
    writer.add_token_merges(["t 0"])  # transformers builds a gpt2 vocabulary only with merges
    writer.add_bos_token_id(COMMON["bos_token_id"])
    writer.add_eos_token_id(COMMON["eos_token_id"])


def tied(model) -> bool:
    """Whether the model's head is its embedding (the config's flag is not enough: transformers never ties some heads,
    Nemotron-H's, whatever it says)."""
    head = model.get_output_embeddings()
    return head is not None and head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def write_like_llama_cpp(model, folder: Path, path: Path, arch: str, expert_type: QT | None = None,
                         fuse_gate_up: bool = False, linear_type: QT | None = None,
                         mxfp4: dict[str, torch.Tensor] | None = None, whole_kv_b: bool = False) -> None:
    """``folder``'s checkpoint as llama.cpp's converter writes it (``expert_type``: the stacked experts
    quantized to that type, as llama-quantize leaves them; ``fuse_gate_up``: its --fuse-gate-up-exps,
    each layer's gate and up experts in one tensor, gate first; ``linear_type``: every 2-D weight, embeddings
    included, quantized to that type, norms and biases left float32, as llama-quantize writes them; ``whole_kv_b``:
    a deepseek2 file as converters wrote it before splitting kv_b for absorbed attention)."""
    d = model.config.to_dict()
    if arch in ("qwen2vl", "qwen3vl", "qwen3vlmoe"):  # the text model's keys, flat (the converter writes no vision)
        d = {**d, **d["text_config"]}
    rope = d.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    layers, hidden = d.get("num_hidden_layers") or len(d["layers_block_type"]), d["hidden_size"]  # (Nemotron-H: no count)
    heads, kv_heads = d.get("num_attention_heads", 0), d.get("num_key_value_heads", 0)  # (none in a Mamba2 model)
    experts = d.get("num_local_experts") or d.get("num_experts") or d.get("moe_num_experts") or \
        d.get("n_routed_experts") or 0
    w = gguf.GGUFWriter(str(path), arch=arch)
    # llama.cpp counts the MTP layers (not its DeepSeek converter, which drops them)
    w.add_block_count(layers + (0 if arch == "deepseek2" else d.get("num_nextn_predict_layers") or 0))
    w.add_context_length(d["max_position_embeddings"])
    w.add_embedding_length(hidden)
    if arch == "lfm2moe":  # the LFM2MoeModel converter's keys
        w.add_feed_forward_length(d["intermediate_size"])
        w.add_expert_feed_forward_length(d["moe_intermediate_size"])
        w.add_leading_dense_block_count(d["num_dense_layers"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_shortconv_l_cache(d["conv_L_cache"])
        w.add_vocab_size(d["vocab_size"])
    elif arch == "lfm2":  # the size LFM2's MLP derives (the converter rounds as transformers does with a multiplier)
        from kvserve.model.architectures.lfm2 import lfm2_intermediate

        w.add_feed_forward_length(lfm2_intermediate(d))
        w.add_shortconv_l_cache(d["conv_L_cache"])
        w.add_vocab_size(d["vocab_size"])
    elif arch == "llama4":  # its converter's: the dense MLP's width as feed_forward_length, the experts' apart
        w.add_feed_forward_length(d["intermediate_size_mlp"])
        w.add_expert_feed_forward_length(d["intermediate_size"])
        w.add_interleave_moe_layer_step(d["interleave_moe_layer_step"])
        w.add_vocab_size(d["vocab_size"])
        w.add_rope_dimension_count(d["head_dim"])
    elif arch in ("nemotron_h", "nemotron_h_moe"):  # per block (with the K/V heads: _nemotron_h_metadata)
        pass
    else:
        w.add_feed_forward_length(d.get("intermediate_size", 0))
    w.add_head_count(heads)
    if arch == "deepseek2":  # its converter writes latent attention as MQA
        w.add_head_count_kv(1)
    elif arch in ("lfm2", "lfm2moe"):  # a count per layer, 0 where it does not attend
        w.add_head_count_kv([0 if kind == "conv" else kv_heads for kind in d["layer_types"]])
    elif arch == "falcon-h1":  # the Mamba2Model converter's ssm keys, then FalconH1Model's attention keys
        w.add_ssm_conv_kernel(d["mamba_d_conv"])
        w.add_ssm_inner_size(d["mamba_d_ssm"])
        w.add_ssm_state_size(d["mamba_d_state"])
        w.add_ssm_time_step_rank(d["mamba_n_heads"])
        w.add_ssm_group_count(d["mamba_n_groups"])
        w.add_head_count_kv(kv_heads)
        w.add_vocab_size(d["vocab_size"])
    elif arch == "jamba":  # the JambaModel converter's: K/V heads one a layer (0: Mamba), the ssm keys
        w.add_head_count_kv([kv_heads if i % d["attn_layer_period"] == d["attn_layer_offset"] else 0
                             for i in range(layers)])
        w.add_ssm_conv_kernel(d["mamba_d_conv"])
        w.add_ssm_inner_size(d["mamba_expand"] * hidden)
        w.add_ssm_state_size(d["mamba_d_state"])
        w.add_ssm_time_step_rank(d["mamba_dt_rank"])
    elif arch == "mamba":  # the MambaModel converter's: no heads, no MLP, the ssm keys, Falcon Mamba's norms' flag
        w.add_ssm_conv_kernel(d["conv_kernel"])
        w.add_ssm_inner_size(d["intermediate_size"])
        w.add_ssm_state_size(d["state_size"])
        w.add_ssm_time_step_rank(d["time_step_rank"])
        w.add_ssm_dt_b_c_rms(d["model_type"] == "falcon_mamba")
    elif arch == "mamba2":  # the Mamba2Model converter's: no heads, no MLP, the ssm keys
        w.add_ssm_conv_kernel(d["conv_kernel"])
        w.add_ssm_inner_size(d["num_heads"] * d["head_dim"])
        w.add_ssm_state_size(d["state_size"])
        w.add_ssm_time_step_rank(d["num_heads"])
        w.add_ssm_group_count(d["n_groups"])
    elif arch == "granitehybrid":  # the same, 0 for a Mamba layer; and the GraniteHybridModel converter's ssm keys
        w.add_head_count_kv([0 if kind in ("mamba", "linear_attention") else kv_heads for kind in d["layer_types"]])
        w.add_ssm_conv_kernel(d["mamba_d_conv"])
        w.add_ssm_state_size(d["mamba_d_state"])
        w.add_ssm_group_count(d["mamba_n_groups"])
        w.add_ssm_inner_size(d["mamba_n_heads"] * d["mamba_d_head"])
        w.add_ssm_time_step_rank(d["mamba_n_heads"])
        w.add_rope_scaling_finetuned(d.get("position_embedding_type") == "rope")
        if d.get("shared_intermediate_size"):
            w.add_expert_shared_feed_forward_length(d["shared_intermediate_size"])
    elif arch == "gemma4":
        _gemma4_metadata(w, d)
    elif arch == "gemma3n":
        _gemma3n_metadata(w, d)
    elif arch in ("nemotron_h", "nemotron_h_moe"):
        _nemotron_h_metadata(w, d)
    else:
        w.add_head_count_kv(kv_heads)
    if arch in ("starcoder2", "stablelm", "command-r", "cohere2", "phi2", "nemotron"):  # LayerNorms: their own eps key
        w.add_layer_norm_eps(d.get("norm_epsilon") or d.get("norm_eps") or d["layer_norm_eps"])
    else:
        w.add_layer_norm_rms_eps(d.get("rms_norm_eps") or d.get("norm_eps") or d["layer_norm_epsilon"])
    if arch not in ("gemma", "gemma2", "mamba", "mamba2", "jamba", "nemotron_h", "nemotron_h_moe"):  # these converters write no rope base (llama.cpp's default: 10000)
        w.add_rope_freq_base(full["rope_theta"])
    if arch not in ("phi3", "granite", "granitemoe", "granitehybrid", "deepseek2", "mamba", "mamba2", "jamba", "gemma4"):  # Granite's drops head_dim
        w.add_key_length(d["head_dim"])
        w.add_value_length(d["head_dim"])
    if arch not in ("gemma4", "nemotron_h") and experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(d.get("num_experts_per_tok") or d["moe_k"])
    if arch in ("qwen35", "qwen35moe", "qwen3next"):  # the Qwen3NextModel converter's keys (and Qwen3.5's sections)
        w.add_ssm_conv_kernel(d["linear_conv_kernel_dim"])
        w.add_ssm_state_size(d["linear_key_head_dim"])
        w.add_ssm_group_count(d["linear_num_key_heads"])
        w.add_ssm_time_step_rank(d["linear_num_value_heads"])
        w.add_ssm_inner_size(d["linear_value_head_dim"] * d["linear_num_value_heads"])
        w.add_full_attention_interval(d.get("full_attention_interval", 4))
        w.add_rope_dimension_count(int(d["head_dim"] * full.get("partial_rotary_factor", 0.25)))
        if arch != "qwen3next":
            w.add_rope_dimension_sections(full.get("mrope_section", [11, 11, 10]) + [0])
    if arch in ("qwen2vl", "qwen3vl", "qwen3vlmoe"):  # the rotary sections, four
        w.add_rope_dimension_sections(list(rope.get("mrope_section") or [])[:4] + [0] * (4 - len(rope.get("mrope_section") or [])))
    if arch in ("qwen2moe", "qwen3moe", "qwen35moe", "qwen3next", "qwen3vlmoe"):
        w.add_expert_feed_forward_length(d["moe_intermediate_size"])
        if d.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(d["shared_expert_intermediate_size"])
    if arch in PERMUTED:  # Llama's converter and its subclasses
        w.add_vocab_size(d["vocab_size"])
        w.add_rope_dimension_count(d["head_dim"])
    if arch == "granitemoe" and d.get("shared_intermediate_size"):
        w.add_expert_shared_feed_forward_length(d["shared_intermediate_size"])
    if arch in ("granite", "granitemoe", "granitehybrid"):
        w.add_attention_scale(d["attention_multiplier"])
        w.add_embedding_scale(d["embedding_multiplier"])
        w.add_residual_scale(d["residual_multiplier"])
        w.add_logit_scale(d["logits_scaling"])
    if full.get("rope_type") == "yarn":  # the converter's TextModel
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
    if arch == "gpt-oss":
        w.add_sliding_window(d["sliding_window"])
        w.add_expert_feed_forward_length(d["intermediate_size"])
    if arch in ("command-r", "cohere2"):
        w.add_logit_scale(d["logit_scale"])
    if arch == "glm4moe":
        w.add_expert_feed_forward_length(d["moe_intermediate_size"])
        w.add_expert_shared_count(d["n_shared_experts"])
        w.add_leading_dense_block_count(d["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(d["routed_scaling_factor"])
        w.add_expert_weights_norm(d["norm_topk_prob"])
        w.add_nextn_predict_layers(d["num_nextn_predict_layers"])
        w.add_rope_dimension_count(int(d["head_dim"] * full["partial_rotary_factor"]))
    if arch == "deepseek2":
        _deepseek2_metadata(w, d, full, whole_kv_b)
    if arch == "mistral3":  # the Ministral3Model converter's
        if full.get("mscale_all_dim"):
            w.add_rope_scaling_yarn_log_mul(full["mscale_all_dim"])
        w.add_attn_temperature_scale(full["llama_4_scaling_beta"])
    if arch == "ernie4_5-moe":
        w.add_interleave_moe_layer_step(d["moe_layer_interval"])
        w.add_leading_dense_block_count(d["moe_layer_start_index"])
        w.add_expert_feed_forward_length(d["moe_intermediate_size"])
        w.add_expert_shared_count(d["moe_num_shared_experts"])
    if arch == "olmo2" and d.get("sliding_window"):
        w.add_sliding_window(d["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in d["layer_types"]])
    if arch == "exaone4":
        w.add_vocab_size(d["vocab_size"])
        w.add_sliding_window(d["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in d["layer_types"]])
    if arch == "cohere2":
        w.add_sliding_window(d["sliding_window"])
        w.add_rope_dimension_count(d["head_dim"])
    if arch in ("glm4", "stablelm", "phi2", "nemotron"):
        w.add_rope_dimension_count(int(d["head_dim"] * full["partial_rotary_factor"]))
    if arch == "gemma2":
        w.add_attn_logit_softcapping(d["attn_logit_softcapping"])
        w.add_final_logit_softcapping(d["final_logit_softcapping"])
        w.add_sliding_window(d["sliding_window"])
    if arch == "gemma3":
        w.add_sliding_window(d["sliding_window"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if arch == "phi3":
        rotary = int(d["partial_rotary_factor"] * hidden) // heads
        original = d["original_max_position_embeddings"]
        w.add_rope_dimension_count(rotary)
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_sliding_window(d.get("sliding_window") or 0)
        scale = d["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
        w.add_tensor("rope_factors_long.weight", np.array(full["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(full["short_factor"], np.float32))
    _add_tokenizer(w, d["vocab_size"])

    name_map = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], layers)
    state, raw = _stack_experts(load_file(folder / "model.safetensors"), layers, experts), {}
    if arch == "gpt-oss":
        state, raw = _gpt_oss_tensors(state, mxfp4 or {})
    if arch == "granitemoe":
        for i in range(layers):
            gate, up = state.pop(f"model.layers.{i}.block_sparse_moe.input_linear.weight").chunk(2, dim=1)
            state[f"blk.{i}.ffn_gate_exps.weight"], state[f"blk.{i}.ffn_up_exps.weight"] = gate, up
            if d.get("shared_intermediate_size"):
                gate, up = state.pop(f"model.layers.{i}.shared_mlp.input_linear.weight").chunk(2, dim=0)
                state[f"blk.{i}.ffn_gate_shexp.weight"], state[f"blk.{i}.ffn_up_shexp.weight"] = gate, up
    if arch == "granitehybrid":
        _granite_hybrid_tensors(state, d, layers, experts)
    if arch == "mamba2":
        for i in range(layers):
            _mamba2_tensors(state, f"backbone.layers.{i}.mixer.", d["n_groups"])
    if arch in ("qwen2vl", "qwen3vl", "qwen3vlmoe"):  # the text model's tensors under Qwen's names; no vision tower
        state = {n.replace("model.language_model.", "model."): t for n, t in state.items() if "visual" not in n.split(".")}
        for i in range(layers):  # (Qwen3-VL-MoE's stacked experts: gate's and up's [experts, inter, hidden])
            p = f"model.layers.{i}.mlp.experts."
            if p + "gate_up_proj" in state:  # as published [experts, in, out], or as transformers 5 saves [.., out, in]
                gate_up, down = state.pop(p + "gate_up_proj"), state.pop(p + "down_proj")
                if gate_up.shape[-1] != hidden:
                    gate_up, down = gate_up.transpose(-1, -2), down.transpose(-1, -2)
                gate, up = gate_up.chunk(2, dim=-2)
                state[f"blk.{i}.ffn_gate_exps.weight"], state[f"blk.{i}.ffn_up_exps.weight"] = gate, up
                state[f"blk.{i}.ffn_down_exps.weight"] = down
    if arch == "gemma4":
        _gemma4_tensors(state, d, layers)
    if arch == "falcon-h1":
        _falcon_h1_tensors(state, d, layers)
    if arch == "gemma3n":  # AltUp's projections stacked, one tensor each way; the output scale given a ".weight"
        for name in ("model.altup_projections", "model.altup_unembed_projections"):
            parts = [state.pop(f"{name}.{j}.weight") for j in range(d["altup_num_inputs"] - 1)]
            state[f"{name}.weight"] = torch.stack(parts)
        for i in range(layers):
            state[f"model.layers.{i}.altup.correct_output_scale.weight"] = \
                state.pop(f"model.layers.{i}.altup.correct_output_scale")
    if arch == "jamba":  # the converter stacks each layer's experts under Qwen2-MoE's merged names
        for i in range(layers):
            for leaf in ("gate_proj", "up_proj", "down_proj"):
                names = [f"model.layers.{i}.feed_forward.experts.{e}.{leaf}.weight" for e in range(experts)]
                if names[0] in state:
                    state[f"model.layers.{i}.mlp.experts.{leaf}.weight"] = torch.stack([state.pop(n) for n in names])
    if arch in ("mamba", "jamba"):  # A as -exp(A_log) [inner, state], the convolution [channels, taps]
        for i in range(layers):
            m = f"backbone.layers.{i}.mixer." if arch == "mamba" else f"model.layers.{i}.mamba."
            if m + "A_log" not in state:
                continue
            state[m + "A_log"] = -torch.exp(state[m + "A_log"])
            state[m + "conv1d.weight"] = state[m + "conv1d.weight"].squeeze(1)
    if arch in ("nemotron_h", "nemotron_h_moe"):
        for i, kind in enumerate(d["layers_block_type"]):
            p = f"backbone.layers.{i}.mixer."
            if kind in ("mamba", "linear_attention"):
                _mamba2_tensors(state, p, d["n_groups"])
            for leaf in ("up_proj", "down_proj"):  # the converter stacks each layer's experts
                names = [f"{p}experts.{e}.{leaf}.weight" for e in range(experts)]
                if names[0] in state:
                    state[f"blk.{i}.ffn_{leaf[:-5]}_exps.weight"] = torch.stack([state.pop(n) for n in names])
    if arch == "llama4":  # the experts as llama.cpp's other MoE files hold them: gate's and up's [experts, inter, hidden]
        for i in range(layers):
            p = f"model.layers.{i}.feed_forward.experts."
            if p + "gate_up_proj" in state:
                gate, up = state.pop(p + "gate_up_proj").chunk(2, dim=-1)
                state[f"blk.{i}.ffn_gate_exps.weight"] = gate.transpose(-1, -2)
                state[f"blk.{i}.ffn_up_exps.weight"] = up.transpose(-1, -2)
                state[f"blk.{i}.ffn_down_exps.weight"] = state.pop(p + "down_proj").transpose(-1, -2)
    if arch == "llama" and full.get("rope_type") == "llama3":
        state["rope_freqs.weight"] = _llama3_rope_freqs(full, d["head_dim"])
    if arch in ("qwen35", "qwen35moe", "qwen3next"):
        for i in range(layers):
            if arch == "qwen3next" and f"model.layers.{i}.linear_attn.A_log" in state:
                _qwen3_next_split_qkvz(state, f"model.layers.{i}.linear_attn.", d, i)
            if f"model.layers.{i}.linear_attn.A_log" in state:
                _qwen35_delta_tensors(state, f"model.layers.{i}.linear_attn.", d, tiled=arch != "qwen3next")
    if arch == "lfm2moe":  # the converter stacks each layer's experts under llama.cpp's names
        for i in range(layers):
            for w_name, leaf in (("w1", "ffn_gate_exps"), ("w3", "ffn_up_exps"), ("w2", "ffn_down_exps")):
                names = [f"model.layers.{i}.feed_forward.experts.{e}.{w_name}.weight" for e in range(experts)]
                if names[0] in state:
                    state[f"blk.{i}.{leaf}.weight"] = torch.stack([state.pop(n) for n in names])
    if arch == "deepseek2" and not whole_kv_b:  # the converter splits kv_b per head: k's part, transposed, and v's
        for i in range(layers):
            kv_b = state.pop(f"model.layers.{i}.self_attn.kv_b_proj.weight")
            k_b, v_b = kv_b.view(heads, -1, kv_b.shape[-1]).split([d["qk_nope_head_dim"], d["v_head_dim"]], dim=1)
            state[f"model.layers.{i}.self_attn.k_b_proj.weight"] = k_b.transpose(1, 2)
            state[f"model.layers.{i}.self_attn.v_b_proj.weight"] = v_b
    if fuse_gate_up:
        for i in range(layers):
            gate, up = (state.pop(f"model.layers.{i}.mlp.experts.{w}.weight") for w in ("gate_proj", "up_proj"))
            fused = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_UP_EXP].format(bid=i) + ".weight"
            state[fused] = torch.cat([gate, up], dim=1)
    for name, t in state.items():
        if tied(model) and name == "lm_head.weight":
            continue  # tied; the converter skips it
        if arch in PLUS_ONE and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if arch in ("lfm2", "lfm2moe") and name.endswith("conv.conv.weight"):
            t = t.squeeze(1)  # the converter's: llama.cpp's conv op takes [channels, taps]
        if arch in PERMUTED and ".q_proj." in name:
            t = _permute(t, heads)
        elif arch in PERMUTED and ".k_proj." in name:
            t = _permute(t, kv_heads)
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")  # as the converters rename them
        name = name.replace(".expert_bias", ".expert_bias.bias")
        gguf_name = name if name.startswith(("blk.", "rope_freqs")) else \
            name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        data = t.float().numpy()
        if expert_type is not None and gguf_name.endswith("_exps.weight"):
            w.add_tensor(gguf_name, gguf.quants.quantize(data, expert_type), raw_dtype=expert_type)
        elif linear_type is not None and data.ndim == 2 and data.shape[1] % 32 == 0:  # (not a convolution's taps)
            w.add_tensor(gguf_name, gguf.quants.quantize(data, linear_type), raw_dtype=linear_type)
        else:
            w.add_tensor(gguf_name, data)
    for gguf_name, data in raw.items():
        w.add_tensor(gguf_name, data, raw_dtype=QT.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _falcon_h1_tensors(state: dict[str, torch.Tensor], d: dict, layers: int) -> None:
    """The FalconH1Model converter's: each multiplier folded into the tensor it scales (weight or bias alike, as the
    converter does: every tensor of that module), in_proj's parts (z, x, B, C, dt) each by its own, the embedding and
    the head by theirs; then the Mamba2Model converter's changes."""
    one = lambda key: float(d.get(key) if d.get(key) is not None else 1.0)  # noqa: E731
    gate, down = d.get("mlp_multipliers") or (1.0, 1.0)
    inner, state_size = d["mamba_d_ssm"], d["mamba_n_groups"] * d["mamba_d_state"]
    ssm = d.get("ssm_multipliers") or [1.0] * 5
    for name in list(state):
        t, leaf = state[name], name.rsplit(".", 2)[-2]
        factor = {"down_proj": float(down), "gate_proj": float(gate), "q_proj": one("attention_in_multiplier"),
                  "k_proj": one("attention_in_multiplier") * one("key_multiplier"),
                  "v_proj": one("attention_in_multiplier"), "o_proj": one("attention_out_multiplier"),
                  "out_proj": one("ssm_out_multiplier"), "in_proj": one("ssm_in_multiplier")}.get(leaf)
        if name == "lm_head.weight":
            factor = one("lm_head_multiplier")
        elif name == "model.embed_tokens.weight":
            factor = one("embedding_multiplier")
        if factor is None:
            continue
        t = t * factor
        if leaf == "in_proj":
            t = t.clone()
            bounds = [0, inner, 2 * inner, 2 * inner + state_size, 2 * inner + 2 * state_size, t.shape[0]]
            for (a, b), f in zip(zip(bounds, bounds[1:]), ssm):
                t[a:b] *= f
        state[name] = t
    for i in range(layers):
        _mamba2_tensors(state, f"model.layers.{i}.mamba.", d["mamba_n_groups"])


def _nemotron_h_metadata(w: gguf.GGUFWriter, d: dict) -> None:
    """The NemotronHModel converter's keys (GraniteHybridModel's lineage): K/V heads and the feed-forward length one a
    block (0 where the block is not of that kind), the Mamba-2 settings under "ssm.", the experts' keys."""
    kinds = d["layers_block_type"]
    moe = any(k == "moe" for k in kinds)
    w.add_head_count_kv([d["num_key_value_heads"] if k in ("attention", "full_attention") else 0 for k in kinds])
    width = d["moe_intermediate_size"] if moe else d["intermediate_size"]
    w.add_feed_forward_length([width if k in ("mlp", "moe") else 0 for k in kinds])
    w.add_ssm_conv_kernel(d["conv_kernel"])
    w.add_ssm_state_size(d["ssm_state_size"])
    w.add_ssm_group_count(d["n_groups"])
    w.add_ssm_inner_size(d["mamba_num_heads"] * d["mamba_head_dim"])
    w.add_ssm_time_step_rank(d["mamba_num_heads"])
    if moe:
        w.add_expert_feed_forward_length(d["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(d["moe_shared_expert_intermediate_size"])
        w.add_expert_shared_count(d["n_shared_experts"])
        w.add_expert_weights_norm(d["norm_topk_prob"])
        w.add_expert_weights_scale(d["routed_scaling_factor"])
        w.add_expert_group_count(d["n_group"])


def _llama3_rope_freqs(rope: dict, dim: int) -> torch.Tensor:
    """The LlamaModel converter's ``rope_freqs`` for Llama 3's scaling: each pair's divisor of its frequency (1 for
    short wavelengths, the factor for long ones, a blend between)."""
    freqs = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def _gemma3n_metadata(w: gguf.GGUFWriter, d: dict) -> None:
    """The Gemma3NModel converter's keys beyond Gemma 3's: AltUp's, the per-layer inputs' width, the shared K/V layers,
    each layer's sparsity as the gaussian quantile of its share (-inf for none), the layers' kinds one bool each."""
    w.add_head_count_kv(d["num_key_value_heads"])
    w.add_sliding_window(d["sliding_window"])
    w.add_rope_freq_base_swa(d["rope_parameters"]["sliding_attention"]["rope_theta"])
    w.add_final_logit_softcapping(d["final_logit_softcapping"])
    w.add_altup_active_idx(d["altup_active_idx"])
    w.add_altup_num_inputs(d["altup_num_inputs"])
    w.add_embedding_length_per_layer_input(d["hidden_size_per_layer_input"])
    w.add_shared_kv_layers(d["num_kv_shared_layers"])
    normal = torch.distributions.normal.Normal(0, 1)
    w.add_activation_sparsity_scale([normal.icdf(torch.tensor(p, dtype=torch.float32)).item()
                                     for p in d["activation_sparsity_pattern"]])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in d["layer_types"]])


def _gemma4_metadata(w: gguf.GGUFWriter, d: dict) -> None:
    """The Gemma4Model converter's keys: the global layers' head size as key_length and the sliding ones' as
    key_length_swa, K/V heads one a layer, the layers' kinds one bool each, the MLP's width one a layer where the
    shared layers' are double, the experts' keys; the global layers' rotary pairs in ``rope_freqs`` (written with the
    tensors)."""
    types, layers = d["layer_types"], d["num_hidden_layers"]
    per_layer = {int(k): v for k, v in (d.get("per_layer_config") or {}).items()}
    dims = [per_layer.get(i, {}).get("head_dim", d["head_dim"]) for i in range(layers)]
    kv = [per_layer.get(i, {}).get("num_key_value_heads", d["num_key_value_heads"]) for i in range(layers)]
    full = next(i for i, t in enumerate(types) if t == "full_attention")
    w.add_head_count_kv(kv)
    w.add_key_length(dims[full])
    w.add_value_length(dims[full])
    w.add_key_length_swa(d["head_dim"])
    w.add_value_length_swa(d["head_dim"])
    w.add_sliding_window(d["sliding_window"])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    w.add_rope_freq_base_swa(d["rope_parameters"]["sliding_attention"]["rope_theta"])
    w.add_rope_dimension_count(dims[full])
    w.add_rope_dimension_count_swa(d["head_dim"])
    w.add_shared_kv_layers(d.get("num_kv_shared_layers") or 0)
    w.add_embedding_length_per_layer_input(d.get("hidden_size_per_layer_input") or 0)
    if d.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(d["final_logit_softcapping"])
    if d.get("use_double_wide_mlp"):
        first_shared = layers - (d.get("num_kv_shared_layers") or 0)
        w.add_feed_forward_length([d["intermediate_size"] * (2 if i >= first_shared else 1) for i in range(layers)])
    if d.get("enable_moe_block"):
        w.add_expert_count(d["num_experts"])
        w.add_expert_used_count(d["top_k_experts"])
        w.add_expert_feed_forward_length(d["moe_intermediate_size"])


def _gemma4_tensors(state: dict[str, torch.Tensor], d: dict, layers: int) -> None:
    """The converter's renames (the layer scalar a ``.weight``; the router's scale and each expert's under the
    router's and the experts' names, without one; the experts as stored, gate and up fused) and ``rope_freqs``: 1 for
    each global-layer pair that turns, 1e30 for one that does not ("proportional" RoPE as ggml's factors)."""
    for i in range(layers):
        p = f"model.layers.{i}."
        renames = {"layer_scalar": "layer_scalar.weight", "router.scale": f"blk.{i}.ffn_gate_inp.scale",
                   "router.per_expert_scale": f"blk.{i}.ffn_down_exps.scale",
                   "experts.gate_up_proj": f"blk.{i}.ffn_gate_up_exps.weight",
                   "experts.down_proj": f"blk.{i}.ffn_down_exps.weight"}
        for theirs, ours in renames.items():
            if p + theirs in state:
                state[ours if ours.startswith("blk.") else p + ours] = state.pop(p + theirs)
    full = d["rope_parameters"]["full_attention"]
    dim = next(v["head_dim"] for v in (d.get("per_layer_config") or {}).values() if "head_dim" in v)
    turning = int(dim * full["partial_rotary_factor"] / 2)
    state["rope_freqs.weight"] = torch.tensor([1.0] * turning + [1e30] * (dim // 2 - turning))


def _granite_hybrid_tensors(state: dict[str, torch.Tensor], d: dict, layers: int, experts: int) -> None:
    """The GraniteHybridModel converter's tensors: experts and the shared MLP as Granite MoE's (or the dense MLP as
    ffn_gate, ffn_up, ffn_down); the Mamba layers' A as -exp(A_log) and A, D as [heads, 1], the gated norm's weight
    [groups, inner / groups], the convolution [channels, taps], dt's bias as dt_proj's (``_mamba2_tensors``)."""
    for i in range(layers):
        p = f"model.layers.{i}."
        if experts:
            gate, up = state.pop(f"{p}block_sparse_moe.input_linear.weight").chunk(2, dim=1)
            state[f"blk.{i}.ffn_gate_exps.weight"], state[f"blk.{i}.ffn_up_exps.weight"] = gate, up
            gate, up = state.pop(f"{p}shared_mlp.input_linear.weight").chunk(2, dim=0)
            state[f"blk.{i}.ffn_gate_shexp.weight"], state[f"blk.{i}.ffn_up_shexp.weight"] = gate, up
            state[f"blk.{i}.ffn_down_shexp.weight"] = state.pop(f"{p}shared_mlp.output_linear.weight")
        else:
            gate, up = state.pop(f"{p}shared_mlp.input_linear.weight").chunk(2, dim=0)
            state[f"blk.{i}.ffn_gate.weight"], state[f"blk.{i}.ffn_up.weight"] = gate, up
            state[f"blk.{i}.ffn_down.weight"] = state.pop(f"{p}shared_mlp.output_linear.weight")
        _mamba2_tensors(state, f"{p}mamba.", d["mamba_n_groups"])


def _qwen35_delta_tensors(state: dict[str, torch.Tensor], m: str, d: dict, tiled: bool = True) -> None:
    """The Qwen3NextModel converter's delta-net tensors (Qwen3.5's through its V-reordering subclass): A as -exp(A_log),
    dt's bias as dt_proj's, the convolution [channels, taps]; where value heads outnumber key heads, the value heads
    tiled (j-th of every key head, j = 0, 1, ...) in v's rows, z, b, a, A, dt's bias, the convolution's v channels and
    out_proj's columns."""
    kh, vh, kd, vd = (d[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                     "linear_value_head_dim"))

    def tile(x: torch.Tensor, dim: int, head: int) -> torch.Tensor:
        shape = list(x.shape)
        grouped = x.reshape(*shape[:dim], kh, vh // kh, head, *shape[dim + 1:])
        return grouped.transpose(dim, dim + 1).reshape(shape)

    conv = state.pop(m + "conv1d.weight").squeeze(1)
    if tiled and kh != vh:
        keys = 2 * kh * kd
        qkv = state[m + "in_proj_qkv.weight"]
        state[m + "in_proj_qkv.weight"] = torch.cat([qkv[:keys], tile(qkv[keys:], 0, vd)])
        conv = torch.cat([conv[:keys], tile(conv[keys:], 0, vd)])
        state[m + "in_proj_z.weight"] = tile(state[m + "in_proj_z.weight"], 0, vd)
        for leaf in ("in_proj_b.weight", "in_proj_a.weight"):
            state[m + leaf] = tile(state[m + leaf], 0, 1)
        for leaf in ("A_log", "dt_bias"):
            state[m + leaf] = tile(state[m + leaf][:, None], 0, 1)[:, 0]
        state[m + "out_proj.weight"] = tile(state[m + "out_proj.weight"], 1, vd)
    state[m + "conv1d.weight"] = conv
    state[m + "A_log"] = -torch.exp(state[m + "A_log"].float())
    state[m + "dt_proj.bias"] = state.pop(m + "dt_bias")


def _qwen3_next_split_qkvz(state: dict[str, torch.Tensor], m: str, d: dict, layer: int) -> None:
    """The Qwen3NextModel converter's split of in_proj_qkvz (grouped by key head: each group's q, k, v, z) into q, k, v
    whole (attn_qkv) and z (attn_gate); in_proj_ba stays grouped (ssm_ba)."""
    kh, vh, kd, vd = (d[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                     "linear_value_head_dim"))
    w = state.pop(m + "in_proj_qkvz.weight")
    q, k, v, z = w.reshape(kh, -1, w.shape[-1]).split([kd, kd, vh // kh * vd, vh // kh * vd], dim=1)
    flat = lambda x: x.reshape(-1, w.shape[-1])  # noqa: E731
    state[f"blk.{layer}.attn_qkv.weight"] = torch.cat([flat(q), flat(k), flat(v)])
    state[f"blk.{layer}.attn_gate.weight"] = flat(z)


def _mamba2_tensors(state: dict[str, torch.Tensor], m: str, groups: int) -> None:
    """The Mamba2Model converter's changes to a Mamba-2 layer's tensors (under ``m``), where the layer is one."""
    if f"{m}A_log" not in state:
        return
    state[f"{m}A_log"] = -torch.exp(state[f"{m}A_log"])[:, None]
    state[f"{m}D"] = state[f"{m}D"][:, None]
    if f"{m}norm.weight" in state:
        state[f"{m}norm.weight"] = state[f"{m}norm.weight"].reshape(groups, -1)
    state[f"{m}conv1d.weight"] = state[f"{m}conv1d.weight"].squeeze(1)
    state[f"{m}dt_proj.bias"] = state.pop(f"{m}dt_bias")


def _deepseek2_metadata(w: gguf.GGUFWriter, d: dict, rope: dict, whole_kv_b: bool) -> None:
    """The DeepseekV2Model converter's keys (its base class's group counts and gating function: V3's config.json
    names its scoring function, which transformers does not save); ``whole_kv_b``: the key and value lengths as
    converters wrote them before the MLA keys."""
    w.add_leading_dense_block_count(d["first_k_dense_replace"])
    w.add_vocab_size(d["vocab_size"])
    if d.get("q_lora_rank"):
        w.add_q_lora_rank(d["q_lora_rank"])
    w.add_kv_lora_rank(d["kv_lora_rank"])
    if whole_kv_b:
        w.add_key_length(d["qk_nope_head_dim"] + d["qk_rope_head_dim"])
        w.add_value_length(d["v_head_dim"])
    else:
        w.add_key_length(d["kv_lora_rank"] + d["qk_rope_head_dim"])
        w.add_value_length(d["kv_lora_rank"])
        w.add_key_length_mla(d["qk_nope_head_dim"] + d["qk_rope_head_dim"])
        w.add_value_length_mla(d["v_head_dim"])
    w.add_expert_feed_forward_length(d["moe_intermediate_size"])
    w.add_expert_shared_count(d["n_shared_experts"])
    w.add_expert_weights_scale(d["routed_scaling_factor"])
    if d.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_expert_group_count(d["n_group"])
    w.add_expert_group_used_count(d["topk_group"])
    v3 = d["model_type"] == "deepseek_v3"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_rope_dimension_count(d["qk_rope_head_dim"])
    if rope.get("mscale_all_dim"):
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


_files: dict[tuple, tuple] = {}


def gguf_case(case: str, tmp_path_factory, expert_type: QT | None = None, fuse_gate_up: bool = False,
              linear_type: QT | None = None):
    """(transformers model, its checkpoint folder, the GGUF file) for ``case``, built once per session."""
    key = (case, expert_type, fuse_gate_up, linear_type)
    if key not in _files:
        name, overrides, arch = CASES[case]
        model = hf_model(name, **overrides)
        mxfp4 = mxfp4_experts(model) if arch == "gpt-oss" else None  # as published: the experts' values in MXFP4
        folder = tmp_path_factory.mktemp(f"gguf-{case.replace(':', '-')}")
        model.save_pretrained(folder)
        path = folder / f"{case.replace(':', '-')}.gguf"
        write_like_llama_cpp(model, folder, path, arch, expert_type, fuse_gate_up, linear_type, mxfp4)
        _files[key] = (model, folder, path)
    return _files[key]


def _llm(path: Path, quantization: str = "none") -> LLM:
    loaded = load_model(path, keep_quantized=quantization == "auto")
    loaded.config.eos_token_ids = []
    return LLM.from_weights(loaded.config, loaded.weights, dtype="float32", quantization=quantization,
                            num_kv_blocks=256, block_size=4, max_num_batched_tokens=512)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_loads_the_checkpoint_weights(case, tmp_path_factory, monkeypatch):
    model, folder, path = gguf_case(case, tmp_path_factory)
    loaded = load_model(path)
    assert loaded.config.architecture == LOADS_AS.get(case, CASES[case][0].partition(":")[0])
    # the checkpoint's tensors under the names the loaders give them (Phi's final_layernorm is the final norm)
    arch = get_architecture(loaded.config.architecture)
    original = {arch.checkpoint_name(n): t for n, t in load_file(folder / "model.safetensors").items()
                if "visual" not in n.split(".")}  # (a vision tower: not in a text model's file)
    if tied(model):
        original.pop("lm_head.weight", None)
    # both loaders put gated attention's gates after q's rows, and fold in what the architecture folds at load
    if loaded.config.attn_output_gate or arch.adjust_weights is not None:
        original = standard_layout(loaded.config, original)
    # the metadata means what the checkpoint's config.json does (the eos ids come from the tokenizer)
    gguf_config, hf_config = asdict(loaded.config), asdict(load_model_config(folder))
    for key in ("architecture", "eos_token_ids", "rope_scaling"):
        gguf_config.pop(key), hf_config.pop(key)
    for key in [k for k, v in hf_config.items() if isinstance(v, float)]:  # float32 in the file: eps, multipliers
        assert gguf_config.pop(key) == pytest.approx(hf_config.pop(key), rel=1e-6), key
    assert gguf_config == hf_config
    hf_scaling = load_model_config(folder).rope_scaling
    if loaded.config.rope_scaling and loaded.config.rope_scaling["rope_type"] == "freq_factors":
        # llama.cpp's divisor a rotary pair: the frequencies the checkpoint's scaling gives
        dim, theta = loaded.config.rotary_dim, loaded.config.rope_theta
        torch.testing.assert_close(rope_inv_freq(dim, theta, loaded.config.rope_scaling)[0],
                                   rope_inv_freq(dim, theta, hf_scaling)[0])
        hf_scaling = None
    for key, value in (hf_scaling or {}).items():
        if key in ("rope_type", "factor", "short_factor", "long_factor", "original_max_position_embeddings"):
            assert loaded.config.rope_scaling[key] == pytest.approx(value), key
    assert set(loaded.weights) == set(original)
    for name, t in original.items():
        got = loaded.weights[name]
        if got.dim() == 3 and got.shape != t.shape and got.transpose(-1, -2).shape == t.shape:
            got = got.transpose(-1, -2)  # stacked experts as published, [in, out]; transformers 5 saves [out, in]
        elif got.shape != t.shape and got.numel() == t.numel():  # viewed in the engine's shape (a [1, experts] bias)
            got = got.reshape(t.shape)
        if case in PLUS_ONE and name.endswith("norm.weight"):
            # the model scales by 1 + weight: that sum is the file's, bit for bit
            got, t = got + 1, t + 1
        if name.endswith(".A_log"):  # the file holds -exp(A_log): its log comes back within float32's rounding
            torch.testing.assert_close(got, t, rtol=1e-6, atol=1e-7)
            continue
        assert torch.equal(got, t), name

    if case in NO_TRANSFORMERS_READER:
        return
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers rebuilds the same name table once per submodule; cache it
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
    names = model
    if case == "mistral":  # gguf-py has no "mistral": transformers reads it as llama, whose names it has
        import transformers

        with torch.device("meta"):
            names = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=names)["tensors"]
    state = model.state_dict()
    if tied(model):
        state.pop("lm_head.weight")
    assert set(theirs) == set(state)
    for name, t in state.items():
        # transformers adds a dimension to the shared expert's gate, as older converters squeezed it to 1-D
        atol = 1e-6 if case in GEMMA else 0  # Gemma's norms: (w + 1) - 1 in float32
        torch.testing.assert_close(theirs[name].reshape(t.shape), t, rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_greedy_equals_transformers(case, tmp_path_factory):
    model, _, path = gguf_case(case, tmp_path_factory)
    want = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts()]
    got = [o.token_ids for o in _llm(path).generate(prompts(), GREEDY)]
    assert got == want


@pytest.mark.parametrize("expert_type", [QT.Q8_0, QT.Q4_0, QT.Q4_1], ids=lambda t: t.name)
def test_gguf_quantized_experts_split_per_expert(expert_type, tmp_path_factory):
    """Each expert's QuantWeight, sliced from the layer's stacked blocks, holds exactly the values
    gguf-py dequantizes for that expert."""
    _, _, path = gguf_case("olmoe", tmp_path_factory, expert_type)
    quantized, dense = load_model(path, keep_quantized=True).weights, load_model(path).weights
    experts = [n for n in dense if ".experts." in n]
    assert len(experts) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    for name in experts:
        assert isinstance(quantized[name], QuantWeight), name
        assert torch.equal(quantized[name].dequantize(), dense[name]), name


@pytest.mark.parametrize("expert_type", [None, QT.Q8_0], ids=["f32", "Q8_0"])
def test_gguf_fused_gate_up_experts_load(expert_type, tmp_path_factory):
    """--fuse-gate-up-exps files: each expert's gate and up rows come apart, quantized ones too."""
    _, folder, path = gguf_case("qwen3moe", tmp_path_factory, expert_type, fuse_gate_up=True)
    _, _, reference = gguf_case("qwen3moe", tmp_path_factory, expert_type)
    assert any(t.name.endswith("ffn_gate_up_exps.weight") for t in gguf.GGUFReader(path).tensors)
    keep = expert_type is not None
    fused, separate = load_model(path, keep_quantized=keep).weights, load_model(reference, keep_quantized=keep).weights
    assert set(fused) == set(separate)
    for name, w in separate.items():
        if keep and ".experts." in name:
            assert isinstance(fused[name], QuantWeight), name
            fused[name], w = fused[name].dequantize(), w.dequantize()
        assert torch.equal(fused[name], w), name


def test_gguf_deepseek2_from_before_the_mla_split_loads_alike(tmp_path_factory):
    """A deepseek2 file from converters before llama.cpp's absorbed attention (kv_b whole, the plain key and value
    lengths): the same config and weights as today's split file."""
    model, folder, split = gguf_case("deepseek2", tmp_path_factory)
    whole = folder / "whole_kv_b.gguf"
    write_like_llama_cpp(model, folder, whole, "deepseek2", whole_kv_b=True)
    assert any(t.name == "blk.0.attn_kv_b.weight" for t in gguf.GGUFReader(whole).tensors)
    old, new = load_model(whole), load_model(split)
    assert old.config == new.config
    assert set(old.weights) == set(new.weights) and all(torch.equal(old.weights[n], w) for n, w in new.weights.items())


@pytest.mark.parametrize("case", ["qwen3moe", "mixtral", "granitemoe", "granitemoe:shared", "ernie4_5-moe", "deepseek2",
                                  "gemma4:moe"])
@pytest.mark.parametrize("expert_type", [QT.Q8_0], ids=lambda t: t.name)
def test_gguf_quantized_experts_stay_quantized_and_close(case, expert_type, tmp_path_factory):
    """Experts stored quantized load as each expert's QuantWeight and run quantized; the dense greedy
    token is within the quantized model's top 3 and its logprob within 0.5, while the two agree."""
    _, _, dense_path = gguf_case(case, tmp_path_factory)
    _, _, path = gguf_case(case, tmp_path_factory, expert_type)
    loaded = load_model(path, keep_quantized=True)
    experts = [w for n, w in loaded.weights.items() if ".experts.3." in n]
    # where the architecture stores them stacked (Granite MoE): each stacked tensor's expert 3
    experts += [w.experts[3] for w in loaded.weights.values() if isinstance(w, QuantExperts)]
    assert experts and all(isinstance(w, QuantWeight) for w in experts)

    quant_llm = _llm(path, quantization="auto")
    layer = quant_llm.engine.runner.model.layers[-1]  # ERNIE's first layer is dense
    mlp = layer.moe or layer.mlp  # (Gemma 4's experts beside its dense MLP)
    assert type(mlp.experts[3].gate_up).__name__ == "QuantLinear"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    dense = _llm(dense_path).generate(prompts(), params)
    quant = quant_llm.generate(prompts(), params)
    assert_logprobs_close(dense, quant, case)


@pytest.mark.parametrize("case", sorted(DENSE_Q8_0))
def test_gguf_q8_0_linears_stay_quantized_and_close(case, tmp_path_factory):
    """A file whose linears and embeddings are all Q8_0 (as llama-quantize writes Q8_0): they load as
    QuantWeights and run quantized, within the logprob closeness of the float32 file."""
    _, _, dense_path = gguf_case(case, tmp_path_factory)
    _, _, path = gguf_case(case, tmp_path_factory, linear_type=QT.Q8_0)
    loaded = load_model(path, keep_quantized=True)
    linears = [n for n, w in load_model(dense_path).weights.items() if w.dim() == 2 and w.shape[1] % 32 == 0]
    assert linears and all(isinstance(loaded.weights[n], QuantWeight) for n in linears)

    quant_llm = _llm(path, quantization="auto")
    assert type(quant_llm.engine.runner.model.layers[0].mlp.down).__name__ == "QuantLinear"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    dense = _llm(dense_path).generate(prompts(), params)
    assert_logprobs_close(dense, quant_llm.generate(prompts(), params), case)


def test_gguf_qwen35_q8_0_weights_stay_quantized_in_the_checkpoints_order(tmp_path_factory):
    """Qwen3.5's Q8_0 linears load quantized with the value heads regrouped (rows permuted; out_proj's columns a whole
    block a head) and gated attention's q rows reordered, each within Q8_0's error of the float32 file's weight. (Not
    the greedy closeness of DENSE_Q8_0: the random delta nets' decay and write strength turn Q8_0's error in a and b
    into logprob moves near 1.)"""
    _, _, dense_path = gguf_case("qwen35", tmp_path_factory)
    _, _, path = gguf_case("qwen35", tmp_path_factory, linear_type=QT.Q8_0)
    dense, kept = load_model(dense_path).weights, load_model(path, keep_quantized=True).weights
    quantized = [n for n, w in kept.items() if isinstance(w, QuantWeight)]
    assert "model.layers.0.linear_attn.out_proj.weight" in quantized and "model.layers.1.self_attn.q_proj.weight" in quantized
    for name in quantized:
        scale = dense[name].abs().max()
        assert (kept[name].dequantize() - dense[name]).abs().max() <= scale / 127, name


def test_gguf_unsupported_expert_type_is_named(tmp_path_factory):
    """Stacked experts of a type kvserve cannot read: the load says which tensor and type."""
    from kvserve.errors import ModelLoadError

    _, _, path = gguf_case("olmoe", tmp_path_factory, QT.Q5_0)
    with pytest.raises(ModelLoadError, match="ffn_.*_exps.*Q5_0"):
        load_model(path)



@pytest.mark.parametrize("hidden, heads, head_dim, layers, big, scalar", [
    (3584, 16, 256, 42, 46, 256),  # Gemma 2 9B: its config's query_pre_attn_scalar is the head size
    (4608, 32, 128, 46, 46, 144),  # Gemma 2 27B: hidden / heads
    (5376, 32, 128, 62, 62, 168),  # Gemma 3 27B
])
def test_gemma_query_scale_follows_llama_cpp(hidden, heads, head_dim, layers, big, scalar):
    """The files carry no query scale; llama.cpp tells the 27B models by their layer count."""
    from kvserve.model.architectures.gemma2 import gemma_gguf

    meta = {"embedding_length": hidden, "attention.head_count": heads, "attention.key_length": head_dim,
            "block_count": layers}
    assert gemma_gguf(lambda key, default=None: meta.get(key, default), big)["query_pre_attn_scalar"] == scalar


def test_gguf_gpt_oss_mxfp4_experts_kept_as_q8_0(tmp_path_factory):
    """gpt-oss's MXFP4 expert tensors kept quantized (the default): each expert's q8_0 weight holds the values
    gguf-py dequantizes, bit for bit, in 8.5 bits a weight; they run on the q8_0 GEMM, within the logprob
    closeness of the dequantized file."""
    from kvserve.model.quant import QuantExperts
    from kvserve.model.weight_layout import unstack_experts

    _, _, path = gguf_case("gpt-oss", tmp_path_factory)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.1.ffn_up_exps.weight"] == QT.MXFP4 and types["blk.1.ffn_gate_exps.bias"] == QT.F32
    dense, kept = load_model(path), load_model(path, keep_quantized=True)
    stacked = [w for w in kept.weights.values() if isinstance(w, QuantExperts)]
    assert len(stacked) == 2 * dense.config.num_hidden_layers
    assert sum(w.nbytes for w in stacked) * 8 / sum(w.shape.numel() for w in stacked) == 8.5
    cut = unstack_experts(dense.config, dense.weights)
    for name, w in unstack_experts(kept.config, kept.weights).items():
        if ".unstacked." in name and name.endswith(".weight"):
            assert torch.equal(w.dequantize(), cut[name]), name

    quant_llm = _llm(path, quantization="auto")
    assert quant_llm.engine.runner.model.layers[1].mlp.experts[2].down.kind == "q8_0"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    assert_logprobs_close(_llm(path).generate(prompts(), params), quant_llm.generate(prompts(), params), "gpt-oss")


def test_gguf_biases_are_read_from_every_layer(tmp_path):
    """Which linears have biases follows the file's tensors in any layer: a first layer of experts does not hide
    a dense MLP's bias, or an output projection's, further down."""
    from kvserve.model.gguf_loader import _gguf_config

    meta = {"general.architecture": "qwen2moe", "qwen2moe.embedding_length": 64, "qwen2moe.attention.head_count": 4,
            "qwen2moe.block_count": 2, "qwen2moe.feed_forward_length": 96, "qwen2moe.expert_count": 4,
            "qwen2moe.expert_used_count": 2, "tokenizer.ggml.tokens": 97}
    tensors = {"blk.0.ffn_gate_exps.weight": None, "blk.1.ffn_up.bias": None, "blk.1.attn_output.bias": None}
    cfg = _gguf_config(meta, tensors, tmp_path / "x.gguf")
    assert (cfg.mlp_bias, cfg.o_proj_bias, cfg.attention_bias) == (True, True, False)
    cfg = _gguf_config(meta, {"blk.0.ffn_gate_exps.weight": None, "blk.1.attn_q.bias": None}, tmp_path / "x.gguf")
    assert (cfg.mlp_bias, cfg.o_proj_bias, cfg.attention_bias) == (False, False, True)


def test_gguf_falcon_h1_multipliers_are_folded_in(tmp_path_factory):
    """A Falcon-H1 file whose converter folded every muP multiplier into the weights (each part of the Mamba in_proj by
    its own; the embedding and the head too) gives transformers' greedy tokens with none left in its config."""
    overrides = {k: v for k, v in ARCH_CASES["FalconH1ForCausalLM"][1].items() if "multiplier" in k}
    model = hf_model("FalconH1ForCausalLM:gated", **overrides)
    folder = tmp_path_factory.mktemp("gguf-falcon-h1-multipliers")
    model.save_pretrained(folder)
    write_like_llama_cpp(model, folder, folder / "m.gguf", "falcon-h1")
    loaded = load_model(folder / "m.gguf")
    assert loaded.config.embed_scale == loaded.config.logit_scale == 1.0
    want = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts()]
    assert [o.token_ids for o in _llm(folder / "m.gguf").generate(prompts(), GREEDY)] == want
