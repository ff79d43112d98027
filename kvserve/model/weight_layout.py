"""How a checkpoint's tensors become what ``kvserve.model.weights.weight_sources`` names, at load: rows reordered
(interleaved rotary pairs, GPT-NeoX's heads, gated attention's gates, Qwen3-Next's grouped delta-net projections),
Conv1D weights transposed, an architecture's own scales folded in (``standard_layout``); stacked experts cut into each
expert's linears and back (``unstack_experts``, ``stack_experts``); GGUF's split tensors joined. Torch-free at import:
each works through the tensors' own methods.
"""

from __future__ import annotations

from typing import Any

from kvserve.model.architectures import get_architecture
from kvserve.model.config import ModelConfig
from kvserve.model.weights import UNSTACKED, linear_sources


def deinterleave_rotary(cfg: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` with q's and k's rows (and biases) of every head reordered, where ``cfg.rope_interleaved``, so that
    the dims rotating together as pairs (2i, 2i+1) sit at i and i + rotary_dim / 2, as rotate-half rotates them.
    Scores are unchanged (q and k reordered alike; v and o untouched); as given otherwise."""
    if not cfg.rope_interleaved or cfg.kv_lora_rank:  # latent attention reorders its rotary dims as it runs
        return weights
    import torch

    arch = get_architecture(cfg.architecture)
    d, rd = int(cfg.head_dim or 0), cfg.rotary_dim
    per_head = [*range(0, rd, 2), *range(1, rd, 2), *range(rd, d)]
    out = dict(weights)
    q_rows, kv_rows = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    # q/k/v stacked in one tensor (CodeGen's, once in q, k, v order): q's heads, then k's, reordered; v's rows kept
    roles = [("qkv_proj", [h * d + j for h in range(cfg.num_attention_heads + cfg.num_key_value_heads)
                           for j in per_head] + list(range(q_rows + kv_rows, q_rows + 2 * kv_rows)))] \
        if arch.weight_name("qkv_proj") is not None else \
        [(role, [h * d + j for h in range(heads) for j in per_head])
         for role, heads in (("q_proj", cfg.num_attention_heads), ("k_proj", cfg.num_key_value_heads))]
    for i in range(cfg.num_hidden_layers):
        for role, rows in roles:
            order = torch.tensor(rows)
            for suffix in ("weight", "bias"):
                name = f"model.layers.{i}.{arch.weight_name(role)}.{suffix}"
                if name in out:  # a GGUF file's weight kept quantized (``QuantWeight``) takes its rows so
                    out[name] = out[name].rows(order) if hasattr(out[name], "rows") else out[name][order]
        # q/k norms weigh each head's dims: theirs reordered as the rows they norm (one [head_dim] per head or shared)
        for role, heads in (("q_norm", cfg.num_attention_heads), ("k_norm", cfg.num_key_value_heads)):
            if (norm := arch.weight_name(role)) is None:
                continue
            for h in range(heads) if "{h}" in str(norm) else [None]:
                for suffix in ("weight", "bias"):
                    name = f"model.layers.{i}.{str(norm).format(h=h) if h is not None else norm}.{suffix}"
                    w = out.get(name)
                    if w is not None and w.numel() % d == 0 and w.shape[-1] in (d, w.numel()):
                        out[name] = w.reshape(-1, d)[:, per_head].reshape(w.shape)
    return out


def gates_after_q(cfg: ModelConfig, weights: dict[str, Any], q_proj: str, heads: int | None = None) -> None:
    """Gated attention's q_proj (each head's q, then its gate) as every head's q, then every gate, in ``weights``
    (``heads``: the layer's query heads; None: num_attention_heads)."""
    heads = heads or cfg.num_attention_heads
    for suffix in ("weight", "bias"):
        if (name := f"{q_proj}.{suffix}") in weights:
            w = weights[name]
            if hasattr(w, "rows"):  # a kept quantized weight: the same order of rows
                import torch

                order = torch.arange(w.shape[0]).view(heads, 2, -1).transpose(0, 1).reshape(-1)
                weights[name] = w.rows(order)
            else:
                weights[name] = w.reshape(heads, 2, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def untile_value_heads(cfg: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """The delta nets' value heads in the checkpoints' order, from llama.cpp's: where there are more value heads than
    key heads its converter tiles them (value head j of every key head, for j = 0, 1, ...) instead of grouping them by
    key head; the rows of v, z, b, a, A, dt's bias and the convolution's v channels, and out_proj's columns (kept
    quantized weights permute their rows, and out_proj's blocks where a head is whole blocks; else it is dequantized)."""
    import torch

    kh, vh = cfg.delta_key_heads, cfg.delta_value_heads
    if not kh or kh == vh:
        return weights
    arch, out = get_architecture(cfg.architecture), dict(weights)
    per, keys, vdim = vh // kh, 2 * cfg.delta_key_heads * cfg.delta_key_dim, cfg.delta_value_dim

    def grouped(head: int, first: int = 0) -> torch.Tensor:
        """Where each grouped row (or column) is in the tiled order, after ``first`` rows left in place."""
        tiled = torch.arange(vh * head).view(per, kh, head).transpose(0, 1).reshape(-1)
        return torch.cat([torch.arange(first), first + tiled])

    def rows(x: Any, order: torch.Tensor) -> Any:
        return x.rows(order) if hasattr(x, "rows") else x[order]

    for i in range(cfg.num_hidden_layers):
        if not cfg.is_delta(i):
            continue
        p = f"model.layers.{i}."
        name = lambda role, suffix=".weight": f"{p}{arch.weight_name(role)}{suffix}"  # noqa: E731
        for role, head, first in (("delta_qkv", vdim, keys), ("delta_conv", vdim, keys), ("delta_z", vdim, 0),
                                  ("delta_b", 1, 0), ("delta_a", 1, 0)):
            out[name(role)] = rows(out[name(role)], grouped(head, first))
        for role in ("delta_A_log", "delta_dt_bias"):
            out[name(role, "")] = out[name(role, "")][grouped(1)]
        o = out[name("delta_out_proj")]
        if hasattr(o, "column_blocks") and vdim % 32 == 0:  # a kept quantized weight: its heads are whole blocks
            out[name("delta_out_proj")] = o.column_blocks(grouped(vdim // 32))
        else:
            out[name("delta_out_proj")] = (o.dequantize() if hasattr(o, "dequantize") else o)[:, grouped(vdim)]
    return out


def standard_layout(cfg: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's linears as the other architectures store them: GPT-2's Conv1D weights ([in, out]:
    ``Architecture.transposed_linears``) transposed, GPT-NeoX's fused q/k/v rows (head by head, q, k and v of each:
    ``Architecture.qkv_per_head``; Falcon's a KV head's group at a time: ``ungroup_qkv``) reordered to q's, then k's,
    then v's (biases too); gated attention's q_proj (each head's q then its gate) as every head's q, then every gate;
    Qwen3-Next's grouped delta-net projections
    (``ungroup_delta``); first what the architecture's own ``adjust_weights`` does (Falcon-H1's multipliers folded
    in); as given otherwise."""
    arch = get_architecture(cfg.architecture)
    if arch.adjust_weights is not None:
        weights = arch.adjust_weights(cfg, dict(weights))
    if not (arch.transposed_linears or arch.qkv_per_head or cfg.attn_output_gate or arch.weight_name("delta_qkvz")):
        return weights
    out = dict(weights)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        # q_proj: each head's q, then its gate: q's first (a gate of its own projection is stacked behind q as it is)
        if cfg.attn_output_gate and not cfg.is_recurrent(i) and not arch.weight_name("attn_gate_proj"):
            gates_after_q(cfg, out, f"{p}{arch.weight_name('q_proj')}", cfg.attention_heads(i))
        if cfg.is_delta(i) and arch.weight_name("delta_qkvz"):
            out.update(ungroup_delta(cfg, out, p + str(arch.weight_name("delta_qkvz")) + ".weight",
                                     p + str(arch.weight_name("delta_ba")) + ".weight"))
    if arch.transposed_linears:
        for names in linear_sources(cfg).values():
            for name in names:
                if name in out and out[name].dim() == 2:
                    out[name] = out[name].t()
    if arch.qkv_per_head:
        for i in range(cfg.num_hidden_layers):
            for suffix in ("weight", "bias"):
                name = f"model.layers.{i}.{arch.weight_name('qkv_proj')}.{suffix}"
                if name in out:
                    out[name] = ungroup_qkv(cfg, out[name])
    return out


def ungroup_qkv(cfg: ModelConfig, w: Any) -> Any:
    """A fused q/k/v tensor stored a KV head's group at a time (its queries, then its key, then its value: GPT-NeoX's
    head by head where every head has its K/V, Falcon's groups otherwise) as every q row, then k's, then v's."""
    kv, d = cfg.num_key_value_heads, int(cfg.head_dim or 0)
    share = cfg.num_attention_heads // kv
    groups = w.reshape(kv, share + 2, d, *w.shape[1:])
    return stack_rows([part.reshape(-1, *w.shape[1:]) for part in groups.split([share, 1, 1], dim=1)])


def ungroup_delta(cfg: ModelConfig, weights: dict[str, Any], qkvz: str, ba: str) -> dict[str, Any]:
    """Qwen3-Next's stacked projections of a gated delta net, whose rows come a key head's group at a time (its q, k,
    v and z; its b and a), as q, k, v, z and b, a each whole (the order ``GatedDeltaNet.in_proj`` splits)."""
    groups, share = cfg.delta_key_heads, cfg.delta_value_heads // cfg.delta_key_heads
    kd, vd = cfg.delta_key_dim, share * cfg.delta_value_dim
    out = {}
    if qkvz in weights:
        w = weights[qkvz].reshape(groups, 2 * kd + 2 * vd, -1)
        out[qkvz] = stack_rows([part.reshape(-1, w.shape[-1]) for part in w.split([kd, kd, vd, vd], dim=1)])
    if ba in weights:
        w = weights[ba].reshape(groups, 2 * share, -1)
        out[ba] = stack_rows([part.reshape(-1, w.shape[-1]) for part in w.split([share, share], dim=1)])
    return out


def join_delta_gguf(cfg: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's delta-net projections from a GGUF file: llama.cpp's converter splits the grouped q/k/v/z into q, k,
    v whole (``attn_qkv``, read as ``delta_qkv``) and z (``attn_gate``: ``delta_z``), which stack again as the decoder's
    ``delta_qkvz``; b and a stay grouped by key head (``ssm_ba``), and come apart as ``ungroup_delta`` does."""
    arch, out = get_architecture(cfg.architecture), dict(weights)
    groups, share = cfg.delta_key_heads, cfg.delta_value_heads // cfg.delta_key_heads
    # where each row of b's then a's whole comes from in the grouped rows (each group: its b's, then its a's)
    order = [g * 2 * share + j for g in range(groups) for j in range(share)]
    order += [g * 2 * share + share + j for g in range(groups) for j in range(share)]
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_delta(i):
            continue
        name = lambda role: f"model.layers.{i}.{arch.weight_name(role)}.weight"  # noqa: E731
        qkv, z = out.pop(name("delta_qkv")), out.pop(name("delta_z"))
        out[name("delta_qkvz")] = type(qkv).cat([qkv, z]) if hasattr(qkv, "cat") else stack_rows([qkv, z])
        ba = out[name("delta_ba")]
        out[name("delta_ba")] = ba.rows(order) if hasattr(ba, "rows") else ba[order]
    return out


def stack_rows(parts: list[Any]) -> Any:
    """The tensors' rows one after another (their own methods: this module imports no torch)."""
    out = parts[0].new_empty(sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    first = 0
    for part in parts:
        out[first : first + part.shape[0]] = part
        first += part.shape[0]
    return out


def unstack_experts(cfg: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` with each layer's stacked expert tensors (``StackedExperts``) cut into every expert's
    linear weights and biases (views: transposed, gate's and up's rows apart; a ``QuantExperts``' own
    QuantWeights), under the names ``weight_sources`` gives them; as given for an architecture that stores
    experts one by one."""
    stacked = get_architecture(cfg.architecture).stacked_experts
    if stacked is None:
        return weights
    out = dict(weights)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if not cfg.is_moe(i) or f"{p}{stacked.gate_up}" not in out:
            continue
        gate_up, down = out.pop(f"{p}{stacked.gate_up}"), out.pop(f"{p}{stacked.down}")
        gate_up_bias, down_bias = out.pop(f"{p}{stacked.gate_up}_bias", None), out.pop(f"{p}{stacked.down}_bias", None)
        up = up_bias = None
        if stacked.up:  # up's apart (DBRX): each expert's gate rows, then its up rows
            up, up_bias = out.pop(f"{p}{stacked.up}"), out.pop(f"{p}{stacked.up}_bias", None)
        n = cfg.num_experts
        for e in range(n):
            name = p + UNSTACKED.format(e=e)
            gu_bias = None if gate_up_bias is None else gate_up_bias[e]
            if hasattr(gate_up, "experts"):  # kept quantized (``QuantExperts``): each expert's, gate's rows first
                gu = gate_up.experts[e]
            else:
                gu = stacked.orient(stacked.expert(gate_up, e, n))
                if up is not None:
                    gu = cat_rows([gu, stacked.orient(stacked.expert(up, e, n))])
                if stacked.interleaved:  # gate's rows first, then up's, as the fused GEMM stacks them
                    gu = gu.reshape(-1, 2, gu.shape[1]).transpose(0, 1).reshape(gu.shape)
            if up_bias is not None and gu_bias is not None:
                gu_bias = cat_rows([gu_bias, up_bias[e]])
            if stacked.interleaved and gu_bias is not None:
                gu_bias = gu_bias.reshape(-1, 2).t().reshape(-1)
            out[f"{name}gate_up.weight"] = gu
            out[f"{name}down.weight"] = down.experts[e] if hasattr(down, "experts") else \
                stacked.orient(stacked.expert(down, e, n), down=True)
            if gu_bias is not None and down_bias is not None:
                out[f"{name}gate_up.bias"], out[f"{name}down.bias"] = gu_bias, down_bias[e]
    return out


def stack_experts(cfg: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``unstack_experts``, for a loader that reads each expert's gate, up and down apart (a GGUF
    file): they and their biases, under the architecture's per-expert names ("expert" + "expert_gate", ...),
    as the stacked tensors ``StackedExperts`` names, in its layout (dense), or as ``QuantExperts`` where
    gate, up and down are all quantized (the rest dequantized); as given for an architecture without them."""
    arch = get_architecture(cfg.architecture)
    stacked = arch.stacked_experts
    if stacked is None:
        return weights
    import torch

    from kvserve.model.quant import QuantExperts, QuantWeight

    out, roles = dict(weights), ("expert_gate", "expert_up", "expert_down")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."

        def name(e: int, role: str, suffix: str) -> str:
            return f"{p}{str(arch.weight_name('expert')).format(e=e)}{arch.weight_name(role)}.{suffix}"

        if not cfg.is_moe(i) or name(0, "expert_gate", "weight") not in out:
            continue
        parts = {(role, suffix): [out.pop(name(e, role, suffix)) for e in range(cfg.num_experts)]
                 for role in roles for suffix in ("weight", "bias") if name(0, role, suffix) in out}
        gate, up, down = (parts[(role, "weight")] for role in roles)
        if stacked.up or stacked.flat or stacked.down_transposed is not None:  # DBRX's: gate's, up's and down's apart
            if ("expert_gate", "bias") in parts:
                raise ValueError(f"{cfg.architecture}: expert biases in this stacked layout are not supported")
            join = torch.cat if stacked.flat else torch.stack
            dense = lambda ws: [w.dequantize() if isinstance(w, QuantWeight) else w for w in ws]  # noqa: E731
            if stacked.up:
                out[p + stacked.gate_up] = join([stacked.orient(g) for g in dense(gate)])
                out[p + stacked.up] = join([stacked.orient(u) for u in dense(up)])
            else:
                out[p + stacked.gate_up] = join([stacked.orient(_pair(g, u, stacked.interleaved))
                                                 for g, u in zip(dense(gate), dense(up))])
            out[p + stacked.down] = join([stacked.orient(d, down=True) for d in dense(down)])
            continue
        if all(isinstance(w, QuantWeight) for w in gate + up + down):
            out[p + stacked.gate_up] = QuantExperts([QuantWeight.cat([g, u]) for g, u in zip(gate, up)], stacked.transposed)
            out[p + stacked.down] = QuantExperts(down, stacked.transposed)
        else:
            gate, up, down = ([w.dequantize() if isinstance(w, QuantWeight) else w for w in ws] for ws in (gate, up, down))
            out[p + stacked.gate_up] = torch.stack([stacked.orient(_pair(g, u, stacked.interleaved)) for g, u in zip(gate, up)])
            out[p + stacked.down] = torch.stack([stacked.orient(d) for d in down])
        if ("expert_gate", "bias") in parts:
            biases = zip(parts[("expert_gate", "bias")], parts[("expert_up", "bias")])
            out[f"{p}{stacked.gate_up}_bias"] = torch.stack([_pair(g, u, stacked.interleaved) for g, u in biases])
            out[f"{p}{stacked.down}_bias"] = torch.stack(parts[("expert_down", "bias")])
    return out


def stack_shared_gate_up(cfg: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """The shared expert's gate and up weights, read apart (a GGUF file), as the one tensor (gate's rows, then up's)
    where the architecture's checkpoints stack them (``shared_gate_up_proj``); as given otherwise."""
    arch = get_architecture(cfg.architecture)
    fused = arch.weight_name("shared_gate_up_proj")
    if fused is None or not cfg.shared_expert_intermediate_size:
        return weights
    out = dict(weights)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.{arch.weight_name('shared_expert')}"
        gate, up = (f"{p}{arch.weight_name(role)}.weight" for role in ("shared_gate_proj", "shared_up_proj"))
        if gate in out and up in out:
            out[f"{p}{fused}.weight"] = cat_rows([out.pop(gate), out.pop(up)])
    return out


def cat_rows(parts: list[Any]) -> Any:
    """Weights' rows one after another: one QuantWeight where every part is quantized (a GGUF file's, kept), else
    dense."""
    from kvserve.model.quant import QuantWeight

    if all(isinstance(w, QuantWeight) for w in parts):
        return QuantWeight.cat(parts)
    return stack_rows([w.dequantize() if isinstance(w, QuantWeight) else w for w in parts])


def stack_dense_gate_up(cfg: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """A layer's MLP gate and up read apart (a GGUF file's ffn_gate, and its ffn_up under the stacked tensor's name),
    as the one tensor (gate's rows, then up's) where the architecture's checkpoints stack them (Granite 4.0 H's dense
    ``shared_mlp.input_linear``); as given otherwise (Phi-3's ffn_up holds both already)."""
    arch = get_architecture(cfg.architecture)
    fused = arch.weight_name("gate_up_proj")
    if fused is None:
        return weights
    out = dict(weights)
    for i in range(cfg.num_hidden_layers):
        gate, both = f"model.layers.{i}.{arch.weight_name('gate_proj')}.weight", f"model.layers.{i}.{fused}.weight"
        if gate in out and both in out:
            out[both] = cat_rows([out.pop(gate), out[both]])
    return out


def join_latent_kv(cfg: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """kv_b_proj [heads * (nope + v), kv_lora_rank] from the two tensors llama.cpp's converter splits it into (for its
    absorbed attention): k_b [heads, kv_lora_rank, nope] (each head's k part transposed) and v_b [heads, v,
    kv_lora_rank], dense; as given where there are none."""
    if not cfg.kv_lora_rank:
        return weights
    import torch

    arch = get_architecture(cfg.architecture)
    out = dict(weights)
    for i in range(cfg.num_hidden_layers):
        k_name, v_name = (f"model.layers.{i}.{arch.weight_name(role)}.weight" for role in ("k_b_proj", "v_b_proj"))
        if k_name not in out or v_name not in out:
            continue
        k_b, v_b = (w.dequantize() if hasattr(w, "dequantize") else w for w in (out.pop(k_name), out.pop(v_name)))
        kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
        out[f"model.layers.{i}.{arch.weight_name('kv_b_proj')}.weight"] = kv_b.reshape(-1, cfg.kv_lora_rank)
    return out


def _pair(gate: Any, up: Any, interleaved: bool) -> Any:
    """An expert's gate and up rows (or biases) as the stacked tensor holds them: alternating or gate's first."""
    import torch

    return torch.stack([gate, up], dim=1).reshape(-1, *gate.shape[1:]) if interleaved else torch.cat([gate, up])
