#!/usr/bin/env python
"""Compare grammar engines (xgrammar, llguidance) for structured output on this machine.

Measures, with the embedded model's tokenizer (SmolLM2-135M, 49152 ids):
  (c) tokenizer setup: building the engine's tokenizer info (fresh each run);
  (a) cold compile of a realistic JSON schema, and compile + the first token mask;
  (b) one decode step for 16 concurrent requests: fill the [16, ceil(V/32)] bitmask, apply it to
      float32 logits [16, V], and accept the next tokens. The 16 requests replay the same token
      streams for both engines: random walks through the schema (uniformly random allowed tokens),
      documents back to back, so the batch stays full. Mask filling is timed batched (the engine's
      thread pool) and one matcher at a time.
Per-step figures are the mean over the steps of a run; each figure is the median of --runs runs.
Prints a Markdown table (docs/results/grammar-engines.md).

Both engines emit compact JSON with ", " and ": " separators. xgrammar goes through kvserve.structured's
own setup and compile paths (what kvserve ships); llguidance through its Python API.

Usage: .venv/bin/python scripts/bench_grammar.py [--runs 5] [--steps 200] [--engines xgrammar llguidance]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

BATCH = 16

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "status": {"enum": ["active", "inactive", "pending", "banned"]},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 32},
                "city": {"type": "string", "minLength": 1, "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "CA", "MX", "FR", "DE"]},
            },
            "required": ["city", "zip"],
        },
        "orders": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0, "maximum": 10000},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "qty"],
            },
        },
    },
    "required": ["id", "name", "status", "address"],
}


def _time(fn) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab: int, threads: int):
        import xgrammar as xgr

        self.xgr, self.tok, self.vocab, self.threads = xgr, tok, vocab, threads
        self.version = xgr.__version__ if hasattr(xgr, "__version__") else _dist_version("xgrammar")
        self.info = None
        self.batcher = xgr.BatchGrammarMatcher(max_threads=threads)

    def setup(self) -> None:
        # kvserve's path: TokenizerInfo.from_huggingface plus a second pass blanking special tokens
        from kvserve.structured import build_tokenizer_info

        self.info = build_tokenizer_info(self.tok, vocab_size=self.vocab)

    def compile(self, schema: str):
        # kvserve's path (GrammarCache.compile: xgrammar's compiler, its own cache off, the
        # bounded-string fix); a fresh compiler each time, so nothing is cached
        from kvserve.structured import GrammarCache, GuidedSpec

        cache = GrammarCache(self.info, max_size=1, compile_threads=self.threads)
        compiled = cache.compile(GuidedSpec.json_schema(schema))
        cache.close()
        return compiled

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill_batch(self, matchers, bitmask) -> None:
        self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def fill_one(self, m, bitmask, i) -> None:
        m.fill_next_token_bitmask(bitmask, i)

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab: int, threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lgt, self.tok, self.vocab = llguidance, llguidance.torch, tok, vocab
        self.version = _dist_version("llguidance")
        self.info = None
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def setup(self) -> None:
        import llguidance.hf

        self.info = llguidance.hf.from_tokenizer(self.tok, n_vocab=self.vocab)

    def compile(self, schema: str):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        m = self.llg.LLMatcher(self.info, grammar)  # builds the grammar; the lexer is built lazily
        if m.is_error():
            raise RuntimeError(m.get_error())
        return grammar, m

    def matcher(self, compiled):
        return compiled[1].deep_copy()

    def fill_batch(self, matchers, bitmask) -> None:
        self.lgt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def fill_one(self, m, bitmask, i) -> None:
        self.lgt.fill_next_token_bitmask(m, bitmask, i)

    # llguidance.torch.apply_token_bitmask_inplace is a torch.compile kernel (needs a C++ toolchain
    # on CPU and seconds of compiling): not timed; the plain-torch kernel serves both engines.
    apply = None

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m) -> bool:
        return m.is_stopped()


def apply_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Plain-torch bitmask application, as in kvserve.structured (engine-independent)."""
    from kvserve.structured.matcher import apply_masks

    apply_masks(logits, bitmask, None)


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def bench_setup_compile(engine, runs: int) -> dict[str, float]:
    schema = json.dumps(SCHEMA)
    setup, compile_, first = [], [], []
    bitmask = torch.full((1, (engine.vocab + 31) // 32), -1, dtype=torch.int32)
    for _ in range(runs):
        setup.append(_time(engine.setup)[0])
        t_compile, compiled = _time(lambda: engine.compile(schema))
        m = engine.matcher(compiled)
        t_first, _ = _time(lambda: engine.fill_one(m, bitmask, 0))
        compile_.append(t_compile)
        first.append(t_compile + t_first)
    return {"setup": statistics.median(setup), "compile": statistics.median(compile_),
            "compile_first_mask": statistics.median(first)}


def make_streams(engines: list, compiled: list, steps: int, seed: int) -> list[list[int]]:
    """BATCH token streams of ``steps`` tokens each: random walks through SCHEMA, each token drawn
    uniformly among those that every engine allows, documents back to back, each ending in EOS.
    Every engine replays the same streams, so they compute masks for the same states. (The engines'
    token languages differ: where bytes are forced, llguidance allows only their canonical
    tokenization, e.g. '":' but not '"' after a key; xgrammar allows any tokenization.)"""
    vocab, eos = engines[0].vocab, engines[0].tok.eos_token_id
    words = (vocab + 31) // 32
    gen = torch.Generator().manual_seed(seed)
    masks = torch.full((len(engines), words), -1, dtype=torch.int32)
    streams = []
    for _ in range(BATCH):
        stream: list[int] = []
        matchers = [e.matcher(c) for e, c in zip(engines, compiled)]
        while len(stream) < steps:
            for i, (e, m) in enumerate(zip(engines, matchers)):
                e.fill_one(m, masks, i)
            both = masks[0].clone()
            for row in masks[1:]:
                both &= row
            logits = torch.rand(1, vocab, generator=gen)
            apply_torch(logits, both.unsqueeze(0))
            token = int(logits.argmax())
            assert torch.isfinite(logits[0, token]), "the engines allow no common token"
            for e, m in zip(engines, matchers):
                assert e.accept(m, token)
            stream.append(token)
            if token == eos:
                matchers = [e.matcher(c) for e, c in zip(engines, compiled)]
        streams.append(stream)
    return streams


def bench_steps(engine, compiled, streams: list[list[int]], runs: int, seed: int) -> dict[str, float]:
    vocab, steps, eos = engine.vocab, len(streams[0]), engine.tok.eos_token_id
    words = (vocab + 31) // 32
    fill_b, fill_s, apply_, accept_, apply_x, finished = [], [], [], [], [], 0
    for run in range(runs):
        gen = torch.Generator().manual_seed(seed + run)
        matchers = [engine.matcher(compiled) for _ in range(BATCH)]
        bitmask = torch.full((BATCH, words), -1, dtype=torch.int32)
        bitmask2 = torch.full((BATCH, words), -1, dtype=torch.int32)
        tb, ts, ta, tc, tx = [], [], [], [], []
        for step in range(steps):
            logits = torch.randn(BATCH, vocab, generator=gen)
            logits_x = logits.clone()
            tb.append(_time(lambda: engine.fill_batch(matchers, bitmask))[0])
            t = time.perf_counter()
            for i, m in enumerate(matchers):
                engine.fill_one(m, bitmask2, i)
            ts.append(time.perf_counter() - t)
            assert torch.equal(bitmask, bitmask2)
            ta.append(_time(lambda: apply_torch(logits, bitmask))[0])
            if engine.apply is not None:
                tx.append(_time(lambda: engine.apply(logits_x, bitmask))[0])
                assert torch.equal(logits, logits_x)
            tokens = [s[step] for s in streams]
            for i, tok in enumerate(tokens):
                assert torch.isfinite(logits[i, tok]), f"{engine.name}: the stream's token {tok} is masked"
            t = time.perf_counter()
            for m, tok in zip(matchers, tokens):
                if not engine.accept(m, tok):
                    raise RuntimeError(f"{engine.name}: rejected the stream's token {tok}")
            tc.append(time.perf_counter() - t)
            for i, tok in enumerate(tokens):
                if tok == eos:  # the document is complete: the next token starts a new request
                    assert engine.done(matchers[i])
                    finished += 1
                    matchers[i] = engine.matcher(compiled)
        fill_b.append(statistics.mean(tb))
        fill_s.append(statistics.mean(ts))
        apply_.append(statistics.mean(ta))
        apply_x.append(statistics.mean(tx) if tx else float("nan"))
        accept_.append(statistics.mean(tc))
    return {"fill_batched": statistics.median(fill_b), "fill_serial": statistics.median(fill_s),
            "apply_torch": statistics.median(apply_), "apply_engine": statistics.median(apply_x),
            "accept": statistics.median(accept_), "finished": finished // runs, "tokens": steps * BATCH}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=2, help="engine worker threads (this machine: 2 cores)")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads for applying masks (a second thread only waits on a busy 2-core box)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", nargs="+", default=["xgrammar", "llguidance"])
    args = p.parse_args(argv)

    from kvserve.model.loader import load_model, resolve_model_path

    loaded = load_model(resolve_model_path(None))
    tok, vocab = loaded.tokenizer, loaded.config.vocab_size
    print(f"tokenizer {type(tok).__name__} len={len(tok)}; model vocab_size={vocab}; torch {torch.__version__}; "
          f"threads={args.threads}; torch threads={args.torch_threads}; runs={args.runs}; steps={args.steps}x{BATCH}",
          file=sys.stderr)
    torch.set_num_threads(args.torch_threads)
    classes = {"xgrammar": XGrammar, "llguidance": LLGuidance}
    engines, results = [], {}
    for name in args.engines:
        try:
            engines.append(classes[name](tok, vocab, args.threads))
        except ImportError as e:
            print(f"{name}: not installed ({e})", file=sys.stderr)
    for engine in engines:
        results[engine.name] = bench_setup_compile(engine, args.runs)
        engine.setup()
    compiled = [e.compile(json.dumps(SCHEMA)) for e in engines]
    streams = make_streams(engines, compiled, args.steps, args.seed)
    for engine, c in zip(engines, compiled):
        r = results[engine.name]
        r.update(bench_steps(engine, c, streams, args.runs, args.seed))
        r["version"] = engine.version
        print(engine.name, json.dumps(r), file=sys.stderr)

    ms = lambda s: "n/a" if s != s else f"{s * 1e3:.3f}"  # noqa: E731
    rows = [("tokenizer setup (ms)", "setup"), ("cold compile (ms)", "compile"),
            ("cold compile + first mask (ms)", "compile_first_mask"),
            ("fill 16 masks, batched (ms/step)", "fill_batched"), ("fill 16 masks, serial (ms/step)", "fill_serial"),
            ("apply [16, V] plain torch (ms/step)", "apply_torch"),
            ("apply [16, V] engine kernel (ms/step)", "apply_engine"),
            ("accept 16 tokens (ms/step)", "accept")]
    names = list(results)
    head = "| | " + " | ".join(f"{n} {results[n]['version']}" for n in names)
    if len(names) == 2:
        head += f" | {names[1]} / {names[0]}"
    print(head + " |")
    print("|---" * (len(names) + 1 + (len(names) == 2)) + "|")
    for label, key in rows:
        cells = [ms(results[n][key]) for n in names]
        if len(names) == 2:
            a, b = results[names[0]][key], results[names[1]][key]
            cells.append(f"{b / a:.2f}x" if a > 0 and a == a and b == b else "-")
        print(f"| {label} | " + " | ".join(cells) + " |")
    for n in names:
        r = results[n]
        grammar = min(r["fill_batched"], r["fill_serial"]) + r["accept"]
        print(f"\n{n}: per decode step for {BATCH} requests: grammar work (best fill + accept) {ms(grammar)} ms, "
              f"+ torch apply {ms(grammar + r['apply_torch'])} ms; {r['finished']} documents end in the "
              f"{r['tokens']} replayed tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
