"""The benchmarks pair methods by seed, never by list position."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.real_llm import goals, hr1_by_seed
from benchmarks.student_variants import baseline_hr1

SASREC = {"candidates/HR@1": [0.2]}


def test_goals_pair_c2kd_and_logit_kd_by_seed():
    rows = {"C2KD": {"candidates/HR@1": [0.30, 0.40], "seeds": [2, 0]},
            "logit KD": {"candidates/HR@1": [0.10, 0.20, 0.50], "seeds": [0, 1, 2]}}
    paired = goals(SASREC, rows)["C2KD - logit KD (paired over seeds)"]
    assert paired["seeds"] == [0, 2]
    assert paired["differences"] == pytest.approx([0.40 - 0.10, 0.30 - 0.50])


def test_rows_recorded_without_seeds_hold_seeds_in_order():
    assert hr1_by_seed({"candidates/HR@1": [0.3, 0.4]}) == {0: 0.3, 1: 0.4}
    with pytest.raises(ValueError, match="2 HR@1 values and 1 seeds"):
        hr1_by_seed({"candidates/HR@1": [0.3, 0.4], "seeds": [5]})


def test_baseline_is_looked_up_by_seed(tmp_path):
    bench = SimpleNamespace(run_folder=lambda family, method, seed: tmp_path / f"{method}-s{seed}")
    recorded = {"families": {"smollm2": {"rows": {"logit KD": {"candidates/HR@1": [0.31, 0.35], "seeds": [1, 4]}}}}}
    assert baseline_hr1(bench, recorded, "smollm2", "logit KD", 4) == 0.35
    with pytest.raises(SystemExit, match=r"seed 0: .*recorded seeds: \[1, 4\]"):
        baseline_hr1(bench, recorded, "smollm2", "logit KD", 0)
