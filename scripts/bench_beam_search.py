"""What beam search costs on this engine: seconds per answer for greedy, n sampled choices and beam
search of width n, through a live server on the embedded model (one request at a time).

Beam search runs above the engine, as in vLLM: each step sends every live beam as a one-token
request, and the prefix cache keeps the prompt from being recomputed; the figure to read is the
time per answer against greedy and against n sampled choices, which decode as many tokens.

    python scripts/bench_beam_search.py [--widths 2 4] [--max-tokens 48] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

PROMPTS = ["The history of the printing press", "A recipe for bread begins with", "The main causes of inflation are",
           "In a distant galaxy, a small robot", "The best way to learn a language is", "Photosynthesis works by"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()

    from kvserve.config import KVServeConfig, ServerConfig
    from kvserve.server.engine_client import AsyncEngineClient
    from server_utils import ServerThread

    client = AsyncEngineClient(KVServeConfig.from_kwargs())
    results: dict[str, float] = {}
    with ServerThread(client, ServerConfig(served_model_names=["m"])) as server, \
            httpx.Client(base_url=server.url, timeout=600) as http:
        def answer(prompt: str, **body) -> float:
            t0 = time.perf_counter()
            r = http.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": args.max_tokens,
                                                   "ignore_eos": True, **body})
            r.raise_for_status()
            return time.perf_counter() - t0

        kinds = {"greedy": {"temperature": 0}}
        for w in args.widths:
            kinds[f"sampled n={w}"] = {"n": w, "temperature": 0.8, "seed": 1}
            kinds[f"beam width {w}"] = {"n": w, "use_beam_search": True}
        answer(PROMPTS[0], **kinds["greedy"])  # warm up
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            for prompt in PROMPTS:
                order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
                for k in order:
                    times[k].append(answer(prompt, **kinds[k]))
        for k, ts in times.items():
            results[k] = statistics.median(ts)
            print(f"{k:>16}: {results[k]:.2f} s per answer of {args.max_tokens} tokens "
                  f"({results[k] / results['greedy']:.1f}x greedy)")
    if args.json:
        Path(args.json).write_text(json.dumps({"max_tokens": args.max_tokens, "median_s": results,
                                               "samples": times}, indent=1))


if __name__ == "__main__":
    main()
