"""Every registered architecture against transformers: a tiny random checkpoint written at test time
(seeded; norms and biases random too, so a weight mapped to the wrong place shows), loaded through
the Hugging Face folder path, and greedy tokens equal to transformers' ``generate`` in float32 with
``--quantization none``: on the native path (paged kernel, fused ops) and the torch path (gather-sdpa,
no native ops); with chunked prefill, prefix-cache hits, preemption, and windows shorter than the
prompt. The quantized default is held to logprob closeness instead."""

from __future__ import annotations

import contextlib
import random
from unittest import mock

import pytest
import torch

from conftest import hf_greedy
from kvserve import SamplingParams
from kvserve.kernels import load_kernels, ops
from kvserve.llm import LLM
from kvserve.model.architectures import architecture_names
from kvserve.model.loader import load_model

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=False)
WINDOW = 6  # shorter than most prompts below
OMIT = "<omit>"  # a COMMON key a config class does not take (Falcon's head_dim is a property)
DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
             linear_conv_kernel_dim=4, head_dim=16, layer_types=["linear_attention", "full_attention"] * 2)
MAMBA = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# latent attention's shapes: every head cached (num_key_value_heads = heads); transformers' head_dim is the rotary dims
LATENT = dict(num_key_value_heads=4, head_dim=8, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
              v_head_dim=12)
LATENT_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.8,
               "mscale_all_dim": 0.8, "rope_theta": 10000.0, "beta_fast": 32, "beta_slow": 1}

ZAMBA2 = dict(head_dim=OMIT, num_hidden_layers=4, num_attention_heads=8, adapter_rank=8, n_mamba_heads=4,
              mamba_ngroups=2,
              layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=8, tie_word_embeddings=True)
CTRL_OMIT = dict.fromkeys(["num_key_value_heads", "head_dim", "intermediate_size"], OMIT)
GEMMA4_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]

