"""What the writer is given for one example: its data row, its tokens and the teacher's outputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from c2kd.cache_schema.schema import IGNORE_INDEX, ArrayDef, CacheSpec, output_defs
from c2kd.errors import CacheError

ArrayLike = np.ndarray | torch.Tensor


def answer_positions(labels: ArrayLike) -> np.ndarray:
    """Positions p whose logits predict an answer token, i.e. labels[p + 1] != -100 (int32)."""
    lab = np.asarray(torch.as_tensor(labels).cpu().numpy()).reshape(-1)
    return (np.nonzero(lab[1:] != IGNORE_INDEX)[0]).astype(np.int32)


@dataclass
class ExampleRecord:
    """One example as the teacher saw it, and the teacher's outputs for it.

    `outputs` holds the teacher's outputs by array name (`schema.output_defs`: each
    `hidden/layer_L`, `final_hidden`, and the logits arrays of the policy), each with one row per
    token or per answer position as its definition says, e.g. `final_hidden` [A, d] or
    `topk_values` [A, K]. Floats may be any float dtype: the writer casts them to the cache dtype.
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
    outputs: Mapping[str, ArrayLike]
    _answers: np.ndarray | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(torch.as_tensor(self.input_ids).shape[0])

    @property
    def answers(self) -> np.ndarray:
        if self._answers is None:
            self._answers = answer_positions(self.labels)
        return self._answers

    def values(self, array: ArrayDef) -> ArrayLike:
        """This example's rows of a token- or answer-major array."""
        return self.outputs[array.name] if array.is_output else getattr(self, array.field)


def _shape(x: ArrayLike | None) -> tuple[int, ...] | None:
    return None if x is None else tuple(torch.as_tensor(x).shape)


def check_record(rec: ExampleRecord, spec: CacheSpec, split: str) -> None:
    """Refuse a record whose shapes do not fit the spec, naming the example and the array."""
    where = f"example {rec.example_id}"
    if rec.split != split:
        raise CacheError(f"{where}: split {rec.split!r} in a shard planned for split {split!r}")
    t = _shape(rec.input_ids)
    if t is None or len(t) != 1 or t[0] < 1:
        raise CacheError(f"{where}: input_ids must be a non-empty 1-D array, got shape {t}")
    for name in ("slot_items", "labels"):
        if _shape(getattr(rec, name)) != t:
            raise CacheError(f"{where}: {name} shape {_shape(getattr(rec, name))} != input_ids shape {t}")
    outputs = output_defs(spec)
    missing = [a.name for a in outputs if a.name not in rec.outputs]
    unknown = sorted(set(rec.outputs) - {a.name for a in outputs})
    if missing or unknown:
        raise CacheError(f"{where}: teacher outputs {missing} missing, {unknown} not in the cache "
                         f"(layers {list(spec.layers)}, logits {spec.logits})")
    rows = {"tokens": t[0], "answers": len(rec.answers)}
    for a in outputs:
        expected = (rows[a.rows], *a.columns)
        if _shape(rec.outputs[a.name]) != expected:
            raise CacheError(f"{where}: {a.name} shape {_shape(rec.outputs[a.name])}, expected {expected} "
                             f"(one row per {a.rows[:-1]})")
