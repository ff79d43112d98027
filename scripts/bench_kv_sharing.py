"""Gemma 4 at a real size with dummy weights: the start-up's memory, a prompt's prefill with and without the cut of the
layers that only read earlier layers' K/V (``CausalLM.rows_from``), and a single stream's decode.

The model is transformers' default ``Gemma4TextConfig`` (30 layers, hidden 2304, heads of 256 and global ones of 512,
per-layer inputs of 256 over a 262,144-token table) with ``--shared`` of its layers on earlier layers' K/V: a shape
chosen, not a published checkpoint's. Nothing is downloaded; the tokenizer is the embedded model's.

    python scripts/bench_kv_sharing.py [--folder DIR] [--shared 20] [--quantization int8] [--prompt-len 512]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from write_bench_models import tokenizer_files  # noqa: E402


def write_folder(folder: Path, shared: int) -> None:
    import transformers

    d = transformers.Gemma4TextConfig(num_kv_shared_layers=shared, final_logit_softcapping=30.0).to_dict()
    d.update(architectures=["Gemma4ForCausalLM"], bos_token_id=1, eos_token_id=2)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(d, indent=1) + "\n", encoding="utf-8")
    for name, text in tokenizer_files().items():
        (folder / name).write_text(text, encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", type=Path, default=Path("/tmp/kvserve-bench-models/gemma4-shape"))
    ap.add_argument("--shared", type=int, default=20)
    ap.add_argument("--quantization", default="int8")
    ap.add_argument("--prompt-len", type=int, default=512)
    args = ap.parse_args()
    write_folder(args.folder, args.shared)

    from kvserve import SamplingParams
    from kvserve.llm import LLM

    start = time.perf_counter()
    llm = LLM(str(args.folder), load_format="dummy", quantization=args.quantization, max_num_seqs=4)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    model = llm.engine.runner.model
    print(f"ready in {time.perf_counter() - start:.1f} s; peak RSS {rss:.1f} GiB; weights "
          f"{model.weight_bytes() / 2**30:.2f} GiB; the rows cut from layer {model.rows_from}")
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 40000) for _ in range(args.prompt_len)] for _ in range(3)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    cut = model.rows_from
    for round_ in range(2):
        for label, rows_from in (("cut", cut), ("no cut", None)):
            model.rows_from = rows_from
            times = []
            for p in prompts:  # a first token of its own per run: no prefix hits between them
                p = [round_ * 7 + (3 if rows_from is None else 1)] + p[1:]
                t = time.perf_counter()
                llm.generate([p], one)
                times.append(time.perf_counter() - t)
            print(f"round {round_}: prefill of {args.prompt_len} tokens ({label}), median of 3: "
                  f"{statistics.median(times) * 1000:.0f} ms")
    model.rows_from = cut
    t = time.perf_counter()
    llm.generate([[5] + prompts[0][:63]], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    print(f"64 tokens after a 64-token prompt: {(time.perf_counter() - t) / 64 * 1000:.0f} ms a token (the prompt's "
          "step included)")


if __name__ == "__main__":
    main()
