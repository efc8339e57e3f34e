"""Online estimators of what prefill, an L2 load and an L3 read cost here, now.

The engine's cost model (``engine/cost_model.py``) feeds and exports them; the
L3 tier keeps one read estimate per attached backend (``storage/bandwidth.py``).
Every estimate is fit online from what this instance measured (its own forward
steps, its own loads, its own L3 reads), never configured: a GPU and a CPU, a
local file store and a remote one each get their own numbers, and a store that
slows down moves them. Pure: no torch, no I/O, O(1) per sample (plain floats).

Invariants:
- An estimate is ``None`` ("unknown") until ``min_samples`` valid samples were
  seen; nothing is made up in the meantime.
- Samples with a time that is not a positive finite number, or with a negative
  or non-finite feature, are rejected (counted, not fitted).
- Coefficients are never negative (each term is work that takes time), so no
  prediction is negative; a prediction is positive once any sample was.
- Any thread may observe and read (each fit has its own lock: the scheduler
  thread feeds it while a scrape reads it).
- A prefill step far slower than predicted (over ``clip`` times, once known) counts
  as ``clip`` times the prediction: a stall moves the fit little. Transfers are not
  clipped: a store throttled tenfold must be followed at once.
- Old samples fade geometrically (``forget`` per sample): about the last
  ``1 / (1 - forget)`` samples dominate, so a change of regime (a busier
  machine) is followed within a few dozen samples. A transfer sample more than
  ``TRANSFER_RESTART`` times off its prediction (a store or link that changed
  speed) keeps only ``RESTART_KEEP`` of the history's weight: followed at once.

Prefill is fit as ``t = a + b*new + c*pairs + d*decode_rows`` over one forward
step: ``a`` the step's fixed cost (launches, sampling, Python), ``b`` the cost
linear in the new tokens (the projections and MLP, which dominate short
contexts), ``c`` the attention work, linear in the (query, key) pairs the new
tokens attend to (``new*context + new*(new+1)/2`` for a chunk after ``context``
cached tokens: quadratic in a cold prompt, linear in a long cached one), and
``d`` what the decode rows the chunk shares the step with add. That is the
shape of a transformer forward's arithmetic, so four numbers carry it across
prompt lengths, cache hits and batches; anything finer would need samples a
serving engine does not see. Only steps that computed prompt tokens are fit:
decode-only steps far outnumber them and would push the prefill samples out
of the forgetting window. A step's time includes waiting for host loads its
layers needed, and on an asynchronous device part of a step lands in the next
one; the fit averages both out over many steps.

Loads and reads are fit as ``t = latency + size / bandwidth`` (pages for the
host->device load, bytes for an L3 read): a call's fixed round trip plus its
transfer.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations

# Feature scales: keep the normal equations' entries near 1 so the solve stays exact.
_TOKENS = 1e3
_PAIRS = 1e6
_ROWS = 1e2
_BYTES = 1e6
# Samples between the refits of the coefficients a clip bounds new samples with.
CLIP_REFIT = 8
# The weight the history keeps when a transfer sample says the path changed speed.
RESTART_KEEP = 0.05
# How far off (times, either way) a transfer sample must be to say so.
TRANSFER_RESTART = 3.0


def attention_pairs(new_tokens: int, context: int) -> int:
    """The (query, key) pairs ``new_tokens`` tokens after ``context`` cached ones attend
    to (causal): each new token sees the context, the earlier new tokens and itself."""
    return new_tokens * context + new_tokens * (new_tokens + 1) // 2


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting (None: singular)."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


@dataclass
class NonNegativeFit:
    """Least squares ``y = sum(coef[i] * x[i])`` with coefficients >= 0, old samples
    forgotten geometrically; keeps only the normal equations (O(dim^2) per sample).

    The fit is solved on demand (cached until the next sample): the least-squares
    solution over every subset of the features, the best one whose coefficients are
    all non-negative (exact non-negative least squares for a handful of features).
    A tiny ridge keeps a feature that never varied from taking an arbitrary share.
    """

    dim: int
    forget: float = 0.97
    min_samples: int = 5
    # Once known, a sample above ``clip`` times the prediction counts as that much: one
    # stall (a collection pause, a page fault storm) shifts the fit a little, not by its
    # size, while a lasting slowdown is still followed, ``clip``-fold per few samples.
    clip: float | None = None
    # Once known, a sample off the prediction by more than ``restart`` times (either way)
    # keeps only ``RESTART_KEEP`` of the history's weight: a path whose speed changed (a
    # store throttled, a link shared) is followed within a sample or two, where the
    # forgetting alone would take dozens. For transfers; prefill steps are clipped instead.
    restart: float | None = None
    num_restarts: int = 0
    num_samples: int = 0
    num_rejected: int = 0
    _xx: list[list[float]] = field(default_factory=list, repr=False)
    _xy: list[float] = field(default_factory=list, repr=False)
    _yy: float = 0.0
    _coef: list[float] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # The coefficients the clip bounds samples with, refit every CLIP_REFIT samples
    # only: a bound needs no precision, and a fit per step would cost the scheduler.
    _clip_coef: list[float] | None = field(default=None, repr=False)
    _clip_age: int = 0

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"dim must be >= 1, got {self.dim}")
        if not 0 < self.forget <= 1:
            raise ValueError(f"forget must be in (0, 1], got {self.forget}")
        if self.min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {self.min_samples}")
        self._xx = [[0.0] * self.dim for _ in range(self.dim)]
        self._xy = [0.0] * self.dim

    def observe(self, x: Sequence[float], y: float) -> bool:
        """Add a sample; False (and counted as rejected) when it is nonsense."""
        if (len(x) != self.dim or not math.isfinite(y) or y <= 0
                or any(not math.isfinite(v) or v < 0 for v in x)):
            self.reject()
            return False
        with self._lock:
            if self.clip is not None and self.known:
                if self._clip_coef is None or self._clip_age >= CLIP_REFIT:
                    if self._coef is None:
                        self._coef = self._fit()
                    self._clip_coef, self._clip_age = self._coef, 0
                self._clip_age += 1
                bound = self.clip * sum(c * v for c, v in zip(self._clip_coef, x, strict=True))
                if bound > 0:
                    y = min(y, bound)
            if self.restart is not None and self.known:
                if self._coef is None:
                    self._coef = self._fit()
                predicted = sum(c * v for c, v in zip(self._coef, x, strict=True))
                if predicted > 0 and not predicted / self.restart <= y <= predicted * self.restart:
                    self._fade(RESTART_KEEP)
                    self.num_restarts += 1
            self._add(x, y)
        return True

    def reject(self) -> None:
        """Count a sample its caller found to be nonsense."""
        with self._lock:
            self.num_rejected += 1

    def _fade(self, keep: float) -> None:
        """Scale the history's weight by ``keep`` (its fit stays the same until new samples)."""
        for row in self._xx:
            for j in range(self.dim):
                row[j] *= keep
        for i in range(self.dim):
            self._xy[i] *= keep
        self._yy *= keep

    def _add(self, x: Sequence[float], y: float) -> None:
        k, xx, xy = self.forget, self._xx, self._xy
        for i in range(self.dim):
            xi = x[i]
            row = xx[i]
            for j in range(self.dim):
                row[j] = k * row[j] + xi * x[j]
            xy[i] = k * xy[i] + xi * y
        self._yy = k * self._yy + y * y
        self.num_samples += 1
        self._coef = None

    @property
    def known(self) -> bool:
        return self.num_samples >= self.min_samples

    def coefficients(self) -> list[float] | None:
        """The fitted coefficients (None: fewer than ``min_samples`` samples)."""
        with self._lock:
            if not self.known:
                return None
            if self._coef is None:
                self._coef = self._fit()
            return list(self._coef)

    def predict(self, x: Sequence[float]) -> float | None:
        coef = self.coefficients()
        if coef is None:
            return None
        return sum(c * v for c, v in zip(coef, x, strict=True))

    def _fit(self) -> list[float]:
        xx, xy = self._xx, self._xy
        ridge = 1e-9 * max(max(xx[i][i] for i in range(self.dim)), 1e-300)
        best: tuple[float, list[float]] = (math.inf, [0.0] * self.dim)
        for size in range(1, self.dim + 1):
            for subset in combinations(range(self.dim), size):
                a = [[xx[i][j] + (ridge if i == j else 0.0) for j in subset] for i in subset]
                b = [xy[i] for i in subset]
                sol = _solve(a, b)
                if sol is None or any(v < 0 for v in sol):
                    continue
                # Residual sum of squares from the normal equations alone.
                sse = self._yy - 2 * sum(s * bi for s, bi in zip(sol, b, strict=True))
                sse += sum(sol[p] * xx[i][j] * sol[q]
                           for p, i in enumerate(subset) for q, j in enumerate(subset))
                if sse < best[0] - 1e-15 * abs(self._yy):
                    coef = [0.0] * self.dim
                    for p, i in enumerate(subset):
                        coef[i] = sol[p]
                    best = (sse, coef)
        return best[1]


