"""Evaluation metrics shared by every model: candidate ranking, full-catalog ranking, generation.

Ranks are 1-based. Ties are pessimistic everywhere: a target's rank is 1 + the number of other
ranked items whose score is >= the target's, so a model that gives every item the same score
ranks every target last instead of first. NaN scores count as -inf (a NaN target ties with every
other item and loses to all of them).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch

# What a training run may select its best state on (over the 20 stored validation candidates), and
# what it selects on by default: teacher fine-tuning, SASRec-free students and distillation alike.
SELECT_METRICS = ("HR@1", "HR@5", "HR@10", "NDCG@5", "NDCG@10", "MRR")
DEFAULT_SELECT_METRIC = "NDCG@10"

CANDIDATE_HR_AT = (1, 5, 10)
CANDIDATE_NDCG_AT = (5, 10)
FULL_CATALOG_AT = (10,)


def _clean_scores(scores: torch.Tensor) -> torch.Tensor:
    if scores.ndim != 2 or scores.shape[0] == 0:
        raise ValueError(f"scores must be a non-empty [batch, items] tensor, got shape {tuple(scores.shape)}")
    scores = scores.detach()
    if not scores.is_floating_point():
        scores = scores.double()
    return torch.where(torch.isnan(scores), torch.full_like(scores, -math.inf), scores)


def per_example_gains(
    ranks: torch.Tensor, hr_at: Sequence[int], ndcg_at: Sequence[int], mrr: bool
) -> dict[str, torch.Tensor]:
    """Per example (float64 [B]): HR@k = [rank <= k], NDCG@k = [rank <= k] / log2(rank + 1), MRR = 1/rank.

    `ranking_metrics` is their mean, so per-example results always agree with the aggregates."""
    ranks = torch.as_tensor(ranks).double()
    out = {f"HR@{k}": (ranks <= k).double() for k in hr_at}
    gain = 1.0 / torch.log2(ranks + 1.0)
    out |= {f"NDCG@{k}": torch.where(ranks <= k, gain, torch.zeros_like(gain)) for k in ndcg_at}
    if mrr:
        out["MRR"] = 1.0 / ranks
    return out


def ranking_metrics(ranks: torch.Tensor, hr_at: Sequence[int], ndcg_at: Sequence[int], mrr: bool) -> dict[str, float]:
    """Means over the batch of the per-example gains (`per_example_gains`)."""
    return {name: float(values.mean()) for name, values in per_example_gains(ranks, hr_at, ndcg_at, mrr).items()}


def candidate_rank_metrics(ranks: torch.Tensor) -> dict[str, float]:
    """`candidate_metrics` from already computed candidate ranks."""
    return ranking_metrics(ranks, CANDIDATE_HR_AT, CANDIDATE_NDCG_AT, mrr=True)


def full_catalog_rank_metrics(ranks: torch.Tensor) -> dict[str, float]:
    """`full_catalog_metrics` from already computed full-catalog ranks."""
    return ranking_metrics(ranks, FULL_CATALOG_AT, FULL_CATALOG_AT, mrr=False)


def candidate_ranks(scores: torch.Tensor, target_index: torch.Tensor) -> torch.Tensor:
    """Rank [B] of each row's target among its candidates: 1 + #(other candidates scored >= it)."""
    scores = _clean_scores(scores)
    target_index = torch.as_tensor(target_index, device=scores.device).long().reshape(-1)
    if target_index.shape[0] != scores.shape[0]:
        raise ValueError(f"{target_index.shape[0]} target indices for {scores.shape[0]} rows of scores")
    if (target_index < 0).any() or (target_index >= scores.shape[1]).any():
        raise ValueError(f"target_index must lie in 0..{scores.shape[1] - 1}")
    target = scores.gather(1, target_index[:, None])
    # The target is >= itself, so the count below is already 1 + #others.
    return (scores >= target).sum(dim=1)


def candidate_metrics(scores: torch.Tensor, target_index: torch.Tensor) -> dict[str, float]:
    """HR@1/5/10, NDCG@5/10 and MRR of the target among each row's stored candidates.

    `scores` [B, C] (higher = better), `target_index` [B] = position of the target in the row.
    Tie rule: pessimistic (module docstring). Nothing is excluded: every candidate competes.
    """
    return candidate_rank_metrics(candidate_ranks(scores, target_index))