# case -> (transformers config class, its arguments beyond COMMON); a case is a registered name, or
# "name:variant" for more of its options (another shape of the same architecture)
CASES: dict[str, tuple[str, dict]] = {
    "LlamaForCausalLM": ("LlamaConfig", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 32})),
    "Qwen2ForCausalLM": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 64})),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", dict(MOE, shared_expert_intermediate_size=48, decoder_sparse_step=1,
                                                   mlp_only_layers=[1])),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(MOE, norm_topk_prob=True)),
    # the window where use_sliding_window turns it on: Qwen3's from max_window_layers on (and biases on q/k/v/o),
    # Qwen2-MoE's on even layers below
    "Qwen3ForCausalLM:window,bias": ("Qwen3Config", dict(num_hidden_layers=3, use_sliding_window=True,
                                                         sliding_window=WINDOW, max_window_layers=1, attention_bias=True)),
    "Qwen2MoeForCausalLM:window": ("Qwen2MoeConfig", dict(MOE, num_hidden_layers=2, use_sliding_window=True,
                                                          sliding_window=WINDOW, max_window_layers=2)),
    "MistralForCausalLM": ("MistralConfig", dict(sliding_window=WINDOW)),
    "MixtralForCausalLM": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)),
    "GemmaForCausalLM": ("GemmaConfig", dict(tie_word_embeddings=True)),
    "Gemma2ForCausalLM": ("Gemma2Config", dict(sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True,
                                               attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(sliding_window=WINDOW, num_hidden_layers=3, query_pre_attn_scalar=16,
                                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                                   tie_word_embeddings=True,
                                                   rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # Gemma 4: global layers with wider heads and one K/V head, values from keys, the last two layers on earlier
    # layers' K/V (one of them a double-wide MLP), per-layer inputs
    "Gemma4ForCausalLM": ("Gemma4TextConfig", dict(sliding_window=WINDOW, num_hidden_layers=5, layer_types=GEMMA4_TYPES,
                                                   global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                                                   num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                                                   vocab_size_per_layer_input=97, use_double_wide_mlp=True,
                                                   final_logit_softcapping=30.0, tie_word_embeddings=True)),
    # experts beside the dense MLP; no per-layer inputs, no sharing; attention biases (o_proj's too)
    "Gemma4ForCausalLM:moe": ("Gemma4TextConfig", dict(sliding_window=WINDOW, num_hidden_layers=3,
                                                       layer_types=GEMMA4_TYPES[2:], global_head_dim=24,
                                                       hidden_size_per_layer_input=0, enable_moe_block=True,
                                                       num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                                                       attention_bias=True)),
    # Gemma 4 unified: Gemma 4's case without per-layer inputs (its config has none)
    "Gemma4UnifiedForCausalLM": ("Gemma4UnifiedTextConfig", dict(
        sliding_window=WINDOW, num_hidden_layers=5, layer_types=GEMMA4_TYPES, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True,
        final_logit_softcapping=30.0, tie_word_embeddings=True)),
    # Gemma 3n: three AltUp streams (the second active), LAuReL, the first layer's MLP gate sparse, the last two layers
    # on earlier layers' K/V, per-layer inputs, MLPs of two widths
    "Gemma3nForCausalLM": ("Gemma3nTextConfig", dict(
        sliding_window=WINDOW, num_hidden_layers=5, layer_types=GEMMA4_TYPES, intermediate_size=[96, 64, 96, 96, 64],
        num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=97, altup_num_inputs=3,
        altup_active_idx=1, laurel_rank=8, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0, 0.0],
        tie_word_embeddings=True)),
    # the corrected stream feeding the per-layer input's gate unscaled (altup_correct_scale off), four streams, no K/V
    # sharing, no sparse gate, an untied head; YaRN on both layer types (transformers 5's rope_parameters scale each)
    "Gemma3nForCausalLM:unscaled": ("Gemma3nTextConfig", dict(
        sliding_window=WINDOW, num_hidden_layers=3, layer_types=GEMMA4_TYPES[2:], num_kv_shared_layers=0,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=97, altup_num_inputs=4, altup_correct_scale=False,
        laurel_rank=4, head_dim=32, rope_parameters={
            t: {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": theta}
            for t, theta in (("sliding_attention", 10000.0), ("full_attention", 1e6))})),
    # three delta nets (pre-norm) then attention (post-norm); key heads as many as value heads (transformers repeats none)
    "OlmoHybridForCausalLM": ("OlmoHybridConfig", dict(num_hidden_layers=4, linear_num_key_heads=4, linear_num_value_heads=4,
                                                       linear_key_head_dim=16, linear_value_head_dim=8)),
    # no rotary (the released checkpoints'), and the write strength not doubled
    "OlmoHybridForCausalLM:nope": ("OlmoHybridConfig", dict(num_hidden_layers=3, linear_num_key_heads=2,
                                                            linear_num_value_heads=2, linear_key_head_dim=16,
                                                            linear_value_head_dim=32, linear_allow_neg_eigval=False,
                                                            rope_parameters={"rope_type": "default", "rope_theta": None},
                                                            layer_types=["linear_attention", "full_attention",
                                                                         "linear_attention"])),
    "Phi3ForCausalLM": ("Phi3Config", dict(partial_rotary_factor=0.5, original_max_position_embeddings=64,
                                           rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.5],
                                                         "long_factor": [2.0, 3.0, 4.0, 5.0]})),
    "Olmo2ForCausalLM": ("Olmo2Config", {}),
    "OlmoForCausalLM": ("OlmoConfig", dict(clip_qkv=0.5)),  # LayerNorms without weights; q/k/v clamped
    "OlmoeForCausalLM": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32)),
    "GraniteForCausalLM": ("GraniteConfig", dict(embedding_multiplier=3.0, residual_multiplier=0.5,
                                                 attention_multiplier=0.3, logits_scaling=2.0, attention_bias=True)),
    # Granite's multipliers, sinks, a window on two layers of three; (":bases") a RoPE base per layer, one layer NoPE
    "GraniteSWAForCausalLM": ("GraniteSWAConfig", dict(
        num_hidden_layers=3, sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention",
                                                                 "sliding_attention"],
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0)),
    "GraniteSWAForCausalLM:bases": ("GraniteSWAConfig", dict(
        num_hidden_layers=4, sliding_window=WINDOW, layer_rope_theta=[0, 10000.0, 500.0, 10000.0],
        num_key_value_heads=1, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        attention_multiplier=0.25)),
    # and Granite MoE's experts (no shared expert); (":shared") with one
    "GraniteMoeSWAForCausalLM": ("GraniteMoeSWAConfig", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], embedding_multiplier=3.0, residual_multiplier=0.5,
        attention_multiplier=0.3, logits_scaling=2.0)),
    "GraniteMoeSWAForCausalLM:shared": ("GraniteMoeSWAConfig", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=48,
        num_hidden_layers=4, sliding_window=WINDOW, layer_rope_theta=[10000.0, 0, 10000.0, 0],
        attention_multiplier=0.25)),
    # Granite's multipliers (logits multiplied), a norm on each sublayer's output; (":pre") without them, the default
    # attention scale
    "HyperCLOVAXForCausalLM": ("HyperCLOVAXConfig", dict(embedding_multiplier=3.0, residual_multiplier=0.5,
                                                         attention_multiplier=0.3, logits_scaling=0.5)),
    "HyperCLOVAXForCausalLM:pre": ("HyperCLOVAXConfig", dict(use_post_norm=False, residual_multiplier=0.5,
                                                             head_dim=32, num_key_value_heads=1)),
    # experts stacked as linear weights (gate's rows then up's), with Granite's multipliers
    "GraniteMoeForCausalLM": ("GraniteMoeConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                                       embedding_multiplier=3.0, residual_multiplier=0.5,
                                                       attention_multiplier=0.3, logits_scaling=2.0)),
    # and a shared expert without a gate (one MLP: gate's rows then up's in input_linear)
    "GraniteMoeSharedForCausalLM": ("GraniteMoeSharedConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                                                   intermediate_size=32, shared_intermediate_size=64,
                                                                   embedding_multiplier=3.0, residual_multiplier=0.5,
                                                                   attention_multiplier=0.3, logits_scaling=2.0)),
    # Granite 4.0 micro: every layer attends, the shared MLP the only one (no experts); and with experts and no rotary
    "GraniteMoeHybridForCausalLM": ("GraniteMoeHybridConfig", dict(
        num_local_experts=0, shared_intermediate_size=48, layer_types=["attention"] * 2, position_embedding_type="rope",
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0)),
    "GraniteMoeHybridForCausalLM:experts,nope": ("GraniteMoeHybridConfig", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=64,
        layer_types=["attention"] * 2, position_embedding_type=None, embedding_multiplier=3.0, residual_multiplier=0.5,
        attention_multiplier=0.3, logits_scaling=2.0)),
    # gated delta nets (two key heads, each shared by two value heads) around gated attention; experts, one dense layer
    "Qwen3NextForCausalLM": ("Qwen3NextConfig", dict(DELTA, num_hidden_layers=4, mlp_only_layers=[2],
                                                     decoder_sparse_step=1, shared_expert_intermediate_size=48,
                                                     **dict(MOE, num_experts=8))),
    "Qwen3_5ForCausalLM": ("Qwen3_5TextConfig", dict(DELTA, num_hidden_layers=4, tie_word_embeddings=True)),
    "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeTextConfig", dict(DELTA, num_hidden_layers=4, shared_expert_intermediate_size=48,
                                                           **dict(MOE, num_experts=8))),
    # Granite 4.0 H: Mamba-2 layers (two groups of B and C, chunks of 4 in transformers' scan) and experts
    "GraniteMoeHybridForCausalLM:mamba": ("GraniteMoeHybridConfig", dict(
        MAMBA, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], num_local_experts=4,
        num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=64, position_embedding_type=None,
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0)),
    # blocks of one sublayer: Mamba-2, experts (grouped sigmoid router, a shared expert), attention without rotary, MLP
    "NemotronHForCausalLM": ("NemotronHConfig", dict(
        layers_block_type=["mamba", "moe", "attention", "mlp", "mamba", "moe"], num_hidden_layers=6, head_dim=16,
        mamba_num_heads=4, mamba_head_dim=32, n_groups=2, ssm_state_size=8, chunk_size=4, use_bias=True,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=1.5, n_shared_experts=0,  # (the shared expert is built anyway)
        tie_word_embeddings=True)),  # (transformers keeps the head its own all the same)
    # Mamba-2 blocks alone: no attention, no MLP
    "Mamba2ForCausalLM": ("Mamba2Config", dict(num_heads=4, head_dim=32, state_size=8, n_groups=2, chunk_size=4,
                                               num_hidden_layers=3)),
    # Griffin: RG-LRU blocks and local attention (half of each head rotating), soft-capped logits (lru_width left at
    # hidden_size: transformers sizes a one-token prompt's convolution state by hidden_size)
    "RecurrentGemmaForCausalLM": ("RecurrentGemmaConfig", dict(num_hidden_layers=4, conv1d_width=3,
                                                               attention_window_size=WINDOW, logits_soft_cap=5.0,
                                                               tie_word_embeddings=True)),
    # RWKV-4: time and channel mixes, LayerNorms on the embeddings and at the end (attention_hidden_size left at
    # hidden_size: transformers sizes the state by hidden_size); (":rescaled") transformers' fp16 rescaling after every
    # block (the stream halved: the same up to the norms' eps)
    "RwkvForCausalLM": ("RwkvConfig", dict(num_hidden_layers=3)),
    "RwkvForCausalLM:rescaled": ("RwkvConfig", dict(num_hidden_layers=3, rescale_every=1)),
    # xLSTM: mLSTM blocks (capped gates that bite) and a SiLU MLP; prompts past chunk_size run transformers' chunkwise
    # form, the rest its recurrent steps (hidden 128: transformers' cache rounds the q/k width up to a multiple of 64)
    "xLSTMForCausalLM": ("xLSTMConfig", dict(hidden_size=128, num_hidden_layers=3, num_heads=4, chunk_size=16,
                                             gate_soft_cap=2.0,
                                             ffn_round_up_to_multiple_of=16, output_logit_soft_cap=5.0,
                                             tie_word_embeddings=True)),  # (transformers keeps the head its own)
    # attention beside Mamba-2 in every layer, every muP multiplier away from 1; the Mamba output normed before its
    # gate, (":plain") not normed, (":gated") normed after it
    "FalconH1ForCausalLM": ("FalconH1Config", dict(
        MAMBA, num_hidden_layers=2, mamba_d_ssm=96, mamba_n_heads=4, mamba_d_head=24, mamba_rms_norm=True,
        mamba_norm_before_gate=True, projectors_bias=True, embedding_multiplier=1.5, lm_head_multiplier=0.7,
        mlp_multipliers=[0.8, 1.3], key_multiplier=0.9, attention_in_multiplier=1.2, attention_out_multiplier=0.6,
        ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.4], ssm_in_multiplier=1.3, ssm_out_multiplier=0.7)),
    "FalconH1ForCausalLM:plain": ("FalconH1Config", dict(MAMBA, num_hidden_layers=2, mamba_d_ssm=128,
                                                         mamba_rms_norm=False)),
    "FalconH1ForCausalLM:gated": ("FalconH1Config", dict(MAMBA, num_hidden_layers=2, mamba_d_ssm=128,
                                                         mamba_rms_norm=True, mamba_norm_before_gate=False)),
    # ALiBi over 6 heads (not a power of two: the slopes' second series), an embedding LayerNorm
    "BloomForCausalLM": ("BloomConfig", dict(num_attention_heads=6, hidden_size=48, num_hidden_layers=2)),
    # MPT's slopes over 6 heads, q/k/v clamped (transformers builds the slopes with alibi_bias_max 8 whatever the
    # config says; kvserve reads it, as MosaicML's code does: 8 here)
    "MptForCausalLM": ("MptConfig", dict(num_attention_heads=6, hidden_size=48, num_hidden_layers=2,
                                         attn_config={"alibi": True, "clip_qkv": 0.6})),
    # chunks of 4 on the rotary layers, every other layer without rotary (scaled queries: a floor_scale of 4 so that
    # the scale moves within the prompts), experts every other layer, a dense MLP of its own size
    "Llama4ForCausalLM": ("Llama4TextConfig", dict(num_hidden_layers=4, no_rope_layer_interval=2, attention_chunk_size=4,
                                                   floor_scale=4, attn_scale=0.3, interleave_moe_layer_step=2,
                                                   num_local_experts=4, num_experts_per_tok=1, intermediate_size=32,
                                                   intermediate_size_mlp=80)),
    # no experts (every layer dense: int8 through its attention options, which the random top-1 router hides)
    "Llama4ForCausalLM:dense": ("Llama4TextConfig", dict(num_hidden_layers=4, no_rope_layer_interval=2,
                                                         attention_chunk_size=4, floor_scale=4, attn_scale=0.3,
                                                         interleave_moe_layer_step=8, num_local_experts=4,
                                                         intermediate_size=32, intermediate_size_mlp=80)),
    # Mamba-1 layers with weighted norms of dt, B and C, attention without positions every 4th layer from the 2nd,
    # experts every other layer (of 64: at 32 int8 moved this random model's logprobs by 0.7)
    "JambaForCausalLM": ("JambaConfig", dict(num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=1,
                                             expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                                             num_experts_per_tok=2, intermediate_size=64, mamba_d_state=8,
                                             mamba_dt_rank=6, use_mamba_kernels=False)),
    # Falcon's new decoder: 2 KV heads (q/k/v a group at a time), attention and the MLP over a norm each;
    # (":one_norm") over one, a KV head each, biases; the old decoder: (":multi_query") one KV head, side by side over
    # one norm, rotary; (":alibi") every head its own K/V, ALiBi (6 heads: the slopes' second series), one after the
    # other, biases
    "FalconForCausalLM": ("FalconConfig", dict(new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=96,
                                               head_dim=OMIT)),
    "FalconForCausalLM:one_norm": ("FalconConfig", dict(new_decoder_architecture=True, num_kv_heads=4, head_dim=OMIT,
                                                        num_ln_in_parallel_attn=1, bias=True,
                                                        tie_word_embeddings=True)),
    "FalconForCausalLM:multi_query": ("FalconConfig", dict(multi_query=True, parallel_attn=True, head_dim=OMIT)),
    "FalconForCausalLM:alibi": ("FalconConfig", dict(multi_query=False, parallel_attn=False, alibi=True, bias=True,
                                                     num_attention_heads=6, hidden_size=48, head_dim=OMIT)),
    # q/k/v clamped, 2 KV heads, bias-less LayerNorms; top-2 of 4 experts renormalised, stored flat with gate and up
    # apart and down transposed; (":plain") one KV head, the top-2 weights as the softmax gave them, a clamp that never
    # bites (transformers' DBRX sizes its experts by d_model and clamps whatever clip_qkv says: both given)
    "DbrxForCausalLM": ("DbrxConfig", dict(d_model=64, n_heads=4, n_layers=2, attn_config={
        "kv_n_heads": 2, "clip_qkv": 0.6, "rope_theta": 10000.0}, ffn_config={
        "ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2})),
    "DbrxForCausalLM:plain": ("DbrxConfig", dict(d_model=64, n_heads=4, n_layers=2, attn_config={
        "kv_n_heads": 1, "clip_qkv": 1e4, "rope_theta": 10000.0}, ffn_config={
        "ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2, "moe_normalize_expert_weights": None})),
    # Mamba-1 blocks (a state per channel); Falcon Mamba's with dt, B and C normed
    "MambaForCausalLM": ("MambaConfig", dict(state_size=8, intermediate_size=96, time_step_rank=6, num_hidden_layers=3,
                                             use_bias=True)),
    "FalconMambaForCausalLM": ("FalconMambaConfig", dict(state_size=8, intermediate_size=96, num_hidden_layers=2,
                                                         tie_word_embeddings=True)),
    # Mamba-2 layers with projection biases and no convolution bias; half of each head rotates where it attends
    "BambaForCausalLM": ("BambaConfig", dict(MAMBA, num_hidden_layers=3, attn_layer_indices=[1], mamba_conv_bias=False,
                                             mamba_proj_bias=True)),
    # sinks, biases everywhere, the router's bias, the clamped SwiGLU, stacked experts, sliding/full, yarn; a low
    # limit so that the clamps bite on these weights
    "GptOssForCausalLM": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                               sliding_window=WINDOW, swiglu_limit=1.5,
                                               rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                                "beta_slow": 1.0, "truncate": False,
                                                                "original_max_position_embeddings": 64})),
    "Gemma3ForConditionalGeneration": ("Gemma3Config", {}),  # text only: see GEMMA3_MM
    "Mistral3ForConditionalGeneration": ("Mistral3Config", {}),  # text only: see MISTRAL3_MM
    "Qwen2VLForConditionalGeneration": ("Qwen2VLConfig", {}),  # text only: see QWEN2_VL and the others
    "Qwen2_5_VLForConditionalGeneration": ("Qwen2_5_VLConfig", {}),
    "Qwen3VLForConditionalGeneration": ("Qwen3VLConfig", {}),
    "Qwen3VLMoeForConditionalGeneration": ("Qwen3VLMoeConfig", {}),
    "Llama4ForConditionalGeneration": ("Llama4Config", {}),
    "Gemma4ForConditionalGeneration": ("Gemma4Config", {}),
    "Gemma3nForConditionalGeneration": ("Gemma3nConfig", {}),  # text only: see GEMMA3N_MM
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5Config", {}),
    "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeConfig", {}),
    # the window on the layers layer_types names
    "MinistralForCausalLM": ("MinistralConfig", dict(sliding_window=WINDOW, num_hidden_layers=3,
                                                     layer_types=["sliding_attention", "full_attention",
                                                                  "sliding_attention"])),
    "SmolLM3ForCausalLM": ("SmolLM3Config", dict(num_hidden_layers=4, no_rope_layer_interval=2)),
    "Starcoder2ForCausalLM": ("Starcoder2Config", dict(sliding_window=WINDOW, norm_epsilon=1e-4, tie_word_embeddings=True)),
    "Glm4ForCausalLM": ("Glm4Config", dict(partial_rotary_factor=0.5)),
    "GlmForCausalLM": ("GlmConfig", dict(partial_rotary_factor=0.5)),
    "FlexOlmoForCausalLM": ("FlexOlmoConfig", dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32)),
    "VaultGemmaForCausalLM": ("VaultGemmaConfig", dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                                       tie_word_embeddings=True, attn_logit_softcapping=5.0,
                                                       final_logit_softcapping=3.0, attention_bias=True)),
    "CwmForCausalLM": ("CwmConfig", dict(sliding_window=WINDOW, num_hidden_layers=4)),
    # learned positions (OPT's 2 rows in), LayerNorms, non-gated MLPs, biases; GPT-2's Conv1D weights stored [in, out],
    # BigCode's one KV head; GPT-NeoX's two norms side by side and its q/k/v head by head, partial rotary; GPT-J's
    # one norm for both, interleaved partial rotary, the LM head's bias
    "OPTForCausalLM": ("OPTConfig", dict(ffn_dim=96, word_embed_proj_dim=64)),
    "GPT2LMHeadModel": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512)),
    "GPTBigCodeForCausalLM": ("GPTBigCodeConfig", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512)),
    "GPTNeoXForCausalLM": ("GPTNeoXConfig", dict(rotary_pct=0.25)),
    "GPTNeoXForCausalLM:sequential": ("GPTNeoXConfig", dict(rotary_pct=0.5, use_parallel_residual=False)),
    # GPT-2's layout with q/k/v apart, unscaled scores, global and windowed layers alternating
    "GPTNeoForCausalLM": ("GPTNeoConfig", dict(num_layers=3, num_heads=4, attention_types=[[["global", "local"], 1],
                                                                                           [["local"], 1]],
                                               window_size=WINDOW, max_position_embeddings=512, num_hidden_layers=OMIT,
                                               num_attention_heads=OMIT, intermediate_size=OMIT, head_dim=OMIT,
                                               num_key_value_heads=OMIT)),
    # GPT-J's layers with q/k/v in one tensor in 4 model-parallel blocks (q, v, k quarters each)
    "CodeGenForCausalLM": ("CodeGenConfig", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, rotary_dim=8)),
    # fixed sinusoidal positions (2 rows in), scaled tied embeddings, LayerNorms, biases, a non-gated GELU MLP
    "XGLMForCausalLM": ("XGLMConfig", dict(ffn_dim=96, tie_word_embeddings=True, intermediate_size=OMIT, head_dim=OMIT,
                                           num_key_value_heads=OMIT)),
    # the stream LayerNormed after each add, no final norm, learned positions, Conv1D weights
    "OpenAIGPTLMHeadModel": ("OpenAIGPTConfig", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                                     tie_word_embeddings=True)),
    "GPTJForCausalLM": ("GPTJConfig", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, rotary_dim=8)),
    # Mixtral's experts under sigmoids chosen with a bias, whole-projection q/k norms, the legacy rotary_dim
    # lightning attention around softmax attention, each norm's output the residual (scaled: MiniMax-Text-01's alphas
    # are 3.56); transformers' blocks (block_size) shorter than the prompts
    "MiniMaxForCausalLM": ("MiniMaxConfig", dict(num_hidden_layers=3, intermediate_size=32, num_local_experts=4,
                                                 num_experts_per_tok=2, block_size=8, full_attn_alpha_factor=1.5,
                                                 linear_attn_alpha_factor=2.0, linear_attn_beta_factor=0.8,
                                                 mlp_alpha_factor=1.2, mlp_beta_factor=0.9,
                                                 layer_types=["linear_attention", "full_attention",
                                                              "linear_attention"])),
    "MiniMaxM2ForCausalLM": ("MiniMaxM2Config", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                                     rotary_dim=8)),
    # LayerNorms, partial rotary, q/k/v biases; then attention and the MLP side by side over one norm
    "StableLmForCausalLM": ("StableLmConfig", dict(use_qkv_bias=True, partial_rotary_factor=0.5)),
    "StableLmForCausalLM:parallel": ("StableLmConfig", dict(use_parallel_residual=True, partial_rotary_factor=0.25)),
    # one LayerNorm without a bias before attention and the MLP side by side, interleaved rotary, a logit scale
    "CohereForCausalLM": ("CohereConfig", dict(logit_scale=0.5, tie_word_embeddings=True)),
    # and three windowed layers (rotary) to a global one (no positions)
    "Cohere2ForCausalLM": ("Cohere2Config", dict(logit_scale=0.5, sliding_window=WINDOW, num_hidden_layers=4)),
    # post norms, per-head q/k norms; a windowed layer (rotary) to each global one (no positions)
    "Exaone4ForCausalLM": ("Exaone4Config", dict(sliding_window=WINDOW, sliding_window_pattern=2, num_hidden_layers=4)),
    "Exaone4ForCausalLM:no_window": ("Exaone4Config", dict(sliding_window=None, layer_types=["full_attention"] * 2)),
    # OLMo 2's layers, three windowed to a global one; yarn on the global layers only
    "Olmo3ForCausalLM": ("Olmo3Config", dict(sliding_window=WINDOW, num_hidden_layers=4, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64})),
    # experts chosen by the softmax plus a per-expert bias, weighted without it; a shared expert without a gate; the
    # first layer dense
    "Ernie4_5_MoeForCausalLM": ("Ernie4_5_MoeConfig", dict(num_hidden_layers=3, moe_num_experts=4, moe_k=2,
                                                           moe_intermediate_size=32, moe_num_shared_experts=1)),
    # experts scored by sigmoids, chosen with a bias, renormalised and scaled; a shared expert without a gate, a dense
    # first layer; partial rotary, q/k/v biases, per-head q/k norms
    "Glm4MoeForCausalLM": ("Glm4MoeConfig", dict(num_hidden_layers=3, n_routed_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=32, n_shared_experts=1, use_qk_norm=True,
                                                 attention_bias=True)),
    # the routed experts' weights scaled (GLM-4.5's 2.5)
    "Glm4MoeForCausalLM:scaled": ("Glm4MoeConfig", dict(num_hidden_layers=3, n_routed_experts=4, num_experts_per_tok=2,
                                                        moe_intermediate_size=32, n_shared_experts=1,
                                                        routed_scaling_factor=2.5)),
    # per-head q/k norms on the rotated q and k; a fixed NTK alpha on the RoPE base; biases on q/k/v/o
    "HunYuanDenseV1ForCausalLM": ("HunYuanDenseV1Config", dict(attention_bias=True, rope_parameters={
        "rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0})),
    # and experts (softmax top-2, renormalised) beside a shared MLP in every layer; the NTK alpha
    "HunYuanMoEV1ForCausalLM": ("HunYuanMoEV1Config", dict(num_experts=4, moe_topk=2, intermediate_size=64,
                                                           rope_parameters={"rope_type": "dynamic", "alpha": 1000.0,
                                                                            "factor": 1.0, "rope_theta": 10000.0})),
    # one LayerNorm before attention and a non-gated GELU MLP side by side, partial rotary, biases (the LM head's too)
    "PhiForCausalLM": ("PhiConfig", dict(partial_rotary_factor=0.5)),
    # latent attention (q's own projection; v wider than q.k, so q and k are the padded ones), YaRN with
    # mscale_all_dim; softmax experts from the best group of two (ranked by their best expert), shared experts
    "DeepseekV2ForCausalLM": ("DeepseekV2Config", dict(LATENT, q_lora_rank=None, v_head_dim=20, num_hidden_layers=3,
                                                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                       n_shared_experts=1, first_k_dense_replace=1,
                                                       topk_method="group_limited_greedy", n_group=2, topk_group=1,
                                                       routed_scaling_factor=1.5, rope_parameters=LATENT_YARN)),
    # q from its own latent, v narrower than q.k (v padded); sigmoid experts chosen with a bias from the best two of four
    # groups (ranked by their best two), renormalised, scaled
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", dict(LATENT, num_hidden_layers=3, n_routed_experts=8,
                                                       num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                                                       first_k_dense_replace=1, n_group=4, topk_group=2)),
    # Kimi delta attention around latent attention without rotary (q without a latent); a dense first layer, then
    # sigmoid experts chosen with a bias from the best of two groups, a shared expert; tie_word_embeddings set (which
    # transformers' model ignores: its head is its own)
    "KimiLinearForCausalLM": ("KimiLinearConfig", dict(LATENT, q_lora_rank=None, num_hidden_layers=3, linear_num_heads=4,
                                                       linear_head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                                                       moe_intermediate_size=32, n_group=2, topk_group=1,
                                                       layer_types=["linear_attention", "full_attention",
                                                                    "linear_attention"], tie_word_embeddings=True)),
    # Ling 3: Kimi delta attention with full-width gates and the bounded decay, around latent attention gated per head;
    # a dense first layer, then DeepSeek-V3's experts
    "BailingHybridForCausalLM": ("BailingHybridConfig", dict(LATENT, num_hidden_layers=3, num_local_experts=8,
                                                             num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
                                                             topk_group=1, first_k_dense_replace=1,
                                                             layer_types=["linear_attention", "full_attention",
                                                                          "linear_attention"])),
    # the experts' SwiGLU clipped on the last two layers, the shared expert's on the second (limits that bite here);
    # tie_word_embeddings set, which transformers' model ignores (its own lm_head)
    "BailingHybridForCausalLM:clipped": ("BailingHybridConfig", dict(LATENT, tie_word_embeddings=True,
                                                                     num_hidden_layers=3, num_local_experts=4,
                                                                     num_experts_per_tok=2, moe_intermediate_size=32,
                                                                     n_group=1, topk_group=1, first_k_dense_replace=1,
                                                                     expert_swiglu_limit_list=[0, 0.3, 0.5],
                                                                     share_expert_swiglu_limit_list=[0, 0.2, 0],
                                                                     layer_types=["linear_attention", "full_attention",
                                                                                  "linear_attention"])),
    # the decay unbounded (kda_safe_gate false), q without a latent, groups of experts not limited
    "BailingHybridForCausalLM:unsafe": ("BailingHybridConfig", dict(LATENT, q_lora_rank=None, num_hidden_layers=3,
                                                                    num_local_experts=4, num_experts_per_tok=2,
                                                                    moe_intermediate_size=32, n_group=1, topk_group=1,
                                                                    first_k_dense_replace=1, kda_safe_gate=False,
                                                                    layer_types=["linear_attention", "linear_attention",
                                                                                 "full_attention"])),
    # the rotary pairs as halves (rope_interleave false), no expert groups
    "DeepseekV3ForCausalLM:halves": ("DeepseekV3Config", dict(LATENT, rope_interleave=False, n_routed_experts=4,
                                                              num_experts_per_tok=2, moe_intermediate_size=32,
                                                              n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                                              topk_group=1, routed_scaling_factor=1.0)),
    # short convolutions around one attention layer (one KV head: each conv layer's inputs take two pool layers);
    # LFM2's own MLP size (2/3 of it, to a multiple of 16)
    "Lfm2ForCausalLM": ("Lfm2Config", dict(num_hidden_layers=4, num_key_value_heads=1, block_multiple_of=16,
                                           layer_types=["conv", "full_attention", "conv", "conv"])),
    # biases on the convolutions and their projections, the attention layers by index
    "Lfm2ForCausalLM:conv_bias": ("Lfm2Config", dict(num_hidden_layers=3, conv_bias=True, full_attn_idxs=[2],
                                                     block_auto_adjust_ff_dim=False)),
    # and sigmoid experts chosen with a bias, renormalised, scaled, after a dense layer
    "Lfm2MoeForCausalLM": ("Lfm2MoeConfig", dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=32, num_dense_layers=1,
                                                 routed_scaling_factor=1.5,
                                                 layer_types=["conv", "full_attention", "conv"])),
    # Qwen3's attention (windowed from max_window_layers on) with DeepSeek-V3's router: 2 of 4 groups, a dense layer first
    "Dots1ForCausalLM": ("Dots1Config", dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                                             n_group=4, topk_group=2, norm_topk_prob=True, sliding_window=WINDOW,
                                             max_window_layers=2)),
    "Glm4MoeLiteForCausalLM": ("Glm4MoeLiteConfig", dict(LATENT, n_routed_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=32, n_shared_experts=1,
                                                         routed_scaling_factor=1.0)),
    # DeepSeek-V3's latent attention and router (2 of 4 groups), the MoE output normed (post_mlp_layernorm), a dense
    # layer first
    "AXK1ForCausalLM": ("AXK1Config", dict(LATENT, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
                                           routed_scaling_factor=1.5)),
    # rotary halves, experts every other layer from the first (moe_layer_freq), two shared experts, no groups
    "AXK1ForCausalLM:halves": ("AXK1Config", dict(LATENT, num_hidden_layers=4, n_routed_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=32, n_shared_experts=2, n_group=1, topk_group=1,
                                                  rope_interleave=False, first_k_dense_replace=0, moe_layer_freq=2)),
    # DeepSeek-V3's latent attention in Llama's layers, dense MLPs; YaRN with mscale_all_dim
    "YoutuForCausalLM": ("YoutuConfig", dict(LATENT, rope_parameters=LATENT_YARN)),
    # gated attention (each head's q then its gate), DeepSeek-V3's sigmoid router with its bias, a dense layer first;
    # (":groups") from 2 of 4 expert groups, scaled
    "MiniCPM5MoeForCausalLM": ("MiniCPM5MoeConfig", dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                                                         moe_intermediate_size=32, n_group=1, topk_group=1,
                                                         routed_scaling_factor=1.0)),
    "MiniCPM5MoeForCausalLM:groups": ("MiniCPM5MoeConfig", dict(num_hidden_layers=3, n_routed_experts=8,
                                                                num_experts_per_tok=2, moe_intermediate_size=32,
                                                                n_group=4, topk_group=2, routed_scaling_factor=1.5)),
    # latent attention with its rotary dims as halves, v of its own width; MiniCPM's embedding, residual and logit scales
    "MiniCPM3ForCausalLM": ("MiniCPM3Config", dict(LATENT, scale_emb=3.0, scale_depth=1.4, dim_model_base=32)),
    # q from its own projection, v at transformers' default width (hidden / heads), longrope (MiniCPM3-4B's)
    "MiniCPM3ForCausalLM:longrope": ("MiniCPM3Config", dict(LATENT, q_lora_rank=None, v_head_dim=None, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.5], "long_factor": [2.0, 3.0, 4.0, 5.0],
        "original_max_position_embeddings": 64})),
    # EXAONE 4's attention (a window on every other layer, the global ones without rotary) in pre-norm layers over
    # DeepSeek-V3's router, a dense layer first
    "ExaoneMoeForCausalLM": ("ExaoneMoeConfig", dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, n_group=4, topk_group=2,
                                                     routed_scaling_factor=1.5, sliding_window=WINDOW,
                                                     sliding_window_pattern=2)),
    # sandwich norms, EXAONE 4's attention (windowed rotary layers, a full one without), experts chosen by logit + bias
    "Kolibri1ForCausalLM": ("Kolibri1Config", dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                                   moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                   sliding_window=WINDOW, norm_topk_prob=True,
                                                   layer_types=["sliding_attention", "full_attention",
                                                                "sliding_attention"])),
    # Kolibri-1's sandwich layers and router over windowed rotary layers and indexed ones without positions (K/V rounded
    # to NVFP4), the third on the second's K/V; two dense layers first
    "Kolibri1_1ForCausalLM": ("Kolibri1_1Config", dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                                                       moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                       sliding_window=WINDOW, norm_topk_prob=True,
                                                       layer_types=["sliding_attention", "indexed_attention",
                                                                    "indexed_attention", "sliding_attention"],
                                                       kv_source_layers=[0, 1, 1, 3], index_layers=[1],
                                                       index_num_heads=2, mlp_only_intermediate_size=80)),
    # every layer full (a window set: none rotates), the chosen weights not renormalised, wider heads
    "Kolibri1ForCausalLM:full": ("Kolibri1Config", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                        shared_expert_intermediate_size=32, sliding_window=WINDOW,
                                                        norm_topk_prob=False, layer_types=["full_attention"] * 2,
                                                        head_dim=32)),
    # sandwich norms mixing the residual by depth, gated attention with a bias a head, windowed rotary layers and a full
    # one without positions (its queries scaled by position), a dense layer, then grouped sigmoid experts (2 of 4
    # groups), stacked; logits capped
    "BeamForCausalLM": ("BeamConfig", dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=32, n_group=4, topk_group=2,
                                           routed_scaling_factor=1.5, sliding_window=WINDOW,
                                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                           mlp_layer_types=["dense", "sparse", "sparse"])),
    # every layer dense (int8 through Beam's attention and residual mix, which the random router hides)
    "BeamForCausalLM:dense": ("BeamConfig", dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                                 moe_intermediate_size=32, n_group=4, topk_group=2,
                                                 sliding_window=WINDOW, mlp_layer_types=["dense"] * 3,
                                                 layer_types=["sliding_attention", "full_attention",
                                                              "sliding_attention"])),
    # sandwich norms mixing the residual through learned gates, fused q/k/v, windowed layers rotating adjacent pairs and
    # a full one without positions (its q and k scaled), a dense relu^2 MLP, then relu^2 experts each normed on its
    # own, beside a normed shared expert; the training framework's names and layouts
    "ErgoForCausalLM": ("ErgoConfig", dict(head_dim=OMIT, num_hidden_layers=3, first_dense_intermediate_size=96,
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_intermediate_size=48, moe_routed_scaling_factor=1.5,
                                           sliding_window=WINDOW, global_attention_every_n_layers=2,
                                           global_attention_scale=1.5)),
    # DeepSeek-V3.2's latent attention and indexer (4 keys a query), q and each head's output gate from [normed, raw]
    # q latent, gated input norms (and MoE layers' MLP norms), a dense layer first, sigmoid experts without groups
    "AXK2ForCausalLM": ("AXK2Config", dict(LATENT, num_hidden_layers=3, n_routed_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=1.5,
                                           mlp_layer_types=["dense", "sparse", "sparse"], index_topk=4,
                                           index_n_heads=4, index_head_dim=16, gated_norm_rank=8)),
    # from the best of 2 expert groups (the others' experts scored 0), 2 shared experts
    "AXK2ForCausalLM:groups": ("AXK2Config", dict(LATENT, num_hidden_layers=3, n_routed_experts=8,
                                                  num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2,
                                                  n_group=2, topk_group=1, index_topk=4, index_n_heads=4,
                                                  mlp_layer_types=["dense", "sparse", "sparse"], index_head_dim=16,
                                                  gated_norm_rank=8)),
    # two stacks of 2 layers in cycles (2 high, each after 2 low passes), weightless norms, gated attention
    "HrmTextForCausalLM": ("HrmTextConfig", dict(num_key_value_heads=OMIT, H_cycles=2, L_cycles=2)),
    # nGPT's layers (L2 norms, interpolated residuals, scaled q and gates), a sliding and a full layer looped twice
    # between an input and an output layer
    "DoryForCausalLM": ("DoryConfig", dict(num_hidden_layers=4, n_input_layers=1, n_output_layers=1,
                                           n_recurrent_loops=2, sliding_window=WINDOW)),
    # the stored scales' multiplier 1 (1 / initializer_range: the random offsets on them not multiplied by 56)
    "DoryForCausalLM:unit_scales": ("DoryConfig", dict(num_hidden_layers=4, n_input_layers=1, n_output_layers=1,
                                                       n_recurrent_loops=2, sliding_window=WINDOW,
                                                       initializer_range=1.0)),
    # a lightning indexer in every layer choosing 4 keys a query (the prompts' contexts longer: the general path with
    # the choice as a mask), its rotary on halves; DeepSeek-V3's router, a dense layer first
    "DeepseekV32ForCausalLM": ("DeepseekV32Config", dict(LATENT, num_hidden_layers=3, n_routed_experts=4,
                                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                                         n_shared_experts=1, n_group=1, topk_group=1,
                                                         first_k_dense_replace=1, index_topk=4, index_n_heads=4,
                                                         index_head_dim=16)),
    # an indexer on the first two layers; the last two windowed with latent shapes of their own (fewer, wider heads,
    # other ranks), another RoPE base, no indexer; the latents scaled, the rotary key normed, a gate a head
    "Dots3NoteForCausalLM": ("Dots3NoteTextConfig", dict(
        LATENT, head_dim=16, num_hidden_layers=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, shared_experts_intermediate_size=24, index_topk=4, index_n_heads=8, index_head_dim=16,
        sliding_window=WINDOW, swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=20,
        swa_kv_lora_rank=12, swa_head_dim=24, swa_qk_nope_head_dim=16, swa_v_head_dim=8)),
    # 12 keys a query (the shorter prompts keep every key, the longer ones not, in the same steps), index heads of the
    # rotary dims alone; expert groups; mlp_bias, which its config takes and transformers' layers ignore
    "DeepseekV32ForCausalLM:groups": ("DeepseekV32Config", dict(LATENT, num_hidden_layers=3, n_routed_experts=8,
                                                                num_experts_per_tok=2, moe_intermediate_size=32,
                                                                n_shared_experts=1, n_group=4, topk_group=2,
                                                                first_k_dense_replace=1, index_topk=12,
                                                                index_n_heads=8, index_head_dim=8, mlp_bias=True)),
    # the indexer's rotary on pairs, the second layer reusing the first's choice
    "GlmMoeDsaForCausalLM": ("GlmMoeDsaConfig", dict(LATENT, num_hidden_layers=3, n_routed_experts=4,
                                                     num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                                                     n_group=1, topk_group=1, first_k_dense_replace=1, index_topk=4,
                                                     index_n_heads=4, index_head_dim=16,
                                                     indexer_types=["full", "shared", "full"])),
    # the pattern from index_topk_freq / index_skip_topk_offset (full, shared, full, shared), v wider than q.k, index
    # heads wider than the rotary dims; mlp_bias set (which transformers' model never reads)
    "GlmMoeDsaForCausalLM:pattern": ("GlmMoeDsaConfig", dict(LATENT, num_hidden_layers=4, n_routed_experts=4,
                                                             num_experts_per_tok=2, moe_intermediate_size=32,
                                                             n_shared_experts=1, n_group=1, topk_group=1,
                                                             first_k_dense_replace=2, index_topk=7, index_n_heads=8,
                                                             index_head_dim=32, index_topk_freq=2,
                                                             index_skip_topk_offset=1, v_head_dim=20, mlp_bias=True)),
    # two latent attentions and dense MLPs a checkpoint layer (4 of ours), the first's experts added after the second's
    # MLP; a softmax router over 4 experts and 2 identity experts, chosen with a bias, scaled; the latents' LoRA scales
    "LongcatFlashForCausalLM": ("LongcatFlashConfig", dict(LATENT, num_layers=2, ffn_hidden_size=96,
                                                           n_routed_experts=4, zero_expert_num=2, moe_topk=2,
                                                           expert_ffn_hidden_size=32, routed_scaling_factor=1.5)),
    # three checkpoint layers, no identity experts, top-1, YaRN with mscale_all_dim, v wider than q.k
    "LongcatFlashForCausalLM:yarn": ("LongcatFlashConfig", dict(LATENT, num_layers=3, ffn_hidden_size=96,
                                                                n_routed_experts=4, zero_expert_num=0, moe_topk=1,
                                                                expert_ffn_hidden_size=32, routed_scaling_factor=1.0,
                                                                rope_parameters=LATENT_YARN, v_head_dim=20,
                                                                q_lora_rank=32)),
    # LayerNorms scaling by 1 + weight, with biases; a non-gated relu2 MLP; partial rotary; biases on the linears
    "NemotronForCausalLM": ("NemotronConfig", dict(partial_rotary_factor=0.5, attention_bias=True, mlp_bias=True)),
    # LayerNorms with biases, a non-gated relu2 MLP, biases on every linear; (":gelu") no biases, GELU
    "Jais2ForCausalLM": ("Jais2Config", {}),
    "Jais2ForCausalLM:gelu": ("Jais2Config", dict(attention_bias=False, mlp_bias=False, hidden_act="gelu",
                                                  num_key_value_heads=1)),
    # RMSNorms without weights (one on the embeddings), q/k normed after a rotary turning the other way, a non-gated
    # relu2 MLP, capped logits; (":gqa") two query heads a KV head, wider heads, tied embeddings
    "NanoChatForCausalLM": ("NanoChatConfig", dict(final_logit_softcapping=3.0, num_key_value_heads=4)),
    "NanoChatForCausalLM:gqa": ("NanoChatConfig", dict(head_dim=32, num_key_value_heads=2, tie_word_embeddings=True)),
    # q/k/v head by head, q/k LayerNorms with biases shared by the heads, half of each head rotating, LayerNorms, relu2;
    # (":no_qk_norm") without the q/k norms, a quarter rotating
    "PersimmonForCausalLM": ("PersimmonConfig", {}),
    "PersimmonForCausalLM:no_qk_norm": ("PersimmonConfig", dict(qk_layernorm=False, partial_rotary_factor=0.25,
                                                                hidden_size=96, num_attention_heads=3, head_dim=32)),
    # norms before o_proj and before the MLP's down projection, a relu2-gated MLP; (":silu") SiLU-gated, one KV head,
    # tied embeddings
    "BitNetForCausalLM": ("BitNetConfig", {}),
    "BitNetForCausalLM:silu": ("BitNetConfig", dict(hidden_act="silu", num_key_value_heads=1,
                                                    tie_word_embeddings=True)),
    "HeliumForCausalLM": ("HeliumConfig", dict(attention_bias=True, mlp_bias=True)),  # no bias on o_proj
    # per-head q/k LayerNorms: Command R+'s (a weight per head, no bias), StableLM 2 12B's (a module per head), Phi's
    # (one LayerNorm with a bias for all of q's heads, another for k's); Command R+'s weights reordered with q/k's
    # interleaved rotary dims (wider heads: a wrong order shows)
    "CohereForCausalLM:qk_norm": ("CohereConfig", dict(logit_scale=0.5, use_qk_norm=True, head_dim=32)),
    "StableLmForCausalLM:qk_layernorm": ("StableLmConfig", dict(qk_layernorm=True, partial_rotary_factor=0.5)),
    "PhiForCausalLM:qk_layernorm": ("PhiConfig", dict(qk_layernorm=True, partial_rotary_factor=0.5)),
    # queries scaled by position past the original context (8 tokens here: most prompts cross it)
    "Ministral3ForCausalLM": ("Ministral3Config", dict(rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=8, llama_4_scaling_beta=0.5, rope_theta=10000.0,
        beta_fast=32.0, beta_slow=1.0))),
    "SeedOssForCausalLM": ("SeedOssConfig", dict(attention_bias=True, attention_out_bias=True)),
    "ArceeForCausalLM": ("ArceeConfig", {}),  # a non-gated MLP with relu squared
    # a non-gated MLP with xIELU, each layer's own parameters (random too, below); per-head q/k norms; llama3 rotary
    "ApertusForCausalLM": ("ApertusConfig", {}),
    # Apertus's layers, the LM head pruned to the first 80 ids (the prompts' ids past it are input-only)
    "Apertus1p5TextForCausalLM": ("Apertus1p5TextConfig", dict(output_vocab_size=80)),
    # the sparsemixer router, LayerNorms, biases on the attention and the LM head, a window, longrope
    "PhimoeForCausalLM": ("PhimoeConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                               attention_bias=True, lm_head_bias=True, sliding_window=WINDOW,
                                               rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.5] * 2,
                                                             "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0],
                                                             "original_max_position_embeddings": 64,
                                                             "short_mscale": 1.2, "long_mscale": 1.3})),
    "Ernie4_5ForCausalLM": ("Ernie4_5Config", {}),  # Llama's layers (int8: the native decode stack), rotary reordered
    "Ernie4_5ForCausalLM:use_bias": ("Ernie4_5Config", dict(use_bias=True)),
    "OlmoeForCausalLM:clip_qkv": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                                      clip_qkv=0.5)),
    # head_dim other than hidden / heads, biases on q/k/v/o and the MLP, tied embeddings
    "LlamaForCausalLM:head_dim,biases,tied": ("LlamaConfig", dict(head_dim=24, attention_bias=True, mlp_bias=True,
                                                                  tie_word_embeddings=True)),
    # dynamic NTK: plain RoPE within the context (transformers re-bases only past max_position_embeddings, whatever
    # original_max_position_embeddings says)
    "LlamaForCausalLM:dynamic": ("LlamaConfig", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0,
                                                                   "original_max_position_embeddings": 16})),
    # the window on the layers from max_window_layers on; untied embeddings
    "Qwen2ForCausalLM:sliding_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                            max_window_layers=1, num_hidden_layers=3)),
    "SmolLM3ForCausalLM:sliding_window": ("SmolLM3Config", dict(num_hidden_layers=3, no_rope_layer_interval=3,
                                                                use_sliding_window=True, sliding_window=WINDOW)),
    # Llama's attention with q/k/v biases; GLM-4.5's sigmoid experts (chosen with a bias from the best 2 of 4 groups,
    # renormalised, scaled) in every layer beside an ungated shared expert
    "SolarOpenForCausalLM": ("SolarOpenConfig", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                     n_shared_experts=1, n_group=4, topk_group=2, attention_bias=True,
                                                     routed_scaling_factor=1.5)),
    # Cohere 2's layers (LayerNorms) with a dense first layer (rotating, of its own size) and then softmax experts
    # averaged with a shared expert; (":rms,sigmoid") RMSNorms, sigmoid experts not renormalised, the shared expert summed
    # (experts of 64: at 32 int8 moved this random model's logprobs by 0.87)
    "Cohere2MoeForCausalLM": ("Cohere2MoeConfig", dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                                                       intermediate_size=32, num_shared_experts=1, first_k_dense_replace=1,
                                                       prefix_dense_intermediate_size=48, sliding_window=WINDOW,
                                                       logit_scale=0.5)),
    "Cohere2MoeForCausalLM:rms,sigmoid": ("Cohere2MoeConfig", dict(
        num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, intermediate_size=64, num_shared_experts=2,
        shared_expert_combination_strategy="sum", expert_selection_fn="sigmoid", norm_topk_prob=False,
        rms_norm_eps=1e-6, sliding_window=WINDOW, sliding_window_pattern=2, logit_scale=0.5)),
    # sandwich norms, per-head q/k norms, rotary on the windowed layers only, an output gate of its own projection; a
    # dense first layer, then sigmoid experts chosen with a bias, renormalised, scaled, beside a shared expert; muP
    # (experts of 64: at 32 int8 moved this random model's logprobs by 0.62)
    "AfmoeForCausalLM": ("AfmoeConfig", dict(num_hidden_layers=4, global_attn_every_n_layers=2, sliding_window=WINDOW,
                                             num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=64, num_shared_experts=1, route_scale=1.5,
                                             mup_enabled=True)),
    # query heads by layer (4, 8, 2: GQA ratios of 2, 4, 1), windowed layers with their own rotary base over whole
    # heads, full layers rotating half of each head; a softplus gate a head; a dense first layer, then sigmoid experts
    # over soft-capped logits chosen with a bias, renormalised, scaled, beside a shared expert
    "LagunaForCausalLM": ("LagunaConfig", dict(
        num_hidden_layers=3, num_attention_heads_per_layer=[4, 8, 2], sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=64, moe_routed_scaling_factor=1.5,
        moe_router_logit_softcapping=2.0,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 1.0}})),
    # a softplus gate a value, every layer's heads the same, no cap (the experts in the native MoE block)
    "LagunaForCausalLM:per_element": ("LagunaConfig", dict(num_hidden_layers=2, gating="per-element", num_experts=4,
                                                           num_experts_per_tok=2, moe_intermediate_size=32,
                                                           shared_expert_intermediate_size=64)),
    # Qwen3-MoE's layers, windowed ones with their own rotary base, a dense layer of its own size; attention biases
    # (o_proj's too)
    "MellumForCausalLM": ("MellumConfig", dict(
        num_hidden_layers=3, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], intermediate_size=64, **MOE, attention_bias=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # sinks, per-head q/k norms, rotary on the windowed layers only (the full ones without positions); sigmoid experts
    # renormalised beside an ungated shared expert, the first two layers dense
    "FlintForCausalLM": ("FlintConfig", dict(num_hidden_layers=5, sliding_window=WINDOW, shared_expert_intermediate_size=64,
                                             attention_bias=True, **MOE)),
    # per-head q/k norms, q/k/v/o biases; a dense first layer, then sigmoid experts chosen with a bias, renormalised,
    # scaled, beside an ungated shared expert
    "HYV3ForCausalLM": ("HYV3Config", dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           num_shared_experts=1, router_scaling_factor=2.0, attention_bias=True)),
    # delta nets (the fused in_proj), attention rotating on the windowed layers only; softmax experts beside an
    # ungated shared expert in every layer
    "LaraMiniForCausalLM": ("LaraMiniConfig", dict(DELTA, num_hidden_layers=5, sliding_window=WINDOW,
                                                   intermediate_size=OMIT, shared_expert_intermediate_size=48,
                                                   layer_types=["linear_attention", "sliding_attention",
                                                                "linear_attention", "full_attention",
                                                                "sliding_attention"], **MOE)),
    # Llama's layers among cross-attention layers, which a text prompt skips; the embedding table 8 rows past the vocab
    "MllamaForCausalLM": ("MllamaTextConfig", dict(num_hidden_layers=5, cross_attention_layers=[1, 3], rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}, tie_word_embeddings=True)),  # (transformers keeps the head its own)
    "MllamaForConditionalGeneration": ("MllamaConfig", {}),  # text only: see MLLAMA_MM
    # a mixture of attention heads (routed q/o projections over shared K/V heads, a bias) beside stacked experts with a
    # bias on their sum
    "JetMoeForCausalLM": ("JetMoeConfig", dict(intermediate_size=32, kv_channels=16, num_local_experts=4,
                                               num_experts_per_tok=2, num_attention_heads=OMIT, head_dim=OMIT)),
    # experts in every layer (softmax over the top-k logits), stacked [experts, in, out], beside ungated shared experts
    "AriaTextForCausalLM": ("AriaTextConfig", dict(intermediate_size=32, moe_num_experts=4, moe_topk=2,
                                                   moe_num_shared_experts=2)),
    "AriaForConditionalGeneration": ("AriaConfig", {}),  # text only: see ARIA_MM
    # Mamba-2 layers with two shared blocks taking the hybrid layers in turn, adapters on q/k/v and gate/up, rotary
    "Zamba2ForCausalLM": ("Zamba2Config", dict(ZAMBA2, num_key_value_heads=8, num_mem_blocks=2,
                                               use_shared_attention_adapter=True, use_mem_rope=True)),
    # one block, adapters on gate/up alone, no rotary, grouped K/V heads, biases in the MLP and the Mamba projections
    "Zamba2ForCausalLM:plain": ("Zamba2Config", dict(ZAMBA2, num_key_value_heads=4, num_mem_blocks=1,
                                                     add_bias_linear=True,
                                                     layers_block_type=["hybrid", "mamba", "hybrid", "hybrid"])),
    # untied embeddings: every use of the blocks its own copy (with its adapters)
    "Zamba2ForCausalLM:untied": ("Zamba2Config", dict(ZAMBA2, num_key_value_heads=8, num_mem_blocks=2,
                                                      tie_word_embeddings=False, use_shared_attention_adapter=True,
                                                      layers_block_type=["hybrid", "hybrid", "mamba", "hybrid"])),
    # short convolutions among full (proportional rotary over half of each head) and windowed (their own base)
    # attention, a sigmoid gate per head, sandwich norms
    "Lfm3ForCausalLM": ("Lfm3Config", dict(num_hidden_layers=5, sliding_window=WINDOW, conv_L_cache=3,
                                           layer_types=["conv", "sliding_attention", "full_attention", "conv",
                                                        "sliding_attention"])),
    # no gate, no sandwich norms, the default rotary both ways, tied
    "Lfm3ForCausalLM:plain": ("Lfm3Config", dict(num_hidden_layers=3, use_attention_gate=False, use_sandwich_norm=False,
                                                 tie_word_embeddings=True, conv_bias=True,
                                                 rope_parameters={"full_attention": {"rope_type": "default",
                                                                                     "rope_theta": 10000.0},
                                                                  "sliding_attention": {"rope_type": "default",
                                                                                        "rope_theta": 10000.0}},
                                                 layer_types=["full_attention", "conv", "full_attention"])),
    # values narrower than keys, scaled; windowed layers with twice the K/V heads and sinks; a third of each head
    # rotating by each layer type's base; a dense first layer, then sigmoid experts chosen with a bias from expert
    # groups
    "MiMoV2FlashForCausalLM": ("MiMoV2FlashConfig", dict(num_hidden_layers=4, head_dim=24, v_head_dim=16,
                                                         sliding_window=WINDOW, n_routed_experts=4,
                                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                                         n_group=2, topk_group=1, routed_scaling_factor=2.0,
                                                         layer_types=["full_attention", "sliding_attention",
                                                                      "sliding_attention", "full_attention"])),
    # every layer dense (int8 through the attention's options), values as wide as keys and unscaled, one KV head
    "MiMoV2FlashForCausalLM:dense": ("MiMoV2FlashConfig", dict(num_hidden_layers=3, head_dim=24, v_head_dim=24,
                                                               num_key_value_heads=1, sliding_window=WINDOW,
                                                               attention_value_scale=None,
                                                               mlp_layer_types=["dense"] * 3,
                                                               layer_types=["sliding_attention", "full_attention",
                                                                            "sliding_attention"])),
    # Mamba-1 layers of two heads (each its own dt, B and C) and one shared block without positions; grouped K/V heads
    "ZambaForCausalLM": ("ZambaConfig", dict(head_dim=OMIT, num_hidden_layers=4, n_mamba_heads=2, mamba_d_state=8,
                                             layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                                             tie_word_embeddings=True)),
    # one head, projection biases, more query heads (narrower); untied embeddings untie the shared block's uses too
    # (transformers ties them by tie_word_embeddings): each reads its own copy
    "ZambaForCausalLM:biases": ("ZambaConfig", dict(head_dim=OMIT, num_hidden_layers=3, n_mamba_heads=1,
                                                    mamba_d_state=8,
                                                    num_attention_heads=8, mamba_proj_bias=True,
                                                    layers_block_type=["hybrid", "mamba", "hybrid"])),
    # differential attention: 4 query heads over 2 K/V heads (the value heads paired across the halves), biases
    "DiffLlamaForCausalLM": ("DiffLlamaConfig", dict(attention_bias=True)),
    # GQA of 4 query heads a K/V head, 4 K/V heads (two value pairs), three layers (lambda_init by depth)
    "DiffLlamaForCausalLM:gqa": ("DiffLlamaConfig", dict(num_attention_heads=16, num_key_value_heads=4, head_dim=8,
                                                         num_hidden_layers=3)),
    # dynamic mask attention (a bias per key and K/V head from its values), per-head q/k norms, the stream weighted
    # per channel before each add; (":window") a window on every layer, biases on q/k/v/o and dt_proj
    "DogeForCausalLM": ("DogeConfig", dict(head_dim=OMIT)),
    "DogeForCausalLM:window": ("DogeConfig", dict(head_dim=OMIT, sliding_window=WINDOW, attention_bias=True,
                                                  num_key_value_heads=4)),
    # Emu3's text model: Llama's layers (GQA), untied
    "Emu3ForCausalLM": ("Emu3TextConfig", {}),
    # learned positions (2 rows in), scaled embeddings, LayerNorms, biases, a non-gated GELU MLP; (":untied") its own
    # output projection, unscaled embeddings
    "BioGptForCausalLM": ("BioGptConfig", dict(num_key_value_heads=OMIT, head_dim=OMIT, tie_word_embeddings=True)),
    "BioGptForCausalLM:untied": ("BioGptConfig", dict(num_key_value_heads=OMIT, head_dim=OMIT, scale_embedding=False)),
    # GPT-NeoX's q/k/v head by head without biases, half of each head rotating, one layer after the other, the last
    # layer's attention output bias alone, tied; (":untied") whole heads rotating, three layers, its own LM head
    "GPTNeoXJapaneseForCausalLM": ("GPTNeoXJapaneseConfig", dict(
        num_key_value_heads=OMIT, head_dim=OMIT, intermediate_size=OMIT, intermediate_multiple_size=2,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "GPTNeoXJapaneseForCausalLM:untied": ("GPTNeoXJapaneseConfig", dict(
        num_key_value_heads=OMIT, head_dim=OMIT, intermediate_size=OMIT, num_hidden_layers=3)),
    # fixed sinusoidal positions from 0, scaled embeddings, LayerNorms, biases, a non-gated ReLU MLP, the LM head's bias
    # over the embedding's weights (tied: the checkpoint stores no head); (":untied") a head of its own
    "CTRLLMHeadModel": ("CTRLConfig", dict(dff=96, tie_word_embeddings=True, **CTRL_OMIT)),
    "CTRLLMHeadModel:untied": ("CTRLConfig", dict(dff=96, **CTRL_OMIT)),
    # LayerNorms without biases on the embeddings and before each sublayer (the first attention reads the normed
    # embeddings), a global layer then two windowed ones (their own rotary base), a gated GELU MLP (Wi's halves), the
    # prediction head before the LM head's bias over the embedding's weights (the checkpoint stores no head);
    # (":biases") biases on every norm and linear, the head's dense layer too, a global layer every other one, its own
    # LM head
    "ModernBertDecoderForCausalLM": ("ModernBertDecoderConfig", dict(
        num_key_value_heads=OMIT, head_dim=OMIT, num_hidden_layers=4, local_attention=2 * WINDOW,
        tie_word_embeddings=True)),
    "ModernBertDecoderForCausalLM:biases": ("ModernBertDecoderConfig", dict(
        num_key_value_heads=OMIT, head_dim=OMIT, num_hidden_layers=3, local_attention=2 * WINDOW, norm_bias=True,
        attention_bias=True, mlp_bias=True, classifier_bias=True, global_attn_every_n_layers=2,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 160000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
}
# Gemma3ForConditionalGeneration's text model, beside a one-layer vision tower the engine does not read
GEMMA3_MM = dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14), mm_tokens_per_image=4,
                 text_config=dict(CASES["Gemma3ForCausalLM"][1]))
# Mistral3ForConditionalGeneration's text model (Mistral's), beside a one-layer Pixtral tower
MISTRAL3_MM = dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      head_dim=16, image_size=28, patch_size=14),
                   text_config=dict(model_type="mistral", sliding_window=WINDOW))
