"""The `distill` recipe (stage two): train a small student from a teacher cache, never the teacher.

    cache (tokenizer, item embeddings, teacher head, hidden states, final states at answers)
      -> student RecLM (preset with the cache's tokenizer + item embeddings, or a saved RecLM)
      -> stage 1 (c2kd only): layer filters g_l trained on the cached teacher states
      -> stage 2: c2kd.training.train(student + C2KD pieces, loss below, best on validation)
      -> saved student + distill.json + metrics.json + log.jsonl + distill.png

Stage-2 losses per method (DESIGN §3; weights and tau are options with the paper's defaults):
    sft         L = L_LM
    logit-kd    L = L_LM + w_logit * tau^2 KL(teacher || student's own head)
    feature-kd  L = L_LM + w_feat * mean_i L_feat(A_i H_s^i, H_t^{m(i)})    (uniform layer map m)
    c2kd        L = L_LM + w_feat * L_feat(H_s^n, g_l*(H_t^l*)) + w_logit * L_logit + w_orth * L_orth
                with l* chosen per example by the router, n = the student's penultimate layer,
                L_logit = soft CE(teacher logits, W_head,t · feat_mlp(H_s^n)) on answer positions.
    Ablations: --router fixed:L | soft, --no-orth, --no-cross-head (L_logit then uses the
    student's own head, with the same soft CE; there is no feat_mlp, so no L_orth either).

Teacher logits come from the cache only: exact mode rebuilds them on the student's device as
final_hidden @ W_headᵀ (autocast off, float32); top-k caches give a distribution on the cached
K tokens (the other logits -inf); full caches are read as they are.

The `--data` folder is used for validation (model selection) and the final validation/test
evaluation, and must be the data the cache was built from (fingerprints are compared before
training). Training examples come from the cache's train split.

The trainer gets the cache's train example ids as its data; its collate_fn (`ReadAhead`) reads
the next micro-batches from the cache in a background thread, several per read, while the
student trains.

While it runs, everything lives in `<out>.partial/` (stage1/ and stage2/ trainer folders,
recipe.json); running the same command again resumes there. At the end the student is saved
with `RecLM.save` and the folder renamed to `<out>`: a folder at `<out>` is always complete.
Under torchrun every rank trains (DDP through the trainer) and reads only its part of each
batch from the cache; rank 0 evaluates and writes the results.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from c2kd.cache_schema.batch import CachedBatch
from c2kd.cache_schema.reader import TeacherCache
from c2kd.errors import C2KDError
from c2kd.run_folder import check_or_write_recipe, claim, publish, write_json
from c2kd.pipeline.examples import ExampleSet, load_examples
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.presets import PRESETS
from c2kd.student.c2kd_modules import (
    CrossHead,
    LayerFilters,
    parse_router,
    route,
    teacher_logits,
    uniform_layer_map,
)
from c2kd.student.losses import cross_head_kd_loss, feature_loss, logit_kd_loss, orth_loss
from c2kd.training import TrainConfig, TrainResult, distributed_info, epoch_batches, read_log, train

DISTILL_KIND = "c2kd-distill"
DISTILL_VERSION = 1
METHODS = ("c2kd", "sft", "logit-kd", "feature-kd")
DEFAULT_SELECT_METRIC = "NDCG@10"  # over the 20 stored validation candidates
PLOT_FILE = "distill.png"


@dataclass(frozen=True)
class DistillRecipe:
    """What to distil; `TrainConfig` (minus out_dir) says how stage 2 trains."""

    method: str = "c2kd"
    student: str = "tiny-student"  # a preset name or a saved RecLM folder
    router: str = "top1"  # top1 | soft | fixed:L
    cross_head: bool = True
    orth: bool = True
    w_feat: float = 0.5
    w_logit: float = 0.5
    w_orth: float = 0.05
    tau: float = 1.0
    stage1_epochs: int = 1
    stage1_lr: float = 1e-3
    max_train: int | None = None  # a fixed random subset of the cached train split (CPU runs)
    max_val: int | None = None  # the first N validation examples for model selection
    select_metric: str = DEFAULT_SELECT_METRIC
    eval_batch_size: int = 32

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise C2KDError(f"--method {self.method!r}: expected one of {', '.join(METHODS)}")
        parse_router(self.router)
        if self.tau <= 0:
            raise C2KDError(f"--tau must be positive, got {self.tau}")
        if self.stage1_epochs < 0:
            raise C2KDError(f"--stage1-epochs must be >= 0, got {self.stage1_epochs}")

    @property
    def uses_filters(self) -> bool:
        return self.method == "c2kd"

    @property
    def uses_orth(self) -> bool:
        return self.method == "c2kd" and self.cross_head and self.orth


# ---------------------------------------------------------------- cached batches


class CachedExamples(Sequence):
    """Example ids of the cache's train split: the trainer indexes it, `collate` reads the cache."""

    def __init__(self, example_ids: np.ndarray):
        self.example_ids = np.asarray(example_ids, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.example_ids)

    def __getitem__(self, i: int) -> int:  # type: ignore[override]
        return int(self.example_ids[i])


