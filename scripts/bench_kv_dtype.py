"""What an 8-bit KV cache costs in accuracy on the embedded model, against full-precision KV
(docs/benchmarks.md, "8-bit KV cache"; tests/model/test_kv8_accuracy.py bounds the same figures).

Per --kv-cache-dtype: perplexity of tests/data/perplexity.txt (windows of 256 tokens), the mean
absolute difference of next-token log-probabilities (of the text's next token) and the top-1
agreement against auto over those windows, and greedy agreement of 32-token generations over PROMPTS. One torch thread.

    python scripts/bench_kv_dtype.py [--tokens 32]

Speed is ``kvserve bench offline`` with ``--kv-cache-dtype`` (scripts/bench_kv_dtype.sh runs both).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from kvserve.bench.perplexity import AGREEMENT_PROMPTS as PROMPTS, greedy_agreement, sequence_logits
from kvserve.config import CacheConfig
from kvserve.engine.request import SamplingParams
from kvserve.llm import LLM
from kvserve.model.loader import load_model, resolve_model_path
from kvserve.runner.torch_runner import TorchRunner
from kvserve.text.tokenizer import Tokenizer

TEXT = Path(__file__).parent.parent / "tests" / "data" / "perplexity.txt"
KV_DTYPES = ("auto", "fp8", "fp8_e5m2", "int8")


def window_logprobs(runner: TorchRunner, ids: list[int], window: int = 256) -> list[torch.Tensor]:
    return [torch.log_softmax(sequence_logits(runner, ids[s : s + window]), -1)
            for s in range(0, len(ids) - 1, window) if len(ids[s : s + window]) >= 2]


def measure(tokens: int = 32) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    m = load_model(resolve_model_path(None), keep_quantized=True)
    ids = m.tokenizer.encode(TEXT.read_text())
    tok = Tokenizer(m.tokenizer, m.config)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ref_lp, ref_next, ref_out, out = None, None, None, {}
    for kv in KV_DTYPES:
        runner = TorchRunner(m.config, m.weights, CacheConfig(num_kv_blocks=64, kv_cache_dtype=kv), dtype=torch.float32)
        lps = window_logprobs(runner, ids)
        nexts = [lp[:-1].gather(1, torch.tensor(ids[i * 256 + 1 : i * 256 + len(lp)]).unsqueeze(1)).squeeze(1)
                 for i, lp in enumerate(lps)]  # log p of the text's next token
        nll, count = -sum(n.sum().item() for n in nexts), sum(len(n) for n in nexts)
        llm = LLM.from_weights(m.config, m.weights, tok, dtype="float32", num_kv_blocks=256, kv_cache_dtype=kv)
        gen = [r.token_ids for r in llm.generate(PROMPTS, params)]
        ref_lp, ref_next, ref_out = ref_lp or lps, ref_next or nexts, ref_out or gen
        out[kv] = {
            "perplexity": math.exp(nll / count),
            "logprob_mad": torch.cat(nexts).sub(torch.cat(ref_next)).abs().mean().item(),
            "top1_agreement": sum((a.argmax(-1) == b.argmax(-1)).float().mean().item() for a, b in zip(lps, ref_lp)) / len(lps),
            "greedy_agreement": sum(greedy_agreement(a, b) for a, b in zip(ref_out, gen)) / len(PROMPTS),
            "bytes_per_token": runner.kv_bytes_per_token,
        }
        print(kv, json.dumps({k: round(v, 4) for k, v in out[kv].items()}), flush=True)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    measure(ap.parse_args().tokens)