def full_catalog_ranks(
    scores: torch.Tensor, targets: torch.Tensor, histories: torch.Tensor | Sequence[Sequence[int]]
) -> torch.Tensor:
    """Rank [B] of each target among all items 1..N, with padding and history items excluded."""
    scores = _clean_scores(scores)
    batch, width = scores.shape
    targets = torch.as_tensor(targets, device=scores.device).long().reshape(-1)
    if targets.shape[0] != batch:
        raise ValueError(f"{targets.shape[0]} targets for {batch} rows of scores")
    if (targets < 1).any() or (targets >= width).any():
        raise ValueError(f"targets must be item ids in 1..{width - 1} (0 is padding)")
    excluded = torch.zeros_like(scores, dtype=torch.bool)
    excluded[:, 0] = True
    if isinstance(histories, torch.Tensor):
        history = histories.to(scores.device).long()
        if history.ndim != 2 or history.shape[0] != batch:
            raise ValueError(f"histories must be [batch, length] (0 = padding), got shape {tuple(history.shape)}")
        if (history < 0).any() or (history >= width).any():
            raise ValueError(f"history item ids must lie in 0..{width - 1}")
        excluded.scatter_(1, history, True)
    else:
        if len(histories) != batch:
            raise ValueError(f"{len(histories)} histories for {batch} rows of scores")
        for row, items in enumerate(histories):
            row_items = torch.as_tensor(list(items), dtype=torch.long, device=scores.device)
            if row_items.numel() and ((row_items < 0).any() or (row_items >= width).any()):
                raise ValueError(f"history item ids must lie in 0..{width - 1} (row {row})")
            excluded[row, row_items] = True
    rows = torch.arange(batch, device=scores.device)
    excluded[rows, targets] = False  # the target is always ranked, even if it is in the history
    target_scores = scores[rows, targets][:, None]
    return ((scores >= target_scores) & ~excluded).sum(dim=1)


def full_catalog_metrics(
    scores: torch.Tensor, targets: torch.Tensor, histories: torch.Tensor | Sequence[Sequence[int]]
) -> dict[str, float]:
    """HR@10 and NDCG@10 of the target among the whole catalog.

    `scores` [B, N+1] over item ids (column 0 = padding), `targets` [B] item ids, `histories`
    either a LongTensor [B, H] padded with 0 or one list of item ids per row. Exclusion rule:
    the padding item 0 and every item in the row's history are removed from the ranking (they
    are known positives, not predictions); the target is never removed. Ties: pessimistic.
    """
    return full_catalog_rank_metrics(full_catalog_ranks(scores, targets, histories))


# --------------------------------------------------------------------------- generation


def normalise_title(text: str) -> str:
    """Case-folded, whitespace collapsed, stripped: the form in which titles are compared."""
    return " ".join(text.casefold().split())


def first_line(answer: str) -> str:
    """The answer's first line after leading whitespace (models often open with a newline)."""
    return answer.lstrip().splitlines()[0] if answer.strip() else ""


def named_candidate(answer: str, candidate_titles: Sequence[str]) -> int | None:
    """Index of the one candidate the answer names, or None when it names none or several.

    Rule: take `first_line(answer)` and normalise it and every candidate title with
    `normalise_title`. A title occurs when it appears in the line as a whole-word match: the
    characters just before and after it are not letters, digits or "_". An occurrence lying
    inside an occurrence of a longer candidate title does not count ("Heat" inside "Heat and
    Dust"). Candidates sharing one normalised title count as one title; the index returned is
    the first of them. The answer names a candidate when exactly one title remains.
    """
    line = normalise_title(first_line(answer))
    spans: dict[str, list[tuple[int, int]]] = {}
    for title in {normalise_title(t) for t in candidate_titles} - {""}:
        found = [m.span() for m in re.finditer(rf"(?<!\w){re.escape(title)}(?!\w)", line)]
        if found:
            spans[title] = found
    named = [title for title, found in spans.items() if any(not _inside_longer(title, span, spans) for span in found)]
    if len(named) != 1:
        return None
    return next(i for i, t in enumerate(candidate_titles) if normalise_title(t) == named[0])


def _inside_longer(title: str, span: tuple[int, int], spans: dict[str, list[tuple[int, int]]]) -> bool:
    start, end = span
    return any(len(other) > len(title) and a <= start and end <= b for other, found in spans.items() for a, b in found)


def generation_metrics(
    answers: Sequence[str], candidate_titles: Sequence[Sequence[str]], target_titles: Sequence[str]
) -> dict[str, float]:
    """The generation protocol (greedy answer, first line): ValidRatio and HR@1.

    ValidRatio = share of answers that name exactly one candidate (`named_candidate`);
    HR@1 = share of ALL answers whose named candidate has the target's title (so it is
    comparable with ranking HR@1); HR@1_valid = the same over valid answers only (the papers'
    HitRatio@1; 0.0 when no answer is valid).
    """
    if not (len(answers) == len(candidate_titles) == len(target_titles)):
        raise ValueError(
            f"{len(answers)} answers, {len(candidate_titles)} candidate lists, {len(target_titles)} targets"
        )
    if not answers:
        raise ValueError("no answers to score")
    valid = correct = 0
    for answer, titles, target in zip(answers, candidate_titles, target_titles, strict=True):
        index = named_candidate(answer, titles)
        if index is not None:
            valid += 1
            correct += normalise_title(titles[index]) == normalise_title(target)
    return {
        "ValidRatio": valid / len(answers),
        "HR@1": correct / len(answers),
        "HR@1_valid": correct / valid if valid else 0.0,
    }