def batch_dict(batch: CachedBatch) -> dict:
    """A CachedBatch as a plain dict of tensors (what the trainer moves to the device)."""
    out = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "slot_items": batch.slot_items,
        "labels": batch.labels,
        "answer_positions": batch.answer_positions,
        "answer_mask": batch.answer_mask,
        "hidden": dict(batch.hidden),
        "hidden_mask": batch.hidden_mask,
    }
    for name in ("final_hidden", "topk_values", "topk_indices", "full_logits"):
        value = getattr(batch, name)
        if value is not None:
            out[name] = value
    return out


def gather_answers(x: Tensor, answer_positions: Tensor, answer_mask: Tensor) -> Tensor:
    """Rows of a per-token tensor x [B, T, ...] at the real answer positions: [N, ...] (batch-major)."""
    index = answer_positions.view(*answer_positions.shape, *([1] * (x.ndim - 2))).expand(*answer_positions.shape, *x.shape[2:])
    return torch.gather(x, 1, index)[answer_mask]


def answer_rows(batch: dict, per_row: Tensor, positions: str) -> Tensor:
    """[N, ...] answer rows of a cached per-row tensor (per token for 'all', per answer for 'answer')."""
    if positions == "all":
        return gather_answers(per_row, batch["answer_positions"], batch["answer_mask"])
    return per_row[batch["answer_mask"]]


def answer_targets(batch: dict) -> Tensor:
    """[N]: the answer token each answer position predicts (labels[p + 1])."""
    return gather_answers(batch["labels"], batch["answer_positions"] + 1, batch["answer_mask"])


def teacher_answer_logits(batch: dict, head_weight: Tensor, policy: str, vocab_size: int) -> Tensor:
    """[N, V] float32 teacher logits at the answer positions, from what the batch holds.

    A batch that already carries "teacher_logits" (a live teacher, see `live_teacher_batch`) is
    used as it is; otherwise exact caches rebuild head(final_hidden), full caches are read, and
    top-k caches put their K logits in a row of -inf."""
    if "teacher_logits" in batch:
        return batch["teacher_logits"].float()
    mask = batch["answer_mask"]
    with torch.autocast(head_weight.device.type, enabled=False):
        if policy == "exact":
            return teacher_logits(batch["final_hidden"][mask], head_weight)
        if policy == "full":
            return batch["full_logits"][mask].float()
        values, indices = batch["topk_values"][mask].float(), batch["topk_indices"][mask]
        dense = torch.full((values.shape[0], vocab_size), float("-inf"), device=values.device)
        return dense.scatter(1, indices, values)


def answer_index(labels: Tensor) -> tuple[Tensor, Tensor]:
    """Padded answer positions [B, A] (p with labels[p + 1] != -100) and their mask [B, A]."""
    is_answer = torch.zeros_like(labels, dtype=torch.bool)
    is_answer[:, :-1] = labels[:, 1:] != -100
    counts = is_answer.sum(1)
    width = int(counts.max()) if len(counts) else 0
    # stable sort puts the answer positions first, in order
    order = torch.sort((~is_answer).to(torch.int8), dim=1, stable=True).indices[:, :width]
    mask = torch.arange(width, device=labels.device).unsqueeze(0) < counts.unsqueeze(1)
    return torch.where(mask, order, torch.zeros_like(order)), mask


