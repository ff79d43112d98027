"""Building blocks of a Llama-family decoder: RMSNorm, rotary embeddings, the SwiGLU MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.errors import ModelLoadError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.native = False  # True: the fused kernels of kvserve.kernels (CPU, set by the model)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, out_rows: int = 0) -> torch.Tensor:
        """``out_dtype``: bf16 where a bf16 GEMM reads the output next (the cast fused into the norm).
        ``out_rows`` (more than x's): that many rows, zeros past x's: the GEMM's padded input
        (``padded_rows``), written here instead of copied there."""
        if self.native:
            return torch.ops.kvserve.rms_norm(x, self.weight, self.eps, out_dtype, out_rows)
        # Normalise in float32 and cast back before the scale, exactly as the reference does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * h.to(x.dtype)
        y = y if out_dtype is None else y.to(out_dtype)
        return y if out_rows <= y.shape[0] else torch.cat([y, y.new_zeros(out_rows - y.shape[0], y.shape[1])])

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor | None,
                    out_dtype: torch.dtype | None = None, out_rows: int = 0) -> torch.Tensor:
        """residual += delta (in place; delta may be bf16 on a float32 residual), then the norm of the
        sum: one kernel, one pass for the add, where native. No delta: the norm alone."""
        if delta is None:
            return self.forward(residual, out_dtype, out_rows)
        if self.native:
            return torch.ops.kvserve.add_rms_norm(residual, delta, self.weight, self.eps, out_dtype, out_rows)
        residual.add_(delta)
        return self.forward(residual, out_dtype, out_rows)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of RoPE, with Llama-3 or linear scaling when configured."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between blended
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, scaled)
    raise ModelLoadError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear)")


class Rotary:
    """Precomputed cos/sin tables, indexed by absolute position (rotate-half convention).

    Plain tensors, not module buffers, so that building the model on the meta device and
    materialising it with ``to_empty`` leaves them intact.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def to(self, device: torch.device) -> "Rotary":
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] for the given positions (computed once per step)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype, native: bool) -> "RotaryStep":
        if native:  # the kernel indexes the float32 tables itself
            return RotaryStep(positions, self.cos, self.sin, native=True)
        cos, sin = self.tables(positions, dtype)
        return RotaryStep(positions, cos, sin, native=False)


class RotaryStep:
    """One step's rotary embedding: the tables gathered at its positions (or, native, the whole
    tables and the positions, rotated in place by one kernel for q and k together)."""

    def __init__(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, native: bool):
        self.positions, self.cos, self.sin, self.native = positions, cos, sin, native

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]."""
        if self.native:
            torch.ops.kvserve.rotary_(q, k, self.positions, self.cos, self.sin)
            return q, k
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    """gate and up projections fused into one GEMM, then silu(gate) * up, then down."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        self.intermediate = intermediate
        self.native = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and runs_amx(self.gate_up, x):
            # an AMX step (QuantLinear.amx): the intermediate stays bf16 from gate_up's GEMM through
            # the activation into down's, instead of two round trips through float32
            act = torch.ops.kvserve.silu_mul(self.gate_up(x, out_dtype=torch.bfloat16))
            return self.down(act, out_dtype=x.dtype)
        gu = self.gate_up(x)
        if self.native:
            return self.down(torch.ops.kvserve.silu_mul(gu))
        return self.down(F.silu(gu[..., : self.intermediate]) * gu[..., self.intermediate :])


class PackedLinear(nn.Module):
    """A CPU linear layer whose weight is pre-packed in oneDNN's blocked layout.

    On the AVX2 machines we measured, torch's default fp32 GEMM (MKL) reaches about half of
    what oneDNN does with a packed weight at decode batch sizes (1-64 rows), so the runner
    swaps every nn.Linear for this after loading. Same maths; only the GEMM kernel differs.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``dtype``: what the GEMM reads x as (the weight's dtype); the cast and the padding rows
        are one copy."""
        m = x.shape[0]
        rows = padded_rows(m) if x.dim() == 2 else m
        if rows != m:
            padded = x.new_empty(rows, x.shape[1], dtype=dtype or x.dtype)
            padded[:m].copy_(x)
            padded[m:].zero_()
            x = padded
        elif dtype is not None:
            x = x.to(dtype)
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out[:m] if rows != m else out


def runs_amx(linear: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``linear`` (a ``QuantLinear`` with a bf16 AMX copy; any other layer: never) takes
    ``x`` through oneDNN's bf16 GEMM."""
    check = getattr(linear, "runs_amx", None)
    return bool(check(x)) if check is not None else False


def padded_rows(m: int) -> int:
    """The row count a PackedLinear hands oneDNN for ``m`` rows: exact up to 16, above that rounded
    up to one of 8 sizes per octave (at most 12.5% more rows).

    oneDNN compiles and caches a kernel for every input shape it sees (~0.5-1 MiB each, up to 1,024
    kept). The rows of a step (its tokens) vary from step to step, so without this the engine's
    memory grew for as long as new counts kept appearing (a soak saw ~1 MiB per new count), and a
    full cache recompiled kernels (milliseconds each). Now each weight shape has at most ~8 kernels
    per octave of batch sizes.
    """
    if m <= 16:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def cpu_packing_supported(dtype: torch.dtype) -> bool:
    return torch.backends.mkldnn.is_available() and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def pack_linears(module: nn.Module) -> None:
    """Replace every nn.Linear below ``module`` by a PackedLinear (CPU only)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
        else:
            pack_linears(child)
