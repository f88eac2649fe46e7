"""C2KD's router (DESIGN §3): which teacher layer each example imitates at the student's layer n.

    top1      argmax_l score_l, score_l = sum over valid tokens of cos(H_s^n, g_l(H_t^l))  (the paper)
    soft:T    softmax_l(score_l / T) weights every layer's loss (soft = soft:1)
    probe     argmin_l of the stage-1 probe's CE on the example's answer: the layer whose filtered
              states best predict what the teacher answers (not the paper's; independent of the student)
    fixed:L   always layer L

The router selects a target, it is not trained.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from c2kd.errors import C2KDError
from c2kd.student.losses import feature_loss

ROUTER_MODES = ("top1", "soft", "soft:T", "probe", "fixed:L")


@dataclass(frozen=True)
class Routing:
    """Router output: per-example layer weights, the chosen layer ids and the raw scores."""

    layers: tuple[int, ...]  # teacher layer id of each weight column
    weights: Tensor  # [B, K], rows sum to 1, no gradient
    chosen: Tensor  # [B] teacher layer id with the largest weight
    scores: Tensor  # [B, K] sum over valid tokens of cos(H_s^n, g_l(H_t^l))
    one_hot: bool  # top1 and fixed:L: each example follows exactly one layer

    def counts(self) -> dict[str, Tensor]:
        """How many examples chose each layer, as `count/`-terms the trainer sums per epoch."""
        return {f"count/router_layer_{l}": (self.chosen == l).sum().float() for l in self.layers}


def parse_router(mode: str) -> tuple[str, float | int | None]:
    """'top1' | 'soft' | 'soft:T' | 'probe' | 'fixed:L' -> (kind, T or L or None); a clear error for anything else."""
    if mode in ("top1", "probe"):
        return mode, None
    if mode == "soft":
        return "soft", 1.0
    kind, _, value = mode.partition(":")
    if kind == "fixed" and value.lstrip("-").isdigit():
        return "fixed", int(value)
    if kind == "soft":
        try:
            temperature = float(value)
        except ValueError:
            temperature = float("nan")
        if math.isfinite(temperature) and temperature > 0:
            return "soft", temperature
    raise C2KDError(f"router mode {mode!r}: expected one of top1, soft, soft:T (T > 0, e.g. soft:4), probe, fixed:L "
                    "(L = a cached teacher layer, e.g. fixed:4)")


def router_scores(student_h: Tensor, projected_teacher: Mapping[int, Tensor], mask: Tensor) -> Tensor:
    """[B, K]: score_l = sum over valid tokens of cos(H_s^n, g_l(H_t^l)) (the authors' router)."""
    s_hat = F.normalize(student_h.float(), dim=-1)
    valid = mask.to(s_hat.dtype)
    columns = [((s_hat * F.normalize(p.float(), dim=-1)).sum(dim=-1) * valid).sum(dim=-1) for p in projected_teacher.values()]
    return torch.stack(columns, dim=-1)


@torch.no_grad()
def route(student_h: Tensor, projected_teacher: Mapping[int, Tensor], mask: Tensor, mode: str = "top1",
          probe_scores: Tensor | None = None) -> Routing:
    """Per-example weights over the candidate teacher layers (see the module docstring); `probe_scores`
    [B, K] (minus each layer's probe CE per example) is what `probe` follows."""
    kind, value = parse_router(mode)
    layers = tuple(projected_teacher)
    if kind == "probe":
        if probe_scores is None:
            raise C2KDError("router probe: no probe scores were given")
        scores = probe_scores.float()
    else:
        scores = router_scores(student_h, projected_teacher, mask)
    if kind in ("top1", "probe"):
        weights = F.one_hot(scores.argmax(dim=-1), len(layers)).to(scores.dtype)
    elif kind == "soft":
        weights = F.softmax(scores / value, dim=-1)
    else:
        if value not in layers:
            raise C2KDError(f"router fixed:{value}: layer {value} is not a cached teacher layer {list(layers)}")
        index = torch.full((scores.shape[0],), layers.index(value), dtype=torch.long, device=scores.device)
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
        return feature_loss(student_h, stacked[pick, torch.arange(len(pick), device=pick.device)], mask)
    return sum(feature_loss(student_h, projected_teacher[l], mask, example_weight=routing.weights[:, k])
               for k, l in enumerate(routing.layers))
