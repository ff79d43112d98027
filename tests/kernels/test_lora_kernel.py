"""ops.lora_apply_ (every adapter of a step in one native call) against torch: rows in any order, slots of
uneven sizes (tiles of 1-4 rows), rows of no adapter untouched, feature counts off the vector width, a fused
linear's parts at their output columns, unused rows of the table skipped."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import load_kernels, ops

pytestmark = pytest.mark.skipif(not load_kernels(), reason="native kernels not built")


@pytest.mark.parametrize("cols", [40, 64])
def test_lora_apply_matches_torch(cols):
    g = torch.Generator().manual_seed(0)
    slots, k, width, rows = 3, 12, 20, 17
    parts = [(0, 4, 0, 20), (4, 8, 20, 30), (8, 12, 30, 50)]  # (rows of A/B, output columns): q, k, v
    out_features = 50
    a = torch.randn(slots, k, cols, generator=g)
    b = torch.randn(slots, k, width, generator=g)
    bounds = torch.zeros(slots, k, 2, dtype=torch.int32)
    for s in range(slots):
        for start, end, lo, hi in parts[: 3 if s != 1 else 1]:  # slot 1 adapts only the first part
            bounds[s, start:end] = torch.tensor([lo, hi], dtype=torch.int32)
    x = torch.randn(rows, cols, generator=g)
    y = torch.randn(rows, out_features, generator=g)
    row_slots = [0, 2, 0, -1, 1, 2, 2, 0, 0, 0, 0, 2, -1, 1, 2, 2, 0]
    order = [r for s in range(slots) for r in range(rows) if row_slots[r] == s]
    want = y.clone()
    for r in order:
        s = row_slots[r]
        t = a[s] @ x[r]
        for kk in range(k):
            lo, hi = bounds[s, kk].tolist()
            want[r, lo:hi] += t[kk] * b[s, kk, : hi - lo]
    ops.lora_apply_(y, x, a, b, bounds, torch.tensor(order), torch.tensor([row_slots[r] for r in order],
                                                                            dtype=torch.int32))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)
