"""Rotary position embeddings: the frequencies of each scaling checkpoints use (linear, llama3, yarn,
longrope, dynamic NTK), partial rotary, and one step's tables.

The frequencies follow transformers' definitions (its rope utilities are the reference in tests);
the tables are built once, cos and sin per absolute position, and multiplied by the scaling's
attention factor (yarn, longrope) as transformers does.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvserve.errors import ModelLoadError
from kvserve.kernels import ops
from kvserve.kernels.ops import apply_rotary  # the torch rotation (the native rotary_'s fallback too)
from kvserve.model.config import yarn_mscale

ROPE_TYPES = ("linear", "llama3", "yarn", "longrope", "su", "dynamic", "proportional", "freq_factors")


def rope_inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_positions: int = 0) -> tuple[torch.Tensor, float, torch.Tensor | None, int]:
    """Inverse frequencies for ``dim`` rotating dims, the factor cos/sin are multiplied by, and for
    longrope the long-context frequencies and the position from which they apply (else None, 0)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    base = theta**exponents
    inv_freq = 1.0 / base
    if not scaling:
        return inv_freq, 1.0, None, 0
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor") or 1.0)
    original = int(scaling.get("original_max_position_embeddings") or max_positions or 8192)
    if kind == "linear":
        return inv_freq / factor, 1.0, None, 0
    if kind == "proportional":  # (Gemma 4's global layers) only the first share of the pairs turn, at their usual rate
        turning = int(float(scaling.get("partial_rotary_factor", 1.0)) * dim // 2)
        inv_freq[turning:] = 0.0
        return inv_freq / factor, 1.0, None, 0
    if kind == "llama3":
        return _llama3(inv_freq, factor, scaling), 1.0, None, 0
    if kind == "freq_factors":  # (a GGUF file's rope_freqs: Llama 3's scaling as llama.cpp stores it) a divisor a pair
        factors = torch.tensor(scaling["freq_factors"], dtype=torch.float32, device="cpu")
        if factors.numel() != inv_freq.numel():
            raise ModelLoadError(f"rope_freqs has {factors.numel()} factors for {inv_freq.numel()} rotary pairs")
        return inv_freq / factors, 1.0, None, 0
    if kind == "yarn":
        if scaling.get("factor") is None and max_positions:
            factor = max_positions / original
        return _yarn(dim, theta, factor, original, scaling)
    if kind == "dynamic" and scaling.get("alpha"):  # Hunyuan's fixed NTK alpha: a larger base, whatever the length
        return 1.0 / (theta * float(scaling["alpha"]) ** (dim / (dim - 2))) ** exponents, 1.0, None, 0
    if kind == "dynamic":
        # transformers' dynamic NTK is plain RoPE up to max_position_embeddings (whatever the scaling's
        # original_max_position_embeddings says) and re-bases every position by the sequence's length beyond it;
        # positions there get the base of the longest context (factor x it) instead, as vLLM's, so that a cached key's
        # rotation never changes
        long_theta = theta * (factor * factor - (factor - 1)) ** (dim / (dim - 2))
        long = 1.0 / long_theta ** exponents
        return inv_freq, 1.0, long, max_positions or original
    if kind in ("longrope", "su"):  # "su": Phi-3's first name for it
        if scaling.get("factor") is None and max_positions:
            factor = max_positions / original
        # Phi-3.5-MoE's short_mscale (and long_mscale past the original context: ``Rotary``) in place of the factor
        attention = scaling.get("attention_factor", scaling.get("short_mscale"))
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32, device="cpu") * base)
        long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32, device="cpu") * base)
        return short, float(attention), long, original
    raise ModelLoadError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")


def _llama3(inv_freq: torch.Tensor, factor: float, scaling: dict[str, Any]) -> torch.Tensor:
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


def _yarn(dim: int, theta: float, factor: float, original: int,
          scaling: dict[str, Any]) -> tuple[torch.Tensor, float, None, int]:
    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    freqs = theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    # dims that rotate fast keep their frequency (extrapolate), slow ones are divided by factor (interpolate)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * freqs)) * (1 - extrapolate) + (1.0 / freqs) * extrapolate
    return inv_freq, float(attention), None, 0


class Rotary:
    """Precomputed cos/sin tables, indexed by absolute position (rotate-half convention), over the
    first ``dim`` dims of each head (all of them but with partial rotary).

    Plain tensors, not module buffers, so that building the model on the meta device and
    materialising it with ``to_empty`` leaves them intact.
    """

    def __init__(self, dim: int, max_positions: int, theta: float, scaling: dict | None, head_dim: int | None = None):
        inv_freq, attention, long, switch = rope_inv_freq(dim, theta, scaling, max_positions)
        t = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)
        if long is not None:  # longrope, dynamic: positions past the original context rotate at the long frequencies
            freqs[switch:] = torch.outer(t[switch:], long)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos() * attention, emb.sin() * attention
        if long is not None and scaling and scaling.get("long_mscale") is not None and attention:
            # longrope's own factor past the original context (Phi-3.5-MoE's long_mscale), per position
            self.cos[switch:] *= scaling["long_mscale"] / attention
            self.sin[switch:] *= scaling["long_mscale"] / attention
        self.dim = dim
        self.partial = head_dim is not None and dim < head_dim

    def to(self, device: torch.device) -> "Rotary":
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, dim] for the given positions (computed once per step)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype, native: bool) -> "RotaryStep":
        if native and not self.partial:  # the kernel indexes the float32 tables itself
            return RotaryStep(positions, self.cos, self.sin, native=True)
        cos, sin = self.tables(positions, dtype)
        return RotaryStep(positions, cos, sin, native=False, dim=self.dim if self.partial else None)


class RotaryStep:
    """One step's rotary embedding: the tables gathered at its positions (or, native, the whole
    tables and the positions, rotated in place by one kernel for q and k together)."""

    def __init__(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, native: bool,
                 dim: int | None = None):
        self.positions, self.cos, self.sin, self.native, self.dim = positions, cos, sin, native, dim

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]."""
        if self.native:
            ops.rotary_(q, k, self.positions, self.cos, self.sin)
            return q, k
        return self._turn(q, self.cos, self.sin), self._turn(k, self.cos, self.sin)

    def apply_q(self, q: torch.Tensor) -> torch.Tensor:
        """q alone (a layer that attends over keys another layer rotated)."""
        cos, sin = self.cos, self.sin
        if self.native:  # the whole tables: gathered at the step's positions
            at = self.positions[: q.shape[0]]
            cos, sin = cos[at].unsqueeze(1).to(q.dtype), sin[at].unsqueeze(1).to(q.dtype)
        return self._turn(q, cos, sin)

    def _turn(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x rotated by the gathered tables (partial rotary: the rest of each head passes through)."""
        if self.dim is None:
            return apply_rotary(x, cos, sin)
        return torch.cat([apply_rotary(x[..., : self.dim], cos, sin), x[..., self.dim:]], -1)
