"""Paired per-user comparison of two methods (c2kd.compare) on synthetic predictions."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from scipy.stats import binomtest

from c2kd.compare import paired_comparison
from c2kd.errors import C2KDError
from c2kd.predictions import COLUMNS, prediction_rows, write_predictions

USERS = 300


def predictions(hits: np.ndarray, split: str = "test", users: np.ndarray | None = None) -> pl.DataFrame:
    """One example per user (as in the leave-one-out test split): rank 1 for a hit, rank 5 otherwise."""
    users = np.arange(len(hits)) if users is None else users
    examples = pl.DataFrame({"example_id": 1000 + users, "user": users, "target": 1 + users % 50})
    return prediction_rows(examples, split, np.where(hits, 1, 5))


def seeded(rng: np.random.Generator, p: float, seeds=(0, 1, 2)) -> dict[int, np.ndarray]:
    return {s: rng.random(USERS) < p for s in seeds}


def test_identical_methods_differ_by_nothing():
    rng = np.random.default_rng(1)
    hits = seeded(rng, 0.3)
    a = {s: predictions(h) for s, h in hits.items()}
    result = paired_comparison(a, dict(a), "C2KD", "logit KD")
    assert result.diff == 0 and result.ci_low == 0 and result.ci_high == 0
    assert result.p_value == 1.0 and result.wins == result.losses == 0
    assert result.n_users == USERS and result.seeds == (0, 1, 2)
    assert result.mean_a == pytest.approx(np.mean([h.mean() for h in hits.values()]))
    assert str(result) == (f"C2KD − logit KD: +0.000 HR@1 [95 % CI +0.000, +0.000], p = 1 "
                           f"(McNemar exact, {USERS} users × 3 seeds)")


def test_a_method_that_wins_on_many_users_is_significant():
    rng = np.random.default_rng(2)
    base = seeded(rng, 0.3)
    # A fixes a third of B's misses and loses a few of its hits
    better = {s: (h | (rng.random(USERS) < 0.33)) & ~(h & (rng.random(USERS) < 0.05)) for s, h in base.items()}
    result = paired_comparison({s: predictions(h) for s, h in better.items()},
                               {s: predictions(h) for s, h in base.items()}, "C2KD", "SFT")
    expected = np.mean([better[s].mean() - base[s].mean() for s in base])
    assert result.diff == pytest.approx(expected)
    assert result.diff == pytest.approx(result.mean_a - result.mean_b)
    assert 0 < result.ci_low < result.diff < result.ci_high
    assert result.p_value < 0.05
    wins = sum(int((better[s] & ~base[s]).sum()) for s in base)
    losses = sum(int((~better[s] & base[s]).sum()) for s in base)
    assert (result.wins, result.losses) == (wins, losses)
    assert result.p_value == pytest.approx(binomtest(wins, wins + losses, 0.5).pvalue)
    assert str(result).startswith(f"C2KD − SFT: +{result.diff:.3f} HR@1 [95 % CI +")
    # the reverse comparison: the same test, the interval mirrored
    reverse = paired_comparison({s: predictions(h) for s, h in base.items()},
                                {s: predictions(h) for s, h in better.items()})
    assert reverse.diff == pytest.approx(-result.diff) and reverse.ci_high < 0
    assert reverse.p_value == pytest.approx(result.p_value)
    assert "−" in str(reverse)


def test_seeds_are_matched_by_seed_not_by_order():
    rng = np.random.default_rng(3)
    a_hits, b_hits = seeded(rng, 0.4, (0, 1, 2)), seeded(rng, 0.4, (0, 1, 2))
    a = {s: predictions(h) for s, h in a_hits.items()}
    b = {s: predictions(h) for s, h in b_hits.items()}
    reordered = {s: b[s] for s in (2, 0, 1)}
    assert paired_comparison(a, b) == paired_comparison(a, reordered)
    wins = sum(int((a_hits[s] & ~b_hits[s]).sum()) for s in a_hits)
    assert paired_comparison(a, b).wins == wins


def test_mismatched_seeds_or_users_are_refused(tmp_path):
    rng = np.random.default_rng(4)
    a = {s: predictions(h) for s, h in seeded(rng, 0.3).items()}
    with pytest.raises(C2KDError, match=r"seeds differ: A has \[0, 1, 2\], B has \[0, 1, 3\]"):
        paired_comparison(a, {0: a[0], 1: a[1], 3: a[2]})
    with pytest.raises(C2KDError, match="seeds differ"):
        paired_comparison(a, {0: a[0], 1: a[1]})
    other_users = predictions(rng.random(USERS) < 0.3, users=np.arange(USERS) + 1)
    with pytest.raises(C2KDError, match="seed 1, split 'test': 1 examples only A evaluated and 1 only B"):
        paired_comparison(a, {**a, 1: other_users})
    with pytest.raises(C2KDError, match="seed 2 has 1 users seed 0 lacks"):
        paired_comparison({**a, 2: other_users}, {**a, 2: other_users})
    with pytest.raises(C2KDError, match="no predictions on split 'validation'"):
        paired_comparison(a, a, split="validation")
    with pytest.raises(C2KDError, match="seeds must be integers"):
        paired_comparison({"0": a[0]}, {"0": a[0]})


def test_predictions_are_read_from_run_folders(tmp_path):
    rng = np.random.default_rng(5)
    hits = seeded(rng, 0.3, (0, 1))
    runs = {}
    for s, h in hits.items():
        run = tmp_path / f"run-s{s}"
        write_predictions(run / "predictions.parquet", [predictions(h, "validation"), predictions(~h, "test")])
        runs[s] = run
    frames = {s: pl.concat([predictions(h, "validation"), predictions(h, "test")]) for s, h in hits.items()}
    from_files = paired_comparison(runs, frames, split="validation")
    assert from_files.diff == 0 and from_files.n_users == USERS
    flipped = paired_comparison(runs, frames, split="test")
    assert flipped.wins + flipped.losses == 2 * USERS and flipped.p_value < 1e-6
    assert set(COLUMNS) <= set(frames[0].columns)