@dataclass
class PrefillEstimate:
    """Seconds of one forward step computing a prompt chunk (scheduler thread only)."""

    forget: float = 0.97
    min_samples: int = 8
    clip: float | None = 4.0
    fit: NonNegativeFit = field(init=False)

    def __post_init__(self) -> None:
        self.fit = NonNegativeFit(4, self.forget, self.min_samples, self.clip)

    @staticmethod
    def features(new_tokens: int, pairs: int, decode_rows: int) -> tuple[float, ...]:
        return (1.0, new_tokens / _TOKENS, pairs / _PAIRS, decode_rows / _ROWS)

    def observe(self, new_tokens: int, pairs: int, decode_rows: int, seconds: float) -> bool:
        """A step that computed ``new_tokens`` prompt tokens, attending ``pairs`` (query,
        key) pairs (``attention_pairs`` summed over its chunks), beside ``decode_rows``
        decoding requests, in ``seconds``."""
        if new_tokens <= 0:
            self.fit.reject()
            return False
        return self.fit.observe(self.features(new_tokens, pairs, decode_rows), seconds)

    @property
    def num_samples(self) -> int:
        return self.fit.num_samples

    def coefficients(self) -> dict[str, float] | None:
        """Seconds per step, per token, per attention pair and per decode row."""
        coef = self.fit.coefficients()
        if coef is None:
            return None
        return {"step_seconds": coef[0], "seconds_per_token": coef[1] / _TOKENS,
                "seconds_per_pair": coef[2] / _PAIRS, "seconds_per_decode_row": coef[3] / _ROWS}

    def predict(self, new_tokens: int, context: int = 0, decode_rows: int = 0) -> float | None:
        """Seconds of a step computing ``new_tokens`` after ``context`` cached tokens."""
        return self.fit.predict(
            self.features(new_tokens, attention_pairs(new_tokens, context), decode_rows)
        )

    def predict_prompt(self, new_tokens: int, context: int = 0, decode_rows: int = 0,
                       chunk: int | None = None) -> float | None:
        """Seconds to compute ``new_tokens`` after ``context`` in chunks of ``chunk``
        tokens (one step each, as the scheduler's chunked prefill does)."""
        coef = self.coefficients()
        if coef is None:
            return None
        return prompt_seconds(PrefillCoefficients(**coef), new_tokens, context, decode_rows,
                              chunk)


