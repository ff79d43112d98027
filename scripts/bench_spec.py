"""Single-stream speculative decoding on a grounded task: decode tokens/s with and without it.

The task quotes and edits a long given text: "repeat this code with one change", over real
functions from Python's standard library (always at hand, never downloaded). Each engine
(speculation off, and each method asked for) answers each task alone, greedy, in turns within
one run, so machine noise hits them alike; outputs must be identical. Decode tokens/s is
(output tokens - 1) / (end - first token). Prints a table and writes JSON.

    python scripts/bench_spec.py [--methods ngram] [--tasks 6] [--max-tokens 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time

from kvserve import SamplingParams
from kvserve.llm import LLM

# (function, identifier to rename, new name): functions of a few hundred tokens
TASKS = [
    ("textwrap.TextWrapper._split", "chunks", "pieces"),
    ("json.encoder.py_encode_basestring_ascii", "replace", "substitute"),
    ("textwrap.indent", "predicate", "keep"),
    ("textwrap.dedent", "margin", "indent"),
    ("string.capwords", "sep", "separator"),
    ("fnmatch.filter", "result", "matches"),
    ("heapq.nsmallest", "result", "smallest"),
    ("shutil.copyfileobj", "buf", "chunk"),
]


def source(path: str) -> str:
    import importlib

    mod, _, attr = path.rpartition(".")
    try:
        obj = importlib.import_module(mod)
    except ImportError:  # a method: module.Class.method
        mod, _, cls = mod.rpartition(".")
        obj = getattr(importlib.import_module(mod), cls)
    return inspect.getsource(getattr(obj, attr))


def task_messages(path: str, old: str, new: str) -> list[dict]:
    code = source(path)
    return [{"role": "user", "content": f"Here is a Python function:\n\n```python\n{code}```\n\n"
             f"Repeat this code exactly, but rename `{old}` to `{new}`. Output only the code."}]


def run_one(llm: LLM, prompt: list[int], params: SamplingParams) -> dict:
    eng = llm.engine
    req = eng.add_request(f"r{time.monotonic_ns()}", prompt, params)
    t0 = time.perf_counter()
    first = None
    while eng.has_unfinished():
        eng.step()
        if first is None and req.num_output_tokens:
            first = time.perf_counter()
    end = time.perf_counter()
    n = req.num_output_tokens
    return {"tokens": req.output_token_ids, "ttft_s": first - t0, "decode_s": end - first,
            "decode_tok_s": (n - 1) / (end - first) if n > 1 else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=["ngram"], help="speculative methods to compare with off")
    ap.add_argument("--num-speculative-tokens", type=int, default=5)
    ap.add_argument("--tasks", type=int, default=len(TASKS))
    ap.add_argument("--rounds", type=int, default=2, help="each engine answers each task this many times")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    engines = {"off": LLM()}
    for m in args.methods:
        engines[m] = LLM(speculative_method=m, num_speculative_tokens=args.num_speculative_tokens)
    tok = engines["off"].tokenizer
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows = []
    for path, old, new in TASKS[: args.tasks]:
        prompt = tok.apply_chat_template(task_messages(path, old, new))
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for rnd in range(args.rounds):
            order = list(engines) if rnd % 2 == 0 else list(reversed(engines))
            for name in order:
                runs[name].append(run_one(engines[name], prompt, params))
        base = runs["off"][0]["tokens"]
        row = {"task": path, "prompt_tokens": len(prompt), "output_tokens": len(base)}
        for name, rs in runs.items():
            assert all(r["tokens"] == base for r in rs), f"{name}: output differs from speculation off on {path}"
            row[name] = statistics.median(r["decode_tok_s"] for r in rs)
        rows.append(row)
        print(f"{path:45s} prompt {len(prompt):4d} out {len(base):4d}  " +
              "  ".join(f"{n} {row[n]:6.1f} tok/s" for n in engines), flush=True)

    summary = {"rows": rows, "methods": {}}
    for m in args.methods:
        st = engines[m].engine.scheduler.stats.spec
        ratios = [r[m] / r["off"] for r in rows]
        summary["methods"][m] = {
            "median_speedup": statistics.median(ratios),
            "speedups": ratios,
            "aggregate_speedup": sum(r[m] for r in rows) / sum(r["off"] for r in rows),
            "verifies": st.num_verifies, "draft_tokens": st.num_draft_tokens,
            "accepted_tokens": st.num_accepted_tokens,
            "acceptance_rate": st.num_accepted_tokens / max(1, st.num_draft_tokens),
            "mean_accepted_length": 1 + st.num_accepted_tokens / max(1, st.num_verifies),
            "accepted_length_histogram": st.accepted_length_counts,
        }
        s = summary["methods"][m]
        print(f"\n{m}: decode speed-up median {s['median_speedup']:.2f}x (per task "
              f"{', '.join(f'{x:.2f}' for x in ratios)}); acceptance {s['acceptance_rate']:.1%}, "
              f"mean accepted length {s['mean_accepted_length']:.2f}; verifies accepting 0..k drafts: "
              f"{st.accepted_length_counts}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
