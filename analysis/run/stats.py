"""The statistics every verdict rule uses: rate intervals, paired tests, a deterministic bootstrap.

Why intervals and not point estimates: "95% of 20 attempts valid" is as compatible with a true rate
of 80% as with 99%. A rule passes only when the interval's lower bound clears its threshold and fails
only when the upper bound is below it; in between it is inconclusive and says about how many more
attempts would decide. Why exact tests from `math` (no scipy): the counts are small, the formulas are
short, and a verdict must be reproducible byte for byte without another dependency.

Why clusters: a rate's unit of evidence is the distinct request (analysis/run/clusters.py), not the attempt.
At temperature 0 a repeat of the same bytes is not a new trial: 4,373 attempts of 37 request bodies
tell about 37 prompts, and a Wilson interval over the 4,373 was about a hundred times too narrow.
`cluster_rate` gives the interval those distinct requests support (docs/verdict-rules.md).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from k3load.outcomes import FAIL, INCONCLUSIVE, PASS

Z95 = 1.959963984540054  # two-sided 95%
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 20261203  # fixed: the same pairs give the same interval on every machine
MAX_MORE_ATTEMPTS = 1_000_000
# From this many attempts a ratio's interval is the normal one (`ratio_normal_ci`), not the bootstrap's:
# there the two agree to well within the bootstrap's own resampling noise, and 2,000 resamples of an
# hour's soak cost seconds of CPU per family. Below it every interval is the seeded bootstrap's.
NORMAL_RATIO_FROM = 10_000
# Fewer distinct requests than this decide no rate, whatever their attempts: a rate over a handful of
# prompts says how those prompts fared, not how the deployment does ("inconclusive, because only N
# distinct requests"). Ten: below it even 10 of 10 clean requests leave a 95% interval reaching 72%.
MIN_DISTINCT_REQUESTS = 10


@dataclass(frozen=True)
class Rate:
    """k successes of n attempts with a 95% interval: Wilson's score interval (well-behaved at 0%, 100% and
    small n) over `effective_n` trials. `clusters`: the distinct requests the attempts repeat
    (`cluster_rate`); None for a count whose items are independent trials (`wilson`)."""

    k: int
    n: int
    low: float
    high: float
    clusters: int | None = None
    effective_n: float | None = None  # what the interval was computed from (None: n)

    @property
    def value(self) -> float | None:
        return self.k / self.n if self.n else None

    def to_dict(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {"k": self.k, "n": self.n, "rate": self.value,
                                              "ci95": [self.low, self.high]}  # type: ignore[dict-item]
        if self.clusters is not None:
            out["distinct_requests"] = self.clusters
            out["effective_n"] = self.effective_n
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Rate:
        """A rate back from its `to_dict()` (verdict.json, a reference profile), its distinct requests kept."""
        return cls(int(data["k"]), int(data["n"]), float(data["ci95"][0]), float(data["ci95"][1]),
                   data.get("distinct_requests"), data.get("effective_n"))

    def text(self) -> str:
        if not self.n:
            return "no attempts"
        if self.clusters is None:
            return f"{self.value:.1%} of {self.n} (95% CI {self.low:.1%}-{self.high:.1%})"
        return (f"{self.value:.1%} of {self.clusters:,} distinct requests (95% CI {self.low:.1%}-{self.high:.1%}), "
                f"{self.n:,} attempts")


def _wilson_bounds(p: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson's score bounds for an observed share p of n (not necessarily whole) trials."""
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(max(p * (1 - p), 0.0) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def wilson(k: int, n: int, z: float = Z95) -> Rate:
    if n <= 0:
        return Rate(0, 0, 0.0, 1.0)
    low, high = _wilson_bounds(k / n, n, z)
    low = 0.0 if k == 0 else low  # exact at the edges, not 1 - 1e-16
    high = 1.0 if k == n else high
    return Rate(k, n, low, high)


def cluster_rate(successes_per_cluster: ArrayLike, attempts_per_cluster: ArrayLike) -> Rate:
    """The rate over attempts, its 95% interval from the distinct requests (clusters) the attempts repeat.

    The point estimate is successes over attempts (what a client sending this mix sees: a request sent
    twice as often weighs twice), the rate every earlier verdict gave. Its interval is Wilson's over an
    effective number of trials: the share's variance estimated from the clusters (the ratio estimator's
    cluster-robust variance, Σ(y_i - p·m_i)² / N²), n_eff = p(1-p)/variance, which is the attempts over
    Kish's design effect 1 + (m̄ - 1)·ICC without estimating the ICC apart. Without the small-sample factor
    C/(C-1), so that attempts that are each their own request get Wilson's interval exactly, as before
    (the coverage test in tests/unit/test_cluster_intervals.py holds without it). Two bounds: n_eff is at
    most the number of distinct requests (a repeat of the same request is not a new trial, however its
    answers happened to vary), and where the clusters show no variance to estimate (every one at the same
    share, 0% and 100% included) it is that number: each distinct request one trial, as the issue's
    "92% of 50 distinct requests (95% CI 81-97%)" reads. Vectorised: one pass over the clusters."""
    y = np.asarray(successes_per_cluster, dtype=float)
    m = np.asarray(attempts_per_cluster, dtype=float)
    keep = m > 0
    y, m = y[keep], m[keep]
    clusters, n, k = len(m), int(m.sum()), round(float(y.sum()))
    if not n:
        return Rate(0, 0, 0.0, 1.0, 0, 0.0)
    p = k / n
    effective = float(clusters)  # no variance to estimate: each distinct request one trial
    if clusters > 1 and 0 < k < n:
        residual = y - p * m
        variance = float(residual @ residual) / (n * n)
        if variance > 0:
            effective = p * (1 - p) / variance
    effective = max(1.0, min(effective, float(clusters), float(n)))
    low, high = _wilson_bounds(p, effective)
    return Rate(k, n, 0.0 if k == 0 else low, 1.0 if k == n else high, clusters, effective)


def decide_rate(rate: Rate, threshold: float) -> str:
    """'pass' (lower bound clears the threshold), 'fail' (upper bound below it) or 'inconclusive'; always
    inconclusive over fewer than MIN_DISTINCT_REQUESTS distinct requests (`too_few_requests`)."""
    if too_few_requests(rate):
        return INCONCLUSIVE
    if rate.n and rate.low >= threshold:
        return PASS
    if rate.n and rate.high < threshold:
        return FAIL
    return INCONCLUSIVE


def too_few_requests(rate: Rate) -> str | None:
    """'only N distinct requests' where a clustered rate has fewer than MIN_DISTINCT_REQUESTS, else None."""
    if rate.clusters is None or rate.clusters >= MIN_DISTINCT_REQUESTS:
        return None
    return f"only {rate.clusters} distinct request{'' if rate.clusters == 1 else 's'}"


def _at(rate: Rate, p: float, size: int) -> Rate:
    """The rate were it seen at share p over `size` distinct requests (or attempts, unclustered), each new
    request bringing the effective trials one brings now."""
    if rate.clusters is None:
        return wilson(round(p * size), size)
    per = (rate.effective_n or 0.0) / rate.clusters if rate.clusters else 1.0
    low, high = _wilson_bounds(p, max(1e-9, per * size))
    return Rate(round(p * size), size, low, high, size, per * size)


def more_requests_to_decide(rate: Rate, threshold: float) -> int | None:
    """About how many more distinct requests (attempts, for an unclustered rate), at the rate seen so far,
    would move the interval clear of the threshold; None when the observed rate sits on the threshold
    (no number decides)."""
    if not rate.n:
        return None
    p = rate.k / rate.n
    if abs(p - threshold) < 1e-9:
        return None
    if decide_rate(rate, threshold) != INCONCLUSIVE:
        return 0
    have = rate.n if rate.clusters is None else rate.clusters
    size = have
    while size < MAX_MORE_ATTEMPTS:
        size = max(size + 1, int(size * 1.25))
        if decide_rate(_at(rate, p, size), threshold) != INCONCLUSIVE:
            break
    low, high = have, size  # bisect the smallest deciding size
    while high - low > 1:
        middle = (low + high) // 2
        if decide_rate(_at(rate, p, middle), threshold) != INCONCLUSIVE:
            high = middle
        else:
            low = middle
    return high - have if high < MAX_MORE_ATTEMPTS else None


more_attempts_to_decide = more_requests_to_decide  # the name unclustered callers knew


def binomial_tail_ge(k: int, n: int, p: float = 0.5) -> float:
    """P(X >= k) for X ~ Binomial(n, p): exact."""
    if k <= 0:
        return 1.0
    return min(1.0, sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1)))


