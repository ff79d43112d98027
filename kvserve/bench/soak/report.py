"""The soak's result: statistics of the outcomes and the /metrics samples, pass/fail, and the text report."""

from __future__ import annotations

from dataclasses import asdict

from kvserve.bench.soak.checks import Outcome
from kvserve.bench.soak.traffic import SoakConfig
from kvserve.bench.stats import Dist


def _dist(values: list[float]) -> dict | None:
    d = Dist.of(values)
    return asdict(d) if d else None


def _series_stats(samples: list[dict], key: str, warmup: float) -> dict | None:
    pts = [(s["t"], s[key]) for s in samples if s.get(key) is not None]
    if not pts:
        return None
    after = [p for p in pts if p[0] >= warmup] or pts[-1:]
    mib = 1 << 20
    slope = None
    if len(after) >= 3 and after[-1][0] > after[0][0]:  # least squares, MiB per minute
        mt = sum(t for t, _ in after) / len(after)
        mv = sum(v for _, v in after) / len(after)
        den = sum((t - mt) ** 2 for t, _ in after)
        slope = round(sum((t - mt) * (v - mv) for t, v in after) / den * 60 / mib, 3) if den else None
    return {"first_mib": round(pts[0][1] / mib, 1), "after_warmup_mib": round(after[0][1] / mib, 1),
            "max_mib": round(max(v for _, v in pts) / mib, 1), "last_mib": round(pts[-1][1] / mib, 1),
            "growth_after_warmup_mib": round((pts[-1][1] - after[0][1]) / mib, 1),
            "slope_after_warmup_mib_per_min": slope}


def build_result(cfg: SoakConfig, outcomes: list[Outcome], samples: list[dict], final: dict,
                 monitor_errors: list[str], healthy: bool, traffic_s: float, warmup: float, model: str) -> dict:
    """The soak's full result (see ``format_result``) from what the run saw."""
    by_kind: dict[str, dict[str, int]] = {}
    for o in outcomes:
        k = by_kind.setdefault(o.kind, {"ok": 0, "aborted": 0, "expected_error": 0, "unexplained": 0})
        k[o.result] += 1
    served = [o for o in outcomes if o.result == "ok"]
    unexplained = [o for o in outcomes if o.result == "unexplained"]
    examples: dict[str, int] = {}
    for o in unexplained:
        key = f"{o.kind}: {o.detail}"
        examples[key] = examples.get(key, 0) + 1
    leaked = None
    if final.get("kv_used") is not None and final.get("running") == 0 and final.get("waiting") == 0:
        leaked = int(final["kv_used"])
    gen = [s["generation_tokens"] for s in samples if s.get("generation_tokens") is not None]
    prompt_tokens = sum(o.prompt_tokens for o in served)
    return {
        "config": asdict(cfg), "model": model, "traffic_s": round(traffic_s, 1), "warmup_s": warmup,
        "requests": len(outcomes),
        "served": sum(k["ok"] + k["aborted"] for k in by_kind.values()),
        "by_kind": dict(sorted(by_kind.items())),
        "expected_errors": sum(o.result == "expected_error" for o in outcomes),
        "busy_429": sum(o.detail == "429 busy" for o in outcomes),
        "json_answers_validated": sum(o.json_valid for o in outcomes),
        "unexplained_errors": len(unexplained) + len(monitor_errors),
        "unexplained_examples": dict(sorted(examples.items(), key=lambda kv: -kv[1])[:20]),
        "monitor_errors": monitor_errors[:20],
        "ttft_ms": _dist([o.ttft for o in served if o.ttft is not None]),
        "e2e_ms": _dist([o.latency for o in served if o.latency is not None]),
        "ttft_ms_by_kind": {k: _dist([o.ttft for o in served if o.kind == k and o.ttft is not None])
                            for k in by_kind if any(o.kind == k and o.ttft is not None for o in served)},
        "e2e_ms_by_kind": {k: _dist([o.latency for o in served if o.kind == k and o.latency is not None])
                           for k in by_kind if any(o.kind == k and o.latency is not None for o in served)},
        "output_tokens": sum(o.completion_tokens for o in served),
        "output_tokens_per_s": round(sum(o.completion_tokens for o in served) / max(traffic_s, 1e-9), 1),
        "server_generation_tokens_per_s": round((gen[-1] - gen[0]) / max(traffic_s, 1e-9), 1) if len(gen) > 1 else None,
        "prompt_tokens": prompt_tokens,
        "prefix_cache_hit_rate": round(sum(o.cached_tokens for o in served) / max(1, prompt_tokens), 4),
        "preemptions": (final.get("preemptions") or 0) - (samples[0].get("preemptions") or 0) if samples else None,
        "server_rss": _series_stats(samples, "server_rss", warmup),
        "engine_rss": _series_stats(samples, "engine_rss", warmup),
        "idle": final,
        "leaked_blocks": leaked,
        "healthy_at_end": healthy,
        "samples": samples,
    }


