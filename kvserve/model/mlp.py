"""The MLPs: a gated MLP (gate and up in one GEMM, an activation, down; gpt-oss's clamped SwiGLU where set) and
a mixture of experts (a router's top-k of gated MLPs, grouped by expert within a step, and an optional shared
expert)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import ops
from kvserve.model.config import NATIVE_ACTIVATIONS
from kvserve.model.layers import RMSNorm, runs_amx
from kvserve.model.moe_native import native_moe_block
from kvserve.model.quant_linear import AMX_MIN_ROWS, QuantLinear

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "relu": F.relu,
               "relu2": lambda x: F.relu(x).square()}
# the activations with a fused act(gate) * up kernel (the native decode stack runs the same kernels)
_KERNELS = {"silu": ops.silu_mul, "gelu_tanh": ops.gelu_tanh_mul}
NATIVE_GATED = {act: _KERNELS[kernel] for act, kernel in NATIVE_ACTIVATIONS.items()}


class XIELU(nn.Module):
    """xIELU (Apertus): a layer's own activation, x > 0: alpha_p x^2 + beta x; else (expm1(min(x, eps)) - x) alpha_n +
    beta x, with alpha_p = softplus(its parameter) and alpha_n = beta + softplus(its own)."""

    def __init__(self):
        super().__init__()
        self.alpha_p, self.alpha_n = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
        self.beta, self.eps = nn.Parameter(torch.tensor(0.5)), nn.Parameter(torch.tensor(-1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p, alpha_n = F.softplus(self.alpha_p), self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n + self.beta * x)


def activation(name: str):
    """The activation ``name`` (a function; xIELU: a module with its layer's parameters)."""
    if name == "xielu":
        return XIELU()
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)}, xielu)")
    return ACTIVATIONS[name]


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float | None) -> torch.Tensor:
    """gpt-oss's SwiGLU: g = min(gate, limit), (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g)."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def normal_quantile(share: float) -> torch.Tensor:
    """The standard normal's ``share`` quantile (float32, as ``torch.distributions.Normal(0, 1).icdf`` computes it), for
    ``gaussian_topk``; on the CPU whatever the default device (the model is built on the meta device)."""
    return torch.erfinv(2 * torch.tensor(share, dtype=torch.float32, device="cpu") - 1) * math.sqrt(2)


def gaussian_topk(gate: torch.Tensor, quantile: torch.Tensor) -> torch.Tensor:
    """relu(gate - cutoff), the cutoff each row's mean plus its (population) std times ``quantile``, the standard
    normal's quantile of the sparsity (``normal_quantile``): about that share of a row's values become 0, were they
    normally distributed (Gemma 3n)."""
    mean, std = gate.mean(-1, keepdim=True), gate.std(-1, keepdim=True, unbiased=False)
    return torch.relu(gate - (mean + std * quantile.to(gate.dtype)))


class GatedMLP(nn.Module):
    """gate and up projections fused into one GEMM, then act(gate) * up, then down (``swiglu``: (alpha,
    limit) of ``clamped_swiglu`` instead; not ``gated``: up alone, act(up), then down)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False,
                 swiglu: tuple[float, float | None] | None = None, gated: bool = True,
                 sub_norm_eps: float | None = None, sparsity: float = 0.0, clip: float | None = None):
        super().__init__()
        self.clip = clip  # act(gate) clamped above and up both ways at this, before their product (Ling 3's); None: not
        self.sparsity = sparsity  # the gate's share cut to 0 before the activation (gaussian_topk); 0: none
        self.sparsity_quantile = normal_quantile(sparsity) if sparsity else None  # (once, not every step)
        # ``sub_norm_eps``: an RMSNorm over act(gate) * up before down (BitNet's ffn_sub_norm)
        self.sub_norm = None if sub_norm_eps is None else RMSNorm(intermediate, sub_norm_eps)
        self.gated = gated  # False: gate_up is up alone, and the MLP down(act(up(x))) (Starcoder2)
        self.gate_up = nn.Linear(hidden, (2 if gated else 1) * intermediate, bias=bias)
        self.down = nn.Linear(intermediate, hidden, bias=bias)
        self.intermediate = intermediate
        self.act_name, self.act = act, activation(act)
        self.swiglu = swiglu
        self.native = False  # the fused act(gate) * up kernel (kvserve.kernels); set by the model, NATIVE_GATED's only
        self.gated_mul: Callable[[torch.Tensor], torch.Tensor] | None = NATIVE_GATED.get(act)

    def use_native(self, on: bool) -> None:
        self.native = on and self.gated_mul is not None and self.swiglu is None and self.gated and self.clip is None

    def runs_amx(self, x: torch.Tensor) -> bool:
        """Whether ``x`` runs both GEMMs on their AMX copies with the activation between them in bf16 (a
        weight kept dense, e.g. one whose inputs are not a whole number of quantized blocks: never)."""
        return self.native and self.sub_norm is None and not self.sparsity and runs_amx(self.gate_up, x) and \
            getattr(self.down, "amx", None) is not None

    def forward(self, x: torch.Tensor, extra_gate_up: torch.Tensor | None = None) -> torch.Tensor:
        """``extra_gate_up``: added to the gate/up projection (a shared block's adapter:
        ``kvserve.model.shared_block``)."""
        if extra_gate_up is None and self.runs_amx(x):
            # an AMX step (QuantLinear.amx): the intermediate stays bf16 from gate_up's GEMM through
            # the activation into down's, instead of two round trips through float32
            act = self.gated_mul(self.gate_up(x, out_dtype=torch.bfloat16))
            return self.down(act, out_dtype=x.dtype)
        gu = self.gate_up(x)
        if extra_gate_up is not None:
            gu = gu + extra_gate_up
        if self.sparsity:
            inter = self.intermediate
            gu = torch.cat((gaussian_topk(gu[..., :inter], self.sparsity_quantile), gu[..., inter:]), -1)
        if not self.gated:
            return self.down(self.act(gu))
        if self.native:
            return self.down(self._sub_norm(self.gated_mul(gu)))
        if self.swiglu is not None:
            return self.down(clamped_swiglu(gu[..., : self.intermediate], gu[..., self.intermediate :], *self.swiglu))
        if self.clip is not None:
            gate = self.act(gu[..., : self.intermediate]).clamp(max=self.clip)
            return self.down(gate * gu[..., self.intermediate :].clamp(-self.clip, self.clip))
        return self.down(self._sub_norm(self.act(gu[..., : self.intermediate]) * gu[..., self.intermediate :]))

    def _sub_norm(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.sub_norm is None else self.sub_norm(x)


def sparsemixer(logits: torch.Tensor, jitter: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3.5-MoE's router at inference: the best expert, weighted by the softmax over the logits within 2 x jitter of
    it (relatively: (best - logit) / max(|logit|, best)); then the best of the rest, weighted alike over the rest.
    (weights, experts), each [rows, 2]."""
    weights, chosen, rest = [], [], logits
    for _ in range(2):
        best, pick = rest.max(dim=-1, keepdim=True)
        far = (best - logits) / logits.abs().clamp(min=best) > 2 * jitter
        weights.append(torch.softmax(rest.masked_fill(far, float("-inf")), dim=-1).gather(-1, pick))
        chosen.append(pick)
        rest = rest.scatter(-1, pick, float("-inf"))
    return torch.cat(weights, -1), torch.cat(chosen, -1)


class MoE(nn.Module):
    """Each token's top ``top_k`` experts of ``experts``, weighted by the router's softmax (or each expert's sigmoid:
    ``scoring``), renormalised over the chosen ones with ``norm_topk`` (the same as gpt-oss's softmax over the chosen
    logits), times ``routed_scale``; chosen by those scores plus ``selection_bias`` where there is one, from the best
    of the expert ``groups`` where they restrict the choice (not ``gated``: experts of up and down alone, Nemotron-H's); a
    step runs
    each expert once over all the tokens routed to it. With the native kernels over packed experts
    (``use_native``), one call of a ``kvserve.MoEBlock`` does it all (``moe_native``); else a loop of experts."""

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, norm_topk: bool, act: str,
                 shared_intermediate: int = 0, router_bias: bool = False, expert_bias: bool = False,
                 swiglu: tuple[float, float | None] | None = None, shared_gated: bool = True,
                 selection_bias: bool = False, scoring: str = "softmax", routed_scale: float = 1.0,
                 groups: tuple[int, int, str] | None = None, jitter: float = 0.01, gated: bool = True,
                 scale_inputs: bool = False, out_norm_eps: float | None = None, bias_on_logits: bool = False,
                 identity_experts: int = 0, logit_softcap: float | None = None, out_bias: bool = False,
                 clip: float | None = None, shared_clip: float | None = None,
                 expert_norm_eps: float | None = None):
        super().__init__()
        # each expert's output RMS-normed by its own weight (a row each), the shared expert's by its own norm (Ergo)
        self.expert_norm_eps = expert_norm_eps
        self.expert_norms = None if expert_norm_eps is None else nn.Parameter(torch.ones(experts, hidden))
        self.out_bias = nn.Parameter(torch.zeros(hidden)) if out_bias else None  # added to the sum (JetMoE's)
        self.logit_softcap = logit_softcap  # the router's logits capped before scoring (Laguna's)
        # router choices past the experts that return their input times their weight (LongCat-Flash's zero experts)
        self.identity_experts = identity_experts
        # an RMSNorm on the block's output, shared expert included (ModelConfig.moe_out_norm)
        self.out_norm = None if out_norm_eps is None else RMSNorm(hidden, out_norm_eps)
        self.bias_on_logits = bias_on_logits  # the selection bias added to the logits (ModelConfig.selection_on_logits)
        self.scoring, self.routed_scale, self.jitter = scoring, routed_scale, jitter
        self.scale_inputs = scale_inputs  # Llama 4: an expert's input times its weight, not its output
        self.groups = groups  # (groups, groups used, "max" or "top2"): ModelConfig.expert_group_choice
        self.router = nn.Linear(hidden, experts + identity_experts, bias=router_bias)
        self.selection_bias = nn.Parameter(torch.zeros(1, experts + identity_experts)) if selection_bias else None
        self.experts = nn.ModuleList(GatedMLP(hidden, intermediate, act, expert_bias, swiglu, gated, clip=clip)
                                     for _ in range(experts))
        self.top_k, self.norm_topk = top_k, norm_topk
        self.shared = GatedMLP(hidden, shared_intermediate, act, gated=gated, clip=shared_clip) \
            if shared_intermediate else None
        self.shared_gate = nn.Linear(hidden, 1, bias=False) if shared_intermediate and shared_gated else None
        self.shared_norm = RMSNorm(hidden, expert_norm_eps) if shared_intermediate and expert_norm_eps else None
        self.native_block: Any | None = None  # a kvserve.MoEBlock over these weights (use_native)
        # the router's and shared gate's dense weights, kept for the native block where the linears get packed
        self.gates: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None

    def keep_gates(self) -> None:
        """Keep the router's (weight, bias) and the shared gate's weight [hidden] as tensors (``gates``): before
        ``pack_linears`` swaps their linears for oneDNN-packed ones, which do not give them back."""
        gate = None if self.shared_gate is None else self.shared_gate.weight.detach().reshape(-1).contiguous()
        bias = self.router.bias
        self.gates = (self.router.weight.detach().contiguous(), None if bias is None else bias.detach().contiguous(), gate)

    def use_native(self, on: bool) -> None:
        for m in self.modules():
            if isinstance(m, GatedMLP):
                m.use_native(on)
        self.native_block = native_moe_block(self) if on else None

    def loop_takes(self, rows: int) -> bool:
        """Whether a step of ``rows`` runs the loop of experts even with the native block: on an AMX CPU, where
        the experts average AMX_MIN_ROWS rows or more (a prefill), their bf16 copies on AMX beat the block's
        integer kernels, as a dense linear's do (kvserve.model.quant_linear)."""
        return getattr(self.experts[0].gate_up, "amx", None) is not None and \
            rows * self.top_k >= AMX_MIN_ROWS * len(self.experts)

    def forward(self, x: torch.Tensor, route: torch.Tensor | None = None) -> torch.Tensor:
        """``route``: what the router reads where it is not ``x`` (Gemma 4's experts: the stream normed otherwise)."""
        if route is None and self.native_block is not None and x.dtype == torch.float32 and x.dim() == 2 and \
                not self.loop_takes(x.shape[0]):
            out = self._native_forward(x)
        else:
            out = self.loop_forward(x, route)
        if self.out_bias is not None:
            out = out + self.out_bias
        return out if self.out_norm is None else self.out_norm(out)

    def _native_forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared
        # a LoRA adapter may wrap the shared expert's linears: then it runs here, after the routed ones
        in_block = shared is None or (type(shared.gate_up) is type(shared.down) is QuantLinear)
        out = self.native_block.forward(x.contiguous(), in_block)
        if not in_block and shared is not None:
            out += self._shared_forward(x)
        return out

    def _shared_forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.shared is not None
        y = self.shared(x)
        if self.shared_norm is not None:
            y = self.shared_norm(y)
        return y if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * y

    def _expert_normed(self, e: int, y: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s output, RMS-normed by its row of ``expert_norms`` where the experts have them."""
        if self.expert_norms is None:
            return y
        yf = y.float()
        normed = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + self.expert_norm_eps)
        return (normed * self.expert_norms[e].float()).to(y.dtype)

    def _in_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` with the experts outside each row's best groups at -inf (as DeepSeek's reference code masks)."""
        assert self.groups is not None
        groups, used, scoring = self.groups
        per_group = choice.view(choice.shape[0], groups, -1)
        score = per_group.amax(-1) if scoring == "max" else per_group.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, score.topk(used, dim=-1).indices, True)
        fill = 0.0 if scoring == "top2_zero" else float("-inf")  # (A.X-K2's: 0, below which a biased score may fall)
        return per_group.masked_fill(~keep[..., None], fill).view_as(choice)

    def loop_forward(self, x: torch.Tensor, route: torch.Tensor | None = None) -> torch.Tensor:
        """The Python loop: route, then each expert over its rows, added back in ascending expert id."""
        logits = self.router(x if route is None else route).float()
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        if self.scoring == "sparsemixer":
            weights, chosen = sparsemixer(logits, self.jitter)
        else:
            probs = torch.sigmoid(logits) if self.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
            choice = probs if self.selection_bias is None else \
                (logits if self.bias_on_logits else probs) + self.selection_bias.float()
            if self.scoring == "sigmoid" and self.selection_bias is None and self.groups is None:
                choice = logits  # the same order, without float32's sigmoid tying logits past ~15 (Llama 4's)
            if self.groups is not None:
                choice = self._in_best_groups(choice)
            chosen = choice.topk(self.top_k, dim=-1).indices
            weights = probs.gather(-1, chosen)
            if self.norm_topk:
                weights = weights / weights.sum(-1, keepdim=True)
            if self.routed_scale != 1:
                weights = weights * self.routed_scale
        weights = weights.to(x.dtype)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        # tokens grouped by expert: one GEMM per expert the step routed to, none for the others
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts) + self.identity_experts).tolist()
        tokens, slot_weights = order // self.top_k, weights.flatten()[order]
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = tokens[start : start + n]
                w = slot_weights[start : start + n, None]
                if e >= len(self.experts):  # an identity expert
                    out.index_add_(0, rows, x[rows] * w)
                else:
                    out.index_add_(0, rows, self.experts[e](x[rows] * w) if self.scale_inputs else
                                   self._expert_normed(e, self.experts[e](x[rows])) * w)
                start += n
        if self.shared is not None:
            out += self._shared_forward(x)
        return out
