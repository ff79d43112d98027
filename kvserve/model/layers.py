"""Building blocks every decoder shares: RMSNorm (the residual add fused in), LayerNorm (Starcoder2), oneDNN-packed
linears and their row padding, an embedding table kept narrower than the model (NarrowEmbedding). Rotary embeddings are in ``rotary``, the MLPs in ``mlp``, attention in ``attention``."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, affine: bool = True):
        super().__init__()
        # not ``affine`` (NanoChat's norms have no weight): a buffer of ones no checkpoint fills, so that every kernel
        # taking a weight runs it unchanged (``unit_weights`` sets it once the model leaves the meta device)
        self.affine = affine
        if affine:
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_buffer("weight", torch.ones(dim), persistent=False)
        self.eps = eps
        self.native = False  # True: the fused kernels of kvserve.kernels (CPU, set by the model)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, out_rows: int = 0) -> torch.Tensor:
        """``out_dtype``: bf16 where a bf16 GEMM reads the output next (the cast fused into the norm).
        ``out_rows`` (more than x's): that many rows, zeros past x's: the GEMM's padded input
        (``padded_rows``), written here instead of copied there."""
        return ops.rms_norm(x, self.weight, self.eps, out_dtype, out_rows, native=self.native)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor | None,
                    out_dtype: torch.dtype | None = None, out_rows: int = 0) -> torch.Tensor:
        """residual += delta (in place; delta may be bf16 on a float32 residual), then the norm of the
        sum: one kernel, one pass for the add, where native. No delta: the norm alone."""
        if delta is None:
            return self.forward(residual, out_dtype, out_rows)
        return ops.add_rms_norm(residual, delta, self.weight, self.eps, out_dtype, out_rows, native=self.native)


class GatedRMSNorm(RMSNorm):
    """An RMSNorm whose output y is gated by sigmoid(gate_out(silu(gate_in(y)))), a low-rank MLP of its own (A.X-K2's
    ``ModelConfig.norm_gate_rank``); float32 out, whatever ``out_dtype``'s hand-off asked (its layers take none)."""

    def __init__(self, dim: int, eps: float, rank: int):
        super().__init__(dim, eps)
        self.gate_in, self.gate_out = nn.Linear(dim, rank, bias=False), nn.Linear(rank, dim, bias=False)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, out_rows: int = 0) -> torch.Tensor:
        return self._gated(super().forward(x))

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor | None,
                    out_dtype: torch.dtype | None = None, out_rows: int = 0) -> torch.Tensor:
        if delta is None:  # (RMSNorm's would call this forward: gated twice)
            return self.forward(residual)
        return self._gated(super().add_forward(residual, delta))

    def _gated(self, y: torch.Tensor) -> torch.Tensor:
        return y * torch.sigmoid(self.gate_out(torch.nn.functional.silu(self.gate_in(y))).float()).to(y.dtype)


class _TorchNorm(nn.Module):
    """RMSNorm's interface (``add_forward``, the output dtype and rows) around a torch-only norm's ``normed``."""

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, out_rows: int = 0) -> torch.Tensor:
        y = self.normed(x)
        y = y if out_dtype is None else y.to(out_dtype)
        return y if out_rows <= y.shape[0] else torch.cat([y, y.new_zeros(out_rows - y.shape[0], y.shape[1])])

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor | None,
                    out_dtype: torch.dtype | None = None, out_rows: int = 0) -> torch.Tensor:
        if delta is not None:
            residual.add_(delta)
        return self.forward(residual, out_dtype, out_rows)


class LayerNorm(_TorchNorm):
    """LayerNorm (with a bias, or none); torch only."""

    def __init__(self, dim: int, eps: float, bias: bool = True, affine: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None  # not affine: OLMo 1's, in float32
        self.bias = nn.Parameter(torch.zeros(dim)) if bias and affine else None
        self.eps = eps

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), None, None, self.eps).to(x.dtype)
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class L2Norm(_TorchNorm):
    """x over its L2 norm, without a weight: x * rsqrt(sum(x^2) + eps) (nGPT's unit sphere: Dory's)."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + self.eps)).to(x.dtype)


class NoNorm(_TorchNorm):
    """The identity with a norm's interface: the final norm of a decoder that has none (GPT-1)."""

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        return x


class HeadLayerNorm(nn.Module):
    """LayerNorm over each head's dims of x [tokens, heads, head_dim], in float32, with a weight (and a bias) for
    each head ([heads, head_dim]) or one they share ([head_dim]); torch only."""

    def __init__(self, heads: int, dim: int, eps: float, per_head: bool, bias: bool):
        super().__init__()
        shape = (heads, dim) if per_head else (dim,)
        self.weight = nn.Parameter(torch.ones(shape))
        self.bias = nn.Parameter(torch.zeros(shape)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), None, None, self.eps) * self.weight.float()
        return (y if self.bias is None else y + self.bias.float()).to(x.dtype)


def make_norm(kind: str, dim: int, eps: float, bias: bool = True, affine: bool = True) -> RMSNorm | LayerNorm | L2Norm:
    """A decoder's norm of ``kind`` (``ModelConfig.norm_type``): "rms" or "layer" (``bias``: with a bias; not
    ``affine``: with neither weight nor bias)."""
    if kind not in ("rms", "layer", "l2"):
        raise ValueError(f"norm type {kind!r} is not supported (rms, layer, l2)")
    if kind == "l2":
        return L2Norm(eps)
    return RMSNorm(dim, eps, affine) if kind == "rms" else LayerNorm(dim, eps, bias, affine)


def unit_weights(model: nn.Module) -> None:
    """The weights of RMSNorms without one set to ones (after ``to_empty``, which leaves their buffers unset)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm) and not m.affine:
                m.weight.fill_(1.0)


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


class NarrowEmbedding(nn.Module):
    """An embedding table kept in the checkpoint's narrower float dtype (bf16 or fp16 under a float32
    model whose LM head is its own layer): a lookup widens only the rows it gathers, the same values."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight).to(self.dtype)
