"""C2KD stage 1 (DESIGN §3): the per-layer filters g_l the router compares through, and their loss.

    g_l = Linear(d_t -> d_s, no bias) per candidate teacher layer l, a shared RMSNorm(d_s) and a
    shared probe head Linear(d_s -> classes); loss  sum_l CE(head(norm(g_l(H_t^l)))) at the answers.

The classes are the vocabulary, or the catalog's items with --kd-over items|candidates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from c2kd.cache_schema import CachedBatch
from c2kd.errors import C2KDError


class LayerFilters(nn.Module):
    """Per-layer filters g_l plus the shared norm and probe head used to train them."""

    def __init__(self, teacher_layers: Sequence[int], d_t: int, d_s: int, classes: int, eps: float = 1e-6):
        super().__init__()
        if not teacher_layers:
            raise C2KDError("LayerFilters needs at least one teacher layer")
        self.teacher_layers = tuple(int(layer) for layer in teacher_layers)
        self.filters = nn.ModuleDict({str(layer): nn.Linear(d_t, d_s, bias=False) for layer in self.teacher_layers})
        self.norm = nn.RMSNorm(d_s, eps=eps)
        self.head = nn.Linear(d_s, classes, bias=False)

    def project(self, teacher_hidden_by_layer: Mapping[int, Tensor]) -> dict[int, Tensor]:
        """{l: g_l(H_t^l)} for every candidate layer; inputs [..., d_t] -> [..., d_s]."""
        missing = [l for l in self.teacher_layers if l not in teacher_hidden_by_layer]
        if missing:
            raise C2KDError(f"teacher hidden states for layers {missing} are missing (have {sorted(teacher_hidden_by_layer)})")
        weight_dtype = self.head.weight.dtype
        return {l: self.filters[str(l)](teacher_hidden_by_layer[l].to(weight_dtype)) for l in self.teacher_layers}

    def probe_logits(self, teacher_hidden_by_layer: Mapping[int, Tensor]) -> dict[int, Tensor]:
        """{l: head(norm(g_l(H_t^l)))} in float32 (under bf16 autocast g_l's output is bf16; the norm's weight is not)."""
        return {l: self.head(self.norm(h.float())).float() for l, h in self.project(teacher_hidden_by_layer).items()}

    def forward(self, teacher_hidden_by_layer: Mapping[int, Tensor], labels_at_answer: Tensor) -> dict[int, Tensor]:
        """{l: CE(probe, labels)}; hidden [N, d_t] at answer positions, labels [N] class indices. Stage 1
        trains through forward() so that a DDP wrapper sees the call."""
        return {l: F.cross_entropy(z, labels_at_answer) for l, z in self.probe_logits(teacher_hidden_by_layer).items()}


def probe_inputs(batch: CachedBatch, classes: Tensor | None) -> tuple[dict[int, Tensor], Tensor]:
    """Each cached layer's states at the answers and the class each one should name: the next token
    (classes None), or with `classes` (the item tokens, in item order) the item index at the answers
    that name an item."""
    hidden = {l: batch.hidden_at_answers(l) for l in batch.hidden}
    targets = batch.answer_targets()
    if classes is None:
        return hidden, targets
    classes = classes.to(targets.device)
    rows = torch.isin(targets, classes)
    labels = (targets[rows, None] == classes[None, :]).int().argmax(dim=1)  # token id -> class index
    return {l: h[rows] for l, h in hidden.items()}, labels


@torch.no_grad()
def probe_scores(filters: LayerFilters, batch: CachedBatch, classes: Tensor | None) -> Tensor:
    """[B, K]: minus each layer's probe CE on the example's answers (its mean over them), for the
    `probe` router; an example with no answer the probe classifies scores 0 on every layer."""
    hidden, labels = probe_inputs(batch, classes)
    example = batch.answer_mask.nonzero()[:, 0].to(labels.device)
    if classes is not None:
        example = example[torch.isin(batch.answer_targets(), classes.to(labels.device))]
    columns = []
    for z in filters.probe_logits(hidden).values():
        ce = F.cross_entropy(z, labels, reduction="none")
        total = torch.zeros(len(batch), device=ce.device).index_add_(0, example, ce)
        count = torch.zeros(len(batch), device=ce.device).index_add_(0, example, torch.ones_like(ce))
        columns.append(-total / count.clamp_min(1.0))
    return torch.stack(columns, dim=-1)


def init_as_lens(filters: LayerFilters, head_rows: Tensor) -> None:
    """Start the filters as the identity and the probe head as the teacher's own head (`head_rows`:
    its rows for the probe's classes): each probe starts as the teacher's head read at layer l (a
    "logit lens"), well above chance on late layers, instead of at chance. Needs d_s == d_t."""
    d_s, d_t = filters.head.weight.shape[1], head_rows.shape[1]
    if d_s != d_t or head_rows.shape[0] != filters.head.weight.shape[0]:
        raise C2KDError(f"--filter-init lens needs the student's width to equal the teacher's ({d_s} vs {d_t}); "
                        "use --filter-init random")
    with torch.no_grad():
        for linear in filters.filters.values():
            linear.weight.copy_(torch.eye(d_s, dtype=linear.weight.dtype))
        filters.head.weight.copy_(head_rows.to(filters.head.weight.dtype))


def stage1_loss(filters: nn.Module, batch: CachedBatch, classes: Tensor | None = None) -> dict[str, Tensor]:
    """Stage 1's loss: the sum over the candidate layers of the probes' CE, each also logged."""
    per_layer = filters(*probe_inputs(batch, classes))
    return {"loss": torch.stack(list(per_layer.values())).sum(), **{f"ce_layer_{l}": v for l, v in per_layer.items()}}
