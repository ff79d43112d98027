"""Adaptive speculation: how many tokens to draft for each decoding request, this step.

Drafting k tokens for a request whose drafts are accepted at rate a yields, per verify,
E(a, k) = 1 + a + ... + a^k tokens instead of one, and costs the step the extra rows of
the verification forward. The step-time model (learned from measured steps) prices
those rows; the policy picks the k of every request that maximises the batch's tokens
per second, exactly (Dinkelbach's method for a ratio: with λ the current tokens/s, each
request takes the k that maximises E - λ·cost, then λ is updated; a few rounds converge).
At a large batch the step is compute-bound and extra rows cost as much as the tokens
they may yield, so k falls to 0 and speculation costs nothing; alone, a stream's step is
bound by reading weights, extra rows are nearly free, and k rises to its maximum.

Acceptance is tracked per request (a moving average of accepted / tried positions). A
request whose drafts were rejected drifts back up toward the prior each step it does
not speculate, so it is tried again now and then. Plain Python: the scheduler runs it.

The scheduler calls the policy at a few named points of a step and knows nothing else of
speculation: ``begin_step`` (plan this step's k per decoding request), ``drafts_to_verify``
(the part of a request's pending draft its chunk carries), ``propose_k`` (tokens to draft after
the step), ``on_result`` (a chunk's tokens came back: learn, count) and ``on_preempt``.
``NoSpeculation`` answers the same calls when speculation is off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.request import Request
from kvserve.engine.step_cost import StepCostModel


@dataclass
class SpecStats:
    num_verifies: int = 0  # verify chunks (a decode with at least one drafted token)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # by verify chunks: accepted drafts plus the target's token
    accepted_length_counts: list[int] = field(default_factory=list)  # [m]: verifies that accepted m drafts


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verify of k drafts emits on average when each is accepted with probability a."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def is_decoding(req: Request) -> bool:
    """The request has exactly its last token left to compute: a decode (with a draft: a verify)."""
    return req.num_tokens - req.num_computed_tokens == 1


class NoSpeculation:
    """The policy when speculation is off: nothing is drafted or verified."""

    def __init__(self) -> None:
        self.stats = SpecStats()

    def begin_step(self, running: list[Request]) -> None:
        pass

    def drafts_to_verify(self, req: Request, budget: int) -> list[int]:
        return []

    def propose_k(self, req: Request) -> int:
        return 0

    def on_result(self, req: Request, is_decode: bool, drafted: int, accepted: int) -> None:
        pass

    def on_preempt(self, req: Request) -> None:
        pass


class SpecPolicy:
    def __init__(self, k_max: int, cost: StepCostModel, *, adaptive: bool = True, prior: float = 0.5,
                 smoothing: float = 0.3, recovery: float = 0.05):
        self.k_max = k_max
        self.cost = cost
        self.adaptive = adaptive
        self.prior = prior
        self.smoothing = smoothing  # weight of the newest verify in the acceptance average
        self.recovery = recovery  # per idle step, how far a request's estimate moves back to the prior
        self.stats = SpecStats(accepted_length_counts=[0] * (k_max + 1))
        self._plan: dict[str, int] = {}  # this step's k per decoding request
        self._fresh_k = k_max  # for requests that finish their prefill this step

    # -- the scheduler's hooks ------------------------------------------------------------
    def begin_step(self, running: list[Request]) -> None:
        """Plan this step: drafted tokens worth verifying (and drafting next) per decoding request."""
        self._plan = self.plan([r for r in running if is_decoding(r)])
        self._fresh_k = max(self._plan.values(), default=self.k_max)

    def drafts_to_verify(self, req: Request, budget: int) -> list[int]:
        """The part of ``req``'s pending draft to verify this step: within the plan's k, the step's
        token budget, the context window and max_tokens (a verify emits up to k + 1 tokens)."""
        drafts = req.spec.draft_token_ids
        if not drafts or not is_decoding(req):
            return []
        k = min(len(drafts), self._plan.get(req.request_id, 0), budget - 1, req.max_total_tokens - req.num_tokens)
        if req.params.max_tokens is not None:
            k = min(k, req.params.max_tokens - req.num_output_tokens - 1)
        return drafts[: max(0, k)]

    def propose_k(self, req: Request) -> int:
        """Tokens to draft for ``req`` after this step (its chunk samples)."""
        return self._plan.get(req.request_id, self._fresh_k)

    def on_result(self, req: Request, is_decode: bool, drafted: int, accepted: int) -> None:
        """``req``'s chunk came back: a verify of ``drafted`` tokens accepted ``accepted``; a plain decode
        (``drafted`` 0) lets a low acceptance estimate recover."""
        if drafted:
            self.observe(req, drafted, accepted)
            req.spec.num_verifies += 1
            req.spec.num_draft_tokens += drafted
            req.spec.num_accepted_tokens += accepted
            st = self.stats
            st.num_verifies += 1
            st.num_draft_tokens += drafted
            st.num_accepted_tokens += accepted
            st.num_emitted_tokens += accepted + 1
            st.accepted_length_counts[accepted] += 1
        elif is_decode:
            self.idle(req)

    def on_preempt(self, req: Request) -> None:
        req.spec.draft_token_ids = []  # its KV is gone: the draft would be verified against nothing

    # -- the policy ---------------------------------------------------------------------------

    def acceptance(self, req: Request) -> float:
        return self.prior if req.spec.acceptance is None else req.spec.acceptance

    def plan(self, decoding: list[Request]) -> dict[str, int]:
        """k for each decoding request (request id → k)."""
        if not self.adaptive:
            return {r.request_id: self.k_max for r in decoding}
        if not self.cost.decode_ready or not decoding:  # plain decode steps first, to learn their price
            return {r.request_id: 0 for r in decoding}
        t0 = self.cost.decode_seconds(len(decoding), sum(r.num_tokens for r in decoding) / 1024)
        if t0 <= 0:
            return {r.request_id: self.k_max for r in decoding}
        # the yield and the extra seconds of each k, per request
        options = []
        for r in decoding:
            a = self.acceptance(r)
            options.append([(expected_tokens(a, k), self.cost.draft_seconds(r.num_tokens, k))
                            for k in range(self.k_max + 1)])
        lam = len(decoding) / t0
        ks = [0] * len(decoding)
        for _ in range(4):
            ks = [max(range(len(opts)), key=lambda k: opts[k][0] - lam * opts[k][1]) for opts in options]
            tokens = sum(opts[k][0] for opts, k in zip(options, ks))
            seconds = t0 + sum(opts[k][1] for opts, k in zip(options, ks))
            new = tokens / seconds
            if abs(new - lam) <= 1e-6 * lam:
                break
            lam = new
        return {r.request_id: k for r, k in zip(decoding, ks)}

    def observe(self, req: Request, drafted: int, accepted: int) -> None:
        """A verify of ``drafted`` tokens accepted the first ``accepted``."""
        if drafted <= 0:
            return
        tried = accepted + 1 if accepted < drafted else drafted  # positions after a rejection are unseen
        rate = accepted / tried
        s = req.spec
        s.acceptance = rate if s.acceptance is None else (1 - self.smoothing) * s.acceptance + self.smoothing * rate

    def idle(self, req: Request) -> None:
        """The request decoded without speculating: a low estimate recovers toward the prior (a high
        one is kept: the batch, not the request, was the reason)."""
        s = req.spec
        if s.acceptance is not None and s.acceptance < self.prior:
            s.acceptance += self.recovery * (self.prior - s.acceptance)
