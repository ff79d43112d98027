"""Summarise scripts/bench_single_pair.sh: per round the read bandwidth, each server's time per output
token and their ratio (kvserve / llama.cpp), then the median ratio over rounds.

Time per output token (TPOT, the mean gap after the first token) rather than the ITL p50: llama.cpp's
server sends a token whose text is an incomplete UTF-8 sequence together with the next one, so with
few requests the p50 of its gaps can be a zero gap. Usage: single_pair_summary.py DIR"""

import json
import statistics
import sys
from pathlib import Path


def tpot_p50(path: Path) -> float:
    return json.loads(path.read_text())["summary"]["tpot_ms"]["p50"]


def main(out: Path) -> None:
    rounds = sorted(int(p.stem.rsplit("_r", 1)[1]) for p in out.glob("kvserve_r*.json"))
    ratios = []
    print(f"{'round':>5} {'GB/s':>6} {'kvserve TPOT ms':>16} {'llama.cpp TPOT ms':>18} {'ratio':>6}")
    for r in rounds:
        k, lc = out / f"kvserve_r{r}.json", out / f"llamacpp_r{r}.json"
        if not lc.exists():
            continue
        bw = (out / f"bandwidth_r{r}.txt").read_text().strip() if (out / f"bandwidth_r{r}.txt").exists() else "?"
        a, b = tpot_p50(k), tpot_p50(lc)
        ratios.append(a / b)
        print(f"{r:>5} {bw:>6} {a:>16.2f} {b:>18.2f} {a / b:>6.2f}")
    if ratios:
        print(f"median ratio {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}) over {len(ratios)} rounds")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