@torch.no_grad()
def live_teacher_batch(teacher: RecLM, tokens: dict, layers: Sequence[int], positions: str = "all") -> dict:
    """The batch a cache would give, computed by running a live teacher on `tokens` (a `collate`
    dict): for fidelity checks and for measuring what the cache saves. Teacher logits are the
    teacher's own (float32), not rebuilt."""
    out = teacher(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                  slot_items=tokens["slot_items"], output_hidden_states=True)
    positions_, mask = answer_index(tokens["labels"])
    batch = {**tokens, "answer_positions": positions_, "answer_mask": mask}
    if positions == "all":
        batch["hidden"] = {l: out.hidden_states[l] for l in layers}
        batch["hidden_mask"] = tokens["attention_mask"].bool()
    else:
        index = positions_.unsqueeze(-1).expand(-1, -1, out.hidden_states[0].shape[-1])
        batch["hidden"] = {l: torch.gather(out.hidden_states[l], 1, index) for l in layers}
        batch["hidden_mask"] = mask
    batch["final_hidden"] = torch.gather(out.hidden_states[teacher.num_layers], 1,
                                         positions_.unsqueeze(-1).expand(-1, -1, teacher.hidden_size))
    batch["teacher_logits"] = gather_answers(out.logits.float(), positions_, mask)
    return batch


# ---------------------------------------------------------------- the stage-2 module


class DistillModel(nn.Module):
    """The student plus the pieces each method trains; forward(batch) -> loss terms.

    Frozen: the stage-1 filters and the teacher head (a non-trainable parameter, so the trainer
    moves it to the device and leaves it out of checkpoints).
    """

    def __init__(
        self,
        student: RecLM,
        recipe: DistillRecipe,
        cache_spec,
        head_weight: Tensor,
        filters: LayerFilters | None = None,
        layer_map: dict[int, int] | None = None,
    ):
        super().__init__()
        self.student = student
        self.recipe = recipe
        self.positions = cache_spec.positions
        self.logits_policy = cache_spec.logits_policy.kind
        self.vocab_size = cache_spec.vocab_size
        d_t, d_s = cache_spec.hidden_size, student.hidden_size
        self.student_layer = max(1, student.num_layers - 1)  # penultimate (authors: 15 of 16)
        self.teacher_head = nn.Parameter(head_weight.detach().float().clone(), requires_grad=False)
        self.filters = filters
        if filters is not None:
            filters.requires_grad_(False)
        self.cross_head = CrossHead(d_s, d_t) if recipe.method == "c2kd" and recipe.cross_head else None
        self.layer_map = dict(layer_map or {})
        self.adapters = (
            nn.ModuleDict({str(i): nn.Linear(d_s, d_t, bias=False) for i in self.layer_map}) if self.layer_map else None
        )
        self.router_layers: tuple[int, ...] = tuple(filters.teacher_layers) if filters is not None else ()
        self.router_counts: dict[int, int] = {}
        own_head = recipe.method == "logit-kd" or (recipe.method == "c2kd" and not recipe.cross_head)
        student_vocab = int(student.lm_head_weight.shape[0])
        if own_head and student_vocab != self.vocab_size:
            raise C2KDError(
                f"--method {recipe.method}{'' if recipe.cross_head else ' --no-cross-head'} compares the student's own "
                f"logits with the teacher's, but their vocabularies differ ({student_vocab} vs {self.vocab_size})"
            )

    def trainable_parameters(self) -> list[nn.Parameter]:
        params = list(self.student.parameters())
        for extra in (self.cross_head, self.adapters):
            if extra is not None:
                params += list(extra.parameters())
        return [p for p in params if p.is_floating_point()]

    # -- rows the feature losses compare -----------------------------------------------------
    def _feature_rows(self, h: Tensor, batch: dict) -> Tensor:
        """Student states on the rows the cache keeps: all tokens [B, T, d] or answers [B, A, d]."""
        if self.positions == "all":
            return h
        index = batch["answer_positions"].unsqueeze(-1).expand(-1, -1, h.shape[-1])
        return torch.gather(h, 1, index)

    def forward(self, batch: dict) -> dict[str, Tensor]:
        r = self.recipe
        needs_hidden = r.method in ("c2kd", "feature-kd")
        out = self.student(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], slot_items=batch["slot_items"],
            labels=batch["labels"], output_hidden_states=needs_hidden,
        )
        terms: dict[str, Tensor] = {"lm": out.loss}
        loss = out.loss
        if r.method == "sft":
            return {"loss": loss, **terms}
        mask = batch["hidden_mask"]

        if r.method in ("c2kd", "logit-kd"):
            z_t = teacher_answer_logits(batch, self.teacher_head, self.logits_policy, self.vocab_size)

        if r.method == "logit-kd":
            z_s = answer_rows(batch, out.logits, "all")
            terms["logit"] = logit_kd_loss(z_s, z_t, None, r.tau)
            loss = loss + r.w_logit * terms["logit"]

        elif r.method == "feature-kd":
            pair_losses = []
            for i, t in self.layer_map.items():
                h_s = self.adapters[str(i)](self._feature_rows(out.hidden_states[i], batch))
                pair_losses.append(feature_loss(h_s, batch["hidden"][t], mask))
            terms["feat"] = torch.stack(pair_losses).mean()
            loss = loss + r.w_feat * terms["feat"]

        else:  # c2kd
            h_n = out.hidden_states[self.student_layer]
            rows = self._feature_rows(h_n, batch)
            with torch.no_grad():
                projected = self.filters.project({l: batch["hidden"][l] for l in self.router_layers})
            routing = route(rows, projected, mask, r.router)
            terms["feat"] = sum(
                feature_loss(rows, projected[l], mask, example_weight=routing.weights[:, k])
                for k, l in enumerate(routing.layers)
            )
            if self.training:
                for layer in routing.chosen.tolist():
                    self.router_counts[layer] = self.router_counts.get(layer, 0) + 1
            if self.cross_head is not None:
                z = self.cross_head.logits(answer_rows(batch, h_n, "all"), self.teacher_head)
                terms["logit"] = cross_head_kd_loss(z, z_t, None, r.tau)
            else:
                terms["logit"] = cross_head_kd_loss(answer_rows(batch, out.logits, "all"), z_t, None, r.tau)
            loss = loss + r.w_feat * terms["feat"] + r.w_logit * terms["logit"]
            if r.uses_orth:
                terms["orth"] = orth_loss(self.cross_head.feat_mlp.weight)
                loss = loss + r.w_orth * terms["orth"]
        return {"loss": loss, **terms}


