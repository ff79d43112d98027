"""LoRA in the forward pass: each of the decoder's linears wrapped (``LoRALinear``) adds, for a step's rows that
carry an adapter, (x @ A^T) @ B of that row's adapter, grouped by adapter as punica's shrink/expand. Natively
(float32, the kernels loaded) one call per linear does every adapter of the step from the slot table
(``ops.lora_apply_``, ``kvserve.lora.slots``); otherwise torch: the rows gathered in adapter order once per
linear, two GEMMs per adapter present, one scatter-add back. Rows of the base model cost nothing; a step with
no adapter row skips all of it (and may run the native decode stack)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.kernels import ops
from kvserve.lora.adapter import LoRAAdapter
from kvserve.lora.slots import SlotTable
from kvserve.model.layers import runs_amx
from kvserve.model.weights import LINEARS


@dataclass
class RowGroups:
    """Rows grouped by adapter: ``perm`` the rows in group order, ``segments`` (adapter, start, end) in it,
    ``slot_of`` each entry's slot (in the slot table)."""

    perm: torch.Tensor
    segments: list[tuple[LoRAAdapter, int, int]]
    identity: bool  # perm is 0..n-1: no gather needed
    slot_of: torch.Tensor


def group_rows(adapters: list[LoRAAdapter | None], slots: dict[int, int]) -> RowGroups | None:
    """The grouping of rows whose adapters are ``adapters`` (None: the base model); None if no row has one."""
    by: dict[int, tuple[LoRAAdapter, list[int]]] = {}
    for i, a in enumerate(adapters):
        if a is not None:
            by.setdefault(id(a), (a, []))[1].append(i)
    if not by:
        return None
    order: list[int] = []
    segments, slot_of = [], []
    for a, rows in by.values():
        segments.append((a, len(order), len(order) + len(rows)))
        order += rows
        slot_of += [slots.get(a.ref.id, -1)] * len(rows)
    identity = order == list(range(len(adapters)))
    return RowGroups(torch.tensor(order, dtype=torch.long), segments, identity,
                     torch.tensor(slot_of, dtype=torch.int32))


class LoRAStep:
    """One step's rows and their adapters, for every layer: all rows, and the rows the last layer keeps
    (``keep_rows`` of ``CausalLM.forward``)."""

    def __init__(self, adapters: list[LoRAAdapter | None], keep_rows: list[int] | None = None,
                 slots: dict[int, int] | None = None):
        """``slots``: adapter (ref id) -> its slot in the slot table."""
        self.num_rows = len(adapters)
        self.all = group_rows(adapters, slots or {})
        self.kept = None if keep_rows is None else group_rows([adapters[i] for i in keep_rows], slots or {})
        self.num_kept = None if keep_rows is None else len(keep_rows)

    def groups_for(self, rows: int) -> RowGroups | None:
        """The grouping of a linear's input of ``rows`` rows: the kept rows', or all rows' (an input padded
        past them too: the padding rows are in no group)."""
        return self.kept if rows == self.num_kept and rows != self.num_rows else self.all


class LoRAContext:
    """Shared by every wrapped linear of a model: the step being run (None: no adapter row, plain linears)."""

    def __init__(self, model: nn.Module) -> None:
        self.step: LoRAStep | None = None
        self.model = model  # its ``native`` says whether the kernels may run
        self.tables: SlotTable | None = None  # the slots as the native kernel reads them (float32 models)

    def apply(self, path: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        assert self.step is not None
        groups = self.step.groups_for(x.shape[0])
        if groups is None:
            return y
        table = self.tables.get(path) if self.tables is not None and self.model.native else None
        if table is not None and x.dtype == y.dtype == torch.float32:
            ops.lora_apply_(y, x if x.stride(-1) == 1 else x.contiguous(), *table, groups.perm, groups.slot_of)
            return y
        xs = x[: len(groups.perm)] if groups.identity else x.index_select(0, groups.perm)
        outs, rows = [], []
        for adapter, start, end in groups.segments:
            delta = adapter.deltas.get(path)
            if delta is not None:  # shrink to the adapter's rank, expand each part to its outputs
                t = torch.mm(xs[start:end], delta.a.t())
                out = y.new_zeros(end - start, y.shape[1], dtype=t.dtype)
                for k0, k1, lo, hi in delta.parts:
                    out[:, lo:hi] = torch.mm(t[:, k0:k1], delta.b[k0:k1, : hi - lo])
                outs.append(out)
                rows.append((start, end))
        if not outs:
            return y
        if len(rows) == len(groups.segments):
            y.index_add_(0, groups.perm, torch.cat(outs).to(y.dtype))
        else:
            for (start, end), out in zip(rows, outs):
                y.index_add_(0, groups.perm[start:end], out.to(y.dtype))
        return y


class LoRALinear(nn.Module):
    """A linear of the decoder with the step's adapters added; the wrapped layer runs as it would alone."""

    def __init__(self, base: nn.Module, ctx: LoRAContext, path: str):
        super().__init__()
        self.base, self.ctx, self.path = base, ctx, path

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        y = self.base(x, **kwargs)
        return y if self.ctx.step is None else self.ctx.apply(self.path, x, y)

    def runs_amx(self, x: torch.Tensor) -> bool:
        """The base layer's bf16 hand-offs only in steps without adapters (the LoRA adds in the model's dtype)."""
        return self.ctx.step is None and runs_amx(self.base, x)

    @property
    def amx(self) -> nn.Module | None:
        return getattr(self.base, "amx", None) if self.ctx.step is None else None


def attach_lora(model: nn.Module) -> LoRAContext:
    """Wrap every linear of ``model``'s layers an adapter may target (not routed experts' nor the LM head) and
    return their shared context. The native decode stack, built before, keeps the plain layers' weights."""
    ctx = LoRAContext(model)
    found = [(name, m) for name, m in model.named_modules()
             if name.startswith("layers.") and name.rpartition(".")[2] in LINEARS and ".experts." not in name]
    for name, m in found:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, LoRALinear(m, ctx, name))
    model.lora = ctx
    return ctx
