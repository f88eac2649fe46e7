"""What stage two minimises, one function per method (DESIGN §3), on a batch read from the cache.

    sft         L = L_LM
    logit-kd    L = L_LM + w_logit · τ² KL(teacher ‖ the student's own head)
    feature-kd  L = L_LM + w_feat · mean_i L_feat(A_i H_s^i, H_t^{m(i)})          (uniform layer map m)
    c2kd        L = L_LM + w_feat · L_feat(H_s^n, g_l*(H_t^l*)) + w_logit · L_logit + w_orth · L_orth
                      [+ w_own_logit · τ² KL(teacher ‖ the student's own head)]

with l* chosen per example by the router (router.py), n the student's penultimate layer (or with
--student-layer last its last, final-normed layer: the state its own head ranks from) and
L_logit the soft cross-entropy between the teacher's logits and W_head,t · feat_mlp(H_s^n) at the
answer positions (cross_head.py), over the support `--kd-over` names (kd_support.py). The
bracketed term is not the paper's (w_own_logit = 0 by default): C2KD teaches the student's own
head, the one that ranks at inference, only through L_LM.
Ablations: --router fixed:L | soft, --no-orth, --no-cross-head (L_logit then uses the student's
own head; there is no feat_mlp, so no L_orth either).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from c2kd.cache_schema import CachedBatch, CacheSpec
from c2kd.recmodel.model import RecLM, RecLMOutput
from c2kd.student.cross_head import CrossHead
from c2kd.student.filters import LayerFilters, probe_scores
from c2kd.student.kd_support import KDSupport
from c2kd.student.losses import cross_head_kd_loss, feature_loss, logit_kd_loss, orth_loss
from c2kd.student.router import Routing, route, routed_feature_loss

METHODS = ("c2kd", "sft", "logit-kd", "feature-kd")


@dataclass(frozen=True)
class LossWeights:
    """The method and its constants (the authors' values as defaults); checked by DistillRecipe."""

    method: str = "c2kd"
    router: str = "top1"  # top1 | soft | fixed:L
    cross_head: bool = True
    orth: bool = True
    w_feat: float = 0.5
    w_logit: float = 0.5
    w_orth: float = 0.05
    tau: float = 1.0
    w_own_logit: float = 0.0  # c2kd: a vanilla logit-KD term on the student's own head too (not the paper's)
    kd_over: str = "vocab"  # vocab | items | candidates: the support of the logit losses (kd_support.py)
    student_layer: str = "penultimate"  # c2kd's layer n: penultimate (the paper) | last (final-normed: what ranks)


def _at(x: Tensor, rows: Tensor | None) -> Tensor:
    return x if rows is None else x[rows]


class DistillModel(nn.Module):
    """The student plus the pieces its method trains; forward(batch) -> loss terms ("loss" = the total).

    Frozen: the stage-1 filters and the teacher head (a non-trainable parameter, so the trainer
    moves it to the device and leaves it out of checkpoints)."""

    def __init__(self, student: RecLM, weights: LossWeights, spec: CacheSpec, head_weight: Tensor,
                 filters: LayerFilters | None = None, layer_map: dict[int, int] | None = None):
        super().__init__()
        self.student, self.w = student, weights
        d_t, d_s = spec.hidden_size, student.hidden_size
        # penultimate: the authors' 15 of 16; last: hidden_states[L] is final-normed, the state the head reads
        last = weights.student_layer == "last"
        self.student_layer = student.num_layers if last else max(1, student.num_layers - 1)
        self.teacher_head = nn.Parameter(head_weight.detach().float().clone(), requires_grad=False)
        self.kd = KDSupport(weights.kd_over, student.item_token_ids)
        self.filters = filters.requires_grad_(False) if filters is not None else None
        self.cross_head = CrossHead(d_s, d_t) if weights.method == "c2kd" and weights.cross_head else None
        self.layer_map = dict(layer_map or {})
        self.adapters = nn.ModuleDict({str(i): nn.Linear(d_s, d_t, bias=False) for i in self.layer_map}) or None

    @property
    def router_layers(self) -> tuple[int, ...]:
        return self.filters.teacher_layers if self.filters is not None else ()

    def trainable_parameters(self) -> list[nn.Parameter]:
        params = [p for p in self.student.parameters() if p.requires_grad]
        for extra in (self.cross_head, self.adapters):
            if extra is not None:
                params += list(extra.parameters())
        return [p for p in params if p.is_floating_point()]

    def forward(self, batch: CachedBatch) -> dict[str, Tensor]:
        return OBJECTIVES[self.w.method](self, batch)

    def run_student(self, batch: CachedBatch, hidden: bool = False) -> RecLMOutput:
        return self.student(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                            slot_items=batch.slot_items, labels=batch.labels, output_hidden_states=hidden)

    def own_head_kd(self, batch: CachedBatch, logits: Tensor, teacher: Tensor, rows: Tensor | None) -> Tensor:
        """Vanilla logit KD: τ² KL(teacher ‖ the student's own head) on the KD support."""
        return logit_kd_loss(*self.kd.pair(self.kd.restrict(logits, rows), teacher, batch, rows), None, self.w.tau)

    def routed_feature(self, batch: CachedBatch, h_n: Tensor) -> tuple[Tensor, Routing]:
        """L_feat between the student's layer-n states and the filtered teacher layer the router picks."""
        states, mask = batch.kept_rows(h_n), batch.hidden_mask
        with torch.no_grad():
            projected = self.filters.project({l: batch.hidden[l] for l in self.router_layers})
        probe = probe_scores(self.filters, batch, self.kd.columns) if self.w.router == "probe" else None
        routing = route(states, projected, mask, self.w.router, probe)
        return routed_feature_loss(states, projected, mask, routing), routing

    def cross_head_logits(self, batch: CachedBatch, h_n: Tensor, rows: Tensor | None) -> Tensor:
        """W_head,t · feat_mlp(H_s^n) at the KD rows, over the KD support's columns."""
        return self.cross_head.logits(_at(batch.answer_rows(h_n), rows), self.kd.head_rows(self.teacher_head))


def sft(m: DistillModel, batch: CachedBatch) -> dict[str, Tensor]:
    lm = m.run_student(batch).loss
    return {"loss": lm, "lm": lm}


def logit_kd(m: DistillModel, batch: CachedBatch) -> dict[str, Tensor]:
    out, rows = m.run_student(batch), m.kd.rows(batch)
    logit = m.own_head_kd(batch, out.logits, m.kd.teacher(batch, m.teacher_head, rows), rows)
    return {"loss": out.loss + m.w.w_logit * logit, "lm": out.loss, "logit": logit}


def feature_kd(m: DistillModel, batch: CachedBatch) -> dict[str, Tensor]:
    out = m.run_student(batch, hidden=True)
    pairs = [feature_loss(m.adapters[str(i)](batch.kept_rows(out.hidden_states[i])), batch.hidden[t], batch.hidden_mask)
             for i, t in m.layer_map.items()]
    feat = torch.stack(pairs).mean()
    return {"loss": out.loss + m.w.w_feat * feat, "lm": out.loss, "feat": feat}


def c2kd(m: DistillModel, batch: CachedBatch) -> dict[str, Tensor]:
    out, rows, w = m.run_student(batch, hidden=True), m.kd.rows(batch), m.w
    h_n = out.hidden_states[m.student_layer]
    feat, routing = m.routed_feature(batch, h_n)
    teacher = m.kd.teacher(batch, m.teacher_head, rows)
    z = m.cross_head_logits(batch, h_n, rows) if m.cross_head is not None else m.kd.restrict(out.logits, rows)
    logit = cross_head_kd_loss(*m.kd.pair(z, teacher, batch, rows), None, w.tau)
    terms = {"lm": out.loss, "feat": feat, "logit": logit}
    if m.cross_head is not None and w.orth:
        terms["orth"] = orth_loss(m.cross_head.feat_mlp.weight)
    if w.w_own_logit > 0:
        terms["own_logit"] = m.own_head_kd(batch, out.logits, teacher, rows)
    zero = torch.zeros((), device=logit.device)
    loss = (out.loss + w.w_feat * feat + w.w_logit * logit + w.w_orth * terms.get("orth", zero)
            + w.w_own_logit * terms.get("own_logit", zero))
    return {"loss": loss, **terms, **routing.counts()}


WEIGHTS = tuple(f.name for f in fields(LossWeights) if f.name.startswith("w_"))  # w_X weighs the term X


def term_weights(w: LossWeights) -> dict[str, float]:
    """Each logged loss term's weight in the total (what its gradient share is measured with)."""
    return {"lm": 1.0, **{name.removeprefix("w_"): getattr(w, name) for name in WEIGHTS}}


OBJECTIVES = {"sft": sft, "logit-kd": logit_kd, "feature-kd": feature_kd, "c2kd": c2kd}
