"""The tensors a reader hands to stage two for a batch of cached examples, and their teacher logits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from c2kd.cache_schema.schema import FINAL_HIDDEN, FULL_LOGITS, TOPK_INDICES, TOPK_VALUES, LogitsPolicy, hidden_layer


@dataclass
class CachedBatch:
    """A padded batch of B examples (T = longest prompt, A = most answer positions).

    Token tensors are right-padded like `collate`: `input_ids` with the tokenizer's pad id,
    `slot_items` with 0, `labels` with -100. `answer_positions[b, a]` is the position p whose
    logits predict the answer token labels[b, p + 1]; `answer_mask` marks the real ones.

    `outputs` holds the teacher's outputs that were read, by array name (`schema.output_defs`),
    padded per example along their rows: `hidden/layer_L` is [B, T, d] when the cache keeps all
    positions (mask: `attention_mask`) or [B, A, d] when it keeps answer positions only (mask:
    `answer_mask`), see `hidden_mask`; the answer-major ones are [B, A, ...]. `final_hidden` is
    the post-final-norm state at the answer positions: exact teacher logits are
    `final_hidden @ head_weight.T` (`teacher_logits` decodes every policy). Float tensors have the
    cache's logical dtype, int tensors are int64.
    """

    positions: str
    logits_policy: LogitsPolicy  # which logits `outputs` holds (the cache's policy)
    vocab_size: int  # V of the teacher's logits
    example_ids: Tensor  # [B] int64
    users: Tensor  # [B] int64
    targets: Tensor  # [B] int64
    candidates: Tensor  # [B, C] int64
    history: Tensor  # [B, H] int64, zero-padded (item 0 is padding)
    input_ids: Tensor  # [B, T] int64
    attention_mask: Tensor  # [B, T] int64
    slot_items: Tensor  # [B, T] int64
    labels: Tensor  # [B, T] int64
    answer_positions: Tensor  # [B, A] int64
    answer_mask: Tensor  # [B, A] bool
    outputs: dict[str, Tensor]

    def __len__(self) -> int:
        return int(self.example_ids.shape[0])

    # --- the teacher's outputs by their usual names (absent when not read) ---------------------
    @property
    def hidden(self) -> dict[int, Tensor]:
        """{layer: hidden states} of the cached layers that were read, in the order asked for."""
        return {layer: x for name, x in self.outputs.items() if (layer := hidden_layer(name)) is not None}

    @property
    def final_hidden(self) -> Tensor | None:
        return self.outputs.get(FINAL_HIDDEN)  # [B, A, d]

    @property
    def topk_values(self) -> Tensor | None:
        return self.outputs.get(TOPK_VALUES)  # [B, A, K]

    @property
    def topk_indices(self) -> Tensor | None:
        return self.outputs.get(TOPK_INDICES)  # [B, A, K] int64

    @property
    def full_logits(self) -> Tensor | None:
        return self.outputs.get(FULL_LOGITS)  # [B, A, V]

    @property
    def hidden_mask(self) -> Tensor:
        """[B, T] or [B, A] bool mask of the rows of `hidden` that are real."""
        return self.attention_mask.bool() if self.positions == "all" else self.answer_mask

    def at_answers(self, x: Tensor, shift: int = 0) -> Tensor:
        """Rows of a per-token tensor x [B, T, ...] at the answer positions (+ shift): [B, A, ...]."""
        index = (self.answer_positions + shift).to(x.device)
        index = index.view(*index.shape, *([1] * (x.ndim - 2))).expand(*index.shape, *x.shape[2:])
        return torch.gather(x, 1, index)

    def answer_rows(self, x: Tensor) -> Tensor:
        """The real answer rows of a per-token tensor x [B, T, ...]: [N, ...], batch-major."""
        return self.at_answers(x)[self.answer_mask.to(x.device)]

    def hidden_at_answers(self, layer: int) -> Tensor:
        """[N, d]: a cached layer's states at the real answer positions, whatever `positions` is."""
        h = self.hidden[layer]
        return self.answer_rows(h) if self.positions == "all" else h[self.answer_mask.to(h.device)]

    def answer_targets(self) -> Tensor:
        """[N]: the token each real answer position predicts (labels[p + 1])."""
        return self.at_answers(self.labels, shift=1)[self.answer_mask.to(self.labels.device)]

    def kept_rows(self, x: Tensor) -> Tensor:
        """A per-token tensor x [B, T, ...] on the rows the cache keeps hidden states for: all
        tokens [B, T, ...] or the answer positions [B, A, ...] (mask: `hidden_mask`)."""
        return x if self.positions == "all" else self.at_answers(x)

    def teacher_logits(self, head_weight: Tensor, rows: Tensor | None = None, columns: Tensor | None = None) -> Tensor:
        """float32 teacher logits at the real answer positions, [N, V] (autocast off), restricted to
        `rows` (bool [N]) and then to the vocabulary `columns` (LongTensor) when given.

        exact: final_hidden @ head_weight[columns].T, the head's rows taken before the product (V
        can be 262k; a KD support of N items then costs N rows, not V). full: the stored logits.
        top-k: -inf but on each row's K cached tokens. `head_weight` [V, d] is the cache's
        `TeacherCache.head_weight()`; the result is on its device."""
        device = head_weight.device
        mask = self.answer_mask.to(device)
        kind = self.logits_policy.kind
        with torch.autocast(device.type, enabled=False):
            if kind == "exact":
                if self.final_hidden is None:
                    raise ValueError("teacher_logits: this batch was read without final_hidden (final_hidden=False)")
                h = self.final_hidden.to(device)[mask]
                h = h if rows is None else h[rows]
                head = head_weight if columns is None else head_weight[columns]
                return h.float() @ head.float().T
            if kind == "full":
                z = self._read_logits(FULL_LOGITS, device)[mask].float()
            else:
                values = self._read_logits(TOPK_VALUES, device)[mask].float()
                indices = self._read_logits(TOPK_INDICES, device)[mask]
                dense = torch.full((values.shape[0], self.vocab_size), float("-inf"), device=device)
                z = dense.scatter(1, indices, values)
            z = z if rows is None else z[rows]
            return z if columns is None else z[:, columns.to(device)]

    def _read_logits(self, name: str, device: torch.device) -> Tensor:
        if name not in self.outputs:
            raise ValueError(f"teacher_logits: this batch was read without its logits ({name}; logits=False)")
        return self.outputs[name].to(device)

    def _map(self, fn: Callable[[Tensor], Tensor]) -> CachedBatch:
        changes = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                changes[f.name] = fn(value)
            elif isinstance(value, dict):
                changes[f.name] = {k: fn(v) for k, v in value.items()}
        return replace(self, **changes)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> CachedBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> CachedBatch:
        """Called by DataLoader(pin_memory=True)."""
        return self._map(lambda t: t.pin_memory())
