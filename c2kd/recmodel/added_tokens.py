"""Trainable rows for the tokens c2kd adds to a pretrained vocabulary (`<slot>`, `<item_i>`).

A pretrained model keeps its own vocabulary frozen: its embedding table and LM head carry
50k–262k rows, and training them all would cost more than a small student's whole body (the
optimizer state alone is twice the table). Only the added tokens' rows train; they live here and
replace the table's rows on the way in (embeddings) and out (logits). When the LM ties its input
and output embeddings, one parameter serves both. `write_into` copies them back into the tables
before the model is saved, so a saved folder is a plain Hugging Face model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from c2kd.recmodel import hf


class AddedTokenRows(nn.Module):
    def __init__(self, lm: nn.Module, token_ids: Sequence[int]):
        super().__init__()
        base = hf.base_model(lm)
        embedding, head = base.get_input_embeddings(), base.get_output_embeddings()
        ids = torch.tensor(sorted(set(int(t) for t in token_ids)), dtype=torch.long)
        row_of = torch.full((embedding.num_embeddings,), -1, dtype=torch.long)
        row_of[ids] = torch.arange(len(ids))
        self.register_buffer("token_ids", ids, persistent=False)
        self.register_buffer("row_of", row_of, persistent=False)
        self.tied = head is None or head.weight is embedding.weight
        self.input_rows = nn.Parameter(embedding.weight.detach()[ids].clone())
        self.output_rows = None if self.tied else nn.Parameter(head.weight.detach()[ids].clone())
        embedding.weight.requires_grad_(False)
        if head is not None:
            head.weight.requires_grad_(False)
        self._cast_head: tuple[tuple, Tensor] | None = None  # (key, the frozen head weight in autocast's dtype)

    def out_rows(self) -> Tensor:
        return self.input_rows if self.output_rows is None else self.output_rows

    def embed(self, input_ids: Tensor, tokens: Tensor, scale: float | Tensor) -> Tensor:
        """`tokens` (the frozen table's embeddings of `input_ids`) with the added tokens' rows in place."""
        rows = self.row_of[input_ids]
        added = rows >= 0
        if not bool(added.any()):
            return tokens
        mine = self.input_rows[rows.clamp(min=0)] * scale
        return torch.where(added.unsqueeze(-1), mine.to(tokens.dtype), tokens)

    def frozen_logits(self, head: nn.Linear, h: Tensor) -> Tensor:
        """head(h) for the frozen pretrained head. Under autocast, nn.Linear casts its whole weight
        (50k-262k rows) at every call; frozen, it is cast once and reused until it changes
        (benchmarks/cpu_step.py; measured in docs/RESULTS.md)."""
        device = h.device.type
        if head.bias is not None or head.weight.requires_grad or not torch.is_autocast_enabled(device):
            return head(h)
        dtype, weight = torch.get_autocast_dtype(device), head.weight
        key = (dtype, weight.device, weight.data_ptr(), weight._version)
        if self._cast_head is None or self._cast_head[0] != key:
            self._cast_head = (key, weight.detach().to(dtype))
        return F.linear(h.to(dtype), self._cast_head[1])

    def patch_logits(self, logits: Tensor, h: Tensor) -> Tensor:
        """Logits over the whole vocabulary with the added tokens' columns from the trainable rows."""
        mine = h @ self.out_rows().to(h.dtype).T
        return logits.index_copy(-1, self.token_ids, mine.to(logits.dtype))

    def rows_of(self, token_ids: Tensor) -> Tensor:
        """Output rows of these (added) token ids."""
        return self.out_rows()[self.row_of[token_ids]]

    @torch.no_grad()
    def write_into(self, lm: nn.Module) -> None:
        """Copy the trained rows into the model's embedding table (and untied head)."""
        base = hf.base_model(lm)
        base.get_input_embeddings().weight[self.token_ids] = self.input_rows.to(base.get_input_embeddings().weight.dtype)
        if self.output_rows is not None:
            head = base.get_output_embeddings()
            head.weight[self.token_ids] = self.output_rows.to(head.weight.dtype)
