"""``kvserve bench offline``: throughput of the engine in-process on random token prompts."""

from __future__ import annotations

import argparse
import json
import random
import time

from kvserve.bench.stats import median, percentile
from kvserve.config import KVServeConfig


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests run before timing")
    p.add_argument("--output-json", default=None, help="also write the figures to this file")
    KVServeConfig.add_cli_args(p)


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from kvserve import SamplingParams, progress
    from kvserve.text.output import OutputProcessor
    from kvserve.errors import InvalidArgumentError
    from kvserve.llm import LLM

    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise InvalidArgumentError(f"--{name.replace('_', '-')} must be at least 1")
    llm = LLM(**KVServeConfig.from_cli_args(args).to_kwargs())
    vocab = llm.engine.vocab_size or 32000
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    if args.warmup:
        llm.generate(prompts[: args.warmup], SamplingParams(max_tokens=4, ignore_eos=True))

    eng = llm.engine
    eng.stats.keep_steps = True
    eng.stats.steps.clear()
    proc = OutputProcessor(None)  # token ids only: measure the engine, not detokenization
    for i, p in enumerate(prompts):
        proc.add(eng.add_request(f"bench-{i}", p, params))
    total = args.num_prompts * args.output_len
    t0 = time.perf_counter()
    with tqdm(total=total, unit="tok", desc="generating", disable=not progress.on_terminal()) as bar:
        while eng.has_unfinished():
            bar.update(len(eng.step()))
    elapsed = time.perf_counter() - t0

    steps = eng.stats.steps
    decode = [s.seconds * 1e3 for s in steps if s.num_decodes == s.num_tokens]
    mixed = [s.seconds * 1e3 for s in steps if s.num_decodes != s.num_tokens]
    runner = eng.runner
    result = {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dtype": str(getattr(runner, "dtype", "?")).replace("torch.", ""),
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(total / elapsed, 1),
        "total_tokens_per_s": round((total + args.num_prompts * args.input_len) / elapsed, 1),
        "steps": len(steps),
        "decode_steps": len(decode),
        "decode_step_ms_p50": round(median(decode), 2) if decode else None,
        "decode_step_ms_p90": round(percentile(decode, 90), 2) if decode else None,
        "prefill_steps": len(mixed),
        "prefill_step_ms_p50": round(median(mixed), 2) if mixed else None,
        "preemptions": eng.scheduler.stats.num_preemptions,
    }
    print(f"\noutput tokens/s: {result['output_tokens_per_s']}   total tokens/s: {result['total_tokens_per_s']}   "
          f"elapsed: {result['elapsed_s']} s   dtype: {result['dtype']}")
    print(f"steps: {len(steps)} ({len(decode)} decode-only, p50 {result['decode_step_ms_p50']} ms, "
          f"p90 {result['decode_step_ms_p90']} ms; {len(mixed)} with prefill, p50 {result['prefill_step_ms_p50']} ms)"
          f"   preemptions: {result['preemptions']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
