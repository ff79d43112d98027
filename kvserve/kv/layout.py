"""KVLayout: the one definition of how many bytes the KV cache takes, per token and per block.

No torch: the simulator sizes its virtual KV cache with it, and the torch KV pool sizes and
allocates its tensors with it. A block holds, for every layer, K and V of ``block_size``
tokens; that is also the payload an offload tier stores per block.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bytes per stored element, by dtype name (torch's spelling: ``getattr(torch, name)``).
ELEMENT_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

# The 8-bit KV cache dtypes (``--kv-cache-dtype``, vLLM's names) and what each stores.
EIGHT_BIT_KV_DTYPES: dict[str, str] = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "int8": "int8",
}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per block
    dtype: str  # what K and V are stored as, a key of ELEMENT_BYTES
    # (K/V heads, head dim) of each layer where layers differ (Gemma 4's global layers); None: num_kv_heads, head_dim
    layer_shapes: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.layer_shapes is not None and len(self.layer_shapes) != self.num_layers:
            raise ValueError(f"{len(self.layer_shapes)} layer shapes for {self.num_layers} layers")
        if self.dtype not in ELEMENT_BYTES:
            raise ValueError(f"unknown KV storage dtype {self.dtype!r}: one of {', '.join(ELEMENT_BYTES)}")

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.dtype]

    def shape(self, layer: int) -> tuple[int, int]:
        """(K/V heads, head dim) of ``layer``."""
        return (self.num_kv_heads, self.head_dim) if self.layer_shapes is None else self.layer_shapes[layer]

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        if self.layer_shapes is not None:
            return 2 * sum(h * d for h, d in self.layer_shapes) * self.element_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size
