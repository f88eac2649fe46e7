"""Where the logit losses compare the teacher and the student (`--kd-over`, DESIGN §3).

    vocab       the whole vocabulary at every answer position (the paper)
    items       the catalog's item tokens, at the answer position that names an item (ids only)
    candidates  as items, then each row narrowed to its example's 20 candidates, renormalised (ids only)

Ranking reads only the item tokens, so `items` keeps what ranking uses and multiplies by N item
rows of the teacher head instead of V; `candidates` carries the teacher's ranking of exactly what
the protocol ranks.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from c2kd.cache_schema import CachedBatch
from c2kd.errors import C2KDError

KD_SUPPORTS = ("vocab", "items", "candidates")
ITEM_SUPPORTS = ("items", "candidates")  # the logit losses over item tokens (ids only)


def support_columns(kind: str, item_token_ids: Tensor) -> Tensor | None:
    """The tokens a support ranges over: None for the vocabulary, else the item tokens in item order
    (also what stage 1's probe head classifies)."""
    return item_token_ids[1:].clone() if kind in ITEM_SUPPORTS else None


class KDSupport(nn.Module):
    """The rows (answer positions) and columns (tokens) the logit losses range over, and the
    teacher's logits there. `columns` is None for the vocabulary, else the item tokens in item order."""

    def __init__(self, kind: str, item_token_ids: Tensor):
        super().__init__()
        self.kind = kind
        self.register_buffer("columns", support_columns(kind, item_token_ids), persistent=False)

    def rows(self, batch: CachedBatch) -> Tensor | None:
        """Which real answer positions [N] the logit losses use: all (None), or those predicting an item."""
        return None if self.columns is None else torch.isin(batch.answer_targets(), self.columns)

    def restrict(self, z: Tensor, rows: Tensor | None) -> Tensor:
        """Logits [N, V] at the real answer positions -> the support's rows and columns."""
        return z if rows is None else z[rows][:, self.columns]

    def head_rows(self, head_weight: Tensor) -> Tensor:
        """The teacher head's rows for the support's columns (a cross-head scores only those)."""
        return head_weight if self.columns is None else head_weight[self.columns]

    def teacher(self, batch: CachedBatch, head_weight: Tensor, rows: Tensor | None) -> Tensor:
        """float32 teacher logits at the support's rows and columns, decoded from the cache."""
        return batch.teacher_logits(head_weight, rows, self.columns)

    def pair(self, z_student: Tensor, z_teacher: Tensor, batch: CachedBatch, rows: Tensor | None) -> tuple[Tensor, Tensor]:
        """(student, teacher) as the losses compare them: with `candidates` both go from [n, items] to
        [n, C], each row's example's candidates in prompt order (a padded candidate, item 0, gets -inf)."""
        if self.kind != "candidates":
            return z_student, z_teacher
        if batch.candidates.shape[1] == 0:
            raise C2KDError("--kd-over candidates: this batch carries no candidates")
        example = batch.answer_mask.nonzero()[:, 0].to(z_teacher.device)[rows]
        candidates = batch.candidates.to(z_teacher.device)[example]  # [n, C] item ids, 1-based
        columns, padded = (candidates - 1).clamp_min(0), candidates == 0
        return tuple(z.gather(1, columns).masked_fill(padded, float("-inf")) for z in (z_student, z_teacher))
