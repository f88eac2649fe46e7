"""Metrics against hand-computed cases (c2kd/metrics.py)."""

from __future__ import annotations

import math

import pytest
import torch

from c2kd.metrics import (
    candidate_metrics,
    candidate_ranks,
    full_catalog_metrics,
    full_catalog_ranks,
    generation_metrics,
    named_candidate,
)


def approx(d: dict) -> dict:
    return {k: pytest.approx(v) for k, v in d.items()}


# --------------------------------------------------------------------------- 20 candidates


def test_candidate_metrics_by_hand():
    scores = torch.zeros(3, 20)
    scores[0] = torch.arange(20.0)  # target at index 19 has the top score: rank 1
    scores[1] = torch.arange(20.0)  # target at index 17: two scores above it, rank 3
    scores[2] = torch.arange(20.0)  # target at index 13: rank 7
    ranks = candidate_ranks(scores, torch.tensor([19, 17, 13]))
    assert ranks.tolist() == [1, 3, 7]
    m = candidate_metrics(scores, torch.tensor([19, 17, 13]))
    assert m == approx(
        {
            "HR@1": 1 / 3,
            "HR@5": 2 / 3,
            "HR@10": 1.0,
            "NDCG@5": (1 + 1 / math.log2(4)) / 3,
            "NDCG@10": (1 + 1 / math.log2(4) + 1 / math.log2(8)) / 3,
            "MRR": (1 + 1 / 3 + 1 / 7) / 3,
        }
    )


def test_candidate_ties_are_pessimistic():
    # One other candidate ties with the target at the top: rank 2, not 1.
    scores = torch.tensor([[5.0, 1.0, 5.0, 0.0]])
    assert candidate_ranks(scores, torch.tensor([0])).tolist() == [2]
    assert candidate_ranks(scores, torch.tensor([2])).tolist() == [2]
    # A constant model ranks every target last.
    flat = torch.ones(2, 20)
    assert candidate_ranks(flat, torch.tensor([0, 19])).tolist() == [20, 20]
    m = candidate_metrics(flat, torch.tensor([0, 19]))
    assert m["HR@10"] == 0.0 and m["MRR"] == pytest.approx(1 / 20)
    # NaN counts as -inf: a NaN target loses to everything; a NaN rival loses to the target.
    nan = torch.tensor([[float("nan"), 1.0, 2.0], [3.0, float("nan"), 2.0]])
    assert candidate_ranks(nan, torch.tensor([0, 0])).tolist() == [3, 1]


def test_candidate_metrics_input_checks():
    with pytest.raises(ValueError, match="target indices"):
        candidate_metrics(torch.zeros(2, 20), torch.tensor([0]))
    with pytest.raises(ValueError, match="target_index must lie"):
        candidate_metrics(torch.zeros(1, 20), torch.tensor([20]))
    with pytest.raises(ValueError, match="non-empty"):
        candidate_metrics(torch.zeros(0, 20), torch.tensor([], dtype=torch.long))


# --------------------------------------------------------------------------- full catalog


def test_full_catalog_excludes_padding_and_history():
    # Items 0..11; scores = item id, so item 11 is the best.
    scores = torch.arange(12.0).repeat(3, 1)
    scores[:, 0] = 100.0  # padding would win if it were not excluded
    targets = torch.tensor([5, 11, 4])
    histories = [[10, 11, 9], [1], [4, 8]]  # row 2: the target is in its history; it still counts
    # row 0: competitors scoring >= 5 that remain: 5, 6, 7, 8 -> rank 4
    # row 1: 11 is the top item -> rank 1
    # row 2: 4 and above without 8: 4,5,6,7,9,10,11 -> rank 7
    assert full_catalog_ranks(scores, targets, histories).tolist() == [4, 1, 7]
    m = full_catalog_metrics(scores, targets, histories)
    assert m == approx({"HR@10": 1.0, "NDCG@10": (1 / math.log2(5) + 1 + 1 / math.log2(8)) / 3})
    # The same histories as a 0-padded tensor give the same ranks.
    padded = torch.tensor([[10, 11, 9], [1, 0, 0], [4, 8, 0]])
    assert full_catalog_ranks(scores, targets, padded).tolist() == [4, 1, 7]


def test_full_catalog_ties_and_cutoff():
    scores = torch.zeros(1, 31)
    scores[0, 1:] = 1.0  # every real item ties
    assert full_catalog_ranks(scores, torch.tensor([3]), [[]]).tolist() == [30]
    assert full_catalog_ranks(scores, torch.tensor([3]), [[1, 2, 4, 5]]).tolist() == [26]
    m = full_catalog_metrics(scores, torch.tensor([3]), [[]])
    assert m == {"HR@10": 0.0, "NDCG@10": 0.0}


def test_full_catalog_input_checks():
    with pytest.raises(ValueError, match="0 is padding"):
        full_catalog_metrics(torch.zeros(1, 5), torch.tensor([0]), [[]])
    with pytest.raises(ValueError, match="history item ids"):
        full_catalog_metrics(torch.zeros(1, 5), torch.tensor([1]), [[7]])


# --------------------------------------------------------------------------- generation


CANDS = ["Toy Story", "Heat", "Heat and Dust", "The Usual Suspects", "Seven (Se7en)"]


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("Toy Story", 0),
        ("  the USUAL   suspects\n", 3),  # case and whitespace do not matter
        ("\nI recommend Toy Story.", 0),  # leading blank line skipped; embedded in a sentence
        ("Heat and Dust", 2),  # "Heat" inside "Heat and Dust" does not count on its own
        ("Heat", 1),
        ("Heated", None),  # whole words only
        ("Toy Story or Heat", None),  # two titles: not valid
        ("Toy Story\nHeat", 0),  # only the first line counts
        ("Heat and Dust, then Heat", None),  # Heat also occurs on its own
        ("seven (se7en)", 4),  # punctuation inside titles is matched literally
        ("", None),
        ("Casablanca", None),
    ],
)
def test_named_candidate(answer, expected):
    assert named_candidate(answer, CANDS) == expected


def test_duplicate_candidate_titles_count_once():
    assert named_candidate("Hamlet", ["Othello", "Hamlet", "hamlet "]) == 1


def test_generation_metrics_by_hand():
    answers = ["Toy Story", "Heat", "Toy Story and Heat", "nothing useful"]
    candidates = [CANDS] * 4
    targets = ["Toy Story", "The Usual Suspects", "Heat", "Heat"]
    # valid: answers 0 and 1; correct: answer 0 only.
    assert generation_metrics(answers, candidates, targets) == approx(
        {"ValidRatio": 0.5, "HR@1": 0.25, "HR@1_valid": 0.5}
    )
    assert generation_metrics(["none"], [CANDS], ["Heat"]) == {"ValidRatio": 0.0, "HR@1": 0.0, "HR@1_valid": 0.0}
    # target titles are compared in the same normalised form
    assert generation_metrics(["heat"], [CANDS], [" HEAT "])["HR@1"] == 1.0


def test_generation_metrics_input_checks():
    with pytest.raises(ValueError, match="2 answers, 1 candidate lists"):
        generation_metrics(["a", "b"], [CANDS], ["Heat", "Heat"])
    with pytest.raises(ValueError, match="no answers"):
        generation_metrics([], [], [])
