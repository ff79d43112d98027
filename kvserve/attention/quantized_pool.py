"""8-bit KV pools (``--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2 | int8``): half the bytes of bf16 KV,
a quarter of fp32, so the same memory holds two to four times the tokens.

A stored value times its scale is the value. Scales are one per layer, K or V, and KV head for
fp8 (a float format keeps its relative precision at any magnitude), and one per channel of each
head for int8 (the embedded model's channels differ up to 5x in range within a head: per-channel
scales cut its log-prob error by 30%); they are bfloat16 values, set once, before the pool holds any
token (``set_scales``: computed at start-up by ``kvserve.runner.kv_calibration``, or given), and
never change, so every block of the pool is read with the scales it was written with. Writes
quantize (scaled, saturated to the format's range, rounded to nearest); reads dequantize only
the slots they gather. The paged kernel reads the 8-bit values directly instead, folding the K
scales into the query and the V scales into the output. A chunk that starts a sequence attends
over its fresh K/V as stored (``as_stored``), so a token's output does not depend on whether its
context came fresh, from the prefix cache, or in smaller chunks.

A block's tier payload carries the scales after the values, so the host, disk and Redis tiers
keep them with it: a payload written under other scales (another replica's, given ones) is
requantized to this pool's on load, never misread. The fingerprint names the storage format,
so an 8-bit block never meets a pool of another dtype.
"""

from __future__ import annotations

import torch

from kvserve.attention.kv_pool import KVPool, LayerKV, register_kv_pool
from kvserve.errors import InvalidArgumentError
from kvserve.kv.layout import EIGHT_BIT_KV_DTYPES, KVLayout
from kvserve.model.config import ModelConfig

# Calibration sees a sample; real inputs reach past its largest value (up to ~1.9x on the embedded
# model's text against random tokens), so the scales leave this headroom before values saturate.
HEADROOM = 2.0


