"""The sampler: one call per step over the logits of every request that samples.

Greedy rows take an argmax. Random rows are filtered (top-k, top-p, min-p) in one batched
pass, then each draws with the exponential-race trick (argmax of p / Exp(1)), which needs
only one random tensor per row: a seeded request owns a generator, so its draws do not
depend on what else is in the batch.
"""

from __future__ import annotations

import weakref

import torch

from kvserve.engine.request import Request, TokenLogprobs


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.shared_generator = torch.Generator(device=device)
        self.shared_generator.manual_seed(seed)
        self._generators: weakref.WeakKeyDictionary[Request, torch.Generator] = weakref.WeakKeyDictionary()

    def generator(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self.shared_generator
        g = self._generators.get(req)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(req.params.seed)
            self._generators[req] = g
        return g

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], dict[str, TokenLogprobs]]:
        """logits: float32 [len(requests), vocab]. Returns token ids and optional logprobs."""
        raw = logits
        if any(r.params.has_penalties for r in requests):
            logits = logits.clone()
            for i, r in enumerate(requests):
                if r.params.has_penalties:
                    apply_penalties(logits[i], r)

        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        if len(greedy) == len(requests):
            tokens = logits.argmax(dim=-1)
        else:
            if greedy:
                idx = torch.tensor(greedy, device=logits.device)
                tokens[idx] = logits[idx].argmax(dim=-1)
            rand = [i for i, r in enumerate(requests) if not r.params.greedy]
            idx = torch.tensor(rand, device=logits.device)
            probs = filtered_probs(logits[idx], [requests[i] for i in rand])
            for row, i in enumerate(rand):
                tokens[i] = race_draw(probs[row], self.generator(requests[i]))

        token_list = tokens.tolist()
        logprobs: dict[str, TokenLogprobs] = {}
        want = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if want:
            lp = torch.log_softmax(raw[want], dim=-1)
            for row, i in enumerate(want):
                n = requests[i].params.logprobs
                tok = token_list[i]
                top = []
                if n:
                    vals, ids = lp[row].topk(n)
                    top = list(zip(ids.tolist(), vals.tolist()))
                logprobs[requests[i].request_id] = TokenLogprobs(tok, lp[row, tok].item(), top)
        return token_list, logprobs


def race_draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a (not necessarily normalised) distribution: argmax of p / Exp(1)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def apply_penalties(logits: torch.Tensor, req: Request, token_ids: list[int] | None = None) -> None:
    """In place, on one row, as vLLM defines them; ``token_ids`` (default: the request's) is the
    sequence the row continues.

    Repetition divides positive (multiplies negative) logits of every token seen in the
    prompt or output; frequency subtracts per occurrence in the output; presence subtracts
    once per distinct output token.
    """
    p = req.params
    seq = req.token_ids if token_ids is None else token_ids
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq)), device=logits.device, dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    out = seq[req.num_prompt_tokens :]
    if out and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(out, device=logits.device), minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, batched; returns probabilities [rows, vocab]."""
    dev = logits.device
    temps = torch.tensor([r.params.temperature for r in requests], device=dev, dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    top_k = [r.params.top_k for r in requests]
    top_p = [r.params.top_p for r in requests]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=dev)
        drop = torch.arange(vocab, device=dev).unsqueeze(0) >= ks.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        ps = torch.tensor(top_p, device=dev, dtype=logits.dtype)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= ps.unsqueeze(1), float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    min_p = [r.params.min_p for r in requests]
    if any(m > 0 for m in min_p):
        mp = torch.tensor(min_p, device=dev, dtype=probs.dtype).unsqueeze(1)
        probs = probs.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs
