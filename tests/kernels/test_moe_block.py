"""The native grouped-expert MoE (kvserve.MoEBlock via ``MoE.forward``) against the Python loop of experts it
replaces, on tiny random MoE blocks shaped as Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE (shared expert), Granite MoE
Shared (a shared expert without a gate), ERNIE 4.5 MoE (experts chosen with a bias, weighted without it), gpt-oss
(router and expert biases, clamped SwiGLU) and DeepSeek-V2/V3 (expert groups), over int8 and int4
experts: the same bits where the arithmetic is the
same (given the routing, the experts' GEMMs and the ascending-expert sum are the loop's), close otherwise (the
router's GEMV, gpt-oss's SwiGLU); and a row's output bit-identical alone and inside any batch."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import needs_onednn_bf16
from kvserve.model.mlp import MoE
from kvserve.model.moe_native import moe_blocker
from kvserve.model.quant import quantize
from kvserve.model.quant_linear import QuantLinear

CASES = {
    "qwen3_moe": dict(experts=8, top_k=2, norm_topk=True),
    "mixtral": dict(experts=4, top_k=2, norm_topk=True),
    "olmoe": dict(experts=8, top_k=4, norm_topk=False),
    "qwen2_moe": dict(experts=6, top_k=2, norm_topk=False, shared=96),
    "granite_moe_shared": dict(experts=4, top_k=2, norm_topk=True, shared=64, shared_gated=False),  # no gate: weight 1
    "gpt_oss": dict(experts=4, top_k=2, norm_topk=True, swiglu=(1.702, 1.5), biases=True),
    # chosen by softmax + a bias of the probabilities' size (normal 0.3 below), weighted by the softmax alone
    "ernie4_5_moe": dict(experts=6, top_k=2, norm_topk=True, shared=64, shared_gated=False, selection_bias=True),
    # each expert's own sigmoid, chosen with the bias, renormalised and scaled (GLM-4.5 MoE)
    "glm4_moe": dict(experts=6, top_k=2, norm_topk=True, shared=64, shared_gated=False, selection_bias=True,
                     scoring="sigmoid", routed_scale=2.5),
    "gelu_tanh": dict(experts=5, top_k=3, norm_topk=True, act="gelu_pytorch_tanh"),
    # DeepSeek-V3's: GLM's router, and the experts of a row's best 2 of 4 groups (ranked by their best two)
    "deepseek_v3": dict(experts=8, top_k=2, norm_topk=True, shared=64, shared_gated=False, selection_bias=True,
                        scoring="sigmoid", routed_scale=2.5, groups=(4, 2, "top2")),
    # DeepSeek-V2's: softmax, 3 experts of a row's best 2 of 4 groups (ranked by their best one), scaled
    "deepseek_v2": dict(experts=8, top_k=3, norm_topk=False, shared=64, shared_gated=False, routed_scale=1.5,
                        groups=(4, 2, "max")),
}
# the cases whose expert arithmetic is the loop's op for op (the loop's SwiGLU is torch's)
EXACT = [c for c in CASES if "swiglu" not in CASES[c]]
KINDS = ["q8_0", "q4_1"]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    from kvserve.kernels import load_kernels

    if not load_kernels():
        pytest.skip("native kernels did not build")


def make_moe(case: str, kind: str | None, hidden: int = 64, inter: int = 64, seed: int = 0) -> MoE:
    """A random MoE block, its experts on the packed kernels (``kind``; None: dense), native ops on."""
    o = CASES[case]
    torch.manual_seed(seed)
    moe = MoE(hidden, inter, o["experts"], o["top_k"], o["norm_topk"], o.get("act", "silu"), o.get("shared", 0),
              router_bias=o.get("biases", False), expert_bias=o.get("biases", False), swiglu=o.get("swiglu"),
              shared_gated=o.get("shared_gated", True), selection_bias=o.get("selection_bias", False),
              scoring=o.get("scoring", "softmax"), routed_scale=o.get("routed_scale", 1.0), groups=o.get("groups"))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    mlps = list(moe.experts) + ([moe.shared] if moe.shared is not None else [])
    for mlp in mlps if kind else []:
        for name in ("gate_up", "down"):
            lin = getattr(mlp, name)
            setattr(mlp, name, QuantLinear(quantize(lin.weight.detach(), kind), lin.bias, torch.float32, amx=False))
    moe.use_native(True)
    return moe.eval()


def route(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loop's routing: top-k of the router's softmax (plus the selection bias; renormalised with norm_topk)."""
    logits = moe.router(x).float()
    probs = torch.sigmoid(logits) if moe.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = probs if moe.selection_bias is None else probs + moe.selection_bias.float()
    chosen = (choice if moe.groups is None else moe._in_best_groups(choice)).topk(moe.top_k, dim=-1).indices
    weights = probs.gather(-1, chosen)
    if moe.norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return chosen.contiguous(), (weights * moe.routed_scale).contiguous()


