"""Reading a Prometheus text exposition (a server's /metrics): sample values by name and labels."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def samples(text: str) -> Iterator[Sample]:
    """Every sample of the exposition (name, labels, value), histogram buckets and counters' _total included."""
    for family in text_string_to_metric_families(text):
        yield from family.samples


def totals(text: str) -> dict[str, float]:
    """Each sample name's value, summed over its labels."""
    out: dict[str, float] = {}
    for s in samples(text):
        out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def metric(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` with ``labels`` (summed over the labels not given); KeyError if there is none."""
    total, found = 0.0, False
    for s in samples(text):
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
            found = True
    if not found:
        raise KeyError(name)
    return total