# the Qwen VL models' text models, multimodal rotary sections over head_dim / 2 (transformers 4's "mrope" type for
# Qwen2-VL, 5's for the others), beside a one-block vision tower
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
QWEN2_VL = dict(vision_config=dict(QWEN_VISION, embed_dim=32, mlp_ratio=2),
                text_config=dict(rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}))
QWEN2_5_VL = dict(vision_config=QWEN_VISION,
                  text_config=dict(rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                    "rope_theta": 1e6}))
QWEN3_VL = dict(vision_config=dict(QWEN_VISION, deepstack_visual_indexes=[0]),
                text_config=dict(rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                  "mrope_interleaved": True, "rope_theta": 5e5}))
# (experts of 24: gate_up is not square, so its orientation shows)
QWEN3_VL_MOE = dict(QWEN3_VL, text_config=dict(QWEN3_VL["text_config"], **dict(MOE, moe_intermediate_size=24),
                                               decoder_sparse_step=1))
# Qwen3.5's text models (interleaved multimodal rotary on a quarter of each head), beside a one-block vision tower
QWEN3_5_TEXT = dict(CASES["Qwen3_5ForCausalLM"][1], rope_parameters={
    "rope_type": "default", "mrope_section": [1, 1, 0], "mrope_interleaved": True, "rope_theta": 1e7,
    "partial_rotary_factor": 0.25})