def _distill_loss(net: nn.Module, batch: dict) -> dict[str, Tensor]:
    return net(batch)


def _stage1_loss(net: nn.Module, batch: dict) -> dict[str, Tensor]:
    per_layer = net(batch["hidden"], batch["targets"])  # {layer: CE of head(norm(g_l(H_t^l)))}
    return {"loss": torch.stack(list(per_layer.values())).sum(), **{f"ce_layer_{l}": v for l, v in per_layer.items()}}


# ---------------------------------------------------------------- building the pieces


def build_student(recipe: DistillRecipe, cache: TeacherCache, seed: int) -> RecLM:
    """The student: a seeded preset over the cache's tokenizer and item embeddings, or a saved RecLM
    whose tokenizer, format and catalog match the cache."""
    spec = cache.spec
    tokenizer = cache.tokenizer()
    if recipe.student in PRESETS:
        return RecLM.from_preset(recipe.student, tokenizer, cache.item_embeddings(), spec.prompt_format, seed=seed,
                                 data_fingerprint=spec.data_fingerprint)
    path = Path(recipe.student)
    if not path.is_dir():
        raise C2KDError(f"--student {recipe.student!r}: neither a preset ({', '.join(PRESETS)}) nor a saved model folder")
    student = RecLM.load(path)
    problems = []
    if student.tokenizer.get_vocab() != tokenizer.get_vocab():
        problems.append("its tokenizer differs from the cache's tokenizer (token-level distillation needs the same one)")
    if student.spec.format != spec.prompt_format:
        problems.append(f"prompt format {student.spec.format!r} != cache {spec.prompt_format!r}")
    if student.spec.data_fingerprint and student.spec.data_fingerprint != spec.data_fingerprint:
        problems.append("it was trained on other data (data fingerprints differ)")
    if problems:
        raise C2KDError(f"--student {path}: " + "; ".join(problems))
    return student


