"""What a constrained tool call costs: the embedded model answering with tools, grammar on vs off.

For each tool_choice (required: the output is one or more calls, the grammar forced from the
first token; auto: free text in which "<tool_call>" triggers the call grammar), the prompts (the
tools described in the system message, as the server does) run constrained, seeded at
temperature 0.7; then the same prompts run free, each request's max_tokens set to the length of
its constrained answer (ignore_eos), so both decode the same number of tokens from the same
prompts: the difference in output tokens/s is the grammar's work. Measured as pairs (constrained,
free; which goes first alternates), each pair's cost from its own two runs, medians over pairs,
so that a machine whose speed drifts (a shared VM) skews both halves of a pair alike: batches of
16 requests, and single streams (one request at a time, cycling through the prompts). Also: a
cold compile of the tool grammar, and the grammar's own work per token (filling a mask and
applying it to one row of logits, advancing the matcher) replayed over the constrained answers.

    python scripts/bench_tool_calls.py [--pairs 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvserve import SamplingParams
from kvserve.llm import LLM
from kvserve.server import protocol as P
from kvserve.server.tools import ToolCalling
from kvserve.structured import GrammarCache

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "maxLength": 40},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "search_flights", "description": "Find flights between two airports",
     "parameters": {"type": "object", "properties": {
         "origin": {"type": "string", "maxLength": 3}, "destination": {"type": "string", "maxLength": 3},
         "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
         "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["origin", "destination", "date", "passengers"]}}},
]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Dakar", "Hanoi", "Porto", "Bern", "Accra",
          "Seoul", "Riga", "Doha", "Nairobi"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    llm = LLM(max_num_seqs=16)
    tok = llm.tokenizer
    calling = ToolCalling("auto", tok)
    summary: dict = {}
    for choice in ("required", "auto"):
        prompts, spec = [], None
        for city in CITIES:
            body = P.ChatCompletionRequest(messages=[{"role": "user", "content": f"What is the weather in {city}?"}],
                                           tools=TOOLS, tool_choice=choice)
            plan = calling.plan(body)
            assert plan is not None
            messages, tools = calling.template_inputs(body.template_messages(), plan)
            prompts.append(tok.apply_chat_template(messages, tools=tools))
            spec = plan.guided
        cache = GrammarCache.from_tokenizer(tok.hf, llm.engine.vocab_size, list(tok.eos_token_ids), max_size=4)
        t = time.perf_counter()
        cache.get_or_compile(spec)
        cold_ms = (time.perf_counter() - t) * 1e3
        cache.close()
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, guided=spec))  # the engine's cache, warm-up

        guided = [SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=i, guided=spec)
                  for i in range(len(prompts))]
        outs = llm.generate(prompts, guided)
        lengths = [len(o.token_ids) for o in outs]
        free = [SamplingParams(max_tokens=n, temperature=0.7, seed=i, ignore_eos=True) for i, n in enumerate(lengths)]
        calls = sum("<tool_call>" in o.text for o in outs)
        result: dict = {"cold_compile_ms": cold_ms, "prompt_tokens": statistics.median(map(len, prompts)),
                        "output_tokens": statistics.median(lengths), "answers_with_calls": calls,
                        "grammar_us_per_token": _grammar_us_per_token(llm, spec, outs)}
        for label in ("batch16", "single"):
            pairs = []
            for r in range(args.pairs):
                batch = list(range(len(prompts))) if label == "batch16" else [r % len(prompts)]
                res = {}
                for name in (("tools", "free") if r % 2 == 0 else ("free", "tools")):
                    params = guided if name == "tools" else free
                    t0 = time.perf_counter()
                    got = llm.generate([prompts[i] for i in batch], [params[i] for i in batch])
                    res[name] = sum(len(o.token_ids) for o in got) / (time.perf_counter() - t0)
                pairs.append({**res, "overhead": 1 - res["tools"] / res["free"]})
            result[label] = {"tools_tok_s": statistics.median(p["tools"] for p in pairs),
                             "free_tok_s": statistics.median(p["free"] for p in pairs),
                             "median_overhead": statistics.median(p["overhead"] for p in pairs), "pairs": pairs}
            print(f"{choice} {label}: tools {result[label]['tools_tok_s']:.1f} tok/s, free "
                  f"{result[label]['free_tok_s']:.1f} tok/s, cost {result[label]['median_overhead']:+.1%} "
                  f"(median of {args.pairs} pairs)", flush=True)
        print(f"{choice}: cold compile {cold_ms:.1f} ms, grammar work {result['grammar_us_per_token']:.0f} us/token, "
              f"prompt {result['prompt_tokens']:.0f} tokens, output {result['output_tokens']:.0f} tokens (median), "
              f"answers with calls {calls}/{len(outs)}", flush=True)
        summary[choice] = result
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


def _grammar_us_per_token(llm: LLM, spec, outs) -> float:
    """The grammar's work per token, replayed over ``outs``: fill the mask, apply it to a row of
    logits, accept the token (what the runner does for a constrained row each step)."""
    import torch

    from kvserve.structured import GrammarMatcher, allocate_bitmask, apply_masks

    compiled = llm.engine.grammars.get_or_compile(spec)
    bitmask = allocate_bitmask(1, llm.engine.vocab_size)
    logits = torch.zeros(1, llm.engine.vocab_size)
    total, tokens = 0.0, 0
    for o in outs:
        m = GrammarMatcher(compiled, stop_token_ids=list(llm.tokenizer.eos_token_ids))
        for t in o.token_ids:
            t0 = time.perf_counter()
            m.fill_mask(bitmask, 0)
            apply_masks(logits, bitmask, [0])
            ok = m.accept(t)
            total += time.perf_counter() - t0
            tokens += 1
            if not ok or m.is_terminated():
                break
    return total / max(tokens, 1) * 1e6


if __name__ == "__main__":
    main()
