"""The ``--max-loras`` slots as the native kernel reads them (``ops.lora_apply_``): per adapted linear, the
adapters in the slots stacked, A [slots, K, in], B [slots, K, widest part] and, per row k of B, the output
columns it adds to (its part of a fused linear; (0, 0): unused). K grows with the largest adapter placed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.lora.adapter import LoRAAdapter
from kvserve.model.config import ModelConfig


@dataclass
class _Table:
    a: torch.Tensor
    b: torch.Tensor
    bounds: torch.Tensor


class SlotTable:
    def __init__(self, shapes: dict[str, tuple[int, int]], num_slots: int):
        """``shapes``: linear path -> (in features, widest part's rows)."""
        self.shapes, self.num_slots = shapes, num_slots
        self.tables: dict[str, _Table] = {}

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_slots: int) -> "SlotTable":
        from kvserve.lora.adapter import adaptable_modules

        shapes: dict[str, tuple[int, int]] = {}
        for target in adaptable_modules(cfg).values():
            rows = target.rows[1] - target.rows[0]
            shapes[target.path] = (target.in_features, max(rows, shapes.get(target.path, (0, 0))[1]))
        return cls(shapes, num_slots)

    def _table(self, path: str, k: int) -> _Table:
        """``path``'s table with room for ``k`` rows per slot (grown, contents kept)."""
        old = self.tables.get(path)
        if old is not None and old.a.shape[1] >= k:
            return old
        k = max(k, 0 if old is None else old.a.shape[1])
        cols, width = self.shapes[path]
        new = _Table(torch.zeros(self.num_slots, k, cols), torch.zeros(self.num_slots, k, width),
                     torch.zeros(self.num_slots, k, 2, dtype=torch.int32))
        if old is not None:
            kk = old.a.shape[1]
            new.a[:, :kk], new.b[:, :kk], new.bounds[:, :kk] = old.a, old.b, old.bounds
        self.tables[path] = new
        return new

    def fill(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put ``adapter`` in ``slot`` (what was there is gone)."""
        for path, table in self.tables.items():
            if path not in adapter.deltas:
                table.a[slot].zero_()
                table.bounds[slot].zero_()
        for path, delta in adapter.deltas.items():
            k = delta.a.shape[0]
            table = self._table(path, k)
            table.a[slot].zero_()
            table.b[slot].zero_()
            table.bounds[slot].zero_()
            table.a[slot, :k] = delta.a
            table.b[slot, :k, : delta.b.shape[1]] = delta.b
            for start, end, lo, hi in delta.parts:
                table.bounds[slot, start:end] = torch.tensor([lo, hi], dtype=torch.int32)

    def get(self, path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        table = self.tables.get(path)
        return None if table is None else (table.a, table.b, table.bounds)
