"""Verification: which drafted tokens the target model accepts, and the token that follows them.

The target scored the last accepted token plus k drafts in one forward, so row i of
``logits`` is the target's distribution for the position of draft i (row k: after all
of them). Greedy requests accept drafts while they equal the argmax. Sampled requests
use the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023): accept draft
d with probability min(1, p(d) / q(d)); at the first rejection draw from the residual
max(0, p - q) renormalised; if all pass, draw the bonus token from row k. The emitted
tokens are then distributed exactly as the target's. A proposer without a distribution
(prompt lookup) is a point mass: q(d) = 1.
"""

from __future__ import annotations

import torch

from kvserve.engine.request import Request, TokenLogprobs
from kvserve.sampling.processors import LogitProcessing
from kvserve.sampling.sampler import apply_penalties, filtered_probs, draw_one


def verify(logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None, req: Request,
           generator: torch.Generator, processing: LogitProcessing | None = None,
           ) -> tuple[list[int], list[TokenLogprobs]]:
    """logits: float32 [k + 1, vocab]; draft_probs: [k, vocab] or None. Returns the emitted
    tokens (accepted drafts, then one more) and their logprobs if the request asks for them.
    ``processing``: the sampler's (it keeps the request's tensors); a fresh one if None."""
    raw = logits
    p = req.params
    if p.has_penalties or p.has_logit_processing:  # row i continues the sequence extended by drafts[:i]
        logits = logits.clone()
        if p.has_logit_processing and processing is None:
            processing = LogitProcessing()
        for i in range(len(drafts) + 1):
            seq = req.token_ids + drafts[:i]
            if p.has_penalties:
                apply_penalties(logits[i], req, seq)
            if processing is not None and p.has_logit_processing:
                processing.apply(logits[i], req, seq)
    if p.greedy:
        target = logits.argmax(dim=-1).tolist()
        m = 0
        while m < len(drafts) and drafts[m] == target[m]:
            m += 1
        tokens = drafts[:m] + [target[m]]
    else:
        probs = filtered_probs(logits, [req] * logits.shape[0])
        tokens = []
        for i, d in enumerate(drafts):
            q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
            u = torch.rand((), generator=generator, device=probs.device).item()
            if q_d > 0 and u * q_d < float(probs[i, d]):
                tokens.append(d)
                continue
            if draft_probs is None:
                residual = probs[i].clone()
                residual[d] = 0.0
            else:
                residual = (probs[i] - draft_probs[i]).clamp_(min=0.0)
            if float(residual.sum()) <= 0.0:  # p == q up to rounding: p itself is the residual
                residual = probs[i]
            tokens.append(draw_one(residual, generator))
            break
        else:
            tokens.append(draw_one(probs[len(drafts)], generator))
    return tokens, _logprobs(raw, tokens, p.logprobs)


def _logprobs(raw: torch.Tensor, tokens: list[int], n: int | None) -> list[TokenLogprobs]:
    if n is None:
        return []
    lp = torch.log_softmax(raw[: len(tokens)], dim=-1)
    out = []
    for i, tok in enumerate(tokens):
        top = []
        if n:
            vals, ids = lp[i].topk(n)
            top = list(zip(ids.tolist(), vals.tolist()))
        out.append(TokenLogprobs(tok, lp[i, tok].item(), top))
    return out
