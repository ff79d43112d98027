"""Soak a kvserve server: mixed traffic for a set time, then requests served, errors, RSS over time,
leaked KV blocks and latencies (the code and the full description: kvserve/bench/soak/).

    python scripts/soak.py --model PATH --duration 1200 --concurrency 16 --json-out soak.json
    python scripts/soak.py --model PATH --serve-args "--num-kv-blocks 64 --max-num-seqs 8" --duration 120
    python scripts/soak.py --url http://127.0.0.1:8000 --duration 600

Exits with status 1 on any unexplained error, leaked KV block, or a server that is unhealthy at the end.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kvserve

from kvserve.bench.soak import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
