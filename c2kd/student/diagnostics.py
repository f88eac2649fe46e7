"""Whether a C2KD run's parts do their job, measured while it trains.

- stage 1: each layer's probe on held-out cached examples — its CE, and its HR@1 when it ranks
  the example's 20 candidates, beside chance (1/20) and the teacher's own HR@1 from the cache;
- stage 2: each weighted loss term's share of the gradient norm (one fixed batch, each epoch);
  the router's choices per epoch and their entropy are counted by the trainer (`Routing.counts`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from c2kd.cache_schema import CachedBatch, TeacherCache
from c2kd.metrics import candidate_ranks
from c2kd.student.filters import LayerFilters, probe_inputs


def _item_answers(batch: CachedBatch, item_tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(rows, candidates, target index): the answer rows [N] that name an item, each one's example's
    candidates [n, C] (item ids) and where its target stands among them [n]."""
    rows = torch.isin(batch.answer_targets(), item_tokens)
    example = batch.answer_mask.nonzero()[:, 0][rows]
    candidates = batch.candidates[example]
    target_index = (candidates == batch.targets[example, None]).int().argmax(dim=1)
    return rows, candidates, target_index


READ_GROUPS = 8  # batches per cache read in probe_report


@torch.no_grad()
def probe_report(filters: LayerFilters, cache: TeacherCache, example_ids: Sequence[int], classes: Tensor | None,
                 item_token_ids: Tensor, head_weight: Tensor, batch_size: int = 64) -> dict[str, float]:
    """Stage 1's probes on `example_ids` (cached examples stage 1 did not train on), flat for the trainer's
    log: `ce_layer_L`, `HR@1_layer_L`, their means, `teacher_HR@1` and `chance_HR@1`."""
    filters = filters.eval()
    device = filters.head.weight.device
    item_token_ids, head_weight = item_token_ids.to(device), head_weight.to(device)
    item_tokens = item_token_ids[1:]
    layers = filters.teacher_layers
    ce, hits = {l: 0.0 for l in layers}, {l: 0 for l in layers}
    rows_seen, ranked, teacher_hits, num_candidates = 0, 0, 0, 0
    ids = np.asarray(example_ids)
    groups = [ids[i : i + batch_size] for i in range(0, len(ids), batch_size)]
    read = lambda start: cache.get_batches(groups[start : start + READ_GROUPS], layers=layers, final_hidden=True,  # noqa: E731
                                           logits=True)
    # a few batches per read: memory stays flat however many held-out examples there are
    for batch in (b for start in range(0, len(groups), READ_GROUPS) for b in read(start)):
        batch = batch.to(device)
        hidden, labels = probe_inputs(batch, classes)
        item_rows, candidates, target = _item_answers(batch, item_tokens)
        num_candidates = candidates.shape[1]
        for l, z in filters.probe_logits(hidden).items():
            ce[l] += float(F.cross_entropy(z, labels, reduction="sum"))
            # with item classes the probe's rows are already the item answers, columns item - 1
            scores = z.gather(1, candidates - 1) if classes is not None else z[item_rows].gather(1, item_token_ids[candidates])
            hits[l] += int((candidate_ranks(scores, target) == 1).sum())
        z_t = batch.teacher_logits(head_weight, item_rows, item_tokens)
        teacher_hits += int((candidate_ranks(z_t.gather(1, candidates - 1), target) == 1).sum())
        rows_seen, ranked = rows_seen + len(labels), ranked + len(target)
    out = {f"ce_layer_{l}": ce[l] / max(rows_seen, 1) for l in layers}
    out |= {f"HR@1_layer_{l}": hits[l] / max(ranked, 1) for l in layers}
    out["probe_ce"] = float(np.mean([out[f"ce_layer_{l}"] for l in layers]))
    out["neg_probe_ce"] = -out["probe_ce"]  # what stage 1 selects its best epoch on (the trainer maximises)
    out["probe_HR@1_best"] = max(out[f"HR@1_layer_{l}"] for l in layers)
    out["probe_HR@1_mean"] = float(np.mean([out[f"HR@1_layer_{l}"] for l in layers]))
    out["teacher_HR@1"] = teacher_hits / max(ranked, 1)
    out["chance_HR@1"] = 1.0 / max(num_candidates, 1)
    out["chance_ce"] = math.log(len(item_tokens) if classes is not None else head_weight.shape[0])
    filters.train()
    return out


def gradient_shares(model: torch.nn.Module, batch: CachedBatch, weights: dict[str, float]) -> dict[str, float]:
    """Each weighted loss term's gradient norm over the trainable parameters and its share of their sum,
    on one batch. The training's random streams are left where they were."""
    params = model.trainable_parameters()
    with torch.random.fork_rng(devices=[]):
        terms = model(batch)
    norms = {}
    for name, value in terms.items():
        weight = weights.get(name, 0.0)
        if weight > 0 and value.requires_grad:
            grads = torch.autograd.grad(weight * value, params, retain_graph=True, allow_unused=True)
            norms[name] = math.sqrt(sum(float(g.float().pow(2).sum()) for g in grads if g is not None))
    total = sum(norms.values()) or 1.0
    return {**{f"grad_norm/{k}": v for k, v in norms.items()}, **{f"grad_share/{k}": v / total for k, v in norms.items()}}
