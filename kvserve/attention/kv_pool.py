"""KVPool: the paged KV cache's tensors, and the block payloads the offload tiers store.

Per layer, K and V are tensors [num_slots, kv_heads, head_dim]; a slot is
``block_id * block_size + offset``. One block past the pool holds the null slot, where padded
attention reads point. The pool is zeroed at allocation, which maps every page up front: left to
the first writes, a cold prompt's page faults cost it ~0.13 s (1.7k tokens, embedded model).

Pools are registered by KV cache dtype name (``--kv-cache-dtype``). "auto" stores K and V in
the model's dtype; a pool that stores them otherwise (bfloat16 for a float32 model, below; 8-bit
with scales: quantized_pool.py) is a subclass registered under its own name. Backends write and read through the pool (``store``,
``gather``), so they need not know how it stores K and V.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any

import torch

from kvserve.attention.registry import Registry
from kvserve.kernels import ops
from kvserve.kv.layout import KVLayout
from kvserve.model.config import ModelConfig


class LayerKV(tuple):
    """One layer's cache; ``k, v = layer`` unpacks its tensors [slots, kv_heads, head_dim] as stored.
    A quantized pool's layers also carry their scales (float32 [kv_heads, head_dim]: a stored
    value times its scale is the value); None in a pool that stores the model's dtype."""

    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def __new__(cls, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> "LayerKV":
        layer = super().__new__(cls, (k, v))
        layer.k_scale, layer.v_scale = k_scale, v_scale
        return layer


class KVPool:
    quantized = False  # True: K and V are stored in fewer bits, with scales (LayerKV.k_scale, v_scale)
    converts_on_read = False  # True: gather and as_stored give another dtype than the one stored
    scales_tag = ""  # how a quantized pool's scales are laid out, for the fingerprint

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device):
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        self.dtype: torch.dtype = getattr(torch, layout.dtype)
        self.block_size = layout.block_size
        self.null_slot = num_blocks * layout.block_size
        self.layers = self._allocate()  # per layer (K, V)
        self._native_store: bool | None = None  # the kernels' store_rows_ (CPU), decided on first use

    @classmethod
    def storage_dtype(cls, model_dtype: torch.dtype) -> torch.dtype:
        """What this pool stores K and V as, for a model running in ``model_dtype``."""
        return model_dtype

    @classmethod
    def layout_for(cls, cfg: ModelConfig, model_dtype: torch.dtype, block_size: int) -> KVLayout:
        dtype = str(cls.storage_dtype(model_dtype)).removeprefix("torch.")
        shapes = cfg.kv_layer_shapes()
        heads, dim = cfg.num_key_value_heads, cfg.head_dim
        if shapes is not None and len(set(shapes)) == 1:  # one shape, wider than the heads' (DiffLlama's, Doge's)
            (heads, dim), shapes = shapes[0], None
        return KVLayout(cfg.kv_cache_layers, heads, dim, block_size, dtype, None if shapes is None else tuple(shapes))

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def allocated(self) -> bool:
        return bool(self.layers)

    def release(self) -> None:
        """Drop the K and V tensors (a sleeping engine's memory back); ``reallocate`` makes them again, zeroed.
        An 8-bit pool keeps its scales."""
        self.layers = []

    def reallocate(self) -> None:
        if not self.layers:
            self.layers = self._allocate()

    def _allocate(self) -> list[LayerKV]:
        layers = []
        for i in range(self.layout.num_layers):
            shape = ((self.num_blocks + 1) * self.block_size, *self.layout.shape(i))
            k, v = (torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))
            layers.append(LayerKV(k, v))
        return layers

    # -- what backends call: writing new K/V, reading a context back in the model's dtype
    def store(self, layer: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes the new tokens' k, v [T, kv_heads, d] to their slots."""
        self._store(layer[0], slots, k)
        self._store(layer[1], slots, v)

    def _store(self, cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        """cache[slots] = x (cast to the cache's dtype): one row copy per token where the kernels run."""
        if self._native_store is None:
            self._native_store = self.device.type == "cpu" and ops.available()
        ops.store_rows_(cache, slots, x.to(cache.dtype), native=self._native_store)

    def as_stored(self, layer: LayerKV, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v as the cache gives them back once stored: what a chunk attends over in its own fresh
        K/V, so a key counts the same whether it is read fresh or from the cache."""
        return k, v

    def gather(self, layer: LayerKV, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (any shape of slot indices), as ``dtype``; only those slots are read."""
        return layer[0][slots].to(dtype), layer[1][slots].to(dtype)

    # -- offload tiers: a block as bytes, K0 V0 K1 V1 ..., each [block_size, kv_heads, head_dim]
    def _slots(self, block: int) -> slice:
        return slice(block * self.block_size, (block + 1) * self.block_size)

    def read_block(self, block: int) -> bytes:
        s = self._slots(block)
        data = torch.cat([c[s].reshape(-1) for kv in self.layers for c in kv]).cpu()
        return data.view(torch.uint8).numpy().tobytes()

    def write_block(self, block: int, payload: bytes) -> None:
        assert len(payload) == self.layout.block_bytes
        s = self._slots(block)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.dtype)
        start = 0
        for k, v in self.layers:
            for c in (k, v):
                n = c[s].numel()
                c[s].copy_(data[start : start + n].view_as(c[s]))
                start += n

    def fingerprint(self, cfg: ModelConfig, weights_sample: bytes, model_dtype: torch.dtype,
                    quantization: str = "") -> bytes:
        """Identifies the model and the KV layout, so stored KV never meets another model or layout.
        ``weights_sample``: ``sample_weights`` of the checkpoint, taken before the model was built over it
        (a build may release the tensors); ``quantization`` names the quantized layers' formats (empty: all dense)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(json.dumps(asdict(cfg), sort_keys=True, default=str).encode())
        layout = self.layout
        tag = f"{model_dtype}|{self.block_size}|{layout.num_kv_heads}x{layout.head_dim}|{layout.layer_shapes}"
        if self.dtype != model_dtype:  # "auto" keeps the tag KV stored before pools existed was keyed by
            tag += f"|kv {self.dtype}{self.scales_tag}"
        if quantization:
            tag += f"|quant {quantization}"
        h.update(tag.encode())
        h.update(weights_sample)
        return h.digest()


def sample_weights(weights: dict[str, Any]) -> bytes:
    """A sample of a checkpoint's values, for ``KVPool.fingerprint``: weights may be ``QuantWeight``s
    (anything with ``rows()`` and ``dequantize()``) or ``QuantExperts``."""
    out = []
    names = sorted(weights)
    for name in names[:4]:  # the first tensors' leading values
        out.append(name.encode())
        w = weights[name]
        w = w.experts[0] if hasattr(w, "experts") else w  # a layer's experts kept quantized: the first one's
        if not isinstance(w, torch.Tensor):  # only the rows the sample reads: not the whole table
            w = w.rows(slice(0, -(-4096 // w.shape[1]))).dequantize()
        out.append(w.flatten()[:4096].float().cpu().numpy().tobytes())
    # and a few values spread over every other tensor: a fine-tune that leaves the embeddings and the first
    # layer alone (a LoRA merged into attention) must change it too, as stored KV must follow the weights
    for name in names[4:]:
        out.append(name.encode())
        out.append(_spread_sample(weights[name]).float().cpu().numpy().tobytes())
    return b"".join(out)


def _spread_sample(w: Any, n: int = 16) -> torch.Tensor:
    """``n`` values evenly spread over a tensor (a quantized one: over its first row, dequantized; experts
    kept quantized: over the first one's)."""
    w = w.experts[0] if hasattr(w, "experts") else w
    if not isinstance(w, torch.Tensor):
        w = w.rows(slice(0, 1)).dequantize()
    flat = w.reshape(-1)
    return flat[:: max(1, flat.numel() // n)][:n]


_POOLS: Registry[KVPool] = Registry("KV cache dtype", "kv_cache_dtype")
register_kv_pool = _POOLS.register  # (name, cls)
get_kv_pool = _POOLS.get  # (name) -> cls; InvalidArgumentError listing the names
kv_pool_names = _POOLS.names

register_kv_pool("auto", KVPool)


class BF16KVPool(KVPool):
    """K and V stored as bfloat16 whatever the model's dtype: half a float32 cache's bytes, so a
    float32 model's decode attention, bound by reading the cache, reads half as much. Chosen by
    ``auto`` where prefill already attends in bf16 (an AMX CPU: ``AttentionBackend.prefill_dtype``),
    so K and V are rounded where that attention rounds them anyway."""

    converts_on_read = True

    @classmethod
    def storage_dtype(cls, model_dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16

    def as_stored(self, layer: LayerKV, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k.to(torch.bfloat16).to(k.dtype), v.to(torch.bfloat16).to(v.dtype)

    def gather(self, layer: LayerKV, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return layer[0][slots].to(dtype), layer[1][slots].to(dtype)


register_kv_pool("bfloat16", BF16KVPool)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, bf16_prefill: bool) -> str:
    """``--kv-cache-dtype``'s pool name: ``auto`` is bfloat16 for a float32 model that prefills in bf16
    (its quantized linears on AMX), where K/V are rounded where that attention rounds them anyway."""
    return "bfloat16" if name == "auto" and bf16_prefill and model_dtype == torch.float32 else name