def take_rows(batch: CachedBatch, rows: Sequence[int]) -> CachedBatch:
    """The sub-batch of these rows, with the padding trimmed to its own longest example."""
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    t = int(batch.attention_mask[idx].sum(1).max()) if len(idx) else 0
    a = int(batch.answer_mask[idx].sum(1).max()) if len(idx) else 0
    hidden_width = t if batch.positions == "all" else a

    def pick(x: Tensor | None, width: int | None = None) -> Tensor | None:
        if x is None:
            return None
        x = x[idx]
        return x[:, :width] if width is not None else x

    return replace(
        batch,
        example_ids=pick(batch.example_ids), users=pick(batch.users), targets=pick(batch.targets),
        candidates=pick(batch.candidates), history=pick(batch.history),
        input_ids=pick(batch.input_ids, t), attention_mask=pick(batch.attention_mask, t),
        slot_items=pick(batch.slot_items, t), labels=pick(batch.labels, t),
        answer_positions=pick(batch.answer_positions, a), answer_mask=pick(batch.answer_mask, a),
        hidden={l: pick(h, hidden_width) for l, h in batch.hidden.items()},
        final_hidden=pick(batch.final_hidden, a), topk_values=pick(batch.topk_values, a),
        topk_indices=pick(batch.topk_indices, a), full_logits=pick(batch.full_logits, a),
    )


class CacheReads:
    """Reads several micro-batches with ONE cache.get (a read costs about the same for 16 or 128
    random examples: the cost is per shard and array touched) and makes a trainer batch of each."""

    def __init__(self, cache: TeacherCache, make: Callable[[CachedBatch], dict], **get_kwargs):
        self.cache, self.make, self.get_kwargs = cache, make, get_kwargs

    def __call__(self, groups: Sequence[Sequence[int]]) -> list[dict]:
        batch = self.cache.get([i for g in groups for i in g], **self.get_kwargs)
        out, start = [], 0
        for g in groups:
            out.append(self.make(take_rows(batch, range(start, start + len(g)))))
            start += len(g)
        return out


def stage1_reads(cache: TeacherCache, layers: Sequence[int]) -> CacheReads:
    """Stage 1 batches: each layer's states at the answer positions, and the answer tokens."""
    def make(cached: CachedBatch) -> dict:
        batch = batch_dict(cached)
        return {
            "hidden": {l: answer_rows(batch, batch["hidden"][l], cache.spec.positions) for l in layers},
            "targets": answer_targets(batch),
        }

    return CacheReads(cache, make, layers=layers, final_hidden=False, logits=False)


def stage2_reads(cache: TeacherCache, recipe: DistillRecipe, layers: Sequence[int]) -> CacheReads:
    """Stage 2 batches: only what the method uses (sft: token ids alone)."""
    kd = recipe.method in ("c2kd", "logit-kd")
    return CacheReads(cache, batch_dict, layers=layers, final_hidden=kd, logits=kd)


