"""A step-time model learned online from measured steps; the scheduler sizes prefill chunks with it.

seconds ≈ w0 + w1·prefill_tokens + w2·decode_seqs + w3·attention_work, where attention_work is
(Σ decode contexts + Σ chunk tokens × chunk end) / 1024. The weights come from least squares over
recent steps (older ones fade), so the model follows whatever machine and runner it is on. Plain
Python: the simulator can drive the same scheduler with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.batch import Batch

NUM_FEATURES = 4


@dataclass(frozen=True)
class StepFeatures:
    prefill_tokens: int
    decode_seqs: int
    attention_work: float

    @classmethod
    def of(cls, batch: Batch) -> "StepFeatures":
        prefill = [c for c in batch.chunks if not c.is_decode]
        decodes = [c for c in batch.chunks if c.is_decode]
        work = sum(c.end for c in decodes) + sum(c.num_tokens * c.end for c in prefill)
        return cls(sum(c.num_tokens for c in prefill), len(decodes), work / 1024)

    def vector(self) -> tuple[float, ...]:
        return (1.0, float(self.prefill_tokens), float(self.decode_seqs), self.attention_work)


class StepCostModel:
    def __init__(self, forget: float = 0.98, min_observations: int = 12):
        self.forget = forget
        self.min_observations = min_observations
        self.num_observations = 0
        self._xtx = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        self._xty = [0.0] * NUM_FEATURES
        self._weights: list[float] | None = None
        self._seen_prefill = self._seen_decode = False

    @property
    def ready(self) -> bool:
        """Enough varied steps seen to trust predictions, and a fit in which prefill costs something."""
        if not (self.num_observations >= self.min_observations and self._seen_prefill and self._seen_decode):
            return False
        w = self.weights()
        return w[1] > 0 or w[3] > 0

    def observe(self, f: StepFeatures, seconds: float) -> None:
        x = f.vector()
        for i in range(NUM_FEATURES):
            self._xty[i] = self.forget * self._xty[i] + x[i] * seconds
            for j in range(NUM_FEATURES):
                self._xtx[i][j] = self.forget * self._xtx[i][j] + x[i] * x[j]
        self.num_observations += 1
        self._seen_prefill |= f.prefill_tokens > 0
        self._seen_decode |= f.decode_seqs > 0 and f.prefill_tokens == 0
        self._weights = None

    def weights(self) -> list[float]:
        """Non-negative least squares (a cost never shrinks with more work): solve, drop the features
        whose weight comes out negative, solve again on the rest. Clipping a negative weight to zero
        instead would leave its correlated partner fitted to compensate for it, and so too small."""
        if self._weights is None:
            active = list(range(NUM_FEATURES))
            while True:
                ridge = 1e-9  # keeps the system solvable before every feature has varied
                a = [[self._xtx[i][j] for j in active] + [self._xty[i]] for i in active]
                for k in range(len(active)):
                    a[k][k] += ridge
                sol = _solve(a)
                if all(w >= 0 for w in sol) or len(active) == 1:
                    break
                active = [i for i, w in zip(active, sol) if w >= 0]
            weights = [0.0] * NUM_FEATURES
            for i, w in zip(active, sol):
                weights[i] = max(0.0, w)
            self._weights = weights
        return self._weights

    def predict(self, f: StepFeatures) -> float:
        return sum(w * x for w, x in zip(self.weights(), f.vector()))


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
