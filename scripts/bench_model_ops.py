"""Sleep, wake and weight updates on the embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF), in process:
``LLM.update_weights_from_disk`` from the GGUF itself (its Q4_1 weights kept) and from a Hugging Face
safetensors folder written from it (bfloat16, served dense), and ``sleep`` / ``wake_up`` at levels 1 and 2.
Each is the engine's own time (the HTTP routes wait for the same command); medians of ``--reps``, and the
greedy answer checked equal before and after. Results: docs/benchmarks.md.

    .venv/bin/python scripts/bench_model_ops.py [--reps 5] [--kv-cache-memory-gb 1] [--num-threads 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from statistics import median


def write_hf_folder(gguf: Path, folder: Path) -> None:
    """The GGUF's weights, dequantized to bfloat16, as a Llama safetensors folder with its tokenizer."""
    import torch
    from safetensors.torch import save_file

    from kvserve.model.loader import load_model

    loaded = load_model(gguf)
    c = loaded.config
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
              "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
              "head_dim": c.head_dim, "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
              "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
              "tie_word_embeddings": c.tie_word_embeddings, "hidden_act": "silu", "torch_dtype": "bfloat16",
              "bos_token_id": 1, "eos_token_id": 2}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in loaded.weights.items()},
              str(folder / "model.safetensors"))
    loaded.tokenizer.save_pretrained(folder)


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    ap.add_argument("--num-threads", type=int, default=2)
    a = ap.parse_args()
    from kvserve import LLM, SamplingParams
    from kvserve.model.locate import resolve_model_path

    gguf = resolve_model_path(None)
    llm = LLM(kv_cache_memory_gb=a.kv_cache_memory_gb, num_threads=a.num_threads)
    greedy = SamplingParams(max_tokens=16, temperature=0)

    def answer() -> str:
        return llm.generate("The capital of France is", greedy)[0].text

    want = answer()
    results: dict[str, list[float]] = {}
    results["update, GGUF (Q4_1 kept)"] = timed(lambda: llm.update_weights_from_disk(str(gguf)), a.reps)
    assert answer() == want, "the same weights must give the same answer"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "SmolLM2-135M-Instruct-bf16"
        start = time.perf_counter()
        write_hf_folder(gguf, folder)
        print(f"wrote {folder} in {time.perf_counter() - start:.1f} s")
        hf = []
        for _ in range(a.reps):
            hf += timed(lambda: llm.update_weights_from_disk(str(folder)), 1)
            print(f"  bf16 folder's answer: {answer()!r}")
            llm.update_weights_from_disk(str(gguf))
        results["update, safetensors folder (bf16, dense)"] = hf
    assert answer() == want
    for level in (1, 2):
        sleeps, wakes = [], []
        for _ in range(a.reps):
            sleeps += timed(lambda: llm.sleep(level), 1)
            wakes += timed(llm.wake_up, 1)
            assert answer() == want, f"level {level}: the answer changed after a sleep"
        results[f"sleep, level {level}"], results[f"wake_up, level {level}"] = sleeps, wakes
    pool = llm.engine.runner.kv_pool
    print(f"embedded model {gguf.name}, KV pool {pool.num_blocks} blocks ({pool.num_blocks * pool.block_bytes / 2**30:.2f} GiB), "
          f"{a.num_threads} threads; answer {want!r}")
    print("| operation | median s | min s | max s |\n|---|---:|---:|---:|")
    for name, xs in results.items():
        print(f"| {name} | {median(xs):.3f} | {min(xs):.3f} | {max(xs):.3f} |")
    print(json.dumps({k: [round(x, 4) for x in v] for k, v in results.items()}))


if __name__ == "__main__":
    main()
