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
"""

from __future__ import annotations

from kvserve.engine.request import Request
from kvserve.engine.step_cost import StepCostModel


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verify of k drafts emits on average when each is accepted with probability a."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class SpecPolicy:
    def __init__(self, k_max: int, cost: StepCostModel, *, adaptive: bool = True, prior: float = 0.5,
                 smoothing: float = 0.3, recovery: float = 0.05):
        self.k_max = k_max
        self.cost = cost
        self.adaptive = adaptive
        self.prior = prior
        self.smoothing = smoothing  # weight of the newest verify in the acceptance average
        self.recovery = recovery  # per idle step, how far a request's estimate moves back to the prior

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
