"""The sampler: one call per step over the logits of every request that samples.

Greedy rows take an argmax (on CPU the native one: rows in parallel, vectorized). Where every row
is greedy or plain temperature, an AMX CPU's quantized LM head can draw them itself, writing no
logits: the runner asks ``head_draw_inputs`` for the temperatures and uniform numbers. Random rows with
plain temperature draw natively on CPU too (``native_temperature_draw``: one pass for the max, one
for the exps). Other random rows are filtered (top-k, top-p, min-p) in one batched
pass, then all draw at once by inverting their cumulative distributions: one uniform number
per row, one batched cumsum and one searchsorted (a draw over the 49k-token vocabulary costs
microseconds, where an exponential race needed 49k random numbers per row). A seeded request
owns a generator and takes its one number from it, so its draws do not depend on what else
is in the batch; the unseeded rows share one generator and one call.
"""

from __future__ import annotations

import weakref

import torch

from kvserve.engine.request import Request, TokenLogprobs
from kvserve.kernels import ops
from kvserve.sampling.processors import LogitProcessing


def greedy_tokens(logits: torch.Tensor, native: bool) -> torch.Tensor:
    """The first largest logit's index per row, as ``logits.argmax(-1)`` gives it."""
    return ops.argmax_rows(logits, native=native)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.native = device.type == "cpu" and ops.available()  # argmax and plain-temperature draws
        self.shared_generator = torch.Generator(device=device)
        self.shared_generator.manual_seed(seed)
        self._generators: weakref.WeakKeyDictionary[Request, torch.Generator] = weakref.WeakKeyDictionary()
        self.processing = LogitProcessing()  # logit_bias, allowed_token_ids, bad_words, min_tokens

    def generator(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self.shared_generator
        g = self._generators.get(req)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(req.params.seed)
            self._generators[req] = g
        return g

    def _uniforms(self, requests: list[Request]) -> torch.Tensor:
        """One U[0, 1) number per request: the unseeded ones in one call to the shared generator."""
        u = torch.empty(len(requests), device=self.device)
        shared = [i for i, r in enumerate(requests) if r.params.seed is None]
        if shared:
            u[shared] = torch.rand(len(shared), generator=self.shared_generator, device=self.device)
        for i, r in enumerate(requests):
            if r.params.seed is not None:
                u[i] = torch.rand(1, generator=self.generator(r), device=self.device)
        return u

    def reads_bf16(self, requests: list[Request]) -> bool:
        """Whether these requests' tokens can be drawn from bf16 logits as an AMX LM head wrote them:
        every row greedy or plain temperature, drawn natively, and nothing that needs float32 logits
        (penalties, logit processing, logprobs). The native draws read bf16 as the floats it holds, so
        the tokens are those of the converted logits."""
        return self.native and all(
            (r.params.greedy or _plain_temperature(r)) and not r.params.has_penalties
            and not r.params.has_logit_processing and r.params.logprobs is None for r in requests)

    def head_draw_inputs(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """For a draw inside the LM head (``CausalLM.draw_in_head``), where ``reads_bf16(requests)``:
        per row the inverse temperature (0: greedy) and the U[0, 1) number, taken from the generators
        as ``__call__`` takes them (the random rows', in order), so a seeded request draws the same."""
        inv_t = torch.zeros(len(requests), dtype=torch.float32)
        u = torch.zeros(len(requests), dtype=torch.float32)
        rand = [i for i, r in enumerate(requests) if not r.params.greedy]
        if rand:
            inv_t[rand] = torch.tensor([1.0 / requests[i].params.temperature for i in rand], dtype=torch.float32)
            u[rand] = self._uniforms([requests[i] for i in rand]).float().cpu()
        return inv_t, u

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], dict[str, TokenLogprobs]]:
        """logits: float32 [len(requests), vocab] (or bf16 where ``reads_bf16(requests)``). Returns
        token ids and optional logprobs."""
        if logits.dtype != torch.float32 and not self.reads_bf16(requests):
            logits = logits.float()
        raw = logits  # logprobs describe the model's distribution, before penalties and processing
        if any(r.params.has_penalties or r.params.has_logit_processing for r in requests):
            logits = logits.clone()
            for i, r in enumerate(requests):
                if r.params.has_penalties:
                    apply_penalties(logits[i], r)
                if r.params.has_logit_processing:
                    self.processing.apply(logits[i], r)

        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        if len(greedy) == len(requests):
            tokens = greedy_tokens(logits, self.native)
        else:
            if greedy:
                idx = torch.tensor(greedy, device=logits.device)
                tokens[idx] = greedy_tokens(logits[idx], self.native)
            rand = [i for i, r in enumerate(requests) if not r.params.greedy]
            # plain temperature rows draw natively where the kernels run; filtered rows go through torch
            plain = [i for i in rand if self.native and _plain_temperature(requests[i])]
            filtered = [i for i in rand if not _plain_temperature(requests[i])] if plain else rand
            if plain:
                sub = logits if len(plain) == len(requests) else logits[torch.tensor(plain, device=logits.device)]
                chosen = native_temperature_draw(sub, [requests[i] for i in plain], self._uniforms([requests[i] for i in plain]))
                if len(plain) == len(requests):
                    tokens = chosen
                else:
                    tokens[torch.tensor(plain, device=logits.device)] = chosen
            if filtered:
                idx = torch.tensor(filtered, device=logits.device)
                probs = filtered_probs(logits[idx], [requests[i] for i in filtered])
                tokens[idx] = inverse_cdf_draw(probs, self._uniforms([requests[i] for i in filtered]))

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


