"""What structured output costs: 16 concurrent JSON-schema requests vs the same prompts unconstrained.

Each round runs the 16 prompts constrained by a realistic schema (seeded sampling, temperature
0.7, up to 256 tokens: the same answers every round) and the same prompts free, each request's
max_tokens set to the length of its constrained answer (ignore_eos): both runs decode the same
number of tokens with the same batch size at every step, so the difference in output tokens/s
is the grammar work (masks, matcher updates). Rounds alternate which goes first. Also times a
cold compile of the schema.

    python scripts/bench_structured.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvserve import SamplingParams
from kvserve.llm import LLM
from kvserve.structured import GrammarCache, GuidedSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "maxLength": 12},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 24},
            "email": {"type": "string", "maxLength": 32},
            "tier": {"enum": ["free", "pro", "enterprise"]}},
            "required": ["name", "email", "tier"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 10},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
            "unit_price": {"type": "number", "minimum": 0, "maximum": 10000}},
            "required": ["sku", "quantity", "unit_price"], "additionalProperties": False}},
        "paid": {"type": "boolean"},
        "notes": {"type": "string", "maxLength": 80},
    },
    "required": ["order_id", "customer", "items", "paid", "notes"],
    "additionalProperties": False,
}
TOPICS = ["a bicycle shop", "a bakery", "a bookstore", "a hardware store", "an online game store", "a florist",
          "a pet shop", "a coffee roaster", "a toy store", "a pharmacy", "a music shop", "a shoe store",
          "a grocery delivery", "a camera shop", "a furniture maker", "a tea house"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    llm = LLM(max_num_seqs=16)
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write one order of {t} as JSON: order_id, "
                                         "customer (name, email, tier), items (sku, quantity, unit_price), paid, notes."}])
               for t in TOPICS]
    spec = GuidedSpec.json_schema(SCHEMA)

    cache = GrammarCache.from_tokenizer(tok.hf, llm.engine.vocab_size, list(tok.eos_token_ids), max_size=4)
    t = time.perf_counter()
    cache.get_or_compile(spec)
    cold_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    cache.get_or_compile(spec)
    warm_ms = (time.perf_counter() - t) * 1e3
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, guided=spec))  # the engine's cache, warm-up

    # seeded: every round's constrained answers are the same, so their lengths are known up front
    guided = [SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=i, guided=spec) for i in range(len(prompts))]
    lengths = [len(o.token_ids) for o in llm.generate(prompts, guided)]
    free = [SamplingParams(max_tokens=n, temperature=0.7, seed=i, ignore_eos=True) for i, n in enumerate(lengths)]
    rounds = []
    for r in range(args.rounds):
        res: dict[str, float] = {}
        outs: list = []
        for name in (("json", "free") if r % 2 == 0 else ("free", "json")):
            t0 = time.perf_counter()
            got = llm.generate(prompts, guided if name == "json" else free)
            res[name] = sum(len(o.token_ids) for o in got) / (time.perf_counter() - t0)
            if name == "json":
                outs = got
        valid = sum(1 for o in outs if o.finish_reason == "stop" and _parses(o.text))
        rounds.append({**res, "valid": valid, "cut_at_max_tokens": sum(o.finish_reason == "length" for o in outs),
                       "tokens": sum(len(o.token_ids) for o in outs),
                       "overhead": 1 - res["json"] / res["free"]})
        print(f"round {r}: json {res['json']:.1f} tok/s, free {res['free']:.1f} tok/s, "
              f"cost {rounds[-1]['overhead']:+.1%}, complete and valid {valid}/{len(outs)}, "
              f"cut at max_tokens {rounds[-1]['cut_at_max_tokens']}", flush=True)
    summary = {"cold_compile_ms": cold_ms, "cached_lookup_ms": warm_ms, "rounds": rounds,
               "median_overhead": statistics.median(r["overhead"] for r in rounds)}
    print(f"cold compile {cold_ms:.1f} ms (cached {warm_ms:.3f} ms); median cost of JSON-schema decoding "
          f"{summary['median_overhead']:+.1%} output tokens/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
