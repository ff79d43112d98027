"""Block-quantized weights kept quantized in memory: ``QuantWeight`` and its formats.

Each format cuts each row of a weight [N, K] into blocks of 32 along K:

- ``q8_0``: int8 q and an fp16 scale d per block; w = d * q (GGUF's Q8_0, bit for bit).
- ``q4_1``: 4-bit q in 0..15 and fp16 scale d and min m per block; w = d * q + m (GGUF's Q4_1).
- ``q4_0``: 4-bit q and an fp16 scale d per block; w = d * (q - 8) (GGUF's Q4_0: 4.5 bits a weight
  against Q4_1's 5). ``as_q4_1`` gives the same values as q4_1 (m = -8d, exact in fp16).

In the 4-bit formats byte j of a block holds q[j] in its low nibble and q[j + 16] in its high one, as
in GGUF.

Arrays are split by kind (qs, d, m) rather than kept as GGUF's interleaved 18/20/34-byte blocks,
so that rows can be permuted, concatenated (q/k/v fusion) and gathered (embedding rows) with plain
tensor indexing; the kernels in ``kvserve/kernels/csrc/gemm/quant_gemm.cpp`` read this layout.

MXFP4 (gpt-oss's experts: 32 E2M1 codes and an E8M0 power of two per block) maps into q8_0 exactly
(``from_mxfp4``): twice each E2M1 value is an integer in [-12, 12] and half the block's power of two is
the fp16 scale, for the powers fp16 holds. ``QuantExperts`` is a layer's stacked expert tensor kept so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
FORMATS = ("q8_0", "q4_1", "q4_0")  # what ``quantize`` makes
FOUR_BIT = ("q4_1", "q4_0")


@dataclass
class QuantWeight:
    """A [N, K] weight in ``kind`` format: qs int8 [N, K] (q8_0) or uint8 [N, K/2] (q4_1, q4_0), d and
    m (q4_1 only) float16 [N, K/32]."""

    kind: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        k = self.qs.shape[1] * (2 if self.kind in FOUR_BIT else 1)
        return torch.Size((self.qs.shape[0], k))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def rows(self, index: torch.Tensor | slice) -> "QuantWeight":
        """The weight of the selected rows (a gather or a permutation: blocks never cross rows)."""
        return QuantWeight(self.kind, self.qs[index], self.d[index], None if self.m is None else self.m[index])

    def column_blocks(self, order: torch.Tensor) -> "QuantWeight":
        """The weight with its blocks of 32 columns in ``order`` (block ``order[j]`` becomes block j, in every row)."""
        n, blocks = self.d.shape
        qs = self.qs.reshape(n, blocks, -1)[:, order].reshape(self.qs.shape)
        return QuantWeight(self.kind, qs, self.d[:, order], None if self.m is None else self.m[:, order])

    def to(self, device: torch.device | str) -> "QuantWeight":
        return QuantWeight(self.kind, self.qs.to(device), self.d.to(device),
                           None if self.m is None else self.m.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        q = unpack_q4(self.qs) if self.kind in FOUR_BIT else self.qs
        q = q.view(n, k // BLOCK, BLOCK).float()
        w = (q - 8 if self.kind == "q4_0" else q) * self.d.float().unsqueeze(-1)
        if self.m is not None:
            w = w + self.m.float().unsqueeze(-1)
        return w.view(n, k).to(dtype)

    def scaled(self, factor: float) -> "QuantWeight":
        """The weight times ``factor``: each block's scale (and q4_1's minimum) scaled, in their fp16."""
        m = None if self.m is None else (self.m.float() * factor).half()
        return QuantWeight(self.kind, self.qs, (self.d.float() * factor).half(), m)

    def as_q4_1(self) -> "QuantWeight":
        """A q4_0 weight as q4_1, value for value: d (q - 8) = d q + (-8 d), and -8 d is exact in fp16."""
        assert self.kind == "q4_0"
        return QuantWeight("q4_1", self.qs, self.d, (self.d.float() * -8).half())

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight":
        """Rows of several weights of one kind and K stacked (fusing q/k/v or gate/up)."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot concatenate quantized weights of kinds {sorted(kinds)}")
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])  # type: ignore[misc]
        return QuantWeight(parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m)


