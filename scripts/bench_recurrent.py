"""The recurrent token mixers against attention at the same width: prefill and decode of three 16-layer, 1024-wide
models with dummy int8 weights, one attending in every layer (Qwen3's layers), one with three gated delta nets to each
attention layer (Qwen3.5's), one with three Mamba-2 layers to each (Granite 4.0 H's). Their shapes are chosen, not
published ones. The prefix cache is off for all three (the recurrent models run without it).

    python scripts/bench_recurrent.py [NAME ...]

(NAME: attention, delta-nets, mamba2, or attention-python: the attention model with its decode steps through the
Python layers, as the recurrent models' run, instead of the native decode stack.)

Prints, per model, the median of three runs: a 512-token prompt's prefill (one token out), and a decode step at batch
1 and batch 8 (16-token prompts, 64 tokens out). docs/benchmarks.md has the figures and the machine.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvserve import LLM, SamplingParams
from kvserve.model.config import ModelConfig
from kvserve.model.dummy import dummy_weights

LAYERS = 16
BASE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=LAYERS, num_attention_heads=8,
            num_key_value_heads=2, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-6,
            tie_word_embeddings=True)
MODELS = {
    "attention": dict(BASE, architectures=["Qwen3ForCausalLM"]),
    "delta-nets": dict(BASE, architectures=["Qwen3_5ForCausalLM"], linear_num_key_heads=8, linear_num_value_heads=16,
                       linear_key_head_dim=128, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                       layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (LAYERS // 4)),
    "mamba2": dict(BASE, architectures=["GraniteMoeHybridForCausalLM"], num_local_experts=0,
                   shared_intermediate_size=3072, layer_types=(["mamba"] * 3 + ["attention"]) * (LAYERS // 4),
                   mamba_n_heads=32, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4,
                   mamba_expand=2, position_embedding_type="rope"),
}


def median_seconds(llm: LLM, prompts: list[list[int]], params: SamplingParams, runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        llm.generate(prompts, params)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(names: list[str]) -> None:
    for name in names or [*MODELS, "attention-python"]:
        cfg = ModelConfig.from_hf_dict(MODELS[name.removesuffix("-python")])
        llm = LLM.from_weights(cfg, dummy_weights(cfg, torch.bfloat16, seed=0), dtype="float32", quantization="int8",
                               max_num_seqs=8, num_kv_blocks=2048, enable_prefix_caching=False)
        if name.endswith("-python"):  # the decode steps through the Python layers, as the recurrent models' run
            llm.engine.runner.model.native_stack = None
        prompt = list(range(100, 612))
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate([prompt], one)  # warm
        prefill = median_seconds(llm, [prompt], one)
        decode = SamplingParams(max_tokens=65, temperature=0.0, ignore_eos=True)
        b1 = median_seconds(llm, [prompt[:16]], decode) / 64
        b8 = median_seconds(llm, [prompt[:16]] * 8, decode) / 64
        print(f"{name}: weights {llm.engine.runner.model.weight_bytes() / 2**20:.0f} MiB; prefill 512 tokens "
              f"{prefill * 1e3:.0f} ms ({512 / prefill:.0f} tok/s); decode step {b1 * 1e3:.1f} ms at batch 1, "
              f"{b8 * 1e3:.1f} ms at batch 8", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