QWEN3_5 = dict(vision_config=QWEN_VISION, text_config=QWEN3_5_TEXT)
QWEN3_5_MOE = dict(vision_config=QWEN_VISION, text_config=dict(CASES["Qwen3_5MoeForCausalLM"][1],
                                                               rope_parameters=QWEN3_5_TEXT["rope_parameters"]))
# Llama 4's text model beside a one-layer vision tower
LLAMA4_MM = dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14, vision_output_dim=64, projector_input_dim=64,
                                    projector_output_dim=64),
                 text_config=dict(CASES["Llama4ForCausalLM"][1]))
# Gemma 4's text model (the towers left out: its config makes none by default)
GEMMA4_MM = dict(text_config=dict(CASES["Gemma4ForCausalLM"][1]))
# Gemma 3n's text model beside a one-layer audio tower and a stand-in for its timm vision tower (stub_timm_tower),
# neither read by the engine
GEMMA3N_MM = dict(vision_config=dict(hidden_size=32), text_config=dict(CASES["Gemma3nForCausalLM"][1]),
                  audio_config=dict(hidden_size=32, conf_num_hidden_layers=1, conf_num_attention_heads=2,
                                    input_feat_size=16, sscp_conv_channel_size=[8, 8]))
# Mllama's text model (cross-attention layers first and last) beside a one-layer vision tower
MLLAMA_MM = dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_global_layers=1,
                                    attention_heads=2, image_size=28, patch_size=14, vision_output_dim=64),
                 image_token_index=96, text_config=dict(num_hidden_layers=4, cross_attention_layers=[0, 3]))