def prompt_logprobs(logits: torch.Tensor, targets: list[int], n: int) -> list[TokenLogprobs]:
    """The logprob and rank of each target token under its row of ``logits`` [rows, vocab] (row i
    predicts targets[i]), with the ``n`` most likely tokens of the row."""
    lp = torch.log_softmax(logits, dim=-1)
    ids = torch.tensor(targets, dtype=torch.long, device=lp.device).unsqueeze(1)
    chosen = lp.gather(1, ids)
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in targets]
    if n:
        vals, top_ids = lp.topk(n, dim=-1)
        top = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), vals.tolist())]
    return [TokenLogprobs(t, v, tp, rank) for t, v, tp, rank in zip(targets, chosen.squeeze(1).tolist(), top, ranks)]


def inverse_cdf_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of (not necessarily normalised) ``probs`` [rows, vocab], given one
    U[0, 1) number per row: the first token whose cumulative mass exceeds u * total. A token of
    zero probability adds nothing to the sum, so it is never chosen."""
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _plain_temperature(req: Request) -> bool:
    """A random row with no top-k, top-p or min-p filter: softmax(logits / T) as it is."""
    p = req.params
    return p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0


def native_temperature_draw(logits: torch.Tensor, requests: list[Request], u: torch.Tensor) -> torch.Tensor:
    """``inverse_cdf_draw(softmax(logits / T), u)`` per row in one native pass (CPU float32 logits):
    the same token for the same u, short of float rounding at a boundary (0.9 vs 14 ms for 64 rows of
    a 49k vocabulary, kvserve/kernels/csrc/sampling/sample_rows.cpp)."""
    inv_t = torch.tensor([1.0 / r.params.temperature for r in requests], dtype=torch.float32)
    return ops.sample_rows(logits, inv_t, u)


def draw_one(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a (not necessarily normalised) distribution [vocab], with ``generator``."""
    u = torch.rand(1, generator=generator, device=probs.device)
    return int(inverse_cdf_draw(probs.unsqueeze(0), u)[0])


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


# top-k / top-p first look only at each row's most likely tokens: sorting the whole 49k vocabulary
# costs ~2.4 ms a row, a top-256 ~0.2 ms. A row whose filter could keep more falls back to the sort.
CANDIDATES = 256


def filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, batched; returns probabilities [rows, vocab]."""
    dev = logits.device
    temps = torch.tensor([r.params.temperature for r in requests], device=dev, dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    top_k = [r.params.top_k for r in requests]
    top_p = [r.params.top_p for r in requests]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)
    min_p = [r.params.min_p for r in requests]
    if any(m > 0 for m in min_p):
        mp = torch.tensor(min_p, device=dev, dtype=probs.dtype).unsqueeze(1)
        probs = probs.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Logits with everything outside each row's top-k and top-p set to -inf."""
    vocab = logits.shape[-1]
    n = min(CANDIDATES, vocab)
    vals, order = logits.topk(n, dim=-1)  # sorted, descending
    cand_probs = (vals - logits.logsumexp(dim=-1, keepdim=True)).exp()  # over the whole vocabulary
    mass = cand_probs.sum(dim=-1)
    # the candidates decide a row exactly when its top-k fits in them, or its top-p mass is in them
    exact = [(0 < k <= n) or (k == 0 and p < 1.0 and m >= p) for k, p, m in zip(top_k, top_p, mass.tolist())]
    if all(exact):
        kept = _filter_sorted(vals, order, top_k, top_p, vocab, cand_probs)
        return torch.full_like(logits, float("-inf")).scatter(1, order, kept)
    vals, order = logits.sort(dim=-1, descending=True)
    kept = _filter_sorted(vals, order, top_k, top_p, vocab, vals.softmax(dim=-1))
    return torch.full_like(logits, float("-inf")).scatter(1, order, kept)


def _filter_sorted(vals: torch.Tensor, order: torch.Tensor, top_k: list[int], top_p: list[float], vocab: int,
                   probs: torch.Tensor) -> torch.Tensor:
    """``vals``: each row's logits in descending order (all of them or the leading candidates),
    ``probs`` their probabilities over the whole vocabulary; returns ``vals`` filtered."""
    dev = vals.device
    ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=dev)
    drop = torch.arange(vals.shape[-1], device=dev).unsqueeze(0) >= ks.unsqueeze(1)
    vals = vals.masked_fill(drop, float("-inf"))
    # top-p counts mass within the top-k: renormalise the rows that have one (the others hold
    # probabilities over the whole vocabulary already, even when only candidates are here)
    has_k = torch.tensor([k > 0 for k in top_k], device=dev).unsqueeze(1)
    probs = probs.masked_fill(drop, 0.0)
    probs = torch.where(has_k, probs / probs.sum(dim=-1, keepdim=True), probs)
    ps = torch.tensor(top_p, device=dev, dtype=vals.dtype)
    # keep the smallest prefix whose mass reaches top_p (the top token always stays)
    mass_before = probs.cumsum(dim=-1) - probs
    return vals.masked_fill(mass_before >= ps.unsqueeze(1), float("-inf"))
