"""What stage two minimises, one function per method (DESIGN §3), on a batch read from the cache.

    sft         L = L_LM
    logit-kd    L = L_LM + w_logit · τ² KL(teacher ‖ the student's own head)
    feature-kd  L = L_LM + w_feat · mean_i L_feat(A_i H_s^i, H_t^{m(i)})          (uniform layer map m)
    c2kd        L = L_LM + w_feat · L_feat(H_s^n, g_l*(H_t^l*)) + w_logit · L_logit + w_orth · L_orth
                      [+ w_own_logit · τ² KL(teacher ‖ the student's own head)]

with l* chosen per example by the router, n the student's penultimate layer and L_logit the soft
cross-entropy between the teacher's logits and W_head,t · feat_mlp(H_s^n) at the answer positions.
The bracketed term is not the paper's (w_own_logit = 0 by default): C2KD teaches the student's
own head, the one that ranks at inference, only through L_LM; --w-own-logit also distils the
teacher into it directly, as logit KD does (README: whether that helps).
Ablations: --router fixed:L | soft, --no-orth, --no-cross-head (L_logit then uses the student's
own head; there is no feat_mlp, so no L_orth either).

--kd-over items (ids only; the paper's is vocab): the logit losses compare the two distributions
over the catalog's item tokens, at the answer positions that predict an item, instead of over the
whole vocabulary at every answer position; stage 1's probe head classifies the same way (N
outputs, not V). Ranking reads nothing else, a fine-tuned teacher puts nearly all its mass there
(0.998 for the demo's SmolLM2 teacher), and the cross-head then multiplies by N item rows of the
teacher head instead of V (1,682 vs 50,835 or 263,827).

--kd-over candidates (ids only): as items, then each row narrowed to its example's candidates
(renormalised over them), so the logit losses teach the ranking the protocol measures. Over the
whole catalog the candidates hold about 1.5 % of a fine-tuned teacher's item mass (chance: 20 of
1,682 items, 1.2 %), so the vocab and items losses carry almost none of the teacher's ranking of
them. Stage 1 is the same as with items.

Teacher logits come from the cache only: exact caches rebuild them on the student's device as
final_hidden @ W_headᵀ (float32, autocast off); top-k caches give a distribution on the cached K
tokens (the other logits -inf); full caches are read as they are. A batch may also carry
`teacher_logits` already (a live teacher, for fidelity checks and benchmarks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from c2kd.cache_schema import CachedBatch, CacheSpec
from c2kd.errors import C2KDError
from c2kd.recmodel.model import RecLM, RecLMOutput
from c2kd.student.c2kd_modules import CrossHead, LayerFilters, routed_feature_loss, route, teacher_logits
from c2kd.student.losses import cross_head_kd_loss, feature_loss, logit_kd_loss, orth_loss

METHODS = ("c2kd", "sft", "logit-kd", "feature-kd")
KD_SUPPORTS = ("vocab", "items", "candidates")
ITEM_SUPPORTS = ("items", "candidates")  # the logit losses over item tokens (ids only)


def check_kd_support(kd_over: str, prompt_format: str | None = None, method: str | None = None) -> None:
    """Refuse an unknown --kd-over, items for a method without logit losses, and items for a cache
    whose answers are not item tokens."""
    if kd_over not in KD_SUPPORTS:
        raise C2KDError(f"--kd-over {kd_over!r}: expected one of {', '.join(KD_SUPPORTS)}")
    if kd_over in ITEM_SUPPORTS and method in ("sft", "feature-kd"):
        raise C2KDError(f"--kd-over {kd_over} changes the logit losses; --method {method} has none (drop --kd-over)")
    if kd_over in ITEM_SUPPORTS and prompt_format not in (None, "ids"):
        raise C2KDError(f"--kd-over {kd_over} compares item-token distributions: it needs an ids cache, this one is "
                        f"{prompt_format!r} (use --kd-over vocab)")


@dataclass(frozen=True)
class LossWeights:
    """The method and its constants (the authors' values as defaults)."""

    method: str = "c2kd"
    router: str = "top1"  # top1 | soft | fixed:L
    cross_head: bool = True
    orth: bool = True
    w_feat: float = 0.5
    w_logit: float = 0.5
    w_orth: float = 0.05
    tau: float = 1.0
    w_own_logit: float = 0.0  # c2kd: a vanilla logit-KD term on the student's own head too (not the paper's)
    kd_over: str = "vocab"  # vocab | items | candidates: the support of the logit losses (module docstring)


def kd_classes(weights: LossWeights, student: RecLM) -> Tensor | None:
    """What the logit losses and stage 1's probe head range over: None = the vocabulary, or (with
    --kd-over items|candidates) the item tokens' ids, in item order."""
    return student.item_token_ids[1:].clone() if weights.kd_over in ITEM_SUPPORTS else None


def layer_filters(weights: LossWeights, layers: Sequence[int], spec: CacheSpec, student: RecLM) -> LayerFilters:
    """C2KD's stage-1 filters over the candidate teacher `layers` for this student and cache: the probe head
    has one output per class (`kd_classes`: the vocabulary, or the items)."""
    classes = kd_classes(weights, student)
    return LayerFilters(layers, spec.hidden_size, student.hidden_size,
                        spec.vocab_size if classes is None else len(classes))


class DistillModel(nn.Module):
    """The student plus the pieces its method trains; forward(batch) -> loss terms ("loss" = the total).

    Frozen: the stage-1 filters and the teacher head (a non-trainable parameter, so the trainer
    moves it to the device and leaves it out of checkpoints)."""

    def __init__(self, student: RecLM, weights: LossWeights, spec: CacheSpec, head_weight: Tensor,
                 filters: LayerFilters | None = None, layer_map: dict[int, int] | None = None):
        super().__init__()
        if weights.method not in METHODS:
            raise C2KDError(f"--method {weights.method!r}: expected one of {', '.join(METHODS)}")
        check_kd_support(weights.kd_over, spec.prompt_format, weights.method)
        self.student, self.w = student, weights
        self.logits_policy, self.vocab_size = spec.logits_policy, spec.vocab_size
        d_t, d_s = spec.hidden_size, student.hidden_size
        self.student_layer = max(1, student.num_layers - 1)  # penultimate (authors: 15 of 16)
        self.teacher_head = nn.Parameter(head_weight.detach().float().clone(), requires_grad=False)
        # The KD support: None = the whole vocabulary; else the item tokens' columns and the teacher
        # head's rows for them (the teacher's logits, and the cross-head's).
        self.register_buffer("kd_columns", kd_classes(weights, student), persistent=False)
        items = self.kd_columns is not None
        self.register_buffer("kd_head", self.teacher_head.detach()[self.kd_columns] if items else None, persistent=False)
        self.filters = filters.requires_grad_(False) if filters is not None else None
        self.cross_head = CrossHead(d_s, d_t) if weights.method == "c2kd" and weights.cross_head else None
        self.layer_map = dict(layer_map or {})
        self.adapters = nn.ModuleDict({str(i): nn.Linear(d_s, d_t, bias=False) for i in self.layer_map}) or None
        self.router_counts: dict[int, int] = {}
        own_head = weights.method == "logit-kd" or (weights.method == "c2kd" and
                                                    (not weights.cross_head or weights.w_own_logit > 0))
        if own_head and student.vocab_size != self.vocab_size:
            raise C2KDError(
                f"--method {weights.method}{'' if weights.cross_head else ' --no-cross-head'}"
                f"{' --w-own-logit' if weights.w_own_logit > 0 else ''} compares the student's "
                f"own logits with the teacher's, but their vocabularies differ ({student.vocab_size} vs {self.vocab_size})"
            )

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

    # -- shared pieces -----------------------------------------------------------------------
    def run_student(self, batch: CachedBatch, hidden: bool = False) -> RecLMOutput:
        return self.student(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                            slot_items=batch.slot_items, labels=batch.labels, output_hidden_states=hidden)

    def kd_rows(self, batch: CachedBatch) -> Tensor | None:
        """Which real answer positions [N] the logit losses use: all (None), or those predicting an item."""
        return None if self.kd_columns is None else torch.isin(batch.answer_targets(), self.kd_columns)

    def on_kd_support(self, z: Tensor, rows: Tensor | None) -> Tensor:
        """Logits [N, V] at the real answer positions restricted to the KD rows and columns."""
        return z if rows is None else z[rows][:, self.kd_columns]

    def kd_pair(self, z_student: Tensor, teacher: Tensor, batch: CachedBatch,
                rows: Tensor | None) -> tuple[Tensor, Tensor]:
        """(student, teacher) logits on the KD support at the KD rows (`teacher`: `teacher_logits` of
        those rows): what the logit losses compare. With --kd-over candidates both go from [n, items]
        to [n, C]: each row's example's candidates in prompt order (a padded candidate, item 0, gets -inf)."""
        if self.w.kd_over != "candidates":
            return z_student, teacher
        if batch.candidates.shape[1] == 0:
            raise C2KDError("--kd-over candidates: this batch carries no candidates")
        example = batch.answer_mask.nonzero()[:, 0].to(teacher.device)[rows]
        candidates = batch.candidates.to(teacher.device)[example]  # [n, C] item ids, 1-based
        columns, padded = (candidates - 1).clamp_min(0), candidates == 0
        return tuple(z.gather(1, columns).masked_fill(padded, float("-inf")) for z in (z_student, teacher))

    def teacher_logits(self, batch: CachedBatch, rows: Tensor | None = None) -> Tensor:
        """float32 teacher logits at the real answer positions (`rows` of them), over the KD support
        (see the module docstring): [N, V], or [n, items] with --kd-over items."""
        live = getattr(batch, "teacher_logits", None)
        if live is not None:
            return self.on_kd_support(live.float(), rows)
        mask, policy = batch.answer_mask, self.logits_policy
        with torch.autocast(self.teacher_head.device.type, enabled=False):
            if policy.kind == "exact":
                h = batch.final_hidden[mask]
                if rows is None:
                    return teacher_logits(h, self.teacher_head)
                return teacher_logits(h[rows], self.kd_head)
            if policy.kind == "full":
                return self.on_kd_support(batch.full_logits[mask].float(), rows)
            values, indices = batch.topk_values[mask].float(), batch.topk_indices[mask]
            dense = torch.full((values.shape[0], self.vocab_size), float("-inf"), device=values.device)
            return self.on_kd_support(dense.scatter(1, indices, values), rows)


def sft(m: DistillModel, batch: CachedBatch) -> dict[str, Tensor]:
    lm = m.run_student(batch).loss
    return {"loss": lm, "lm": lm}


def own_head_kd(m: DistillModel, batch: CachedBatch, logits: Tensor, teacher: Tensor, rows: Tensor | None) -> Tensor:
    """Vanilla logit KD: τ² KL(teacher ‖ the student's own head, `logits` at the answer positions) on the KD support."""
    return logit_kd_loss(*m.kd_pair(m.on_kd_support(logits, rows), teacher, batch, rows), None, m.w.tau)


def logit_kd(m: DistillModel, batch: CachedBatch) -> dict[str, Tensor]:
    out = m.run_student(batch)
    rows = m.kd_rows(batch)
    logit = own_head_kd(m, batch, out.logits, m.teacher_logits(batch, rows), rows)
    return {"loss": out.loss + m.w.w_logit * logit, "lm": out.loss, "logit": logit}


def feature_kd(m: DistillModel, batch: CachedBatch) -> dict[str, Tensor]:
    out = m.run_student(batch, hidden=True)
    pairs = [feature_loss(m.adapters[str(i)](batch.kept_rows(out.hidden_states[i])), batch.hidden[t], batch.hidden_mask)
             for i, t in m.layer_map.items()]
    feat = torch.stack(pairs).mean()
    return {"loss": out.loss + m.w.w_feat * feat, "lm": out.loss, "feat": feat}


def c2kd(m: DistillModel, batch: CachedBatch) -> dict[str, Tensor]:
    out = m.run_student(batch, hidden=True)
    h_n = out.hidden_states[m.student_layer]
    rows, mask = batch.kept_rows(h_n), batch.hidden_mask
    with torch.no_grad():
        projected = m.filters.project({l: batch.hidden[l] for l in m.router_layers})
    routing = route(rows, projected, mask, m.w.router)
    if m.training:
        for layer in routing.chosen.tolist():
            m.router_counts[layer] = m.router_counts.get(layer, 0) + 1
    feat = routed_feature_loss(rows, projected, mask, routing)
    kd_rows = m.kd_rows(batch)
    if m.cross_head is None:
        z = m.on_kd_support(out.logits, kd_rows)
    elif kd_rows is None:
        z = m.cross_head.logits(batch.answer_rows(h_n), m.teacher_head)
    else:
        z = m.cross_head.logits(batch.answer_rows(h_n)[kd_rows], m.kd_head)
    teacher = m.teacher_logits(batch, kd_rows)
    logit = cross_head_kd_loss(*m.kd_pair(z, teacher, batch, kd_rows), None, m.w.tau)
    zero = torch.zeros((), device=logit.device)
    uses_orth, uses_own = m.cross_head is not None and m.w.orth, m.w.w_own_logit > 0
    orth = orth_loss(m.cross_head.feat_mlp.weight) if uses_orth else zero
    own = own_head_kd(m, batch, out.logits, teacher, kd_rows) if uses_own else zero
    terms = {"lm": out.loss, "feat": feat, "logit": logit, **({"orth": orth} if uses_orth else {}),
             **({"own_logit": own} if uses_own else {})}
    return {"loss": out.loss + m.w.w_feat * feat + m.w.w_logit * logit + m.w.w_orth * orth + m.w.w_own_logit * own,
            **terms}


OBJECTIVES = {"sft": sft, "logit-kd": logit_kd, "feature-kd": feature_kd, "c2kd": c2kd}


def stage1_loss(filters: nn.Module, batch: CachedBatch, classes: Tensor | None = None) -> dict[str, Tensor]:
    """Stage 1 (c2kd): sum over the candidate layers of CE(head(norm(g_l(H_t^l)))) at the answers.

    `classes` (--kd-over items|candidates: the item tokens, the head's outputs in that order): the CE over the
    catalog, at the answers that are items, instead of over the vocabulary at every answer."""
    hidden = {l: batch.hidden_at_answers(l) for l in batch.hidden}
    targets = batch.answer_targets()
    if classes is not None:
        classes = classes.to(targets.device)
        rows = torch.isin(targets, classes)
        hidden = {l: h[rows] for l, h in hidden.items()}
        targets = (targets[rows, None] == classes[None, :]).int().argmax(dim=1)  # token id -> class index
    per_layer = filters(hidden, targets)  # through forward(), so a DDP wrapper sees the call
    return {"loss": torch.stack(list(per_layer.values())).sum(), **{f"ce_layer_{l}": v for l, v in per_layer.items()}}
