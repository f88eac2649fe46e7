"""What the writer is given for one example: its data row, its tokens and the teacher's outputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from c2kd.cache_schema.schema import IGNORE_INDEX, CacheSpec
from c2kd.errors import CacheError

ArrayLike = np.ndarray | torch.Tensor


def answer_positions(labels: ArrayLike) -> np.ndarray:
    """Positions p whose logits predict an answer token, i.e. labels[p + 1] != -100 (int32)."""
    lab = np.asarray(torch.as_tensor(labels).cpu().numpy()).reshape(-1)
    return (np.nonzero(lab[1:] != IGNORE_INDEX)[0]).astype(np.int32)


@dataclass
class ExampleRecord:
    """One example as the teacher saw it, and the teacher's outputs for it.

    `hidden[layer]` holds one row per token ([T, d], positions "all") or one row per answer
    position ([A, d], positions "answer"); `final_hidden` is the post-final-norm state at the
    answer positions ([A, d]); `topk_*` are [A, K], `full_logits` [A, V]. Floats may be any
    float dtype: the writer casts them to the cache dtype.
    """

    example_id: int
    split: str
    user: int
    target: int
    history: Sequence[int]
    candidates: Sequence[int]
    input_ids: ArrayLike
    slot_items: ArrayLike
    labels: ArrayLike
    hidden: Mapping[int, ArrayLike]
    final_hidden: ArrayLike
    topk_values: ArrayLike | None = None
    topk_indices: ArrayLike | None = None
    full_logits: ArrayLike | None = None
    _answers: np.ndarray | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(torch.as_tensor(self.input_ids).shape[0])

    @property
    def answers(self) -> np.ndarray:
        if self._answers is None:
            self._answers = answer_positions(self.labels)
        return self._answers


def _shape(x: ArrayLike | None) -> tuple[int, ...] | None:
    return None if x is None else tuple(torch.as_tensor(x).shape)


def check_record(rec: ExampleRecord, spec: CacheSpec, split: str) -> None:
    """Refuse a record whose shapes do not fit the spec, naming the example and the field."""
    where = f"example {rec.example_id}"
    if rec.split != split:
        raise CacheError(f"{where}: split {rec.split!r} in a shard planned for split {split!r}")
    t = _shape(rec.input_ids)
    if t is None or len(t) != 1 or t[0] < 1:
        raise CacheError(f"{where}: input_ids must be a non-empty 1-D array, got shape {t}")
    for name in ("slot_items", "labels"):
        if _shape(getattr(rec, name)) != t:
            raise CacheError(f"{where}: {name} shape {_shape(getattr(rec, name))} != input_ids shape {t}")
    n_tok, n_ans, d = t[0], len(rec.answers), spec.hidden_size
    rows = n_tok if spec.positions == "all" else n_ans
    if set(rec.hidden) != set(spec.layers):
        raise CacheError(f"{where}: hidden layers {sorted(rec.hidden)} != cache layers {list(spec.layers)}")
    for layer, h in rec.hidden.items():
        if _shape(h) != (rows, d):
            raise CacheError(
                f"{where}: hidden layer {layer} has shape {_shape(h)}, expected {(rows, d)} (positions={spec.positions})"
            )
    if _shape(rec.final_hidden) != (n_ans, d):
        raise CacheError(f"{where}: final_hidden shape {_shape(rec.final_hidden)}, expected {(n_ans, d)}")
    policy = spec.logits_policy
    if policy.kind == "topk":
        for name in ("topk_values", "topk_indices"):
            if _shape(getattr(rec, name)) != (n_ans, policy.k):
                raise CacheError(f"{where}: {name} shape {_shape(getattr(rec, name))}, expected {(n_ans, policy.k)}")
    if policy.kind == "full" and _shape(rec.full_logits) != (n_ans, spec.vocab_size):
        raise CacheError(f"{where}: full_logits shape {_shape(rec.full_logits)}, expected {(n_ans, spec.vocab_size)}")
