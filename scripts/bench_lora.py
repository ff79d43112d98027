"""Multi-LoRA cost on the embedded model: decode steps of 64 requests spread over 8 rank-16 adapters against the
base model's (the same 64 requests, no adapter), and the base model through the Python layers (what a LoRA step
runs: the native decode stack has no LoRA); plus adapter load times. Adapters are random, written in PEFT's
format with every target (q/k/v/o/gate/up/down). Results go in docs/benchmarks.md.

    PYTHONPATH=$PWD python scripts/bench_lora.py [--requests 64 --adapters 8 --rank 16 --output-len 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvserve import LLM, SamplingParams
from kvserve.lora.adapter import adaptable_modules


def write_random_adapter(folder: Path, cfg, rank: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, target in adaptable_modules(cfg).items():
        rows = target.rows[1] - target.rows[0]
        key = f"base_model.model.{module}"
        scale = target.in_features ** -0.5
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, target.in_features, generator=gen) * scale
        tensors[f"{key}.lora_B.weight"] = torch.randn(rows, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    targets = sorted({m.rpartition(".")[2] for m in adaptable_modules(cfg)})
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": targets}))


def decode_step_ms(llm: LLM, prompts: list[list[int]], params: SamplingParams, lora=None) -> float:
    stats = llm.engine.stats
    stats.steps.clear()
    stats.keep_steps = True
    llm.generate(prompts, params, lora=lora)
    stats.keep_steps = False
    full = [s.seconds for s in stats.steps if s.num_seqs == len(prompts) and s.num_decodes == len(prompts)]
    return 1000 * statistics.median(full)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, max_num_seqs=args.requests)
    cfg = llm.engine.runner.cfg
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.adapters):
            write_random_adapter(Path(tmp) / f"a{i}", cfg, args.rank, seed=i)
            llm.load_lora_adapter(f"a{i}", str(Path(tmp) / f"a{i}"))
        load_s = llm.engine.runner.lora.load_seconds
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(100, 40000, (args.input_len,), generator=gen).tolist() for _ in range(args.requests)]
        params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
        names = [f"a{i % args.adapters}" for i in range(args.requests)]
        llm.generate(prompts[:4], SamplingParams(max_tokens=4))  # warm-up
        rows = {"base": [], "base, Python layers": [], "lora": []}
        stack = llm.engine.runner.model.native_stack
        for _ in range(args.rounds):  # alternating, so drift hits every row alike
            rows["base"].append(decode_step_ms(llm, prompts, params))
            llm.engine.runner.model.native_stack = None
            rows["base, Python layers"].append(decode_step_ms(llm, prompts, params))
            llm.engine.runner.model.native_stack = stack
            rows["lora"].append(decode_step_ms(llm, prompts, params, names))
    base = statistics.median(rows["base"])
    print(f"{args.requests} requests, {args.adapters} adapters of rank {args.rank}, decode step (median ms over "
          f"{args.rounds} rounds of {args.output_len} tokens):")
    for name, values in rows.items():
        med = statistics.median(values)
        print(f"  {name:22s} {med:7.2f} ms  ({med / base:.2f}x base)  rounds: {', '.join(f'{v:.2f}' for v in values)}")
    print(f"adapter load: median {1000 * statistics.median(load_s):.1f} ms, max {1000 * max(load_s):.1f} ms "
          f"({len(load_s)} adapters)")


if __name__ == "__main__":
    main()