# Aria's text model beside a one-layer Idefics3 vision tower and its projector
ARIA_MM = dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=28, patch_size=14), projector_patch_to_query_dict={4: 2},
               image_token_id=96, text_config=dict(CASES["AriaTextForCausalLM"][1], moe_num_shared_experts=1))
MULTIMODAL = {"Gemma3ForConditionalGeneration": GEMMA3_MM, "Gemma3nForConditionalGeneration": GEMMA3N_MM,
              "Gemma4ForConditionalGeneration": GEMMA4_MM, "Mistral3ForConditionalGeneration": MISTRAL3_MM,
              "AriaForConditionalGeneration": ARIA_MM, "MllamaForConditionalGeneration": MLLAMA_MM,
              "Qwen2VLForConditionalGeneration": QWEN2_VL, "Qwen2_5_VLForConditionalGeneration": QWEN2_5_VL,
              "Qwen3VLForConditionalGeneration": QWEN3_VL, "Qwen3VLMoeForConditionalGeneration": QWEN3_VL_MOE,
              "Qwen3_5ForConditionalGeneration": QWEN3_5, "Qwen3_5MoeForConditionalGeneration": QWEN3_5_MOE,
              "Llama4ForConditionalGeneration": LLAMA4_MM}
PROMPT_LENS = [1, 5, 9, 17, 30]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_every_registered_architecture_has_a_case():
    assert sorted({case.partition(":")[0] for case in CASES}) == architecture_names()