def mcnemar_one_sided(worse: int, better: int) -> float:
    """Exact one-sided McNemar p-value that the 'worse' discordant pairs outnumber the 'better' ones
    by more than chance (cold valid / warm broken against cold broken / warm valid)."""
    return binomial_tail_ge(worse, worse + better) if worse + better else 1.0


def sign_test_less(ratios: Sequence[float], bound: float) -> float:
    """Exact one-sided sign test p-value that the median ratio is below `bound` (ties dropped)."""
    below = sum(1 for r in ratios if r < bound)
    above = sum(1 for r in ratios if r > bound)
    return binomial_tail_ge(below, below + above) if below + above else 1.0


def bootstrap_median_ci(values: Sequence[float], level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES
                        ) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the median, seeded so the verdict is reproducible."""
    data = list(values)
    if len(data) < 2:
        return None
    rng = random.Random(BOOTSTRAP_SEED)
    medians = sorted(statistics.median(rng.choices(data, k=len(data))) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * (resamples - 1))], medians[math.ceil((1 - tail) * (resamples - 1))]


def ratio_ci(numerators: Sequence[int], denominators: Sequence[int], resamples: int = BOOTSTRAP_RESAMPLES
             ) -> tuple[float, float] | None:
    """Percentile bootstrap interval of sum(numerators)/sum(denominators), resampling attempts (a
    request's tokens are not independent of each other, so tokens are never the unit); seeded."""
    n = len(numerators)
    if n < 2 or not sum(denominators):
        return None
    num, den = np.asarray(numerators, dtype=float), np.asarray(denominators, dtype=float)
    rng = np.random.Generator(np.random.PCG64(BOOTSTRAP_SEED))
    ratios: list[float] = []
    chunk = max(1, min(resamples, 2_000_000 // n))
    while len(ratios) < resamples:
        picks = rng.integers(0, n, size=(min(chunk, resamples - len(ratios)), n))
        sums = den[picks].sum(axis=1)
        ratios += [float(x) for x in (num[picks].sum(axis=1)[sums > 0] / sums[sums > 0])]
        if not sums.any():
            break
    if not ratios:
        return None
    ratios.sort()
    return ratios[int(0.025 * (len(ratios) - 1))], ratios[int(np.ceil(0.975 * (len(ratios) - 1)))]


EXACT = 2.0**53  # whole numbers whose every partial sum stays below this add up exactly, in any order


def _resample_sums(table: list[np.ndarray], matrix: np.ndarray | None, picks: np.ndarray) -> list[np.ndarray]:
    """Each column's sum over each row of picks (a row is one resample); `matrix`: the columns side by
    side when they are whole numbers (then counted and multiplied), else None (gathered and summed)."""
    if matrix is None:
        return [np.take(column, picks).sum(axis=1) for column in table]
    counts = np.empty(picks.shape)
    for row, drawn in enumerate(picks):
        counts[row] = np.bincount(drawn, minlength=picks.shape[1])
    product = counts @ matrix
    return [product[:, k] for k in range(matrix.shape[1])]


def ratio_normal_ci(numerators: Sequence[float], denominators: Sequence[float]) -> tuple[float, float] | None:
    """95% interval of sum(numerators)/sum(denominators) from the ratio estimator's linearised variance,
    attempts the unit as in `ratio_ci`: R ± z·sqrt(Σ(a − R·d)² / (n − 1) / n) / mean(d), kept inside the
    range of the attempts' own ratios when every denominator is positive (no resample's ratio can leave
    it then). It is what the percentile bootstrap converges to as attempts grow, and costs one pass
    instead of 2,000."""
    n = len(numerators)
    num, den = np.asarray(numerators, dtype=float), np.asarray(denominators, dtype=float)
    total = float(den.sum())
    if n < 2 or not total:
        return None
    ratio = float(num.sum()) / total
    residual = num - ratio * den
    half = Z95 * math.sqrt(float(residual @ residual) / (n - 1) / n) / (total / n)
    low, high = ratio - half, ratio + half
    if bool(np.all(den > 0)):  # then every resample's ratio lies between the attempts' own ratios
        own = num / den
        low, high = max(low, float(own.min())), min(high, float(own.max()))
    return low, high


def ratio_cis(numerators: Sequence[int], denominators: Sequence[Sequence[int]], resamples: int = BOOTSTRAP_RESAMPLES
              ) -> list[tuple[float, float] | None]:
    """`ratio_ci(numerators, d)` for each d, each the same interval to the last bit, from one stream;
    from NORMAL_RATIO_FROM attempts `ratio_normal_ci(numerators, d)` instead.

    Why: each call draws the same picks (same seed, same n, same chunks), and at an hour's soak a call
    is 2,000 resamples of 360,000 attempts, so the picks are drawn once and the numerator summed once.
    Token counts are whole numbers, whose sums are exact in any order: each resample's picks are then
    counted per attempt and the counts multiplied into every column at once (one random access per
    pick instead of one per pick and column, the rest a dense product). Other values are gathered with
    `np.take` and summed as ratio_ci sums them. Either way every sum is the float ratio_ci gets. A
    denominator whose chunks part from the others' (a resample that summed to 0 shortens its next
    chunk, and the chunking shapes the stream) takes `ratio_ci` itself."""
    n = len(numerators)
    if n >= NORMAL_RATIO_FROM:
        return [ratio_normal_ci(numerators, den) for den in denominators]
    live = [i for i, den in enumerate(denominators) if n >= 2 and sum(den) != 0]
    out: list[tuple[float, float] | None] = [None] * len(denominators)
    if not live:
        return out
    table = [np.asarray(c, dtype=float) for c in (numerators, *(denominators[i] for i in live))]
    whole = all(bool(np.all(c == np.floor(c))) and float(np.abs(c).max()) * n < EXACT for c in table)
    matrix = np.column_stack(table) if whole else None
    rng = np.random.Generator(np.random.PCG64(BOOTSTRAP_SEED))
    ratios: dict[int, list[float]] = {i: [] for i in live}
    open_ = list(live)
    chunk = max(1, min(resamples, 2_000_000 // n))
    while open_:
        sizes = {min(chunk, resamples - len(ratios[i])) for i in open_}
        if len(sizes) > 1:  # the streams part: each remaining interval is drawn on its own
            for i in open_:
                out[i] = ratio_ci(numerators, denominators[i], resamples)
                del ratios[i]
            break
        sums = _resample_sums(table, matrix, rng.integers(0, n, size=(sizes.pop(), n)))
        num = sums[0]
        for column, i in enumerate(live, start=1):
            if i not in open_:
                continue
            den = sums[column]
            ratios[i] += [float(x) for x in (num[den > 0] / den[den > 0])]
            if len(ratios[i]) >= resamples or not den.any():
                open_.remove(i)
    for i, found in ratios.items():
        found.sort()
        out[i] = (found[int(0.025 * (len(found) - 1))], found[int(np.ceil(0.975 * (len(found) - 1)))]) if found \
            else None
    return out
