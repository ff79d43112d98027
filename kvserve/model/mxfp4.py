"""MXFP4 (OCP microscaling FP4), as gpt-oss's checkpoints store their experts: kept as q8_0, or dequantized.

A tensor ``<name>`` is stored as ``<name>_blocks`` (uint8 [..., rows, groups, 16]: 32 FP4 E2M1 values per
group, two to a byte, the low nibble first) and ``<name>_scales`` (uint8 [..., rows, groups]: a power of
two per group, biased by 127). gpt-oss stores each expert's matrix as a linear's weight ([out, in]) while its
bf16 checkpoints store the transpose ([in, out]): ``dequantize_mxfp4`` returns the latter, the layout the
stacked experts are read in (``StackedExperts``). ``mxfp4_experts_q8_0`` keeps them quantized instead, each
expert as the q8_0 weight of its linear (``quant.from_mxfp4``: the same values, 8.5 bits a weight).
"""

from __future__ import annotations

import torch

from kvserve.model.quant import QuantExperts, from_mxfp4

# E2M1: the 16 codes' values
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
ROWS_PER_PASS = 1 << 16  # bounds the int64 code indices a pass holds


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [E, rows, G, 16] and scales [E, rows, G] -> [E, G * 32, rows] in ``dtype``."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    *lead, groups, width = blocks.shape
    flat_blocks = blocks.reshape(-1, width).to(torch.uint8)
    exponents = scales.reshape(-1, 1).to(torch.int32) - 127
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    out = torch.empty(flat_blocks.shape[0], 2 * width, dtype=dtype)
    for start in range(0, flat_blocks.shape[0], ROWS_PER_PASS):
        part = flat_blocks[start : start + ROWS_PER_PASS]
        values = torch.empty(part.shape[0], 2 * width, dtype=torch.float32)
        values[:, 0::2], values[:, 1::2] = lut[(part & 0x0F).long()], lut[(part >> 4).long()]
        out[start : start + ROWS_PER_PASS] = torch.ldexp(values, exponents[start : start + ROWS_PER_PASS])
    return out.reshape(*lead, groups * 2 * width).transpose(-1, -2).contiguous()


def mxfp4_experts_q8_0(blocks: torch.Tensor, scales: torch.Tensor, interleaved: bool = False) -> QuantExperts:
    """blocks [E, rows, G, 16] and scales [E, rows, G] -> each expert's q8_0 weight [rows, G * 32], the values
    ``dequantize_mxfp4`` gives (transposed); ``interleaved``: rows alternate gate and up (``StackedExperts``),
    reordered gate's first. Raises ValueError where a scale does not fit q8_0 (``from_mxfp4``)."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    experts, rows, groups, width = blocks.shape
    if interleaved:  # on the packed bytes: 4.25 bits a weight to move, not 8.5
        order = torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)])
        blocks, scales = blocks[:, order], scales[:, order]
    packed = blocks.reshape(experts * rows, groups, width).to(torch.uint8)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(experts * rows, groups * 2 * width)
    qw = from_mxfp4(codes, scales.reshape(experts * rows, groups).to(torch.uint8))
    return QuantExperts([qw.rows(slice(e * rows, (e + 1) * rows)) for e in range(experts)])