@dataclass(frozen=True)
class PrefillCoefficients:
    """A prefill fit's numbers in plain units (a snapshot: can be sent to other ranks)."""

    step_seconds: float
    seconds_per_token: float
    seconds_per_pair: float
    seconds_per_decode_row: float


def prompt_seconds(coef: PrefillCoefficients, new_tokens: int, context: int = 0,
                   decode_rows: int = 0, chunk: int | None = None) -> float:
    """Seconds to compute ``new_tokens`` after ``context`` cached ones, one step per
    ``chunk`` tokens (all in one step when ``chunk`` is None), ``decode_rows`` beside."""
    step = new_tokens if chunk is None or chunk <= 0 else chunk
    per_step = coef.step_seconds + coef.seconds_per_decode_row * decode_rows
    total, done = 0.0, 0
    while done < new_tokens:
        n = min(step, new_tokens - done)
        total += (per_step + coef.seconds_per_token * n
                  + coef.seconds_per_pair * attention_pairs(n, context + done))
        done += n
    return total


@dataclass
class TransferEstimate:
    """``seconds = latency + size * seconds_per_unit`` for a transfer of ``size`` units
    (pages, bytes); one per path (the host->device load, each L3 backend's reads)."""

    unit_scale: float = 1.0  # the feature is size / unit_scale (numerics only)
    forget: float = 0.97
    min_samples: int = 3
    fit: NonNegativeFit = field(init=False)

    def __post_init__(self) -> None:
        self.fit = NonNegativeFit(2, self.forget, self.min_samples, restart=TRANSFER_RESTART)

    def observe(self, size: float, seconds: float) -> bool:
        """A transfer of ``size`` units that took ``seconds``; an empty one is rejected."""
        if not size > 0:
            self.fit.reject()
            return False
        return self.fit.observe((1.0, size / self.unit_scale), seconds)

    @property
    def num_samples(self) -> int:
        return self.fit.num_samples

    @property
    def latency_s(self) -> float | None:
        coef = self.fit.coefficients()
        return None if coef is None else coef[0]

    @property
    def seconds_per_unit(self) -> float | None:
        coef = self.fit.coefficients()
        return None if coef is None else coef[1] / self.unit_scale

    def predict(self, size: float) -> float | None:
        return self.fit.predict((1.0, size / self.unit_scale))


def bytes_transfer_estimate() -> TransferEstimate:
    """An estimate over bytes (an L3 backend's reads): its bandwidth is 1 / seconds_per_unit."""
    return TransferEstimate(unit_scale=_BYTES)