def with_threads(n: int, f):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return f()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 37])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", EXACT)
def test_grouped_experts_equal_the_loop_bit_for_bit(case, kind, rows, threads):
    moe = make_moe(case, kind)
    assert moe.native_block is not None
    x = torch.randn(rows, 64)
    ids, weights = route(moe, x)
    got = with_threads(threads, lambda: moe.native_block.run_experts(x, ids, weights))
    ref = moe.loop_forward(x)
    if moe.shared is not None:  # run_experts is the routed experts alone
        ref = ref - moe._shared_forward(x)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(got, ref)


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_forward_runs_the_block_and_agrees_with_the_loop(case, kind, rows, monkeypatch):
    moe = make_moe(case, kind)
    x = torch.randn(rows, 64)
    calls = []
    block = moe.native_block
    monkeypatch.setattr(moe, "native_block", type("Spy", (), {
        "forward": lambda self, *a: calls.append(1) or block.forward(*a)})())
    got = with_threads(2, lambda: moe(x))
    assert calls == [1]
    torch.testing.assert_close(got, moe.loop_forward(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_rows_output_is_the_same_alone_and_in_any_batch(case, kind):
    moe = make_moe(case, kind)
    x = torch.randn(23, 64)
    batch = with_threads(2, lambda: moe(x))
    perm = torch.randperm(23)
    shuffled = with_threads(1, lambda: moe(x[perm].contiguous()))
    assert torch.equal(shuffled, batch[perm])
    for i in range(23):
        alone = with_threads(2, lambda: moe(x[i : i + 1]))
        assert torch.equal(alone[0], batch[i]), i


def test_blocks_share_one_scratch_without_disturbing_each_other():
    """Every block a thread runs shares that thread's buffers (a prefill's would be ~400 MB a layer): blocks of
    other shapes and step sizes, run in turn, still give the loop's bits, and eight layers' blocks hold
    no more than one does."""
    olmoe, qwen2 = make_moe("olmoe", "q8_0"), make_moe("qwen2_moe", "q4_1", hidden=128, inter=96, seed=1)
    for moe, rows in ((olmoe, 50), (qwen2, 3), (olmoe, 2), (qwen2, 41), (olmoe, 50), (qwen2, 1)):
        x = torch.randn(rows, moe.router.in_features)
        torch.testing.assert_close(with_threads(2, lambda: moe(x)), moe.loop_forward(x), rtol=1e-4, atol=1e-5)
    layers = [make_moe("olmoe", "q4_1", seed=s) for s in range(8)]
    x = torch.randn(300, 64)  # more rows than any step above: the scratch grows once, for the first layer
    layers[0](x)
    one = layers[0].native_block.scratch_bytes()
    for layer in layers[1:]:
        layer(x)
    assert layers[-1].native_block.scratch_bytes() == one >= 300 * 4 * 64 * 4 * 2  # gate_up's and down's outputs


def test_dense_experts_keep_the_loop():
    moe = make_moe("qwen3_moe", None)
    assert moe.native_block is None and moe_blocker(moe) == "experts not on the packed quantized kernels"
    x = torch.randn(4, 64)
    assert torch.equal(moe(x), moe.loop_forward(x))


def test_the_block_checks_its_arguments():
    block = make_moe("mixtral", "q8_0").native_block
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        block.run_experts(x, torch.tensor([[0, 9], [1, 2]]), torch.ones(2, 2))
    with pytest.raises(RuntimeError, match="twice"):
        block.run_experts(x, torch.tensor([[1, 1], [1, 2]]), torch.ones(2, 2))
    with pytest.raises(RuntimeError, match="float32"):
        block.forward(x.double(), True)


def test_a_shared_expert_under_an_adapter_runs_in_python():
    """A LoRA adapter wraps the shared expert's linears (not QuantLinear any more): the block runs the routed
    experts, and the wrapped shared expert runs in Python (its adapter applied: here, an offset)."""
    moe = make_moe("qwen2_moe", "q8_0")

    class Offset(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base

        def forward(self, x):
            return self.base(x) + 0.5

    moe.shared.gate_up = Offset(moe.shared.gate_up)
    x = torch.randn(6, 64)
    torch.testing.assert_close(moe(x), moe.loop_forward(x), rtol=1e-4, atol=1e-5)


@needs_onednn_bf16
def test_on_amx_a_prefill_sized_step_runs_the_loop_on_the_experts_bf16_copies(monkeypatch):
    """Experts with AMX copies (forced: emulated where the CPU lacks AMX) take the loop once they average
    AMX_MIN_ROWS rows (their bf16 GEMMs), the block below that."""
    from kvserve.model.quant_linear import AMX_MIN_ROWS

    moe = make_moe("mixtral", "q8_0")  # 4 experts, top-2
    for mlp in moe.experts:
        for name in ("gate_up", "down"):
            lin = getattr(mlp, name)
            setattr(mlp, name, QuantLinear(quantize(lin.dequantize(), "q8_0"), None, torch.float32, amx=True))
    moe.use_native(True)
    few, many = AMX_MIN_ROWS * 2 - 1, AMX_MIN_ROWS * 2  # rows x top-k against AMX_MIN_ROWS x experts
    assert not moe.loop_takes(few) and moe.loop_takes(many)
    calls = []
    block = moe.native_block
    monkeypatch.setattr(moe, "native_block", type("Spy", (), {
        "forward": lambda self, *a: calls.append(1) or block.forward(*a)})())
    moe(torch.randn(few, 64))
    moe(torch.randn(many, 64))
    assert calls == [1]


@pytest.mark.parametrize("case", ["deepseek_v2", "deepseek_v3"])
def test_expert_groups_restrict_each_rows_experts(case):
    """Every row's experts lie in its best groups, and the groups change the choice for some rows (so the block's
    agreement with the loop above covers the group choice too)."""
    moe = make_moe(case, "q8_0")
    groups, used, _ = moe.groups
    x = torch.randn(64, 64)
    ids, _ = route(moe, x)
    per_group = moe.router.out_features // groups
    assert all(len({int(e) // per_group for e in row}) <= used for row in ids)
    moe.groups = None
    assert not torch.equal(route(moe, x)[0], ids)
