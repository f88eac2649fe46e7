"""SASRec: self-attentive sequential recommendation (Kang & McAuley, ICDM 2018).

Item embedding (row 0 = padding) scaled by sqrt(width) plus a learned positional embedding,
a stack of pre-norm causal self-attention blocks with a point-wise feed-forward network, and a
final layer norm. The score of item i after a sequence is the dot product of the last hidden
state with item i's input embedding (the embedding table is shared with the output layer, as in
the paper), so the trained table is a meaningful collaborative item embedding.

Sequences are LEFT padded to `max_len` so the last position is always the prediction point.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class SASRecSpec:
    """Architecture of a SASRec model (everything needed to rebuild it before loading weights)."""

    num_items: int
    hidden: int = 64
    num_blocks: int = 2
    num_heads: int = 1
    max_len: int = 10
    dropout: float = 0.2

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, dropout: float):
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"hidden width {hidden} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.dropout = dropout

    def forward(self, query: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """query/keys [B, T, d]; allowed [B, 1, T, T] boolean (True = may attend)."""
        b, t, d = query.shape
        h = self.num_heads
        q = self.q(query).view(b, t, h, d // h).transpose(1, 2)
        k, v = self.kv(keys).view(b, t, 2, h, d // h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=self.dropout if self.training else 0.0
        )
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class SASRecBlock(nn.Module):
    """One block: x + Attn(LN(x) as query, x as keys/values), then x + FFN(LN(x)).

    As in the reference implementation the layer norm is applied to the query only; keys and
    values see the un-normalised stream.
    """

    def __init__(self, hidden: int, num_heads: int, dropout: float):
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden, eps=1e-8)
        self.attn = CausalSelfAttention(hidden, num_heads, dropout)
        self.ffn_norm = nn.LayerNorm(hidden, eps=1e-8)
        self.ffn = nn.Sequential(
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, hidden), nn.Dropout(dropout)
        )
        self.attn_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q = self.attn_norm(x)
        x = q + self.attn_dropout(self.attn(q, x, allowed))
        x = x + self.ffn(self.ffn_norm(x))
        return x * keep  # padded positions stay exactly zero


class SASRec(nn.Module):
    def __init__(self, spec: SASRecSpec):
        super().__init__()
        self.spec = spec
        self.item_emb = nn.Embedding(spec.num_items + 1, spec.hidden, padding_idx=0)
        self.pos_emb = nn.Embedding(spec.max_len, spec.hidden)
        self.emb_dropout = nn.Dropout(spec.dropout)
        self.blocks = nn.ModuleList(
            SASRecBlock(spec.hidden, spec.num_heads, spec.dropout) for _ in range(spec.num_blocks)
        )
        self.final_norm = nn.LayerNorm(spec.hidden, eps=1e-8)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.xavier_normal_(p)
            elif name.endswith("bias") and "norm" not in name:
                nn.init.zeros_(p)
        with torch.no_grad():
            self.item_emb.weight[0].zero_()

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        """seq [B, T] left-padded item ids (T <= max_len) → hidden states [B, T, d]."""
        b, t = seq.shape
        if t > self.spec.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len {self.spec.max_len}")
        keep = (seq != 0).unsqueeze(-1).to(self.item_emb.weight.dtype)
        x = self.item_emb(seq) * math.sqrt(self.spec.hidden)
        x = x + self.pos_emb.weight[self.spec.max_len - t :]  # right-aligned: last position = last slot
        x = self.emb_dropout(x) * keep
        # Causal, not into padding; every position may see itself so no row is fully masked.
        causal = torch.ones(t, t, dtype=torch.bool, device=seq.device).tril()
        allowed = causal & (seq != 0)[:, None, :] | torch.eye(t, dtype=torch.bool, device=seq.device)
        allowed = allowed.unsqueeze(1)
        for block in self.blocks:
            x = block(x, allowed, keep)
        return self.final_norm(x)

    def item_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Dot-product score of every item (column 0 is the padding item, forced to -inf)."""
        scores = hidden @ self.item_emb.weight.T
        scores[..., 0] = float("-inf")
        return scores

    def last_scores(self, seq: torch.Tensor) -> torch.Tensor:
        """Scores over the whole catalog after the last position: [B, num_items + 1]."""
        return self.item_scores(self.forward(seq)[:, -1])
