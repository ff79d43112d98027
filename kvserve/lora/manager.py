"""The runner's adapters: registered names (``LoRARef``), the weights of up to ``--max-cpu-loras`` of them kept
in memory (least recently used dropped first, read again from their folder on use), and the ``--max-loras``
slots a step's adapters occupy (the scheduler lets no step need more). Each step it turns the batch's rows into
a ``LoRAStep`` for the wrapped linears (``kvserve.lora.layers``)."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

from kvserve.config import LoRAConfig
from kvserve.errors import InvalidArgumentError, NotFoundError
from kvserve.lora.adapter import LoRAAdapter, load_adapter
from kvserve.kernels import ops
from kvserve.lora.layers import LoRAStep, attach_lora
from kvserve.lora.registry import LoRARef, adapter_key, check_adapter_folder, check_lora_name
from kvserve.lora.slots import SlotTable
from kvserve.model.config import ModelConfig

log = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, cfg: ModelConfig, config: LoRAConfig, model: nn.Module, dtype: torch.dtype):
        self.cfg, self.config, self.dtype = cfg, config, dtype
        self.ctx = attach_lora(model)
        self.refs: dict[str, LoRARef] = {}  # registered names
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # by ref id, least recently used first
        self.slots: list[int | None] = [None] * config.max_loras  # ref ids the latest steps used
        if dtype == torch.float32 and getattr(model, "native", False) and ops.available():
            self.ctx.tables = SlotTable.for_model(cfg, config.max_loras)
        self._ids = itertools.count(1)
        self.load_seconds: list[float] = []
        # ref ids of the requests in the engine (the engine core sets it): their weights are never dropped, so a
        # request admitted with its adapter's weights in memory never needs its folder again
        self.in_use: Callable[[], set[int]] = set

    def rebind(self, model: nn.Module) -> None:
        """Serve the adapters on ``model``, the engine's new base model (new weights, a wake from level 2): its
        linears wrapped, the slot tables (the adapters' own weights) kept."""
        tables, self.ctx = self.ctx.tables, attach_lora(model)
        self.ctx.tables = tables

    # -- registering --------------------------------------------------------------------------
    def load(self, name: str, path: str) -> LoRARef:
        """Read, check and register the adapter at ``path`` as ``name``; InvalidArgumentError for a bad one
        (nothing registered then) or a name taken."""
        check_lora_name(name)
        if name in self.refs:
            raise InvalidArgumentError(f"an adapter named {name!r} is already loaded; unload it first",
                                       param="lora_name")
        started = time.perf_counter()
        path = os.path.realpath(path)
        check_adapter_folder(path)
        ref = LoRARef(name, next(self._ids), path, adapter_key(path))
        adapter = load_adapter(ref, self.cfg, self.config.max_lora_rank, self.dtype)
        ref = LoRARef(name, ref.id, path, ref.key, adapter.rank)
        adapter.ref = ref
        self.refs[name] = ref
        self._keep(ref.id, adapter)
        self.load_seconds.append(time.perf_counter() - started)
        log.info("LoRA adapter %s loaded from %s: rank %d, %d linears, %.1f MiB, %.3f s", name, path, adapter.rank,
                 len(adapter.deltas), adapter.nbytes / (1 << 20), self.load_seconds[-1])
        return ref

    def unload(self, name: str) -> None:
        """Forget ``name`` for new requests; requests already holding it finish on its weights."""
        if self.refs.pop(name, None) is None:
            raise NotFoundError(f"no adapter named {name!r} is loaded", param="lora_name", code="lora_not_found")

    def resolve(self, name: str) -> LoRARef:
        ref = self.refs.get(name)
        if ref is None:
            raise NotFoundError(f"the model {name!r} does not exist", param="model", code="model_not_found")
        return ref

    # -- weights and slots ----------------------------------------------------------------------
    def _keep(self, ref_id: int, adapter: LoRAAdapter, pinned: frozenset[int] | set[int] = frozenset()) -> None:
        self.loaded[ref_id] = adapter
        self.loaded.move_to_end(ref_id)
        pinned = pinned | self.in_use()
        for rid in list(self.loaded):
            if len(self.loaded) <= self.config.cpu_loras:
                break
            if rid not in pinned and rid != ref_id:
                del self.loaded[rid]

    def adapter(self, ref: LoRARef, pinned: set[int]) -> LoRAAdapter:
        """``ref``'s weights, read again from its folder if they were dropped."""
        adapter = self.loaded.get(ref.id)
        if adapter is None:
            adapter = load_adapter(ref, self.cfg, self.config.max_lora_rank, self.dtype)
        self._keep(ref.id, adapter, pinned)
        return adapter

    def prefetch(self, ref: LoRARef) -> None:
        """A request for ``ref`` is being admitted: its weights in memory now (read from its folder if they were
        dropped), or the InvalidArgumentError saying why they cannot be read (the folder was removed, ...): the
        request is refused, not the step that would have needed them."""
        self.adapter(ref, {ref.id})

    def _occupy(self, adapters: dict[int, LoRAAdapter]) -> dict[int, int]:
        """Put the step's adapters in slots (copied into the slot table), replacing adapters of no use to this
        step; returns ref id -> slot."""
        free = [i for i, s in enumerate(self.slots) if s not in adapters]
        for rid, adapter in adapters.items():
            if rid not in self.slots:
                if not free:
                    raise RuntimeError(f"a step with more than --max-loras {len(self.slots)} adapters")
                slot = free.pop(0)
                self.slots[slot] = rid
                if self.ctx.tables is not None:
                    self.ctx.tables.fill(slot, adapter)
        return {rid: self.slots.index(rid) for rid in adapters}

    def step(self, refs: list[LoRARef | None], keep_rows: list[int] | None) -> LoRAStep | None:
        """The step of rows whose adapters are ``refs`` (None: base), or None when no row has one."""
        ids = list(dict.fromkeys(r.id for r in refs if r is not None))
        if not ids:
            return None
        by_id = {r.id: r for r in refs if r is not None}
        adapters = {rid: self.adapter(by_id[rid], set(ids)) for rid in ids}
        slots = self._occupy(adapters)
        return LoRAStep([None if r is None else adapters[r.id] for r in refs], keep_rows, slots)

    @property
    def names(self) -> list[str]:
        return list(self.refs)