def test_importing_one_architecture_first_still_registers_them_all():
    """A module imported before the registry loads (a test helper importing lfm2's) registers itself; the registry
    still loads the rest."""
    import subprocess
    import sys

    code = ("import kvserve.model.architectures.lfm2\n"
            "from kvserve.model.architectures import architecture_names\nprint(len(architecture_names()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) == len(architecture_names())


def hf_model(case: str, **overrides):
    """``case``'s tiny random transformers model (its arguments, then ``overrides``)."""
    import transformers

    name = case.partition(":")[0]
    config_class, extra = CASES[case]
    if name in MULTIMODAL:
        parts = MULTIMODAL[name]
        text = {**COMMON, **parts["text_config"], **overrides}
        cfg = getattr(transformers, config_class)(**{**parts, "text_config": text},
                                                  tie_word_embeddings=text["tie_word_embeddings"])
    else:
        cfg = getattr(transformers, config_class)(**{k: v for k, v in {**COMMON, **extra, **overrides}.items()
                                                     if v != OMIT})
    cfg.architectures = [name]
    torch.manual_seed(0)
    with stub_timm_tower():
        model = getattr(transformers, name)(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() > 1:
                # routers peaked too
                p.normal_(0, 1.0 if pname.endswith(("gate.weight", "router.weight", "router.layer.weight")) else 0.2)
            else:  # norms and biases away from their initial values, so a misplaced one changes the answer
                p.add_(torch.randn_like(p) * 0.2)
        for bname, b in model.named_buffers():  # a router's selection bias (GLM-4.5 MoE keeps it as a buffer)
            if bname.endswith(("e_score_correction_bias", "expert_bias")):  # (a buffer: the init left it at zero)
                b.normal_(0, 0.05)
    return model.eval()


@contextlib.contextmanager
def stub_timm_tower():
    """Gemma 3n's vision tower is a timm model (timm is not installed here): a small linear stands in for it, as the
    engine reads no vision weights and a text prompt never runs the tower."""
    from transformers.models.gemma3n import modeling_gemma3n

    real = modeling_gemma3n.AutoModel.from_config

    def from_config(config, *args, **kwargs):
        if getattr(config, "model_type", None) == "gemma3n_vision":
            return torch.nn.Linear(2, 2)
        return real(config, *args, **kwargs)

    with mock.patch.object(modeling_gemma3n.AutoModel, "from_config", from_config):
        yield


_folders: dict[str, tuple] = {}


def checkpoint(name: str, tmp_path_factory):
    """(transformers model, the folder it saved) for ``name``, built once per session."""
    if name not in _folders:
        model = hf_model(name)
        folder = tmp_path_factory.mktemp(name.replace(":", "-").replace(",", "-"))
        model.save_pretrained(folder)
        word_tokenizer(COMMON["vocab_size"]).save_pretrained(folder)
        _folders[name] = (model, folder)
    return _folders[name]


def word_tokenizer(vocab: int):
    """A word-level tokenizer over ``vocab`` ids ("t0" ...): the folder loads as a checkpoint does."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")


def prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 97) for _ in range(n)] for n in PROMPT_LENS]


def make_llm(folder, torch_path: bool = False, quantization: str = "none", **kw) -> LLM:
    loaded = load_model(folder, keep_quantized=quantization != "none")  # as the engine loads (build.py)
    loaded.config.eos_token_ids = []
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    llm = LLM.from_weights(loaded.config, loaded.weights, dtype="float32", quantization=quantization,
                           attention_backend="gather-sdpa" if torch_path else "auto", **kw)
    if torch_path:
        llm.engine.runner.model.use_native_ops(False)
    return llm


_expected: dict[str, list[list[int]]] = {}


def expected(name: str, tmp_path_factory) -> list[list[int]]:
    if name not in _expected:
        model, _ = checkpoint(name, tmp_path_factory)
        _expected[name] = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts()]
    return _expected[name]


def count_general_calls(monkeypatch) -> list[int]:
    """Counts the layers attended by the torch fallback for windows and soft caps (attention/general.py)."""
    import kvserve.attention.backend as backend

    calls = [0]
    real = backend.attend_general

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "attend_general", counted)
    return calls


@pytest.mark.parametrize("torch_path", [False, True], ids=["native", "torch"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_equals_transformers(name, torch_path, tmp_path_factory, monkeypatch):
    from kvserve.attention.paged import PagedBackend

    _, folder = checkpoint(name, tmp_path_factory)
    general = count_general_calls(monkeypatch)
    llm = make_llm(folder, torch_path, max_num_batched_tokens=512)
    got = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
    assert got == expected(name, tmp_path_factory)
    runner = llm.engine.runner
    specs = [layer.self_attn.spec for layer in runner.model.layers if hasattr(layer.self_attn, "spec")]
    sinks = any(getattr(layer.self_attn, "sinks", None) is not None for layer in runner.model.layers)
    # flash_prefill (AMX bf16 prompts) takes windows and caps but no sinks: those steps' sink layers go to the torch path
    flash_steps = sinks and runner.attention.prefill_dtype == torch.bfloat16 and ops.flash_prefill_available()
    # (the kernels take no ALiBi and no chunked attention: the torch path always)
    general_only = any(spec.alibi is not None or spec.chunk is not None for spec in specs)
    # (nor an indexer's choice of keys, once a context is longer than its top-k: Dots 3's windows beside one)
    general_only |= any(getattr(layer.self_attn, "index_topk", 0) for layer in runner.model.layers)
    if (sinks or any(spec.masked for spec in specs)) and not flash_steps and not general_only:
        # windows, soft caps and sinks: in the paged backend's kernels where it runs, else the torch fallback
        assert (general[0] == 0) == isinstance(runner.attention, PagedBackend), general
    if not torch_path and load_kernels():
        assert isinstance(runner.attention, PagedBackend)


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_prefill_prefix_hits_and_preemption_keep_the_answer(name, tmp_path_factory):
    _, folder = checkpoint(name, tmp_path_factory)
    want = expected(name, tmp_path_factory)
    # prompts in chunks of 3 tokens; then again, every prompt a prefix-cache hit
    llm = make_llm(folder, max_num_batched_tokens=3)
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == want
    hits = llm.engine.kv.stats.device_hits
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == want
    if llm.engine.runner.cfg.has_recurrent_state:  # a state per sequence: no prefix cache (tests/model/test_mamba.py)
        assert llm.engine.kv.cache is None and llm.engine.kv.state_slots
    else:
        assert llm.engine.kv.stats.device_hits >= hits + 16  # the longer prompts' whole blocks
    # a pool that holds about one sequence: later ones are preempted and recomputed (where every layer has
    # a window a sequence holds only the window's blocks and its chunk's: steps of 4 tokens, 5 blocks)
    small = dict(max_num_batched_tokens=32, num_kv_blocks=(max(PROMPT_LENS) + 8) // 4 + 2)
    if llm.engine.kv.sliding_window is not None:
        small = dict(max_num_batched_tokens=4, num_kv_blocks=5)
    llm = make_llm(folder, **small)
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == want
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert llm.engine.kv.num_available_blocks == llm.engine.kv.pool.num_blocks

def assert_logprobs_close(dense, quant, label: str) -> None:
    """vLLM's check_logprobs_close: at every step while the two agree, the dense model's greedy token is
    within the quantized model's top logprobs, and their logprobs within 0.5 of each other."""
    for d, q in zip(dense, quant):
        for step, (dt, qt) in enumerate(zip(d.token_ids, q.token_ids)):
            top = dict(q.logprobs[step].top)
            assert dt in top, (label, step, dt, top)
            assert abs(top[dt] - d.logprobs[step].logprob) < 0.5
            if dt != qt:
                break


# where int8 moves this random model's greedy tokens beyond the closeness bound (what the case adds is checked exactly:
# dense greedy tokens above, the native block against the loop in tests/kernels/test_moe_block.py)
NOT_CLOSE = {"Glm4MoeForCausalLM:scaled": "x2.5 amplifies int8's flips among the random router's near-equal sigmoids",
             "DeepseekV3ForCausalLM": "int8 flips the choice of expert groups among the random router's near-equal "
                                      "sigmoids (int8 through latent attention: the other DeepSeek cases)",
             "DbrxForCausalLM:plain": "int8 flips the random router's second expert on a decode row (a 0.4 logit gap), "
                                      "whose weight is not renormalised: 0.52 against the 0.5 bound (int8 through "
                                      "DBRX's layers and flat stacked experts: DbrxForCausalLM)",
             "MiniCPM5MoeForCausalLM:groups": "int8 flips the choice of expert groups among the random router's "
                                              "near-equal sigmoids, x1.5 (int8 through its attention and router: "
                                              "MiniCPM5MoeForCausalLM)",
             "DeepseekV32ForCausalLM:groups": "int8 moves this random router's choices (8 experts in groups) beyond the "
                                              "bound with the indexer's choice or without it (index_topk 64: every key, "
                                              "the same); int8 through the indexer: DeepseekV32ForCausalLM",
             "PhimoeForCausalLM": "the sparsemixer's 2% threshold (which logits share a pick's softmax) moves under "
                                  "int8 on this random router, a step change in the weights",
             **dict.fromkeys(["Llama4ForCausalLM", "Llama4ForConditionalGeneration"],
                             "int8 flips the random router's top-1 choice (its weight scales the expert's input); "
                             "int8 through Llama 4's attention: Llama4ForCausalLM:dense"),
             **dict.fromkeys(["Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"],
                             "the random delta nets move most under int8 (0.43 of the 0.5 bound for the dense Qwen3.5; "
                             "0.16 with their in_proj dense), enough to flip this random router's choices (int8 "
                             "through the delta nets and gated attention: the dense Qwen3.5 cases)"),
             "Dots3NoteForCausalLM": "int8 moves this random latent attention's logprobs 0.52 against the 0.5 bound "
                                     "(1.06 with the latents' scales left out, worse with every layer dense: not the "
                                     "router; DeepSeek-V3.2's case without the gate and the scales: 0.46); int8 "
                                     "through latent attention and an indexer: DeepseekV32ForCausalLM",
             "LaraMiniForCausalLM": "the same for Lara's delta nets before a random softmax router in every layer: 0.70 "
                                    "against the 0.5 bound on the 8th token of the first prompt (int8 through the "
                                    "delta nets: the dense Qwen3.5 cases)",
             **dict.fromkeys(["Zamba2ForCausalLM", "Zamba2ForCausalLM:plain", "Zamba2ForCausalLM:untied"],
                             "these random weights make the shared blocks' attention over [stream, embeddings] near "
                             "one-hot (0.88 the mean top probability) and every layer a Mamba layer after it: int8 "
                             "moves "
                             "logprobs up to ~1.5 (the same cases with every matrix halved stay within 0.3)"),
             "MiMoV2FlashForCausalLM": "int8 flips this random sigmoid router's choices among near-equal scores (0.72 "
                                       "with one expert group and no scaling too; int8 through MiMo's attention: "
                                       "MiMoV2FlashForCausalLM:dense)",
             "MiniMaxForCausalLM": "the lightning layers' sums are not normalised (a softmax's are): int8 on these "
                                   "random 0.2-std weights moves logprobs up to 1.2 and flips the random router; with "
                                   "every matrix but the router halved, within 0.015 of dense at every step",
             "BailingHybridForCausalLM:unsafe": "int8 on the delta nets' full-width forget gate, whose error exp(A_log) "
                                                "(up to 16 here) multiplies in the unbounded decay's log, drops a dense "
                                                "token from the top 5; with the delta nets' in_proj and out_proj dense, "
                                                "within 0.14 (int8 through the bounded gate: BailingHybridForCausalLM)",
             "AXK2ForCausalLM:groups": "int8 flips this random grouped router's choices (the greedy token left the "
                                       "quantized top 5 at a step; AXK2ForCausalLM, the same layers without groups, "
                                       "stays close)",
             "DoryForCausalLM": "the random offsets (0.2) on nGPT's stored scales, used times 1 / initializer_range "
                                "(56) and squared for q and the gates, make this model's logit and gate scales tens "
                                "to thousands: int8 moves logprobs by 1.6 (with that multiplier 1, "
                                "DoryForCausalLM:unit_scales, within the bound)",
             "BeamForCausalLM": "int8 flips this random grouped sigmoid router's choices (0.76 against the 0.5 bound; "
                                "with one expert group and no scaling within it; int8 through Beam's attention and "
                                "residual mix: BeamForCausalLM:dense)",
             "ZambaForCausalLM:biases": "the same for Zamba's shared block (narrow heads, near one-hot here): 0.62 "
                                        "against the 0.5 bound; with every matrix halved within 0.01 (int8 through "
                                        "Zamba's layers: ZambaForCausalLM)"}


@pytest.mark.parametrize("name", sorted(set(CASES) - set(NOT_CLOSE)))
def test_quantized_default_stays_close_to_dense(name, tmp_path_factory):
    """int8 weights: the dense model's greedy token is within the quantized model's top 5 (vLLM's quantization tests'
    count: near-ties of these random, flat models reorder a top 3), and their logprobs within 0.5 of each other, at
    every step while the two agree (vLLM's check_logprobs_close)."""
    _, folder = checkpoint(name, tmp_path_factory)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    dense = make_llm(folder).generate(prompts(), params)
    quant = make_llm(folder, quantization="int8").generate(prompts(), params)
    assert_logprobs_close(dense, quant, name)


def test_gemma3_multimodal_checkpoint_answers_as_its_text_model(tmp_path_factory, caplog):
    """Gemma3ForConditionalGeneration's folder, text only: the same config as Gemma3ForCausalLM's over its
    text_config, the vision tower left unread (and logged), and the answers of a Gemma3ForCausalLM holding
    the same text weights."""
    import dataclasses
    import logging

    import transformers

    from kvserve.model.config import ModelConfig

    mm, folder = checkpoint("Gemma3ForConditionalGeneration", tmp_path_factory)
    text = transformers.Gemma3ForCausalLM(mm.config.text_config).eval()
    text.model.load_state_dict(mm.model.language_model.state_dict())
    text.tie_weights()
    causal = text.config.to_dict()
    causal["architectures"] = ["Gemma3ForCausalLM"]
    ours = ModelConfig.from_hf_dict(mm.config.to_dict())
    assert dataclasses.replace(ours, architecture="Gemma3ForCausalLM") == ModelConfig.from_hf_dict(causal)
    with caplog.at_level(logging.INFO, logger="kvserve.model.hf_loader"):
        llm = make_llm(folder, max_num_batched_tokens=512)
    assert "not read" in caplog.text
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == [hf_greedy(text, p, GREEDY.max_tokens)
                                                                    for p in prompts()]


def test_an_architecture_s_other_name_loads_as_it(tmp_path_factory, tmp_path):
    """MiniCPM5-MoE's released config.json names "MiniCPM5MoEForCausalLM" (transformers' config renames it): the same
    architecture, the same tokens."""
    import json
    import shutil

    _, folder = checkpoint("MiniCPM5MoeForCausalLM", tmp_path_factory)
    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["MiniCPM5MoEForCausalLM"]}))
    got = [o.token_ids for o in make_llm(tmp_path).generate(prompts(), GREEDY)]
    assert got == expected("MiniCPM5MoeForCausalLM", tmp_path_factory)


