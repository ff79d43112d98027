"""Per-adapter usage for /metrics: requests, prompt and generated tokens by ``lora_name`` (counted by the engine
client as deltas arrive), and the adapters loaded. Labels are bounded: past MAX_LABELS names, "other"."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

MAX_LABELS = 64


class LoRAUsage:
    """Counts by adapter name; the client calls ``start`` per request and ``on_delta`` per delta."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.prompt_tokens: Counter[str] = Counter()
        self.generation_tokens: Counter[str] = Counter()
        self._of: dict[str, str] = {}  # request id -> its label, while it runs

    def label(self, name: str) -> str:
        return name if name in self.requests or len(self.requests) < MAX_LABELS else "other"

    def start(self, request_id: str, name: str, num_prompt_tokens: int) -> None:
        label = self._of[request_id] = self.label(name)
        self.requests[label] += 1
        self.prompt_tokens[label] += num_prompt_tokens

    def on_delta(self, delta: Any) -> None:
        label = self._of.get(delta.request_id)
        if label is not None:
            self.generation_tokens[label] += len(delta.new_token_ids)
            if delta.finished:
                del self._of[delta.request_id]


class LoRACollector(Collector):
    """``kvserve_lora_requests``, ``kvserve_lora_prompt_tokens``, ``kvserve_lora_generation_tokens`` (counters,
    by lora_name) and ``kvserve_lora_adapters_loaded`` (a gauge), from an engine client with LoRA on."""

    def __init__(self, client: Any):
        self.client = client

    def collect(self) -> Iterator[Any]:
        usage: LoRAUsage | None = getattr(self.client, "lora_usage", None)
        adapters = getattr(self.client, "lora_adapters", None)
        if usage is None or adapters is None:
            return
        yield GaugeMetricFamily("kvserve_lora_adapters_loaded", "LoRA adapters loaded.", value=len(adapters))
        for name, counts, doc in (("requests", usage.requests, "Requests, by LoRA adapter."),
                                  ("prompt_tokens", usage.prompt_tokens, "Prompt tokens, by LoRA adapter."),
                                  ("generation_tokens", usage.generation_tokens, "Generated tokens, by LoRA adapter.")):
            family = CounterMetricFamily(f"kvserve_lora_{name}", doc, labels=["lora_name"])
            for label, n in counts.items():
                family.add_metric([label], n)
            yield family
