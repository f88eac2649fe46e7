"""The tensors a reader hands to stage two for a batch of cached examples."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class CachedBatch:
    """A padded batch of B examples (T = longest prompt, A = most answer positions).

    Token tensors are right-padded like `collate`: `input_ids` with the tokenizer's pad id,
    `slot_items` with 0, `labels` with -100. `answer_positions[b, a]` is the position p whose
    logits predict the answer token labels[b, p + 1]; `answer_mask` marks the real ones.
    `hidden[layer]` is [B, T, d] when the cache keeps all positions (mask: `attention_mask`) or
    [B, A, d] when it keeps answer positions only (mask: `answer_mask`); see `hidden_mask`.
    `final_hidden` is the post-final-norm state at the answer positions: exact teacher logits are
    `final_hidden @ head_weight.T`. Float tensors have the cache's logical dtype.
    """

    positions: str
    example_ids: torch.Tensor  # [B] int64
    users: torch.Tensor  # [B] int64
    targets: torch.Tensor  # [B] int64
    candidates: torch.Tensor  # [B, C] int64
    history: torch.Tensor  # [B, H] int64, zero-padded (item 0 is padding)
    input_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] int64
    slot_items: torch.Tensor  # [B, T] int64
    labels: torch.Tensor  # [B, T] int64
    answer_positions: torch.Tensor  # [B, A] int64
    answer_mask: torch.Tensor  # [B, A] bool
    hidden: dict[int, torch.Tensor]
    final_hidden: torch.Tensor | None = None  # [B, A, d]
    topk_values: torch.Tensor | None = None  # [B, A, K]
    topk_indices: torch.Tensor | None = None  # [B, A, K] int64
    full_logits: torch.Tensor | None = None  # [B, A, V]

    def __len__(self) -> int:
        return int(self.example_ids.shape[0])

    @property
    def hidden_mask(self) -> torch.Tensor:
        """[B, T] or [B, A] bool mask of the rows of `hidden` that are real."""
        return self.attention_mask.bool() if self.positions == "all" else self.answer_mask

    def at_answers(self, x: torch.Tensor, shift: int = 0) -> torch.Tensor:
        """Rows of a per-token tensor x [B, T, ...] at the answer positions (+ shift): [B, A, ...]."""
        index = (self.answer_positions + shift).to(x.device)
        index = index.view(*index.shape, *([1] * (x.ndim - 2))).expand(*index.shape, *x.shape[2:])
        return torch.gather(x, 1, index)

    def answer_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The real answer rows of a per-token tensor x [B, T, ...]: [N, ...], batch-major."""
        return self.at_answers(x)[self.answer_mask.to(x.device)]

    def hidden_at_answers(self, layer: int) -> torch.Tensor:
        """[N, d]: a cached layer's states at the real answer positions, whatever `positions` is."""
        h = self.hidden[layer]
        return self.answer_rows(h) if self.positions == "all" else h[self.answer_mask.to(h.device)]

    def answer_targets(self) -> torch.Tensor:
        """[N]: the token each real answer position predicts (labels[p + 1])."""
        return self.at_answers(self.labels, shift=1)[self.answer_mask.to(self.labels.device)]

    def kept_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A per-token tensor x [B, T, ...] on the rows the cache keeps hidden states for: all
        tokens [B, T, ...] or the answer positions [B, A, ...] (mask: `hidden_mask`)."""
        return x if self.positions == "all" else self.at_answers(x)

    def _map(self, fn) -> CachedBatch:
        changes = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                changes[f.name] = fn(value)
            elif isinstance(value, dict):
                changes[f.name] = {k: fn(v) for k, v in value.items()}
        return replace(self, **changes)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> CachedBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> CachedBatch:
        """Called by DataLoader(pin_memory=True)."""
        return self._map(lambda t: t.pin_memory())
