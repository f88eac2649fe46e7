"""Paired, per-user comparison of two methods from their per-example predictions (`c2kd.predictions`).

Two methods evaluated on the same examples over several seeds are compared user by user:

- seeds are matched by seed (a mapping seed -> predictions for each method), never by position;
  both methods must have the same seeds and, at each seed, the same examples of the same users;
- each user's score is the mean hit over the seeds (and over the user's examples: one per user in
  the leave-one-out validation and test splits); `diff` is the mean over users of the per-user
  difference, which equals the difference of the two methods' HR@1 averaged over seeds;
- the 95 % confidence interval is a paired bootstrap over users (the users resampled, both methods
  kept together), percentile method, with a fixed random seed;
- the p-value is McNemar's exact test on the discordant (example, seed) pairs (A right and B wrong
  = a win, the reverse = a loss): a two-sided binomial test of wins among wins + losses at 1/2.
  Pooling seeds treats a user's seeds as separate pairs, which is the usual simplification; the
  bootstrap, which resamples whole users, does not make it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import polars as pl
from scipy.stats import binomtest

from c2kd.errors import C2KDError
from c2kd.predictions import check_predictions, read_predictions

BINARY_METRICS = {"hit@1": "HR@1", "hit@10": "HR@10"}
DEFAULT_RESAMPLES = 10_000
DEFAULT_RNG_SEED = 0


@dataclass(frozen=True)
class PairedComparison:
    """Method A against method B on one split, per user, pooled over seeds."""

    name_a: str
    name_b: str
    metric: str  # a column of the predictions, e.g. "hit@1"
    split: str
    n_users: int
    seeds: tuple[int, ...]
    mean_a: float  # mean over users of the per-user mean over seeds
    mean_b: float
    diff: float  # mean_a - mean_b
    ci_low: float  # paired bootstrap over users, `confidence` level
    ci_high: float
    p_value: float  # McNemar exact (two-sided) on the discordant (example, seed) pairs
    wins: int  # pairs A got right and B wrong
    losses: int  # pairs B got right and A wrong
    confidence: float = 0.95

    def __str__(self) -> str:
        seeds = f"{len(self.seeds)} seed{'s' if len(self.seeds) != 1 else ''}"
        level = f"{self.confidence * 100:g} %"
        return (f"{self.name_a} − {self.name_b}: {_signed(self.diff)} {BINARY_METRICS[self.metric]} "
                f"[{level} CI {_signed(self.ci_low)}, {_signed(self.ci_high)}], {_p(self.p_value)} "
                f"(McNemar exact, {self.n_users} users × {seeds})")


def _signed(x: float) -> str:
    # a true minus sign, and no "-0.000"
    text = f"{x:+.3f}"
    return "+0.000" if text in ("-0.000", "+0.000") else text.replace("-", "−")


def _p(p: float) -> str:
    return f"p = {p:.2g}" if p >= 0.001 else f"p = {p:.1e}"


Predictions = pl.DataFrame | str | os.PathLike


def paired_comparison(
    a: Mapping[int, Predictions],
    b: Mapping[int, Predictions],
    name_a: str = "A",
    name_b: str = "B",
    split: str = "test",
    metric: str = "hit@1",
    resamples: int = DEFAULT_RESAMPLES,
    rng_seed: int = DEFAULT_RNG_SEED,
    confidence: float = 0.95,
) -> PairedComparison:
    """Compare method A with method B on `split`, per user, pooled over seeds.

    `a`, `b`: seed -> predictions of that seed's run (a frame, a predictions file or a run folder).
    Refuses (C2KDError, one line) seeds that differ between the methods and, at any seed, examples
    or users that differ; also users that differ from one seed to the next."""
    if metric not in BINARY_METRICS:
        raise C2KDError(f"metric {metric!r}: expected one of {', '.join(BINARY_METRICS)} (a hit per example)")
    if resamples < 1 or not 0 < confidence < 1:
        raise C2KDError(f"resamples must be >= 1 and 0 < confidence < 1, got {resamples} and {confidence}")
    seeds = _matched_seeds(a, b, name_a, name_b)
    pairs = [_paired_seed(seed, a[seed], b[seed], name_a, name_b, split, metric) for seed in seeds]
    users0 = set(pairs[0]["user"].unique().to_list())
    for seed, frame in zip(seeds[1:], pairs[1:], strict=True):
        users = set(frame["user"].unique().to_list())
        if users != users0:
            raise C2KDError(f"split {split!r}: seed {seed} has {len(users - users0)} users seed {seeds[0]} lacks and "
                            f"lacks {len(users0 - users)} of its users; every seed must evaluate the same users")
    joined = pl.concat(pairs)
    per_user = (joined.group_by("user").agg(pl.col("a").mean(), pl.col("b").mean()).sort("user"))
    hits_a, hits_b = per_user["a"].to_numpy(), per_user["b"].to_numpy()
    low, high = paired_bootstrap(hits_a - hits_b, resamples, rng_seed, confidence)
    wins = int((joined["a"] & ~joined["b"]).sum())
    losses = int((~joined["a"] & joined["b"]).sum())
    p_value = binomtest(wins, wins + losses, 0.5).pvalue if wins + losses else 1.0
    mean_a, mean_b = float(hits_a.mean()), float(hits_b.mean())
    return PairedComparison(
        name_a=name_a, name_b=name_b, metric=metric, split=split, n_users=len(per_user), seeds=tuple(seeds),
        mean_a=mean_a, mean_b=mean_b, diff=float((hits_a - hits_b).mean()), ci_low=low, ci_high=high,
        p_value=float(min(1.0, p_value)), wins=wins, losses=losses, confidence=confidence,
    )


def paired_bootstrap(differences: np.ndarray, resamples: int, rng_seed: int, confidence: float) -> tuple[float, float]:
    """Percentile interval of the mean of `differences` (one per user) over users resampled with replacement."""
    rng = np.random.default_rng(rng_seed)
    n = len(differences)
    means = np.empty(resamples)
    chunk = max(1, 2**22 // max(n, 1))  # bounded memory: about 32 MiB of indices at a time
    for start in range(0, resamples, chunk):
        size = min(chunk, resamples - start)
        means[start : start + size] = differences[rng.integers(0, n, size=(size, n))].mean(axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)


def _matched_seeds(a: Mapping[int, Predictions], b: Mapping[int, Predictions], name_a: str, name_b: str) -> list[int]:
    for name, runs in ((name_a, a), (name_b, b)):
        if not runs:
            raise C2KDError(f"{name}: no seeds to compare")
        bad = [s for s in runs if isinstance(s, bool) or not isinstance(s, (int, np.integer))]
        if bad:
            raise C2KDError(f"{name}: seeds must be integers (a mapping seed -> predictions), got {bad[0]!r}")
    if set(a) != set(b):
        raise C2KDError(f"seeds differ: {name_a} has {sorted(a)}, {name_b} has {sorted(b)}; "
                        "compare the seeds both methods ran")
    return sorted(int(s) for s in a)


def _load(predictions: Predictions, what: str) -> pl.DataFrame:
    if isinstance(predictions, pl.DataFrame):
        return check_predictions(predictions, what)
    return read_predictions(predictions)


def _paired_seed(seed: int, a: Predictions, b: Predictions, name_a: str, name_b: str, split: str,
                 metric: str) -> pl.DataFrame:
    """One seed's examples of `split` with both methods' hits side by side: user, a, b."""
    frames = []
    for name, predictions in ((name_a, a), (name_b, b)):
        frame = _load(predictions, f"{name} seed {seed}").filter(pl.col("split") == split)
        if frame.height == 0:
            raise C2KDError(f"{name} seed {seed}: no predictions on split {split!r}")
        frames.append(frame.select("example_id", "user", "target", pl.col(metric)))
    key = ["example_id", "user", "target"]
    joined = frames[0].join(frames[1], on=key, how="full", suffix="_b", coalesce=True)
    only_a = joined[f"{metric}_b"].null_count()
    only_b = joined[metric].null_count()
    if only_a or only_b:
        raise C2KDError(f"seed {seed}, split {split!r}: {only_a} examples only {name_a} evaluated and {only_b} only "
                        f"{name_b} evaluated (or their users or targets differ); both must evaluate the same examples")
    return joined.select("user", pl.col(metric).alias("a"), pl.col(f"{metric}_b").alias("b"))
