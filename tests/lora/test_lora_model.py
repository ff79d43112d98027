"""LoRA adapters in the model: greedy tokens with an adapter equal PEFT's merged model (float32, no quantization)
for several architectures, on the native and torch paths; a step mixing adapters and the base model equals each
run alone; bad adapters give clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import hf_greedy
from kvserve import SamplingParams
from kvserve.kernels import load_kernels
from kvserve.errors import InvalidArgumentError, KVServeError, NotFoundError
from lora_utils import write_adapter
from model.test_architectures import checkpoint, make_llm, prompts

pytest.importorskip("peft")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# Gemma: sandwich norms; Qwen2-MoE: attention and the shared expert; ERNIE: rotary rows reordered; Phi-3: stacked qkv
ARCHS = ["LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen2MoeForCausalLM", "Ernie4_5ForCausalLM",
         "Phi3ForCausalLM"]


def lora_llm(folder, torch_path: bool = False, **kw):
    return make_llm(folder, torch_path, enable_lora=True, max_num_batched_tokens=512, **kw)


@pytest.mark.parametrize("torch_path", [False, True], ids=["native", "torch"])
@pytest.mark.parametrize("name", ARCHS)
def test_greedy_equals_peft_merged(name, torch_path, tmp_path_factory):
    model, folder = checkpoint(name, tmp_path_factory)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "shared_expert.gate_proj", "shared_expert.up_proj",
               "shared_expert.down_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj") if "Moe" in name else \
        ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if "Phi3" in name else None
    adapter = tmp_path_factory.mktemp("adapter")
    merged = write_adapter(model, adapter, seed=7, **({"targets": targets} if targets else {}))
    llm = lora_llm(folder, torch_path)
    llm.load_lora_adapter("a", str(adapter))
    want = [hf_greedy(merged, p, GREEDY.max_tokens) for p in prompts()]
    base = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts()]
    assert want != base  # the adapter changes the answers
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY, lora="a")] == want
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == base
    tables = llm.engine.runner.lora.ctx.tables
    if not torch_path and load_kernels():  # the native kernel ran, from the slot table
        assert tables is not None and tables.tables


def test_rslora_rank_and_alpha_patterns(tmp_path_factory):
    model, folder = checkpoint("LlamaForCausalLM", tmp_path_factory)
    adapter = tmp_path_factory.mktemp("rslora")
    merged = write_adapter(model, adapter, seed=3, r=4, alpha=8, rslora=True, rank_pattern={"v_proj": 2},
                           alpha_pattern={"o_proj": 3.0})
    llm = lora_llm(folder, max_lora_rank=4)
    llm.load_lora_adapter("r", str(adapter))
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY, lora="r")] == \
        [hf_greedy(merged, p, GREEDY.max_tokens) for p in prompts()]


def test_mixed_batch_equals_each_alone(tmp_path_factory):
    """Three adapters and the base model in the same steps give what each gives alone."""
    model, folder = checkpoint("LlamaForCausalLM", tmp_path_factory)
    names = ["a", "b", "c"]
    llm = lora_llm(folder, max_loras=4)
    for i, n in enumerate(names):
        path = tmp_path_factory.mktemp(f"mix-{n}")
        write_adapter(model, path, seed=10 + i, targets=("q_proj", "v_proj", "down_proj") if n == "b" else
                      ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
        llm.load_lora_adapter(n, str(path))
    ps = prompts()
    alone = {n: [o.token_ids for o in llm.generate(ps, GREEDY, lora=n)] for n in [*names, None]}
    assert len({json.dumps(v) for v in alone.values()}) == 4
    mixed_names = [[*names, None][(i + j) % 4] for j in range(4) for i in range(len(ps))]
    mixed = llm.generate(ps * 4, GREEDY, lora=mixed_names)
    for k, (o, n) in enumerate(zip(mixed, mixed_names)):
        assert o.token_ids == alone[n][k % len(ps)], (k, n)


def test_max_loras_bounds_a_step(tmp_path_factory):
    """With one slot, requests of two adapters never share a step, and all finish as alone."""
    model, folder = checkpoint("LlamaForCausalLM", tmp_path_factory)
    llm = lora_llm(folder, max_loras=1, max_cpu_loras=1)
    for i, n in enumerate("xy"):
        path = tmp_path_factory.mktemp(f"slot-{n}")
        write_adapter(model, path, seed=20 + i)
        llm.load_lora_adapter(n, str(path))
    ps = prompts()
    alone = {n: [o.token_ids for o in llm.generate(ps, GREEDY, lora=n)] for n in "xy"}
    runner, seen = llm.engine.runner, []
    real = runner.lora.step

    def step(refs, keep):
        seen.append({r.name for r in refs if r is not None})
        return real(refs, keep)

    runner.lora.step = step
    out = llm.generate(ps + ps, GREEDY, lora=["x"] * len(ps) + ["y"] * len(ps))
    assert [o.token_ids for o in out] == alone["x"] + alone["y"]
    assert all(len(s) <= 1 for s in seen) and {"x"} in seen and {"y"} in seen
    assert len(runner.lora.loaded) == 1  # the CPU LRU's bound: the other one is read again when needed


def test_bad_adapters_are_refused_clearly(tmp_path_factory):
    model, folder = checkpoint("LlamaForCausalLM", tmp_path_factory)
    llm = lora_llm(folder, max_lora_rank=8)
    big = tmp_path_factory.mktemp("big")
    write_adapter(model, big, seed=1, r=16)
    with pytest.raises(InvalidArgumentError, match="rank 16, over --max-lora-rank 8"):
        llm.load_lora_adapter("big", str(big))
    import transformers

    wider = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8))
    mismatch = tmp_path_factory.mktemp("mismatch")
    write_adapter(wider, mismatch, seed=1)
    with pytest.raises(InvalidArgumentError, match="does not fit this model"):
        llm.load_lora_adapter("m", str(mismatch))
    lm_head = tmp_path_factory.mktemp("lm_head")
    write_adapter(model, lm_head, seed=1, targets=("q_proj", "lm_head"))
    with pytest.raises(InvalidArgumentError, match="lm_head.*kvserve adapts only these linears"):
        llm.load_lora_adapter("h", str(lm_head))
    with pytest.raises(InvalidArgumentError, match="not a PEFT adapter folder"):
        llm.load_lora_adapter("e", str(tmp_path_factory.mktemp("empty")))
    with pytest.raises(KVServeError, match="'nope' does not exist"):
        llm.generate(prompts()[:1], GREEDY, lora="nope")
    with pytest.raises(NotFoundError):
        llm.unload_lora_adapter("nope")
    assert llm.engine.runner.lora.names == []
