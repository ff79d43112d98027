"""A step-time model learned online from measured steps; the scheduler sizes prefill chunks with it.

Two fits, so that neither can hide in the other:
- decode: seconds of a decode-only step ≈ d0 + d1·sequences + d2·Σcontext/1024, fitted on
  decode-only steps;
- prefill: the extra seconds prefill adds to a step ≈ p1·tokens + p2·Σ(tokens·chunk end)/1024,
  fitted with no intercept on what a step with prefill took beyond the decode fit's prediction
  for its decodes (its fixed overhead included);
- drafts: a speculative verify chunk counts as a decode row plus its k drafted tokens, and
  the drafts add ≈ v1·tokens + v2·Σ(tokens·chunk end)/1024, fitted like prefill on what steps
  with drafts (and no prefill) took beyond the decode fit. Until it has data, the prefill
  fit's price stands in.
One regression over all steps let the intercept absorb the prefill cost whenever recent steps
carried prefill chunks of similar size, so a long chunk looked nearly free; splitting the fits
keeps the marginal price of a prefill token honest. Recent steps weigh more (older ones fade),
so the model follows whatever machine and runner it is on. Plain Python: the simulator drives
the same scheduler with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.batch import Batch


@dataclass(frozen=True)
class StepFeatures:
    prefill_tokens: int
    decode_seqs: int
    decode_attention: float  # Σ decode contexts / 1024
    prefill_attention: float = 0.0  # Σ chunk tokens × chunk end / 1024
    draft_tokens: int = 0  # drafted tokens verified (their decode rows count as decodes)
    draft_attention: float = 0.0  # Σ drafts × chunk end / 1024

    @classmethod
    def of(cls, batch: Batch) -> "StepFeatures":
        prefill = [c for c in batch.chunks if not c.is_decode and not c.is_verify]
        decodes = [c for c in batch.chunks if c.is_decode or c.is_verify]
        drafts = [(len(c.draft_token_ids), c.end) for c in batch.chunks if c.is_verify]
        return cls(sum(c.num_tokens for c in prefill), len(decodes),
                   sum(c.end - len(c.draft_token_ids) for c in decodes) / 1024,
                   sum(c.num_tokens * c.end for c in prefill) / 1024,
                   sum(k for k, _ in drafts), sum(k * end for k, end in drafts) / 1024)


class _RecursiveLeastSquares:
    """Non-negative least squares over exponentially fading observations."""

    def __init__(self, n: int, forget: float):
        self.n, self.forget = n, forget
        self.count = 0
        self._xtx = [[0.0] * n for _ in range(n)]
        self._xty = [0.0] * n
        self._w: list[float] | None = None

    def observe(self, x: tuple[float, ...], y: float) -> None:
        for i in range(self.n):
            self._xty[i] = self.forget * self._xty[i] + x[i] * y
            for j in range(self.n):
                self._xtx[i][j] = self.forget * self._xtx[i][j] + x[i] * x[j]
        self.count += 1
        self._w = None

    def weights(self) -> list[float]:
        """Solve; drop the features whose weight comes out negative (a cost never shrinks with
        more work) and solve again on the rest."""
        if self._w is None:
            active = list(range(self.n))
            sol: list[float] = []
            while active:
                a = [[self._xtx[i][j] for j in active] + [self._xty[i]] for i in active]
                for k in range(len(active)):
                    a[k][k] += 1e-9  # keeps the system solvable before every feature has varied
                sol = _solve(a)
                if all(w >= 0 for w in sol):
                    break
                active = [i for i, w in zip(active, sol) if w >= 0]
            w = [0.0] * self.n
            for i, v in zip(active, sol):
                w[i] = max(0.0, v)
            self._w = w
        return self._w


class StepCostModel:
    def __init__(self, forget: float = 0.98, min_observations: int = 4):
        self.min_observations = min_observations
        self._decode = _RecursiveLeastSquares(3, forget)
        self._prefill = _RecursiveLeastSquares(2, forget)
        self._draft = _RecursiveLeastSquares(2, forget)

    @property
    def ready(self) -> bool:
        """Both fits have seen enough steps, and prefill costs something."""
        return (self._decode.count >= self.min_observations and self._prefill.count >= self.min_observations
                and any(w > 0 for w in self._prefill.weights()))

    @property
    def decode_ready(self) -> bool:
        return self._decode.count >= self.min_observations

    def observe(self, f: StepFeatures, seconds: float) -> None:
        if f.draft_tokens:
            if f.prefill_tokens == 0 and self._decode.count:  # steps with both teach neither
                rest = seconds - self.decode_seconds(f.decode_seqs, f.decode_attention)
                self._draft.observe((float(f.draft_tokens), f.draft_attention), rest)
        elif f.prefill_tokens == 0:
            self._decode.observe((1.0, float(f.decode_seqs), f.decode_attention), seconds)
        else:
            # before any decode-only step is known, charge the whole step to prefill: an
            # overestimate, so the first caps err on the side of smaller chunks
            rest = seconds - self.decode_seconds(f.decode_seqs, f.decode_attention) if self._decode.count else seconds
            self._prefill.observe((float(f.prefill_tokens), f.prefill_attention), rest)

    def decode_seconds(self, seqs: int, attention: float) -> float:
        """A step of ``seqs`` decodes (Σ contexts / 1024 = ``attention``), with the step's fixed cost."""
        w = self._decode.weights()
        return w[0] + w[1] * seqs + w[2] * attention

    def draft_seconds(self, context: int, k: int) -> float:
        """What verifying ``k`` drafted tokens after a decode row at ``context`` adds to a step."""
        fit = self._draft if self._draft.count >= self.min_observations else self._prefill
        w = fit.weights()
        return w[0] * k + w[1] * k * (context + k) / 1024

    def prefill_seconds(self, start: int, n: int) -> float:
        """What a prefill chunk of ``n`` tokens at position ``start`` adds to a step."""
        w = self._prefill.weights()
        return w[0] * n + w[1] * n * (start + n) / 1024

    def predict(self, f: StepFeatures) -> float:
        w = self._prefill.weights()
        return (self.decode_seconds(f.decode_seqs, f.decode_attention)
                + w[0] * f.prefill_tokens + w[1] * f.prefill_attention)


def _solve(a: list[list[float]]) -> list[float]:
    """Gaussian elimination with partial pivoting on an augmented n x (n+1) matrix."""
    n = len(a)
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(a[r][c]))
        a[c], a[p] = a[p], a[c]
        if abs(a[c][c]) < 1e-30:
            continue
        for r in range(c + 1, n):
            k = a[r][c] / a[c][c]
            for j in range(c, n + 1):
                a[r][j] -= k * a[c][j]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        if abs(a[r][r]) < 1e-30:
            continue
        x[r] = (a[r][n] - sum(a[r][j] * x[j] for j in range(r + 1, n))) / a[r][r]
    return x
