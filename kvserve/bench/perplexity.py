"""Accuracy of a model build: perplexity of a text and greedy agreement between two generations.

Used to bound what quantized weights cost against the dequantized float32 model (the tests,
``scripts/bench_quant.py``), and what an 8-bit KV cache costs against full precision
(``scripts/bench_kv_dtype.py``). Perplexity runs the runner's own forward (paged KV and attention
included) over fixed windows of the text, each from position 0. A chunk that starts a sequence
attends over its own fresh K/V, never the cache; ``chunk`` feeds each window that many tokens at a
time, so every later token reads the earlier ones back from the cache (``chunk=1``: as decoding does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvserve.attention import SeqRows
from kvserve.runner.inputs import build_inputs
from kvserve.runner.torch_runner import TorchRunner

# Short prompts of varied kinds (facts, stories, code, lists), for greedy agreement between two builds.
AGREEMENT_PROMPTS = [
    "The capital of France is", "Here is a short story about a dog:", "def fibonacci(n):",
    "The three primary colors are", "Water boils at", "To make a cup of tea, first",
    "The largest planet in the solar system is", "A good way to learn a new language is",
    "In 1969, the first person to walk on the moon", "The recipe calls for two cups of flour and",
    "Photosynthesis is the process by which", "My favourite season is autumn because",
    "SELECT name FROM users WHERE", "The train left the station at noon and", "Dear hiring manager,",
    "List three uses of a paperclip:",
]


@torch.inference_mode()
def perplexity(runner: TorchRunner, token_ids: Sequence[int], window: int = 256, chunk: int | None = None) -> float:
    """exp(mean negative log-likelihood) of each token given the ones before it in its window."""
    blocks_needed = -(-window // runner.block_size)
    if blocks_needed > runner.num_kv_blocks:
        raise ValueError(f"a window of {window} tokens needs {blocks_needed} KV blocks; the runner has "
                         f"{runner.num_kv_blocks}")
    table = list(range(blocks_needed))
    total, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        piece = list(token_ids[start : start + window])
        if len(piece) < 2:
            break
        logprobs = torch.log_softmax(sequence_logits(runner, piece[:-1], table, chunk), dim=-1)
        targets = torch.tensor(piece[1:], device=logprobs.device)
        total -= logprobs.gather(1, targets.unsqueeze(1)).sum().item()
        count += len(piece) - 1
    return math.exp(total / count)


@torch.inference_mode()
def sequence_logits(runner: TorchRunner, token_ids: list[int], block_table: list[int] | None = None,
                    chunk: int | None = None) -> torch.Tensor:
    """float32 logits [len, vocab] of every position of one sequence run from position 0 (its KV
    goes to ``block_table``, by default the pool's first blocks), ``chunk`` tokens per forward
    (default: all at once)."""
    table = block_table or list(range(-(-len(token_ids) // runner.block_size)))
    step = chunk or len(token_ids)
    out = []
    for start in range(0, len(token_ids), step):
        rows = SeqRows(list(token_ids[start : start + step]), start, table)
        inputs = build_inputs([rows], runner.attention)
        hidden = runner.model(inputs.input_ids, inputs.positions, runner.attention, inputs.meta, runner.kv_pool.layers)
        out.append(runner.model.logits(hidden))
    return torch.cat(out)


def greedy_agreement(reference: Sequence[int], other: Sequence[int]) -> float:
    """The fraction of positions where two greedy generations hold the same token (over the
    reference's length; a shorter ``other`` counts as different past its end)."""
    if not reference:
        return 1.0
    same = sum(1 for a, b in zip(reference, other) if a == b)
    return same / len(reference)
