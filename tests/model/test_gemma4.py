"""Gemma 4's parts beyond the shared-case tests (tests/model/test_architectures.py): a KV pool whose layers differ in
shape, layers that take no pool layer of their own, the per-layer inputs' table kept as stored."""

import pytest
import torch

from kvserve.attention.kv_pool import KVPool
from kvserve.kv.layout import KVLayout
from kvserve.model.config import ModelConfig
from test_architectures import GREEDY, checkpoint, hf_model, make_llm, prompts, word_tokenizer

CASE = "Gemma4ForCausalLM"  # 5 layers: sliding, global, sliding, then a sliding and a global on earlier layers' K/V


def test_the_pool_holds_each_layers_shape_and_no_layer_for_those_that_share(tmp_path_factory):
    _, folder = checkpoint(CASE, tmp_path_factory)
    llm = make_llm(folder)
    cfg: ModelConfig = llm.engine.runner.model.config
    assert cfg.kv_cache_layers == 3  # the two last layers read layers 2 (sliding) and 1 (global)
    assert cfg.kv_layer_shapes() == [(2, 16), (1, 32), (2, 16)]
    pool = llm.engine.runner.attention.pool
    assert [tuple(k.shape[1:]) for k, _ in pool.layers] == [(2, 16), (1, 32), (2, 16)]
    assert pool.layout.bytes_per_token == 2 * (32 + 32 + 32) * 4
    model = llm.engine.runner.model
    assert model.cache_of[3] == model.cache_of[2] and model.cache_of[4] == model.cache_of[1]


def test_a_block_of_layers_of_different_shapes_goes_out_and_back():
    """The offload tiers' payload: every layer's K and V of a block, whatever each layer's shape."""
    layout = KVLayout(3, 2, 16, 4, "float32", ((2, 16), (1, 32), (2, 16)))
    pool = KVPool(layout, 4, torch.device("cpu"))
    for k, v in pool.layers:
        k.normal_(), v.normal_()
    payload = pool.read_block(2)
    assert len(payload) == layout.block_bytes
    other = KVPool(layout, 4, torch.device("cpu"))
    other.write_block(1, payload)
    for (k, v), (k2, v2) in zip(pool.layers, other.layers):
        assert torch.equal(k[8:12], k2[4:8]) and torch.equal(v[8:12], v2[4:8])


def test_an_8bit_kv_cache_is_refused_in_one_line(tmp_path_factory):
    _, folder = checkpoint(CASE, tmp_path_factory)
    with pytest.raises(ValueError, match="8-bit KV cache keeps one shape"):
        make_llm(folder, kv_cache_dtype="int8")


def test_a_bf16_checkpoint_keeps_its_per_layer_table_as_stored(tmp_path):
    """A float32 model over a bf16 checkpoint looks up the per-layer table in bf16 (layers x its width a token: the
    bulk of Gemma 4 E2B's weights) and answers as transformers does over the same weights in float32."""
    from kvserve.model.layers import NarrowEmbedding

    model = hf_model(CASE).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    word_tokenizer(97).save_pretrained(tmp_path)
    llm = make_llm(tmp_path)
    table = llm.engine.runner.model.per_layer_embed
    assert isinstance(table, NarrowEmbedding) and table.weight.dtype == torch.bfloat16
    from conftest import hf_greedy

    reference = model.float()
    want = [hf_greedy(reference, p, GREEDY.max_tokens) for p in prompts()]
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == want


def test_the_simulator_sizes_the_same_kv_per_token(tmp_path_factory):
    """The planner reads the config as the engine does: K/V a token over the pool's layers, each at its own shape."""
    import json

    from kvserve.sim.models import ModelSpec

    _, folder = checkpoint(CASE, tmp_path_factory)
    spec = ModelSpec.from_hf_config(json.loads((folder / "config.json").read_text()))
    assert spec.kv_layout("fp32").bytes_per_token == 2 * (32 + 32 + 32) * 4


def test_the_layers_that_only_read_kv_run_the_sampled_rows_alone(tmp_path_factory, monkeypatch):
    """Layers 3 and 4 write no K/V, so a 30-token prompt's step runs them on the one row it samples (and the answer is
    transformers', the greedy tests' check); layers 0-2 run every row."""
    from kvserve.model.decoder_layer import DecoderLayer

    _, folder = checkpoint(CASE, tmp_path_factory)
    llm = make_llm(folder)
    assert llm.engine.runner.model.rows_from == 3
    seen: dict[int, list[int]] = {}
    real = DecoderLayer._closed_forward

    def record(self, h, *args, **kwargs):
        out = real(self, h, *args, **kwargs)
        seen.setdefault(id(self), []).append(out[0].shape[0])
        return out

    monkeypatch.setattr(DecoderLayer, "_closed_forward", record)
    llm.generate([prompts()[-1]], GREEDY)
    layers = llm.engine.runner.model.layers
    first_step = [seen[id(layer)][0] for layer in layers]
    assert first_step[:3] == [30, 30, 30] and first_step[3:] == [1, 1]


def test_a_layer_on_shared_kv_refuses_the_q_options_it_does_not_run(tmp_path_factory):
    """Its q-only path runs per-head RMS q norms before rotary: a clamp (or a position scale, ...) is refused at build
    in one line, not skipped."""
    import dataclasses

    from kvserve.model.attention import Attention
    from kvserve.model.loader import load_model_config

    _, folder = checkpoint(CASE, tmp_path_factory)
    cfg = load_model_config(folder)
    Attention(cfg, 3)  # (as configured: it builds)
    with pytest.raises(ValueError, match="earlier layer's K/V runs per-head RMS q norms"):
        Attention(dataclasses.replace(cfg, clip_qkv=0.5), 3)