def test_a_sigmoid_router_picks_by_logit_past_float32_saturation():
    """Logits of 15 and 14.8 have the same float32 sigmoid: the top-1 expert is still the larger logit's (Llama 4's
    router, which ranks logits), and it scales that expert's input."""
    from kvserve.model.mlp import MoE

    moe = MoE(4, 8, 2, 1, False, "silu", scoring="sigmoid", scale_inputs=True)
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor([[14.8, 0, 0, 0], [15.0, 0, 0, 0]]))  # (a tie's topk takes the first)
        for e, expert in enumerate(moe.experts):
            expert.gate_up.weight.fill_(1.0)
            expert.down.weight.fill_(1.0 + e)  # expert 1's output twice expert 0's
    x = torch.tensor([[1.0, 0, 0, 0]])
    assert torch.sigmoid(torch.tensor(15.0)) == torch.sigmoid(torch.tensor(14.8))
    want = moe.experts[1](x * torch.sigmoid(torch.tensor(15.0)))
    torch.testing.assert_close(moe.loop_forward(x), want)


def test_sparsemixer_equals_transformers():
    """Phi-3.5-MoE's router against transformers' (inference): the same two experts and weights a row, on logits close
    enough that the threshold leaves some of them in each pick's softmax (so its weights are not a plain softmax's)."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer as reference

    from kvserve.model.mlp import sparsemixer

    torch.manual_seed(0)
    logits = 1 + torch.randn(256, 8) * 0.02
    weights, experts = sparsemixer(logits, 0.01)
    want_weights, want_experts = reference(logits, jitter_eps=0.01, training=False, top_k=2)
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=0)
    assert (weights[:, 0] < 0.99).any() and (weights[:, 0] > 0.99).any()  # some picks share their softmax, some not


def test_stacked_experts_load_either_way_round(tmp_path_factory, tmp_path):
    """Qwen3-VL-MoE's experts as its published files store them ([experts, in, out]) and as transformers 5 saves them
    ([experts, out, in]): the same weights either way."""
    import shutil

    from safetensors.torch import load_file, save_file

    _, folder = checkpoint("Qwen3VLMoeForConditionalGeneration", tmp_path_factory)
    tensors = load_file(folder / "model.safetensors")
    stacked = [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert stacked
    for name in stacked:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    saved, published = load_model(folder).weights, load_model(tmp_path).weights
    assert set(saved) == set(published)
    assert all(torch.equal(saved[n], published[n]) for n in saved)


@pytest.mark.parametrize("case, stack, why", [
    ("GptOssForCausalLM", True, None), ("MixtralForCausalLM", True, None),
    ("OlmoeForCausalLM:clip_qkv", False, "q/k/v clamps"),
    ("Starcoder2ForCausalLM", False, "LayerNorms, a non-gated MLP"),
    ("Phi3ForCausalLM", False, "partial rotary"),
    ("StableLmForCausalLM:parallel", False, "LayerNorms, a parallel residual, partial rotary"),
    ("Cohere2ForCausalLM", False, "LayerNorms, a parallel residual"),
    ("PhiForCausalLM", False, "LayerNorms, a non-gated MLP, a parallel residual, partial rotary"),
    ("Glm4MoeForCausalLM", False, "partial rotary"),
    ("HunYuanDenseV1ForCausalLM", False, "q/k norms after rotary"),
    ("DeepseekV3ForCausalLM", False, "latent attention"),
    ("CohereForCausalLM:qk_norm", False, "LayerNorms, a parallel residual, q/k LayerNorms"),
    ("Ministral3ForCausalLM", False, "queries scaled by position"),
    ("Lfm2ForCausalLM", False, "short convolutions"), ("Lfm2MoeForCausalLM", False, "short convolutions"),
    ("GraniteMoeHybridForCausalLM:mamba", False, "Mamba layers"),
    ("Qwen3NextForCausalLM", False, "partial rotary, gated delta nets, gated attention"),
    ("KimiLinearForCausalLM", False, "latent attention, gated delta nets"),
    ("MiniMaxForCausalLM", False, "lightning attention, residuals taken after the norms"),
    ("BailingHybridForCausalLM", False, "latent attention, gated delta nets, gated attention"),
    ("NemotronHForCausalLM", False, "a non-gated MLP, relu2, Mamba layers"),
    ("FalconH1ForCausalLM", False, "Mamba layers, attention beside Mamba"),
    ("Zamba2ForCausalLM", False, "gelu, Mamba layers, shared transformer blocks"),
    ("ZambaForCausalLM", False, "gelu, Mamba layers, shared transformer blocks"),
    ("RecurrentGemmaForCausalLM", False, "partial rotary, RG-LRU layers"),
    ("RwkvForCausalLM", False, "LayerNorms, a norm on the embeddings, RWKV mixes"),
    ("xLSTMForCausalLM", False, "mLSTM layers"),
    ("Lfm3ForCausalLM", False, "short convolutions, gated attention"),
    ("MiMoV2FlashForCausalLM", False, "partial rotary, attention shapes per layer, values narrower than keys"),
    ("BloomForCausalLM", False, "LayerNorms, a non-gated MLP, ALiBi, a norm on the embeddings"),
    ("Llama4ForCausalLM", False, "q/k norms after rotary, q/k norms without weights, queries scaled by position, "
                                 "chunked attention, experts scaling their inputs"),
    ("OPTForCausalLM", False, "LayerNorms, a non-gated MLP, relu"),
    ("MllamaForConditionalGeneration", True, None),
    ("GPTNeoForCausalLM", False, "LayerNorms, a non-gated MLP"),
    ("CodeGenForCausalLM", False, "LayerNorms, a non-gated MLP, a parallel residual, partial rotary"),
    ("XGLMForCausalLM", False, "LayerNorms, a non-gated MLP, gelu"),
    ("OpenAIGPTLMHeadModel", False, "LayerNorms, a non-gated MLP, norms after the residual adds, no final norm"),
    ("JetMoeForCausalLM", False, "routed query experts, a bias on the experts' sum"), ("AriaTextForCausalLM", True, None),
    ("DiffLlamaForCausalLM", False, "differential attention"),
    ("DogeForCausalLM", False, "key biases, weighted residuals"), ("Emu3ForCausalLM", True, None),
    ("BioGptForCausalLM", False, "LayerNorms, a non-gated MLP, gelu"),
    ("GPTNeoXJapaneseForCausalLM", False, "LayerNorms, a non-gated MLP, gelu, partial rotary"),
    ("CTRLLMHeadModel", False, "LayerNorms, a non-gated MLP, relu"),
    ("ModernBertDecoderForCausalLM", False, "LayerNorms, gelu, a norm on the embeddings, no norm before the first "
                                            "layer, a transform before the LM head"),
    ("Exaone4ForCausalLM", True, None), ("Olmo3ForCausalLM", True, None),
    ("ArceeForCausalLM", False, "a non-gated MLP, relu2"), ("HeliumForCausalLM", True, None),
    ("SeedOssForCausalLM", True, None), ("Ernie4_5_MoeForCausalLM", True, None),
    ("Ernie4_5ForCausalLM", True, None), ("SmolLM3ForCausalLM", True, None), ("GemmaForCausalLM", True, None),
    ("Gemma2ForCausalLM", True, None), ("Gemma3ForCausalLM", True, None), ("Olmo2ForCausalLM", True, None), ("GraniteForCausalLM", True, None),
    ("GraniteMoeForCausalLM", True, None), ("GraniteMoeSharedForCausalLM", True, None),
    ("Gemma4ForCausalLM", False, "attention shapes per layer, normed values, values from keys or K/V shared between "
     "layers, experts beside the MLP, per-layer inputs or layer scalars"),
    ("AXK1ForCausalLM", False, "latent attention, a norm on the experts' output"),
    ("MiniCPM5MoeForCausalLM", False, "gated attention"), ("ExaoneMoeForCausalLM", True, None),
    ("Kolibri1ForCausalLM", False, "a selection bias on the router's logits"),
    ("BeamForCausalLM", False, "queries scaled by position, gated attention, residual mixes"),
    ("ErgoForCausalLM", False, "a non-gated MLP, relu2, residual mixes, norms on the experts' outputs"),
    ("AXK2ForCausalLM", False, "latent attention, top-k key selection, gated norms"),
    ("HrmTextForCausalLM", False, "no final norm, gated attention, stacks run in cycles"),
    ("Kolibri1_1ForCausalLM", False, "K/V rounded to NVFP4, a selection bias on the router's logits, normed values, "
     "values from keys or K/V shared between layers"),
    ("DoryForCausalLM", False, "L2 norms, gated attention, residual mixes, looped layers, q scaled per channel, a "
     "norm before o_proj, a norm before the MLP's down projection"),
    ("DeepseekV32ForCausalLM", False, "latent attention, top-k key selection"),
    ("LongcatFlashForCausalLM", False, "latent attention, experts added a layer later, identity experts"),
    ("Gemma4UnifiedForCausalLM", False, "attention shapes per layer, normed values, values from keys or K/V shared "
     "between layers, experts beside the MLP, per-layer inputs or layer scalars"),
    ("Gemma3nForCausalLM", False, "normed values, values from keys or K/V shared between layers, experts beside the "
     "MLP, per-layer inputs or layer scalars, AltUp streams, LAuReL, activation sparsity")])
def test_the_start_up_log_names_what_keeps_a_model_off_the_native_stack(case, stack, why, tmp_path_factory, caplog):
    """int8 (what the native decode stack runs over): every option it lacks is named in the start-up log and the
    layers run in Python; models whose options it runs (ERNIE's interleaved rotary reordered at load, SmolLM3's
    layers without rotary, Gemma's sandwich norms, GELU-tanh and local rotary, OLMo 2's post norms and
    whole-projection q/k norms, Granite's scales and biases, MoE experts: gpt-oss's clamped SwiGLU and biases)
    get the stack, and the log names nothing."""
    import logging

    _, folder = checkpoint(case, tmp_path_factory)
    with caplog.at_level(logging.INFO, logger="kvserve.model.decoder"):
        llm = make_llm(folder, quantization="int8")
    assert (llm.engine.runner.model.native_stack is not None) == stack
    if why is not None:
        assert f"this model has {why})" in caplog.text
    else:
        assert "decode steps run the Python layers" not in caplog.text


@pytest.mark.parametrize("case", ["MistralForCausalLM", "GptOssForCausalLM", "Qwen3_5ForCausalLM",
                                  "MiniMaxForCausalLM", "KimiLinearForCausalLM",
                                  "GraniteMoeHybridForCausalLM:mamba", "MambaForCausalLM", "BloomForCausalLM"])
def test_a_bfloat16_model_attends_windows_and_sinks(case, tmp_path_factory):
    """A bf16 model (a bf16 KV pool) through the general attention path (windows, sinks, ALiBi) and the recurrent
    layers (their convolution states bf16, their recurrent states float32): it runs, and its first greedy token of
    each prompt is float32 transformers' (later ones may drift with bf16 rounding)."""
    _, folder = checkpoint(case, tmp_path_factory)
    loaded = load_model(folder)
    loaded.config.eos_token_ids = []
    llm = LLM.from_weights(loaded.config, loaded.weights, dtype="bfloat16", quantization="none", num_kv_blocks=256,
                           block_size=4)
    got = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
    assert all(len(g) == GREEDY.max_tokens for g in got)
    assert sum(g[0] == w[0] for g, w in zip(got, expected(case, tmp_path_factory))) >= len(got) - 1


