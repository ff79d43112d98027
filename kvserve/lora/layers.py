"""LoRA in the forward pass: each of the decoder's linears wrapped (``LoRALinear``) adds, for a step's rows that
carry an adapter, (x @ A^T) @ B of that row's adapter, grouped by adapter as punica's shrink/expand: the rows
gathered in adapter order once per linear, two GEMMs per adapter present, one scatter-add back. Rows of the
base model cost nothing; a step with no adapter row skips all of it (and may run the native decode stack)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.lora.adapter import LoRAAdapter
from kvserve.model.layers import runs_amx
from kvserve.model.weights import LINEARS


@dataclass
class RowGroups:
    """Rows grouped by adapter: ``perm`` the rows in group order, ``segments`` (adapter, start, end) in it."""

    perm: torch.Tensor
    segments: list[tuple[LoRAAdapter, int, int]]
    identity: bool  # perm is 0..n-1: no gather needed


def group_rows(adapters: list[LoRAAdapter | None]) -> RowGroups | None:
    """The grouping of rows whose adapters are ``adapters`` (None: the base model); None if no row has one."""
    by: dict[int, tuple[LoRAAdapter, list[int]]] = {}
    for i, a in enumerate(adapters):
        if a is not None:
            by.setdefault(id(a), (a, []))[1].append(i)
    if not by:
        return None
    order: list[int] = []
    segments = []
    for a, rows in by.values():
        segments.append((a, len(order), len(order) + len(rows)))
        order += rows
    identity = order == list(range(len(adapters)))
    return RowGroups(torch.tensor(order, dtype=torch.long), segments, identity)


class LoRAStep:
    """One step's rows and their adapters, for every layer: all rows, and the rows the last layer keeps
    (``keep_rows`` of ``CausalLM.forward``)."""

    def __init__(self, adapters: list[LoRAAdapter | None], keep_rows: list[int] | None = None):
        self.num_rows = len(adapters)
        self.all = group_rows(adapters)
        self.kept = None if keep_rows is None else group_rows([adapters[i] for i in keep_rows])
        self.num_kept = None if keep_rows is None else len(keep_rows)

    def groups_for(self, rows: int) -> RowGroups | None:
        """The grouping of a linear's input of ``rows`` rows: the kept rows', or all rows' (an input padded
        past them too: the padding rows are in no group)."""
        return self.kept if rows == self.num_kept and rows != self.num_rows else self.all


class LoRAContext:
    """Shared by every wrapped linear of a model: the step being run (None: no adapter row, plain linears)."""

    def __init__(self) -> None:
        self.step: LoRAStep | None = None

    def apply(self, path: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        assert self.step is not None
        groups = self.step.groups_for(x.shape[0])
        if groups is None:
            return y
        xs = x[: len(groups.perm)] if groups.identity else x.index_select(0, groups.perm)
        outs, rows = [], []
        for adapter, start, end in groups.segments:
            delta = adapter.deltas.get(path)
            if delta is not None:  # shrink to the adapter's rank, expand to the linear's outputs
                outs.append(torch.mm(torch.mm(xs[start:end], delta.a.t()), delta.b))
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
    ctx = LoRAContext()
    found = [(name, m) for name, m in model.named_modules()
             if name.startswith("layers.") and name.rpartition(".")[2] in LINEARS and ".experts." not in name]
    for name, m in found:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, LoRALinear(m, ctx, name))
    model.lora = ctx
    return ctx
