"""Decode step time of an MoE model on the native decode stack (the experts in its grouped MoEBlock) against
the Python layers (MoE.forward: the same block, but the layers' ~12 ops each from Python) and the Python layers
with the loop of experts the block replaced (one QuantLinear call per routed expert), in one process.

A random Qwen3-MoE-shaped model (``--load-format dummy``'s weights: kvserve.model.dummy) scaled down to fit a
small machine, int8 or int4. A decode step's time: (time of ``max_tokens`` tokens - time of 1) / (max_tokens - 1),
per batch size, median of ``--reps``. Results: docs/benchmarks.md ("issue 42: MoE on the native stack").

    .venv/bin/python scripts/bench_moe_stack.py [--reps 5] [--layers 8] [--experts 32] [--quantization int8]
"""

from __future__ import annotations

import argparse
import os
import time
from statistics import median


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=384)
    ap.add_argument("--quantization", default="int8")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch's threads (0: its default)")
    args = ap.parse_args()
    if args.threads:
        __import__("torch").set_num_threads(args.threads)

    from kvserve import SamplingParams
    from kvserve.llm import LLM
    from kvserve.model.config import ModelConfig
    from kvserve.model.dummy import dummy_weights
    from kvserve.model.mlp import MoE

    cfg = ModelConfig.from_hf_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8192, "hidden_size": args.hidden,
        "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64, "num_key_value_heads": 4,
        "head_dim": 64, "intermediate_size": 4 * args.hidden, "moe_intermediate_size": args.moe_intermediate,
        "num_experts": args.experts, "num_experts_per_tok": args.top_k, "norm_topk_prob": True,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False})
    cfg.eos_token_ids = []
    weights = dummy_weights(cfg, seed=0)
    llm = LLM.from_weights(cfg, weights, dtype="float32", quantization=args.quantization, num_kv_blocks=512)
    model = llm.engine.runner.model
    stack = model.native_stack
    assert stack is not None, "the stack did not build"
    blocks = [(m, m.native_block) for m in model.modules() if isinstance(m, MoE)]
    print(f"load {os.getloadavg()}, threads {__import__('torch').get_num_threads()}")
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = [[(7 * i + j) % 8000 + 3 for j in range(16)] for i in range(batch)]
        for name in ("stack", "python", "loop"):
            model.native_stack = stack if name == "stack" else None
            for moe, block in blocks:  # "loop": the Python loop of experts, as before the block
                moe.native_block = None if name == "loop" else block

            def run(n: int) -> float:
                t0 = time.perf_counter()
                llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                return time.perf_counter() - t0

            run(4)  # warm
            steps = [(run(args.max_tokens) - run(1)) / (args.max_tokens - 1) for _ in range(args.reps)]
            print(f"batch {batch:3d} {name:6s}: decode step median {1e3 * median(steps):.2f} ms "
                  f"(min {1e3 * min(steps):.2f}, max {1e3 * max(steps):.2f}) load {os.getloadavg()[0]:.2f}")
    model.native_stack = stack


if __name__ == "__main__":
    main()