class ReadAhead:
    """The trainer's collate_fn: serves each micro-batch from reads made ahead in a background thread.

    The trainer's order is known in advance: micro-batch k of epoch e is
    `epoch_batches(n, batch_size, seed, e, world)[k]`, of which this rank takes every world-th
    example. The next `group` micro-batches are read together (one cache read) while the
    student trains. A call whose ids are not the predicted ones is read on the spot, so a wrong
    prediction costs speed, never correctness; a resumed run is found on its first call (the
    planned epochs are searched once). All reads go through the one background thread, so the
    cache is never read concurrently.
    """

    def __init__(self, read: Callable[[list[list[int]]], list[dict]], example_ids: np.ndarray, batch_size: int,
                 seed: int, epochs: int, group: int = 8):
        self.read, self.example_ids, self.batch_size, self.seed = read, example_ids, batch_size, seed
        self.epochs, self.group = max(1, epochs), max(1, group)
        self.rank, self.world = distributed_info()[:2]
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="c2kd-read-ahead")
        self.pending: dict[tuple[int, int], tuple[Future, int]] = {}
        self.orders: dict[int, list[tuple[int, ...]]] = {}
        self.searched = False
        self.hits = self.misses = 0

    def _order(self, epoch: int) -> list[tuple[int, ...]]:
        if epoch not in self.orders:
            batches = epoch_batches(len(self.example_ids), self.batch_size, self.seed, epoch, self.world)
            self.orders[epoch] = [tuple(int(i) for i in self.example_ids[b[self.rank :: self.world]]) for b in batches]
        return self.orders[epoch]

    def _locate(self, ids: tuple[int, ...]) -> tuple[int, int] | None:
        for epoch, k in self.pending:  # the usual case: a call we read ahead for
            if self._order(epoch)[k] == ids:
                return epoch, k
        if self.searched:
            return None
        self.searched = True  # once: the first call, or the first surprise
        for epoch in range(self.epochs):
            order = self._order(epoch)
            if ids in order:
                return epoch, order.index(ids)
            del self.orders[epoch]
        return None

    def _following(self, epoch: int, k: int, n: int) -> list[tuple[int, int]]:
        """The (up to) n positions after (epoch, k) in the planned run."""
        out = []
        while len(out) < n:
            k += 1
            if k >= len(self._order(epoch)):
                epoch, k = epoch + 1, 0
            if epoch >= self.epochs:
                break
            out.append((epoch, k))
        return out

    def _schedule_after(self, where: tuple[int, int]) -> None:
        todo = [p for p in self._following(*where, self.group) if p not in self.pending]
        if todo:  # read a whole group from the first position not yet being read
            positions = [todo[0], *self._following(*todo[0], self.group - 1)]
            future = self.pool.submit(self.read, [list(self._order(e)[k]) for e, k in positions])
            for j, p in enumerate(positions):
                self.pending.setdefault(p, (future, j))

    def __call__(self, example_ids: list[int]) -> dict:
        ids = tuple(int(i) for i in example_ids)
        where = self._locate(ids)
        hit = self.pending.pop(where, None) if where is not None else None
        for key in [key for key in self.pending if where is None or key < where]:
            self.pending.pop(key)  # read ahead for calls that will not come
        if hit is None:
            self.misses += 1
            hit = (self.pool.submit(self.read, [list(ids)]), 0)  # queued before any read-ahead
        else:
            self.hits += 1
        if where is not None:
            self.orders = {e: v for e, v in self.orders.items() if e >= where[0]}
            self._schedule_after(where)
        future, j = hit
        return future.result()[j]

    def close(self) -> None:
        self.pending.clear()
        self.pool.shutdown(wait=True, cancel_futures=True)


