"""Soak: mixed traffic against a server for a set time, then the books are checked.

``concurrency`` clients each send one request after another until ``duration`` runs out, every
request drawn at random from a mix: completions and chat, streamed and not; clients that close
the connection mid-stream or before the first token; JSON-schema constrained answers (validated
with jsonschema when they finish with ``stop``); prompts that share a few long prefixes (the
prefix cache); n > 1, seeded sampling, stop strings, logprobs; and a few deliberately bad
requests, whose 400s are expected errors. Every response is checked: status, a well-formed body
or an event stream that ends with ``[DONE]``, finish reasons, usage. Anything else (a 5xx, a
malformed answer, a timeout, a broken connection) is an unexplained error.

Every ``sample_interval`` seconds /metrics gives the server's and the engine's RSS, the running
and waiting requests and the KV blocks in use and cached. At the end traffic stops, the server is
left to go idle, and the KV blocks still in use are leaked ones (``kvserve_kv_cache_blocks_used``
counts blocks held by requests; blocks only the prefix cache holds count as free).

    python scripts/soak.py --model PATH --duration 120 --serve-args "--num-kv-blocks 64" --json-out soak.json
    python scripts/soak.py --url http://127.0.0.1:8000 --duration 1200 --concurrency 16
"""

from kvserve.bench.soak.launcher import ServeProcess, main, soak_with_server
from kvserve.bench.soak.report import failed, format_result
from kvserve.bench.soak.run import run_soak
from kvserve.bench.soak.traffic import MIX, SoakConfig

__all__ = ["MIX", "ServeProcess", "SoakConfig", "failed", "format_result", "main", "run_soak", "soak_with_server"]
