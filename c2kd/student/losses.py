"""The training losses of stage two, each written as its formula (DESIGN §3).

Conventions shared by every function here:
- features are `[..., d]` and logits `[..., V]`; `mask` is a boolean tensor of the leading
  shape (`[B, T]` for token-level tensors) that is True where a position counts. Padding is
  masked out, so appending padding to a batch never changes a loss.
- reductions are means over the positions where `mask` is True.
- answer positions are the positions p whose logits predict an answer token, i.e.
  `labels[p + 1] != -100` (see `c2kd.recmodel.prompts.answer_index`). L_LM is the recommender
  LM's own loss (`RecLM.forward` with labels), computed with the head at those positions only.

Choices that follow the authors' code (and are therefore not free parameters here):
- `feature_loss`: features are L2-normalised per token; the MSE term is the mean over every
  (valid token, feature) element; the cosine term is the mean per-token cosine, which equals the
  cosine of the flattened unit-row tensors that the authors compute.
- `cross_head_kd_loss`: soft cross-entropy -sum p_t log p_s, NOT multiplied by tau^2 (the authors
  fix tau = 1, where the factor is 1 anyway).
- `orth_loss`: Frobenius norms (torch.dist with p=2, not squared), each divided by W.numel().
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

def masked_mean(values: Tensor, mask: Tensor | None) -> Tensor:
    """Mean of `values` over the positions where `mask` is True (all positions when mask is None)."""
    if mask is None:
        return values.mean()
    mask = mask.to(values.device)
    if mask.shape != values.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match values {tuple(values.shape)}")
    count = mask.sum()
    if count == 0:
        # No valid position: a zero that still belongs to the graph, so backward() works.
        return values.sum() * 0.0
    return torch.where(mask, values, torch.zeros_like(values)).sum() / count


def feature_loss(h_s: Tensor, h_t: Tensor, mask: Tensor | None, example_weight: Tensor | None = None) -> Tensor:
    """L_feat = 0.5 * MSE(ĥ_s, ĥ_t) + 0.5 * (1 - cos(ĥ_s, ĥ_t)), ĥ = h / ||h|| per token.

    h_s, h_t: [B, T, d] (or [N, d]); mask: [B, T] (or [N]). `example_weight` ([B] or [N]) scales
    each example's tokens: the soft router passes its layer weights here (weights summing to one
    over layers keep the total a proper average).
    """
    hat_s = F.normalize(h_s.float(), dim=-1)
    hat_t = F.normalize(h_t.float(), dim=-1)
    mse_per_token = (hat_s - hat_t).pow(2).mean(dim=-1)
    cos_per_token = (hat_s * hat_t).sum(dim=-1)
    per_token = 0.5 * mse_per_token + 0.5 * (1.0 - cos_per_token)
    if example_weight is not None:
        shape = example_weight.shape + (1,) * (per_token.dim() - example_weight.dim())
        per_token = per_token * example_weight.to(per_token.dtype).reshape(shape)
    return masked_mean(per_token, mask)


def soft_cross_entropy(z_student: Tensor, z_teacher: Tensor, mask: Tensor | None, tau: float = 1.0) -> Tensor:
    """mean over masked positions of -sum_v softmax(z_t/tau)_v * log_softmax(z_s/tau)_v.

    Teacher logits may hold -inf (top-k caches): those vocabulary entries get probability 0 and
    contribute nothing (0 * log p is taken as 0, never NaN). A row with no finite teacher logit
    (a top-k cache read with --kd-over items, none of its K tokens an item) contributes 0, and no
    NaN gradient.
    """
    p_t = torch.nan_to_num(F.softmax(z_teacher.float() / tau, dim=-1), nan=0.0)
    log_p_s = F.log_softmax(z_student.float() / tau, dim=-1)
    terms = torch.where(p_t > 0, p_t * log_p_s, torch.zeros_like(log_p_s))
    return masked_mean(-terms.sum(dim=-1), mask)


def cross_head_kd_loss(z_student: Tensor, z_teacher: Tensor, mask: Tensor | None, tau: float = 1.0) -> Tensor:
    """L_logit (C2KD cross-head): soft CE between the teacher's logits and z = W_head,t · feat_mlp(H_s^n).

    Not multiplied by tau^2, as in the authors' code (they use tau = 1).
    """
    return soft_cross_entropy(z_student, z_teacher, mask, tau)


def logit_kd_loss(z_student: Tensor, z_teacher: Tensor, mask: Tensor | None, tau: float = 1.0) -> Tensor:
    """Vanilla KD (Hinton): tau^2 * KL(softmax(z_t/tau) || softmax(z_s/tau)) with the student's OWN head.

    KL = soft CE - teacher entropy; the entropy does not depend on the student, so at tau = 1 the
    gradient equals that of the cross-head CE, and the value is 0 when the student matches the teacher.
    Rows with no finite teacher logit contribute 0 (see soft_cross_entropy).
    """
    p_t = torch.nan_to_num(F.softmax(z_teacher.float() / tau, dim=-1), nan=0.0)
    log_p_t = F.log_softmax(z_teacher.float() / tau, dim=-1)
    log_p_s = F.log_softmax(z_student.float() / tau, dim=-1)
    terms = torch.where(p_t > 0, p_t * (log_p_t - log_p_s), torch.zeros_like(log_p_s))
    return (tau**2) * masked_mean(terms.sum(dim=-1), mask)


def orth_loss(weight: Tensor, eps: float = 1e-6) -> Tensor:
    """L_orth = ||Ŵ Ŵᵀ - I||_F / numel + ||Ŵᵀ Ŵ - I||_F / numel, Ŵ = W with unit-norm rows."""
    w_hat = F.normalize(weight.float(), dim=1, eps=eps)
    rows, cols = w_hat.shape
    eye_rows = torch.eye(rows, device=w_hat.device)
    eye_cols = torch.eye(cols, device=w_hat.device)
    numel = weight.numel()
    return (
        torch.linalg.matrix_norm(w_hat @ w_hat.T - eye_rows) / numel
        + torch.linalg.matrix_norm(w_hat.T @ w_hat - eye_cols) / numel
    )