@dataclass
class QuantExperts:
    """A layer's experts stored stacked (``StackedExperts``: [experts, in, out], or [experts, out, in] where not
    ``transposed``) kept quantized: each expert's linear weight [out, in] as a QuantWeight, gate's rows before
    up's (the order ``unstack_experts`` cuts dense ones into). ``shape`` is the stacked tensor's, which the
    checkpoint check reads."""

    experts: list[QuantWeight]
    transposed: bool = True

    @property
    def shape(self) -> torch.Size:
        out, k = self.experts[0].shape
        return torch.Size((len(self.experts), k, out) if self.transposed else (len(self.experts), out, k))

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.experts)


# twice the E2M1 codes' values: integers, the q of a q8_0 block whose scale is half the MXFP4 block's
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# E8M0 exponents e whose half scale 2^(e - 128) fp16 holds exactly (2^-24 subnormal .. 2^15): scales 2^-23 .. 2^16
E8M0_IN_FP16 = (104, 143)
CODES_PER_PASS = 1 << 21  # bounds the int64 indices a pass of ``from_mxfp4`` holds


def from_mxfp4(codes: torch.Tensor, exponents: torch.Tensor) -> QuantWeight:
    """MXFP4 as q8_0, value for value: ``codes`` uint8 [N, K] (E2M1 codes in element order), ``exponents``
    uint8 [N, K/32] (E8M0, biased by 127). A block whose power of two fp16 cannot hold as a half raises
    ValueError, unless its codes are all zero (then its scale is 0: the same zeros)."""
    n, k = codes.shape
    lut = torch.tensor(E2M1_DOUBLED, dtype=torch.int8)
    qs = torch.empty(n, k, dtype=torch.int8)
    flat_codes, flat_qs = codes.reshape(-1), qs.view(-1)
    for start in range(0, flat_codes.numel(), CODES_PER_PASS):
        flat_qs[start : start + CODES_PER_PASS] = lut[flat_codes[start : start + CODES_PER_PASS].long()]
    e = exponents.to(torch.int32)
    lo, hi = E8M0_IN_FP16
    outside = (e < lo) | (e > hi)
    if outside.any():
        zero = ~qs.view(n, k // BLOCK, BLOCK).any(-1)
        if (outside & ~zero).any():
            bad = e[outside & ~zero]
            raise ValueError(f"MXFP4 scales 2^{int(bad.min()) - 127}..2^{int(bad.max()) - 127} are outside what a "
                             "q8_0 block's fp16 scale holds exactly (2^-23..2^16)")
        e = torch.where(outside, lo, e)
    d = torch.ldexp(torch.ones(e.shape), (e - 128).float()).half()
    d[outside] = 0
    return QuantWeight("q8_0", qs, d.contiguous())


def unpack_q4(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K] in element order (low nibbles are a block's first 16)."""
    n = qs.shape[0]
    blocks = qs.view(n, -1, BLOCK // 2)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).view(n, -1)


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> uint8 [N, K/2] (the inverse of ``unpack_q4``)."""
    n = q.shape[0]
    blocks = q.view(n, -1, BLOCK)
    return (blocks[..., : BLOCK // 2] | (blocks[..., BLOCK // 2 :] << 4)).reshape(n, -1).contiguous()


def quantize(weight: torch.Tensor, kind: str) -> QuantWeight:
    """A dense [N, K] weight (K a multiple of 32) in ``kind`` format, round to nearest."""
    if kind not in FORMATS:
        raise ValueError(f"unknown quantized format {kind!r} (known: {', '.join(FORMATS)})")
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"cannot quantize a weight of {k} columns in blocks of {BLOCK}")
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if kind == "q8_0":
        d16 = (w.abs().amax(-1) / 127).half()  # quantize against the fp16 scale the kernels multiply by
        inv = torch.where(d16 > 0, 1 / d16.float(), torch.zeros_like(d16, dtype=torch.float32))
        q = (w * inv.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
        return QuantWeight(kind, q.reshape(n, k).contiguous(), d16.contiguous())
    if kind == "q4_0":  # llama.cpp's rule: d = the signed extreme / -8 (it becomes q = 0), q = floor(x/d + 8.5)
        extreme = w.gather(-1, w.abs().argmax(-1, keepdim=True)).squeeze(-1)
        d16 = (extreme / -8).half()
        inv = torch.where(d16 != 0, 1 / d16.float(), torch.zeros_like(d16, dtype=torch.float32))
        q = (w * inv.unsqueeze(-1) + 8.5).floor().clamp(0, 15).to(torch.uint8)
        return QuantWeight(kind, pack_q4(q.reshape(n, k)), d16.contiguous())
    lo, hi = w.amin(-1), w.amax(-1)
    d = (hi - lo) / 15
    # as above: against the fp16-rounded scale and min
    d16, m16 = d.half(), lo.half()
    inv = torch.where(d16 > 0, 1 / d16.float(), torch.zeros_like(d))
    q = ((w - m16.float().unsqueeze(-1)) * inv.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
    return QuantWeight(kind, pack_q4(q.reshape(n, k)), d16.contiguous(), m16.contiguous())


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantWeight:
    """A GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K / MXFP4 tensor's raw bytes (any shape) as a QuantWeight of ``shape``
    [N, K] (MXFP4 as q8_0: ``from_mxfp4``, whose ValueError it passes on)."""
    n, k = shape
    if type_name == "Q4_K":
        return _from_q4_k(raw, n, k)
    if type_name == "MXFP4":  # a block: the E8M0 byte, then 16 bytes whose low nibbles are codes 0-15, high 16-31
        b = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(n, k // BLOCK, 17).copy())
        codes = torch.cat([b[..., 1:] & 0x0F, b[..., 1:] >> 4], dim=-1).reshape(n, k)
        return from_mxfp4(codes, b[..., 0])
    nb = k // BLOCK
    block_bytes = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[type_name]
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(n, nb, block_bytes)
    d = b[..., 0:2].copy().view(np.float16).reshape(n, nb)
    if type_name == "Q8_0":
        qs = b[..., 2:].copy().view(np.int8).reshape(n, k)
        return QuantWeight("q8_0", torch.from_numpy(qs), torch.from_numpy(d))
    if type_name == "Q4_0":
        return QuantWeight("q4_0", torch.from_numpy(b[..., 2:].copy().reshape(n, k // 2)), torch.from_numpy(d))
    m = b[..., 2:4].copy().view(np.float16).reshape(n, nb)
    qs = b[..., 4:].copy().reshape(n, k // 2)
    return QuantWeight("q4_1", torch.from_numpy(qs), torch.from_numpy(d), torch.from_numpy(m))


Q4_K_BLOCK = 256  # a super-block: 8 sub-blocks of 32, each with a 6-bit scale and min


def _from_q4_k(raw: np.ndarray, n: int, k: int) -> QuantWeight:
    """GGUF Q4_K as q4_1: a super-block of 256 (fp16 d and dmin, twelve bytes packing 8 six-bit
    scales sc and mins mn, 128 bytes of nibbles) is 8 blocks of 32 with w = (d*sc) q - (dmin*mn),
    so each sub-block becomes a q4_1 block with scale d*sc and min -dmin*mn (rounded to fp16: a
    relative 2^-11 on the scale, far below the 4-bit step). The 4-bit values are kept as they are."""
    nsb = k // Q4_K_BLOCK
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(n, nsb, 144)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)  # [n, nsb, 1]
    dmin = b[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc_bytes = b[..., 4:16].astype(np.uint16)  # [n, nsb, 12]
    lo, hi = sc_bytes[..., 0:4], sc_bytes[..., 4:8]
    tail = sc_bytes[..., 8:12]
    # sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7: a nibble of
    # bytes 8-11 below the top two bits of bytes 0-3 (scales) and 4-7 (mins)
    scales = np.concatenate([lo & 63, (tail & 0xF) | ((lo >> 6) << 4)], axis=-1).astype(np.float32)
    mins = np.concatenate([hi & 63, (tail >> 4) | ((hi >> 6) << 4)], axis=-1).astype(np.float32)
    block_d = (d * scales).astype(np.float16).reshape(n, nsb * 8)
    block_m = (-(dmin * mins)).astype(np.float16).reshape(n, nsb * 8)
    qs = b[..., 16:].reshape(n, nsb, 4, 32)  # 4 chunks of 32 bytes: sub-block 2j low nibbles, 2j+1 high
    values = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k)  # element order
    q = pack_q4(torch.from_numpy(np.ascontiguousarray(values)))
    return QuantWeight("q4_1", q, torch.from_numpy(block_d), torch.from_numpy(block_m))