class QuantizedKVPool(KVPool):
    quantized = True
    converts_on_read = True
    storage: torch.dtype  # what K and V are stored as
    qmax: float  # the largest magnitude the storage dtype holds (scaled values saturate there)
    integer: bool  # rounded to integers (int8), else converted (fp8 rounds to nearest itself)
    per_channel: bool  # a scale per head channel, else per head

    def __init__(self, layout, num_blocks: int, device: torch.device):
        if layout.layer_shapes is not None:
            raise ValueError("an 8-bit KV cache keeps one shape of scales for every layer; this model's layers cache "
                             "K/V of different shapes: use --kv-cache-dtype auto")
        L, H, d = layout.num_layers, layout.num_kv_heads, layout.head_dim
        self.granularity = d if self.per_channel else 1  # scales per head: 1, or one per channel
        # the kernel reads [kv_heads, d] per layer; per-head scales are repeated over d
        self.k_scales = torch.ones(L, H, d, dtype=torch.float32, device=device)
        self.v_scales = torch.ones(L, H, d, dtype=torch.float32, device=device)
        super().__init__(layout, num_blocks, device)

    def _allocate(self) -> list[LayerKV]:
        """Each layer's K and V with its scales (kept across ``release``: the scales belong to the weights)."""
        return [LayerKV(k, v, self.k_scales[i], self.v_scales[i]) for i, (k, v) in enumerate(super()._allocate())]

    @classmethod
    def storage_dtype(cls, model_dtype: torch.dtype) -> torch.dtype:
        return cls.storage

    @classmethod
    def layout_for(cls, cfg: ModelConfig, model_dtype: torch.dtype, block_size: int) -> KVLayout:
        if cfg.conv_layers is not None and any(cfg.conv_layers):  # their inputs share the pool with K and V
            raise InvalidArgumentError(f"--kv-cache-dtype {cls.storage}: {cfg.architecture}'s short convolutions "
                                       "keep their inputs in the KV pool, which an 8-bit cache cannot hold "
                                       "exactly; use auto")
        return super().layout_for(cfg, model_dtype, block_size)

    @property
    def scales_tag(self) -> str:
        return f"|scales per {'channel' if self.granularity > 1 else 'head'}"

    # -- scales ---------------------------------------------------------------------------
    def set_scales(self, k_amax: torch.Tensor, v_amax: torch.Tensor, headroom: float = HEADROOM) -> None:
        """Scales from the largest magnitudes K and V are expected to take, float [layers, kv_heads, d]
        (or [layers, kv_heads]): that magnitude times ``headroom`` maps to the format's largest value."""
        for amax, scales in ((k_amax, self.k_scales), (v_amax, self.v_scales)):
            amax = amax.float().to(self.device)
            if amax.dim() == 2:
                amax = amax.unsqueeze(-1)
            if self.granularity == 1:
                amax = amax.amax(-1, keepdim=True)
            # bfloat16 values (a payload stores them in 2 bytes), rounded up: the largest value still fits
            scale = (amax * headroom / self.qmax).clamp_min(1e-8)
            rounded = scale.to(torch.bfloat16).float()
            rounded = torch.where(rounded < scale, (scale * (1 + 2 ** -7)).to(torch.bfloat16).float(), rounded)
            scales.copy_(rounded.expand_as(scales))

    def _stored_scales(self) -> torch.Tensor:
        """The scales as a tier payload carries them: bfloat16 [2, layers, kv_heads, granularity]."""
        return torch.stack([self.k_scales, self.v_scales])[..., : self.granularity].to(torch.bfloat16)

    # -- writes and reads -----------------------------------------------------------------
    def quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x [..., kv_heads, d] in any float dtype -> the storage dtype, under ``scale`` [kv_heads, d].
        (Times 1 / scale, as the native decode stack computes it, so both write the same bytes.)"""
        y = (x.float() * torch.reciprocal(scale)).clamp_(-self.qmax, self.qmax)
        if self.integer:
            y.round_()
        return y.to(self.storage)

    @staticmethod
    def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (q.float() * scale).to(dtype)

    # torch's CPU index ops do not take fp8 tensors: they move the bytes, as uint8
    def store(self, layer: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        layer[0].view(torch.uint8).index_copy_(0, slots, self.quantize(k, layer.k_scale).view(torch.uint8))
        layer[1].view(torch.uint8).index_copy_(0, slots, self.quantize(v, layer.v_scale).view(torch.uint8))

    def as_stored(self, layer: LayerKV, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.dequantize(self.quantize(k, layer.k_scale), layer.k_scale, k.dtype),
                self.dequantize(self.quantize(v, layer.v_scale), layer.v_scale, v.dtype))

    def gather(self, layer: LayerKV, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = (c.view(torch.uint8)[slots].view(self.storage) for c in layer)
        return self.dequantize(k, layer.k_scale, dtype), self.dequantize(v, layer.v_scale, dtype)

    # -- offload tiers: the values, then the scales they were written with -----------------
    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes + self._stored_scales().numel() * 2

    def read_block(self, block: int) -> bytes:
        return super().read_block(block) + self._stored_scales().cpu().view(torch.uint8).numpy().tobytes()

    def write_block(self, block: int, payload: bytes) -> None:
        assert len(payload) == self.block_bytes
        n = self.layout.block_bytes
        values, stored = payload[:n], torch.frombuffer(bytearray(payload[n:]), dtype=torch.bfloat16)
        stored = stored.view(2, *self.k_scales.shape[:2], self.granularity).to(self.device)
        if torch.equal(stored, self._stored_scales()):
            super().write_block(block, values)
            return
        # written under other scales: back to values under those, then quantized under ours
        data = torch.frombuffer(bytearray(values), dtype=torch.uint8).view(self.dtype).to(self.device)
        data = data.view(len(self.layers), 2, self.block_size, self.layout.num_kv_heads, self.layout.head_dim)
        s = self._slots(block)
        for i, layer in enumerate(self.layers):
            for j, own in enumerate((layer.k_scale, layer.v_scale)):
                values_ij = self.dequantize(data[i, j], stored[j, i].float(), torch.float32)
                layer[j][s].copy_(self.quantize(values_ij, own))


class Fp8E4M3KVPool(QuantizedKVPool):  # more precision (3 mantissa bits); with scales, range enough
    storage, qmax, integer, per_channel = torch.float8_e4m3fn, 448.0, False, False


class Fp8E5M2KVPool(QuantizedKVPool):  # more range (5 exponent bits), 2 mantissa bits
    storage, qmax, integer, per_channel = torch.float8_e5m2, 57344.0, False, False


class Int8KVPool(QuantizedKVPool):
    storage, qmax, integer, per_channel = torch.int8, 127.0, True, True


for _cls in (Fp8E4M3KVPool, Fp8E5M2KVPool, Int8KVPool):
    for _name, _stored in EIGHT_BIT_KV_DTYPES.items():  # fp8 is fp8_e4m3, as in vLLM
        if getattr(torch, _stored) == _cls.storage:
            register_kv_pool(_name, _cls)