def planned_epochs(config: TrainConfig, num_examples: int) -> int:
    """How many epochs (some maybe partial) a trainer run with this config goes through."""
    world = distributed_info()[1]
    if not config.max_steps:
        return config.epochs
    micro = len(epoch_batches(num_examples, config.batch_size, config.seed, 0, world))
    steps_per_epoch = max(1, -(-micro // config.grad_accum))
    return -(-config.max_steps // steps_per_epoch)


def _train_subset(ids: np.ndarray, max_train: int | None) -> np.ndarray:
    """A fixed (seed-independent) subset, so runs with different seeds see the same examples."""
    if max_train is None or max_train >= len(ids):
        return ids
    return np.sort(ids[np.random.default_rng(0).choice(len(ids), size=max_train, replace=False)])


def _on_epoch_end_router(model: DistillModel):
    """Trainer hook: the router's layer choices of the epoch, summed over ranks, into the log."""

    def hook(epoch: int, stats: dict) -> dict | None:
        if not model.router_layers:
            return None
        counts = torch.tensor([model.router_counts.get(l, 0) for l in model.router_layers], dtype=torch.float64,
                              device=model.teacher_head.device)
        if dist.is_initialized():
            dist.all_reduce(counts)
        model.router_counts.clear()
        return {"router_counts": {str(l): int(c) for l, c in zip(model.router_layers, counts.tolist())}}

    return hook


# ---------------------------------------------------------------- the recipe


def distill(
    cache: str | os.PathLike,
    data: str | Path | ExampleSet,
    out: str | Path,
    recipe: DistillRecipe,
    train_config: dict | None = None,
    overwrite: bool = False,
    keep_checkpoints: bool = False,
) -> dict:
    """Distil a student from a teacher cache and save it at `out`; returns `out/distill.json`.

    `train_config`: TrainConfig fields for stage 2 (all but out_dir; weight decay defaults to the
    authors' 1e-5). Re-running after an interruption with the same arguments resumes."""
    wall = time.perf_counter()
    out, work = claim(out, overwrite)
    examples = data if isinstance(data, ExampleSet) else load_examples(data)

    # Refusals before anything is trained: cache schema/completeness (the reader), data, layers.
    teacher_cache = TeacherCache.open(cache, expect={"splits": ["train"], "data_fingerprint": examples.fingerprint})
    spec = teacher_cache.spec
    kind, fixed_layer = parse_router(recipe.router)
    if recipe.uses_filters and kind == "fixed" and fixed_layer not in spec.layers:
        raise C2KDError(f"--router {recipe.router}: layer {fixed_layer} is not cached (cached: {list(spec.layers)})")

    settings = {"weight_decay": 1e-5, **(train_config or {})}
    config = TrainConfig(out_dir=work / "stage2", **settings)
    student = build_student(recipe, teacher_cache, seed=config.seed)
    layer_map = None
    if recipe.method == "feature-kd":
        teacher_layers = spec.teacher_num_layers or int(teacher_cache.teacher_config().get("num_layers", 0))
        layer_map = uniform_layer_map(student.num_layers, teacher_layers, spec.layers)

    rank = distributed_info()[0]
    recipe_record = {"recipe": "distill", **asdict(recipe), "cache": str(cache),
                     "cache_spec_hash": spec.spec_hash, "data_fingerprint": examples.fingerprint}
    check_or_write_recipe(work, recipe_record, rank)
    train_ids = _train_subset(teacher_cache.split_ids("train"), recipe.max_train)
    train_data = CachedExamples(train_ids)

    # Stage 1 (c2kd): filters on cached teacher states, teacher frozen by construction.
    filters, stage1_result = None, None
    if recipe.uses_filters:
        torch.manual_seed(config.seed)
        filters = LayerFilters(spec.layers, spec.hidden_size, student.hidden_size, spec.vocab_size)
        if recipe.stage1_epochs > 0:
            stage1_config = TrainConfig(
                out_dir=work / "stage1", lr=recipe.stage1_lr, weight_decay=settings["weight_decay"],
                epochs=recipe.stage1_epochs, batch_size=config.batch_size, seed=config.seed, device=config.device,
                checkpoint_every=config.checkpoint_every, log_every=config.log_every, progress=config.progress,
            )
            reader = ReadAhead(stage1_reads(teacher_cache, spec.layers), train_ids, stage1_config.batch_size,
                               stage1_config.seed, planned_epochs(stage1_config, len(train_ids)))
            try:
                stage1_result = train(filters, _stage1_loss, train_data, reader, None, None, stage1_config)
            finally:
                reader.close()

    # Stage 2.
    model = DistillModel(student, recipe, spec, teacher_cache.head_weight(), filters, layer_map)
    layers = (list(spec.layers) if recipe.uses_filters else sorted(set(layer_map.values())) if layer_map else [])

    from c2kd.student.evaluate import RecLMEvaluator

    evaluator = RecLMEvaluator(examples, "validation", limit=recipe.max_val, batch_size=recipe.eval_batch_size,
                               generation=False, full_catalog=False, progress=False)
    reader = ReadAhead(stage2_reads(teacher_cache, recipe, layers), train_ids, config.batch_size, config.seed,
                       planned_epochs(config, len(train_ids)))
    try:
        result: TrainResult = train(
            model, _distill_loss, train_data, reader, lambda m: evaluator(m.student), recipe.select_metric, config,
            trainable_parameters=model.trainable_parameters(), on_epoch_end=_on_epoch_end_router(model),
        )
    finally:
        reader.close()
    read_ahead = {"hits": reader.hits, "misses": reader.misses}
    record = {
        "kind": DISTILL_KIND, "version": DISTILL_VERSION, "recipe": asdict(recipe),
        "cache": {"path": str(cache), "layers": list(spec.layers), "positions": spec.positions,
                  "logits": spec.logits, "dtype": spec.dtype, "teacher": spec.teacher_description,
                  "teacher_fingerprint": spec.teacher_fingerprint, "spec_hash": spec.spec_hash},
        "student": {"source": recipe.student, "base": student.spec.base, "layers": student.num_layers,
                    "hidden_size": student.hidden_size, "distilled_layer": model.student_layer,
                    "non_embedding_parameters": student.non_embedding_parameters()},
        "feature_kd_layer_map": {str(k): v for k, v in (layer_map or {}).items()} or None,
        "data": {"dir": str(examples.root), "fingerprint": examples.fingerprint, "train_examples": len(train_data),
                 "validation_examples": evaluator.frame.height},
        "train": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items() if k != "out_dir"},
        "stage1_steps": stage1_result.final_step if stage1_result else 0,
        "validation": {"select_metric": recipe.select_metric, "best_step": result.best_step,
                       "best": result.best_metrics},
        "final_step": result.final_step,
        "read_ahead": read_ahead,
        "timings": {"stage1_s": round(stage1_result.total_train_s, 3) if stage1_result else 0.0,
                    "train_s": round(result.total_train_s, 3), "resumed_from_step": result.resumed_from},
    }
    if rank != 0:
        return record
    record["metrics"] = final_metrics(model.student, examples, recipe.eval_batch_size)
    record["timings"]["this_run_s"] = round(time.perf_counter() - wall, 3)
    _finish(model.student, work, out, record, overwrite, keep_checkpoints)
    return record


def final_metrics(student: RecLM, examples: ExampleSet, batch_size: int) -> dict:
    """Validation and test metrics of the selected student (the full evaluation protocol)."""
    from c2kd.student.evaluate import RecLMEvaluator

    return {split: RecLMEvaluator(examples, split, batch_size=batch_size, progress=False).evaluate(student)
            for split in ("validation", "test")}


def _finish(student: RecLM, work: Path, out: Path, record: dict, overwrite: bool, keep_checkpoints: bool) -> None:
    """Save the selected student with its records and plot, then rename it into place at `out`."""
    staged = student.save(work / "model")
    shutil.copyfile(work / "stage2" / "log.jsonl", staged / "log.jsonl")
    if (work / "stage1" / "log.jsonl").exists():
        shutil.copyfile(work / "stage1" / "log.jsonl", staged / "stage1_log.jsonl")
    write_json(staged / "distill.json", record)
    write_json(staged / "metrics.json", record["metrics"])
    plot_run(staged, record)
    publish(staged, out, work, overwrite, keep_work=keep_checkpoints)


def plot_run(run_dir: Path, record: dict) -> Path:
    """distill.png: loss terms per step, router layer choices per epoch, validation metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train_lines, epochs, evals = (read_log(run_dir, kind) for kind in ("train", "epoch", "eval"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    for term in ("loss", "lm", "feat", "logit", "orth"):
        points = [(r["step"], r[term]) for r in train_lines if term in r]
        if points:
            ax.plot(*zip(*points), label=term)
    ax.set(title="training loss terms", xlabel="optimizer step", yscale="log")
    ax.legend()

    ax = axes[1]
    counted = [r for r in epochs if "router_counts" in r]
    if counted:
        layers = list(counted[0]["router_counts"])
        bottom = np.zeros(len(counted))
        for layer in layers:
            share = np.array([r["router_counts"][layer] / max(1, sum(r["router_counts"].values())) for r in counted])
            ax.bar([r["epoch"] + 1 for r in counted], share, bottom=bottom, label=f"layer {layer}")
            bottom += share
        ax.set(title="router: teacher layer chosen (share of examples)", xlabel="epoch", ylim=(0, 1),
               xticks=[r["epoch"] + 1 for r in counted])
        ax.legend()
    else:
        ax.text(0.5, 0.5, f"no router (method {record['recipe']['method']})", ha="center", va="center")
        ax.set_axis_off()

    ax = axes[2]
    metric = record["validation"]["select_metric"]
    points = [(r["step"], r[metric]) for r in evals if metric in r]
    if points:
        ax.plot(*zip(*points), marker="o")
    ax.set(title=f"validation {metric}", xlabel="optimizer step")
    fig.suptitle(f"distill {record['recipe']['method']} (router {record['recipe']['router']})")
    fig.tight_layout()
    path = run_dir / PLOT_FILE
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
