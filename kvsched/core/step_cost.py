"""A per-instance model of a worker step's GPU time, fitted online from the workers' reports.

    step_ms = intercept + a * prefill_tokens + b * decodes + c * decode_context
              + d * attention + e * swapped_blocks + f * fetched_blocks

prefill_tokens: prompt tokens of the step's chunks; decodes: sequences that decoded;
decode_context: the context tokens those sequences attend over, summed; attention: the
quadratic term of the chunks, sum of c * (c + prefix) (c the chunk's length, prefix the tokens
before it: a chunk deep into a long prompt costs far more than its token count says);
swapped_blocks: KV blocks copied to or from host memory at the step's boundary (the copies of
the Tasks messages the step's report first says applied; kvsched/core/tiers.py);
fetched_blocks: KV blocks got from the shared storage tier at the step's boundary, counted the
same way (kvsched/core/storage.py).

The coefficients start from the config's seed and are refitted by recursive least squares
with exponential forgetting, kept in information form: R = f R + x x', r = f r + x y, solved for
the coefficients. A constant ridge towards the seed keeps the terms a workload never exercises
(the attention term while nothing prefills) at their seed instead of letting them drift.
Reports are folded in batches (`FOLD_EVERY` of them, or at once when one carries prefill work,
the steps whose prediction matters): a steady decode step then costs one tuple append. The fold
points depend only on the report stream, so the model is a pure function of it: no clock, no
randomness, the same coefficients for the same reports.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FEATURES = (
    "intercept",
    "prefill_tokens",
    "decodes",
    "decode_context",
    "attention",
    "swapped_blocks",
    "fetched_blocks",
)
# Typical size of each feature: the fit runs on features divided by these, so the normal
# equations are well conditioned (an attention term of 1e9 beside an intercept of 1).
_SCALE = np.array([1.0, 1e3, 1e2, 1e6, 1e8, 1e2, 1e2])
# Ridge towards the seed, in the scaled units (a report adds ~1 per exercised term): small
# against the forgetting window, so it only decides the terms no recent report exercised.
_PRIOR = 1e-4
FOLD_EVERY = 64
# Weight of the newest step in the predicted and measured moving averages.
EWMA_ALPHA = 0.05


class StepCostModel:
    """Predicts a step's milliseconds from its terms; learns from measured steps."""

    def __init__(self, seed_ms: Sequence[float], forgetting: float) -> None:
        """seed_ms: one coefficient per FEATURES entry (milliseconds per unit).
        forgetting: weight of the past per report, in (0, 1]; 1 never forgets."""
        if len(seed_ms) != len(FEATURES):
            raise ValueError(f"need {len(FEATURES)} seed coefficients {FEATURES}")
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        self.seed = np.asarray(seed_ms, dtype=np.float64)
        self.forgetting = forgetting
        self._seed_scaled = self.seed * _SCALE
        self._R = np.zeros((len(FEATURES), len(FEATURES)))
        self._r = np.zeros(len(FEATURES))
        self._ridge = _PRIOR * np.eye(len(FEATURES))
        self._coef = self.seed.copy()
        self._plan = tuple(max(0.0, float(c)) for c in self.seed)
        self._rows: list[tuple[float, float, float, float, float, float, float]] = []
        self._ys: list[float] = []
        self.num_observed = 0  # reports learned from
        self.last_predicted_ms = 0.0  # the newest learned report: predicted before learning it
        self.last_measured_ms = 0.0
        self.ewma_predicted_ms = 0.0
        self.ewma_measured_ms = 0.0

    @property
    def coefficients(self) -> tuple[float, ...]:
        """The fitted coefficients, in FEATURES order (ms per unit)."""
        return tuple(float(c) for c in self._coef)

    def predict_ms(
        self,
        prefill_tokens: float,
        decodes: float,
        decode_context: float,
        attention: float,
        swapped_blocks: float = 0.0,
        fetched_blocks: float = 0.0,
    ) -> float:
        """Predicted milliseconds of a step with these terms, for planning: a term the fit made
        negative (noise) counts as free, never as a refund."""
        c0, c1, c2, c3, c4, c5, c6 = self._plan
        return (
            c0
            + c1 * prefill_tokens
            + c2 * decodes
            + c3 * decode_context
            + c4 * attention
            + c5 * swapped_blocks
            + c6 * fetched_blocks
        )

    @property
    def prefill_costs(self) -> tuple[float, float]:
        """(ms per prefill token, ms per unit of attention term) used for planning."""
        return self._plan[1], self._plan[4]

    @property
    def swap_block_ms(self) -> float:
        """Planned ms per block copied between host and GPU memory."""
        return self._plan[5]

    @property
    def fetch_block_ms(self) -> float:
        """Planned ms per block fetched from the storage tier."""
        return self._plan[6]

    def priced_tier_hit(self, gpu: int, host: int, stored: int, block_size: int) -> float:
        """Prompt tokens a hit of (GPU, host, storage) tokens is worth by this model: GPU hits
        whole, host and storage hits by the recompute their transfer saves
        (`priced_hit_tokens`). Routing's hit score, its predicted waits and a queued
        request's predicted prefill all read this one price."""
        if not host and not stored:
            return float(gpu)
        a_tok, a_attn = self.prefill_costs
        runs = [
            (host, self.swap_block_ms * host / block_size),
            (stored, self.fetch_block_ms * stored / block_size),
        ]
        return priced_hit_tokens(gpu, runs, a_tok, a_attn)

    def observe(
        self,
        prefill_tokens: int,
        decodes: int,
        decode_context: int,
        attention: int,
        swapped_blocks: int,
        measured_ms: float,
        fetched_blocks: int = 0,
    ) -> None:
        """Learn from one measured step."""
        self._rows.append(
            (
                1.0,
                prefill_tokens,
                decodes,
                decode_context,
                attention,
                swapped_blocks,
                fetched_blocks,
            )
        )
        self._ys.append(measured_ms)
        if prefill_tokens or len(self._rows) >= FOLD_EVERY:
            self.fold()

    def fold(self) -> None:
        """Fold the reports observed since the last fold into the fit and solve it again."""
        if not self._rows:
            return
        x = np.array(self._rows, dtype=np.float64)
        y = np.array(self._ys, dtype=np.float64)
        self._rows, self._ys = [], []
        # One-step-ahead predictions (before learning these rows), for predicted vs measured:
        # the moving averages e <- e + alpha (v - e) over the rows, unrolled.
        pred = x @ self._coef
        k = len(y)
        keep = 1.0 - EWMA_ALPHA
        if self.num_observed == 0:  # the first row starts the averages
            ep, em = float(pred[0]), float(y[0])
            pred, y_new, k_new = pred[1:], y[1:], k - 1
        else:
            ep, em = self.ewma_predicted_ms, self.ewma_measured_ms
            y_new, k_new = y, k
        w_avg = EWMA_ALPHA * keep ** np.arange(k_new - 1, -1, -1, dtype=np.float64)
        self.ewma_predicted_ms = keep**k_new * ep + float(w_avg @ pred)
        self.ewma_measured_ms = keep**k_new * em + float(w_avg @ y_new)
        self.last_predicted_ms = float(x[-1] @ self._coef)
        self.last_measured_ms = float(y[-1])
        self.num_observed += k
        xs = x / _SCALE
        f = self.forgetting
        w = f ** np.arange(k - 1, -1, -1, dtype=np.float64)  # newest weighs 1
        xw = xs * w[:, None]
        decay = f**k
        self._R = decay * self._R + xw.T @ xs
        self._r = decay * self._r + xw.T @ y
        coef_scaled = np.linalg.solve(
            self._R + self._ridge, self._r + self._ridge @ self._seed_scaled
        )
        self._coef = coef_scaled / _SCALE
        self._plan = tuple(max(0.0, float(c)) for c in self._coef)


def priced_hit_tokens(
    gpu_tokens: float,
    runs: Sequence[tuple[float, float]],
    prefill_token_ms: float,
    attention_ms: float,
) -> float:
    """Prompt tokens a hit is worth: GPU hits whole; each further run (tokens, ms to bring them
    to the GPU) in tier order (host memory: swap-in, then storage: fetch by size / bandwidth)
    by the share of its recompute time the transfer saves (none when moving costs more than
    recomputing: the model's prefill terms over its positions). For routing (`core.router`)."""
    worth, start = float(gpu_tokens), float(gpu_tokens)
    for tokens, transfer_ms in runs:
        if tokens <= 0:
            continue
        end = start + tokens
        recompute = prefill_token_ms * tokens + attention_ms * (end * end - start * start) / 2
        if recompute > 0:
            worth += tokens * max(0.0, 1.0 - transfer_ms / recompute)
        start = end
    return worth