def failed(result: dict) -> list[str]:
    """Why the soak failed (empty: it passed)."""
    why = []
    if result["unexplained_errors"]:
        why.append(f"{result['unexplained_errors']} unexplained errors")
    if result["leaked_blocks"] is None:
        why.append("the server did not go idle after the traffic stopped")
    elif result["leaked_blocks"]:
        why.append(f"{result['leaked_blocks']} KV blocks leaked")
    if not result["healthy_at_end"]:
        why.append("/health did not answer 200 at the end")
    if result.get("server_log_errors"):
        why.append(f"{len(result['server_log_errors'])} errors in the server's log")
    if result.get("server_exit_code") not in (None, 0):
        why.append(f"the server exited with status {result['server_exit_code']}")
    return why


def format_result(r: dict) -> str:
    def dist(d: dict | None) -> str:
        return "-" if d is None else f"p50 {d['p50']:.0f}, p99 {d['p99']:.0f}"

    def rss(d: dict | None) -> str:
        if d is None:
            return "-"
        return (f"first {d['first_mib']}, after warm-up {d['after_warmup_mib']}, max {d['max_mib']}, "
                f"last {d['last_mib']} MiB; growth after warm-up {d['growth_after_warmup_mib']:+} MiB "
                f"({d['slope_after_warmup_mib_per_min']} MiB/min)")

    lines = [f"soak: {r['traffic_s']} s of traffic on {r['model']}, {r['config']['concurrency']} clients",
             f"requests {r['requests']}, served {r['served']} (aborts included), expected errors "
             f"{r['expected_errors']} (429s {r['busy_429']}), UNEXPLAINED {r['unexplained_errors']}"]
    for kind, k in r["by_kind"].items():
        lines.append(f"  {kind:<18} ok {k['ok']:>6}  aborted {k['aborted']:>5}  expected errors "
                     f"{k['expected_error']:>4}  unexplained {k['unexplained']:>3}")
    for example, n in r["unexplained_examples"].items():
        lines.append(f"  ! {n} x {example}")
    for e in r["monitor_errors"]:
        lines.append(f"  ! {e}")
    for e in r.get("server_log_errors", [])[:10]:
        lines.append(f"  ! server log: {e}")
    lines += [
        f"TTFT ms {dist(r['ttft_ms'])}; end-to-end ms {dist(r['e2e_ms'])}",
        f"output tokens {r['output_tokens']} ({r['output_tokens_per_s']}/s; the server counted "
        f"{r['server_generation_tokens_per_s']}/s), JSON answers validated {r['json_answers_validated']}, "
        f"prefix cache hits {r['prefix_cache_hit_rate']:.1%} of prompt "
        f"tokens, preemptions {r['preemptions']}",
        f"server RSS: {rss(r['server_rss'])}",
        f"engine RSS: {rss(r['engine_rss'])}",
        f"leaked KV blocks once idle: {r['leaked_blocks']} (cached: {r['idle'].get('kv_cached')}); "
        f"healthy at the end: {r['healthy_at_end']}",
    ]
    why = failed(r)
    lines.append("FAILED: " + "; ".join(why) if why else "PASSED")
    return "\n".join(lines)