@pytest.mark.parametrize("case, config, option", [
    ("Gemma3ForCausalLM", dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 4.0,
                                                                      "rope_theta": 1e4},
                                                "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
     "rope_parameters"),
    ("GPTJForCausalLM", dict(CASES["GPTJForCausalLM"][1], tie_word_embeddings=True), "tie_word_embeddings"),
    ("Ernie4_5_MoeForCausalLM", dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
                                     use_bias=True), "use_bias"),
    ("DeepseekV2ForCausalLM", dict(LATENT, q_lora_rank=None, attention_bias=True), "attention_bias"),
    ("DeepseekV2ForCausalLM", dict(LATENT, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   topk_method="noaux_tc"), "topk_method"),
    ("DeepseekV2ForCausalLM", dict(LATENT, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   n_shared_experts=1, mlp_bias=True), "mlp_bias"),
    ("AriaTextForCausalLM", dict(moe_num_experts=4, moe_topk=2, mlp_bias=True), "mlp_bias"),
    ("AriaTextForCausalLM", dict(moe_num_experts=4, moe_topk=2, hidden_act="gelu"), "hidden_act"),
    ("XGLMForCausalLM", dict(pad_token_id=3), "pad_token_id"),
    ("DogeForCausalLM", dict(is_moe=True, num_experts=16, num_experts_per_tok=4), "is_moe"),
    ("CTRLLMHeadModel", dict(dff=96, layer_norm_epsilon=1e-5), "layer_norm_epsilon"),
    ("KimiLinearForCausalLM", dict(LATENT, mla_use_nope=False), "mla_use_nope"),
    ("MiniMaxForCausalLM", dict(postnorm=False), "postnorm"),
    ("LagunaForCausalLM", dict(CASES["LagunaForCausalLM"][1], attention_bias=True), "attention_bias"),
    ("Lfm3ForCausalLM", dict(CASES["Lfm3ForCausalLM"][1], attention_bias=True), "use_attention_gate"),
    ("MiMoV2FlashForCausalLM", dict(CASES["MiMoV2FlashForCausalLM"][1], head_dim=16), "rotary dims"),
    ("BailingHybridForCausalLM", dict(LATENT, gated_attention_proj_granularity_type="element_wise"),
     "gated_attention_proj_granularity_type")])
def test_an_option_no_path_runs_is_refused_in_one_line(case, config, option, tmp_path):
    """ERNIE MoE's biased shared experts (and DeepSeek-V2's, Aria's: mlp_bias), a q projection without the bias its latent attention has, a router method
    not built, Aria's shared experts of another activation than its SiLU routed ones, XGLM's zeroed row of positions:
    loading names the option instead of serving without it."""
    import json

    import transformers

    from kvserve.errors import ModelLoadError
    from kvserve.model.hf_loader import hf_folder_config

    d = getattr(transformers, CASES[case][0])(**{**COMMON, **config}).to_dict()
    d["architectures"] = [case]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ModelLoadError, match=f"{option} .* is not supported") as e:
        hf_folder_config(tmp_path)
    assert "\n" not in str(e.value)


def test_gpt_neox_japanese_reads_the_last_layer_s_attention_bias(tmp_path_factory):
    """GPT-NeoX-Japanese's last layer alone has an attention output bias (``dense_bias``): read as o_proj's bias there,
    zeros before it (its greedy tokens barely feel it on these random weights)."""
    model, folder = checkpoint("GPTNeoXJapaneseForCausalLM:untied", tmp_path_factory)
    weights = load_model(folder).weights
    last = model.config.num_hidden_layers - 1
    want = model.gpt_neox_japanese.layers[last].attention.dense_bias
    assert want.abs().sum() > 0 and torch.equal(weights[f"model.layers.{last}.attention.dense.bias"], want.detach())
    assert all(not weights[f"model.layers.{i}.attention.dense.bias"].any() for i in range(last))


@pytest.mark.parametrize("case", ["DiffLlamaForCausalLM", "DogeForCausalLM:window"])
def test_heads_cached_wider_take_an_8bit_cache(case, tmp_path_factory):
    """Differential attention's and the dynamic mask's heads, cached wider than the model's (one shape every layer):
    an int8 KV cache holds them, its calibration pairing their rotated dims, and the first greedy tokens stay
    transformers'."""
    _, folder = checkpoint(case, tmp_path_factory)
    llm = make_llm(folder, kv_cache_dtype="int8")
    assert llm.engine.runner.kv_pool.layout.head_dim == llm.engine.runner.cfg.cache_head_dim(0)
    got = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
    assert sum(g[0] == w[0] for g, w in zip(got, expected(case, tmp_path_factory))) >= len(got) - 1


def test_doge_s_context_stops_at_its_keep_window():
    """Past keep_window_size keys transformers keeps each query's top keys by bias, which no path here runs: the
    model's context is capped there."""
    import transformers

    from kvserve.model.config import ModelConfig

    d = transformers.DogeConfig(**{**COMMON, "head_dim": None, "keep_window_size": 64}).to_dict()
    d["architectures"] = ["DogeForCausalLM"]
    assert ModelConfig.from_hf_dict(d).max_position_embeddings == 64
