"""The small trainable pieces of C2KD (DESIGN §3): layer filters, the router, the cross-head.

    stage 1:  g_l = Linear(d_t -> d_s, no bias) per candidate teacher layer l, a shared RMSNorm(d_s)
              and a shared head Linear(d_s -> V); loss  sum_l CE(head(norm(g_l(H_t^l)))) on answers.
    stage 2:  the router picks, per example, the teacher layer whose filtered states g_l(H_t^l) are
              most similar to the student's layer-n states; the cross-head maps H_s^n into the
              teacher's width so the teacher's own (frozen) LM head can score it.

Nothing here knows about models or caches: inputs are plain tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from c2kd.errors import C2KDError
from c2kd.student.losses import feature_loss

ROUTER_MODES = ("top1", "soft", "fixed:L")


class LayerFilters(nn.Module):
    """Per-layer filters g_l plus the shared norm and head used to train them (stage 1)."""

    def __init__(self, teacher_layers: Sequence[int], d_t: int, d_s: int, vocab: int, eps: float = 1e-6):
        super().__init__()
        if not teacher_layers:
            raise C2KDError("LayerFilters needs at least one teacher layer")
        self.teacher_layers = tuple(int(layer) for layer in teacher_layers)
        self.filters = nn.ModuleDict({str(layer): nn.Linear(d_t, d_s, bias=False) for layer in self.teacher_layers})
        self.norm = nn.RMSNorm(d_s, eps=eps)
        self.head = nn.Linear(d_s, vocab, bias=False)

    def project(self, teacher_hidden_by_layer: Mapping[int, Tensor]) -> dict[int, Tensor]:
        """{l: g_l(H_t^l)} for every candidate layer; inputs [..., d_t] -> [..., d_s]."""
        self._check_layers(teacher_hidden_by_layer)
        weight_dtype = self.head.weight.dtype
        return {l: self.filters[str(l)](teacher_hidden_by_layer[l].to(weight_dtype)) for l in self.teacher_layers}

    def layer_losses(self, teacher_hidden_by_layer: Mapping[int, Tensor], labels_at_answer: Tensor) -> dict[int, Tensor]:
        """{l: CE(head(norm(g_l(H_t^l))), labels)}; hidden [N, d_t] at answer positions, labels [N]: the
        head's class indices (the next tokens' ids; item indices with --kd-over items)."""
        projected = self.project(teacher_hidden_by_layer)
        # the norm in float32 (under bf16 autocast g_l's output is bf16; RMSNorm's weight stays float32)
        return {l: F.cross_entropy(self.head(self.norm(h.float())).float(), labels_at_answer) for l, h in projected.items()}

    def forward(self, teacher_hidden_by_layer: Mapping[int, Tensor], labels_at_answer: Tensor) -> dict[int, Tensor]:
        # Stage 1 trains through forward() (so that a DDP wrapper sees the call): the per-layer CEs.
        return self.layer_losses(teacher_hidden_by_layer, labels_at_answer)

    def _check_layers(self, hidden: Mapping[int, Tensor]) -> None:
        missing = [l for l in self.teacher_layers if l not in hidden]
        if missing:
            raise C2KDError(f"teacher hidden states for layers {missing} are missing (have {sorted(hidden)})")


@dataclass(frozen=True)
class Routing:
    """Router output: per-example layer weights, the chosen layer ids and the raw scores."""

    layers: tuple[int, ...]  # teacher layer id of each weight column
    weights: Tensor  # [B, K], rows sum to 1, no gradient
    chosen: Tensor  # [B] teacher layer id with the largest weight (for counting)
    scores: Tensor  # [B, K] sum over valid tokens of cos(H_s^n, g_l(H_t^l))
    one_hot: bool  # top1 and fixed:L: each example follows exactly one layer


def parse_router(mode: str) -> tuple[str, int | None]:
    """'top1' | 'soft' | 'fixed:L' -> (kind, L or None), with a clear error for anything else."""
    if mode in ("top1", "soft"):
        return mode, None
    if mode.startswith("fixed:"):
        value = mode.split(":", 1)[1]
        if value.lstrip("-").isdigit():
            return "fixed", int(value)
    raise C2KDError(f"router mode {mode!r}: expected one of top1, soft, fixed:L (L = a cached teacher layer, e.g. fixed:4)")


def router_scores(student_h: Tensor, projected_teacher: Mapping[int, Tensor], mask: Tensor) -> Tensor:
    """[B, K]: score_l = sum over valid tokens of cos(H_s^n, g_l(H_t^l)) (the authors' router)."""
    s_hat = F.normalize(student_h.float(), dim=-1)
    valid = mask.to(s_hat.dtype)
    columns = []
    for projected in projected_teacher.values():
        cos = (s_hat * F.normalize(projected.float(), dim=-1)).sum(dim=-1)  # [B, T]
        columns.append((cos * valid).sum(dim=-1))
    return torch.stack(columns, dim=-1)


@torch.no_grad()
def route(student_h: Tensor, projected_teacher: Mapping[int, Tensor], mask: Tensor, mode: str = "top1") -> Routing:
    """Per-example weights over the candidate teacher layers.

    top1: one-hot on argmax_l score_l (the paper); soft: softmax_l(score_l); fixed:L: one-hot on L.
    The weights carry no gradient: the router selects a target, it is not trained.
    """
    kind, fixed_layer = parse_router(mode)
    layers = tuple(projected_teacher)
    scores = router_scores(student_h, projected_teacher, mask)
    if kind == "top1":
        weights = F.one_hot(scores.argmax(dim=-1), len(layers)).to(scores.dtype)
    elif kind == "soft":
        weights = F.softmax(scores, dim=-1)
    else:
        if fixed_layer not in layers:
            raise C2KDError(f"router fixed:{fixed_layer}: layer {fixed_layer} is not a cached teacher layer {list(layers)}")
        index = torch.full((scores.shape[0],), layers.index(fixed_layer), dtype=torch.long, device=scores.device)
        weights = F.one_hot(index, len(layers)).to(scores.dtype)
    layer_ids = torch.tensor(layers, device=scores.device)
    return Routing(layers=layers, weights=weights, chosen=layer_ids[weights.argmax(dim=-1)], scores=scores,
                   one_hot=kind != "soft")


def routed_feature_loss(student_h: Tensor, projected_teacher: Mapping[int, Tensor], mask: Tensor, routing: Routing) -> Tensor:
    """L_feat against the routed teacher layers. One-hot routing compares each example with its
    one chosen layer only (one loss over the batch, not K losses of which K-1 are zero); the soft
    router weights each layer's loss per example."""
    if routing.one_hot:
        stacked = torch.stack([projected_teacher[l] for l in routing.layers])  # [K, B, T, d]
        pick = routing.weights.argmax(dim=-1)
        target = stacked[pick, torch.arange(len(pick), device=pick.device)]
        return feature_loss(student_h, target, mask)
    return sum(feature_loss(student_h, projected_teacher[l], mask, example_weight=routing.weights[:, k])
               for k, l in enumerate(routing.layers))


def count_choices(chosen: Tensor, layers: Sequence[int]) -> dict[int, int]:
    """How many examples chose each teacher layer (every layer listed, zeros included)."""
    values = chosen.tolist()
    return {int(l): sum(1 for v in values if v == l) for l in layers}


class CrossHead(nn.Module):
    """z = W_head,teacher · feat_mlp(h_s): the student's features scored by the teacher's frozen LM head."""

    def __init__(self, d_s: int, d_t: int):
        super().__init__()
        self.feat_mlp = nn.Linear(d_s, d_t, bias=True)

    def logits(self, h_s: Tensor, teacher_head_weight: Tensor) -> Tensor:
        """h_s [..., d_s], teacher head [V, d_t] -> [..., V]; the head is detached (never trained)."""
        head = teacher_head_weight.detach().to(self.feat_mlp.weight.dtype)
        return self.feat_mlp(h_s) @ head.T


def teacher_logits(final_hidden: Tensor, head_weight: Tensor, head_bias: Tensor | None = None) -> Tensor:
    """Exact teacher logits rebuilt from cached post-final-norm states: z_t = h W_headᵀ (+ b)."""
    z = final_hidden.float() @ head_weight.float().T
    return z if head_bias is None else z + head_bias.float()


def uniform_layer_map(num_student_layers: int, num_teacher_layers: int, available_teacher_layers: Sequence[int]) -> dict[int, int]:
    """SLMRec-style uniform layer map for the feature-KD baseline: {student layer: teacher layer}.

    Rule: student layer i (1-indexed, i = 1 .. L_s - 1) is paired with teacher layer
    round(i * L_t / L_s). The student's last layer is left out: its output is the final-normed
    state that the LM loss trains directly, and no cache stores the teacher's counterpart as a
    plain layer output. Pairs whose teacher layer is not in the cache are dropped (a cache holds
    late layers only); if none is left, the error names the layers that would be needed.
    """
    if num_student_layers < 2:
        raise C2KDError(f"feature-KD needs a student with at least 2 layers (got {num_student_layers})")
    available = {int(l) for l in available_teacher_layers}
    wanted = {i: round(i * num_teacher_layers / num_student_layers) for i in range(1, num_student_layers)}
    kept = {i: t for i, t in wanted.items() if t in available}
    if not kept:
        missing = sorted(set(wanted.values()) - available)
        raise C2KDError(
            f"feature-KD uniform layer map needs teacher layers {missing} (student {num_student_layers} layers, "
            f"teacher {num_teacher_layers}); the cache holds {sorted(available)}. "
            "Re-run cache-teacher with those layers, or use --method c2kd."
        )
    return kept
