"""Scales for an 8-bit KV cache, computed at start-up from one forward pass of the model itself.

The model runs once over a fixed sequence of seeded random token ids, with a temporary
full-precision KV pool, and the largest magnitude each layer's K and V take per KV head (and
channel) becomes the 8-bit pool's scales (``QuantizedKVPool.set_scales``, with headroom).
The sequence is the same on every run and every replica, so the scales are too: a request's
output never depends on which requests came first, and replicas share tier blocks as they are.
K is measured after rotary embedding by the norm of each rotated channel pair (the largest value
either channel reaches at any position), since the sample's few positions see few rotations.
"""

from __future__ import annotations

import logging

import torch

from kvserve.attention import KVPool, LayerKV, SeqRows
from kvserve.attention.general import LayerAttention
from kvserve.attention.sdpa import GatherSdpaBackend, SdpaMetadata
from kvserve.runner.inputs import build_inputs

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 256
CALIBRATION_SEED = 0


class _Recorder(GatherSdpaBackend):
    """gather-sdpa that also keeps the largest |K| and |V| of each layer it is called for, in order."""

    def __init__(self, pool: KVPool, model_dtype: torch.dtype):
        super().__init__(pool, model_dtype)
        self.k_amax: list[torch.Tensor] = []
        self.v_amax: list[torch.Tensor] = []

    def attend_layer(self, q, k, v, layer_kv: LayerKV, meta: SdpaMetadata, spec: LayerAttention,  # type: ignore[override]
                     rows: torch.Tensor | None = None) -> torch.Tensor:
        # every layer's attention comes here, windowed or capped ones too (they never reach forward)
        half = k.shape[-1] // 2  # rotate-half pairs: channel i with i + d/2
        pair = torch.sqrt(k[..., :half].float() ** 2 + k[..., half:].float() ** 2).amax(0)
        self.k_amax.append(torch.cat([pair, pair], dim=-1))
        self.v_amax.append(v.float().abs().amax(0))
        return super().attend_layer(q, k, v, layer_kv, meta, spec, rows)


@torch.inference_mode()
def calibrate_kv_scales(model, pool: KVPool, model_dtype: torch.dtype, num_tokens: int = CALIBRATION_TOKENS) -> None:
    """Set ``pool``'s scales from one forward of ``model`` (a ``CausalLM``); no-op for a pool
    that stores the model's dtype."""
    if not pool.quantized:
        return
    cfg = model.config
    n = min(num_tokens, cfg.max_position_embeddings)
    g = torch.Generator().manual_seed(CALIBRATION_SEED)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
    blocks = -(-n // pool.block_size)
    scratch = KVPool(KVPool.layout_for(cfg, model_dtype, pool.block_size), blocks, pool.device)
    recorder = _Recorder(scratch, model_dtype)
    inputs = build_inputs([SeqRows(ids, 0, list(range(blocks)))], recorder)
    model(inputs.input_ids, inputs.positions, recorder, inputs.meta, scratch.layers)
    pool.set_scales(torch.stack(recorder.k_amax), torch.stack(recorder.v_amax))
    log.info("KV cache scales: calibrated on %d tokens (K %.3g..%.3g, V %.3g..%.3g)", n,
             pool.k_scales.min(), pool.k_scales.max(), pool.v_scales.min(), pool.v_scales.max())
