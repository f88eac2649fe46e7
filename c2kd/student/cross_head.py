"""C2KD's cross-head (DESIGN §3): the student's features scored by the teacher's frozen LM head."""

from __future__ import annotations

from torch import Tensor, nn


class CrossHead(nn.Module):
    """z = W_head,teacher · feat_mlp(h_s); L_orth keeps feat_mlp's rows near-orthogonal."""

    def __init__(self, d_s: int, d_t: int):
        super().__init__()
        self.feat_mlp = nn.Linear(d_s, d_t, bias=True)

    def logits(self, h_s: Tensor, teacher_head_weight: Tensor) -> Tensor:
        """h_s [..., d_s], teacher head [V, d_t] -> [..., V]; the head is detached (never trained)."""
        head = teacher_head_weight.detach().to(self.feat_mlp.weight.dtype)
        return self.feat_mlp(h_s) @ head.T
