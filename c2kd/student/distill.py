"""The `distill` recipe (stage two): train a small student from a teacher cache, never the teacher.

    cache (tokenizer, item embeddings, teacher head, hidden states, final states at answers)
      -> student RecLM (c2kd.recmodel.build, over the cache's tokenizer and item embeddings)
      -> stage 1 (c2kd only): layer filters g_l trained on the cached teacher states
      -> stage 2: c2kd.training.train(DistillModel = student + its method's pieces, best on validation)
      -> saved student + distill.json + metrics.json + log.jsonl + distill.png (student/report.py)

The losses are in `objective.py`, the batches in `cache_batches.py`. The `--data` folder is
used for validation (model selection) and the final validation/test evaluation, and must be the
data the cache was built from (fingerprints are compared before training). Training examples
come from the cache's train split.

While it runs, everything lives in `<out>.partial/` (stage1/ and stage2/ trainer folders,
recipe.json); running the same command again resumes there. At the end the student is saved
and the folder renamed to `<out>`: a folder at `<out>` is always complete. Under torchrun every
rank trains (DDP through the trainer) and reads only its part of each batch from the cache;
rank 0 evaluates and writes the results.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from c2kd.cache_schema import CacheSpec, TeacherCache
from c2kd.distributed import dist_env
from c2kd.errors import C2KDError
from c2kd.evaluate import RecLMEvaluator
from c2kd.metrics import DEFAULT_SELECT_METRIC, SELECT_METRICS
from c2kd.data.examples import ExampleSet, fixed_subset, load_examples
from c2kd.recmodel.build import build_model, check_source
from c2kd.recmodel.hf import prepare_for_training
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.pretrained import c2kd_home
from c2kd.run_folder import check_or_write_recipe, claim, finished_run, leaves_nothing_when_refused
from c2kd.student.cache_batches import CacheBatches
from c2kd.student.diagnostics import probe_report
from c2kd.student.filters import LayerFilters, init_as_lens, stage1_loss
from c2kd.student.kd_support import ITEM_SUPPORTS, KD_SUPPORTS, support_columns
from c2kd.student.layer_map import uniform_layer_map
from c2kd.student.objective import METHODS, WEIGHTS, DistillModel, LossWeights, term_weights
from c2kd.student.report import distill_record, epoch_diagnostics, finish, run_diagnostics
from c2kd.student.router import parse_router
from c2kd.training import TrainConfig, TrainResult, comparable_config, train

# Settings added after distill runs were first recorded, with the value those runs used: a finished
# or interrupted run recorded without one is still the same run.
SETTINGS_ADDED = {"kd_over": "vocab", "w_own_logit": 0.0, "router_layers": None, "student_layer": "penultimate",
                  "filter_init": "random", "stage1_holdout": 0.1, "stage1_select": "ce", "shuffle_block": 0}
STUDENT_LAYERS = ("penultimate", "last")
STAGE1_SELECT = {"ce": "neg_probe_ce", "hr1": "probe_HR@1_mean"}  # what stage 1's best epoch maximises
# lens: identity filters + the teacher's head as the probe head (filters.py); auto: lens where the
# student's width is the teacher's, else random
FILTER_INITS = ("random", "lens", "auto")


# `--recipe paper`: the paper's C2KD (DESIGN.md §3; stage 1 at its authors' schedule). The dataclass's
# own defaults are the paper's constants too, but stage 1's (1 epoch at 1e-3, as recorded runs had it).
PAPER_RECIPE = {"router": "top1", "cross_head": True, "orth": True, "w_feat": 0.5, "w_logit": 0.5, "w_orth": 0.05,
                "tau": 1.0, "w_own_logit": 0.0, "kd_over": "vocab", "student_layer": "penultimate", "stage1_epochs": 3,
                "stage1_lr": 8e-4, "filter_init": "random"}
# `--recipe default` (what `c2kd distill` and `c2kd tune` start from), per method: chosen on validation
# by `c2kd tune`, 12 trials per method, on the demo's SmolLM2-135M pair
# (benchmarks/results/c2kd_parts/demo.json); weights to two significant digits. The same search on
# the Gemma-3 demo's pair (8 trials, c2kd_parts/gemma.json) chose the same C2KD recipe.
DEFAULT_RECIPES = {
    "c2kd": {"router": "soft:8", "filter_init": "auto", "student_layer": "penultimate", "w_feat": 3.1, "w_logit": 0.45,
             "w_own_logit": 8.0, "stage1_epochs": 3, "stage1_lr": 8e-4},
    "logit-kd": {"w_logit": 8.0},  # tune chose 3.7 on one seed; 8 scored higher on validation over 5 (DESIGN §3)
}
RECIPES = ("default", "paper")
STAGE1_HOLDOUT_MAX = 2048  # held-out examples judging stage 1's probes, whatever the cache's size


def recipe_preset(name: str, method: str, cross_head: bool = True) -> dict:
    """The DistillRecipe fields preset `name` sets for `method` (`--no-cross-head` drops the own-head
    term: C2KD's logit loss is then on the student's own head already)."""
    if name not in RECIPES:
        raise C2KDError(f"--recipe {name!r}: expected one of {', '.join(RECIPES)}")
    fields = PAPER_RECIPE if name == "paper" else DEFAULT_RECIPES.get(method, {})
    return {k: v for k, v in fields.items() if cross_head or k != "w_own_logit"}


@dataclass(frozen=True)
class DistillRecipe(LossWeights):
    """What to distil: the method and its weights (LossWeights) and the student; `TrainConfig`
    (minus out_dir) says how stage 2 trains."""

    student: str = "tiny-student"  # a preset, a pretrained alias or folder (with shrink), or a saved RecLM
    shrink: str | None = None  # first:K | narrow:WIDTHxLAYERS
    item_head: str = "auto"  # token | hybrid | auto (hybrid for ids), for a student built here
    router_layers: tuple[int, ...] | None = None  # c2kd: the cached teacher layers the router chooses among (None: all)
    stage1_epochs: int = 1
    stage1_lr: float = 1e-3
    filter_init: str = "random"  # random | lens (needs the student's width = the teacher's) | auto
    stage1_holdout: float = 0.1  # without a cached validation split: the share of train examples stage 1 holds out (<= 2,048)
    stage1_select: str = "ce"  # stage 1's best epoch by the probes' held-out CE (ce) or mean HR@1 over the candidates (hr1)
    # the epoch's order shuffles shards, then examples within blocks of >= this many (0: one full
    # shuffle); data no larger than a block is fully shuffled (cache_batches.py)
    shuffle_block: int = 4096
    max_train: int | None = None  # a fixed random subset of the cached train split (CPU runs)
    max_val: int | None = None  # the first N validation examples for model selection
    select_metric: str = DEFAULT_SELECT_METRIC
    eval_batch_size: int = 32

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise C2KDError(f"--method {self.method!r}: expected one of {', '.join(METHODS)}")
        parse_router(self.router)
        if self.kd_over not in KD_SUPPORTS:
            raise C2KDError(f"--kd-over {self.kd_over!r}: expected one of {', '.join(KD_SUPPORTS)}")
        if self.kd_over in ITEM_SUPPORTS and self.method in ("sft", "feature-kd"):
            raise C2KDError(f"--kd-over {self.kd_over} changes the logit losses; --method {self.method} has none (drop --kd-over)")
        check_source(self.student, self.shrink, self.item_head)
        for name in (*WEIGHTS, "stage1_epochs", "shuffle_block"):
            if getattr(self, name) < 0:
                raise C2KDError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.router_layers is not None:
            if self.method != "c2kd":
                raise C2KDError(f"--router-layers chooses C2KD's candidate teacher layers; --method {self.method} has no router")
            if not self.router_layers or len(set(self.router_layers)) != len(self.router_layers):
                raise C2KDError(f"--router-layers {','.join(map(str, self.router_layers))}: expected distinct cached "
                                "teacher layers, e.g. 14,15,16,17")
        if self.w_own_logit > 0 and (self.method != "c2kd" or not self.cross_head):
            raise C2KDError("--w-own-logit adds vanilla logit KD on the student's own head to C2KD's cross-head loss: "
                            "it needs --method c2kd with the cross-head (for the own head alone: --method logit-kd)")
        if self.student_layer not in STUDENT_LAYERS:
            raise C2KDError(f"--student-layer {self.student_layer!r}: expected one of {', '.join(STUDENT_LAYERS)}")
        if self.filter_init not in FILTER_INITS:
            raise C2KDError(f"--filter-init {self.filter_init!r}: expected one of {', '.join(FILTER_INITS)}")
        if self.stage1_select not in STAGE1_SELECT:
            raise C2KDError(f"--stage1-select {self.stage1_select!r}: expected one of {', '.join(STAGE1_SELECT)}")
        if not 0.0 < self.stage1_holdout < 1.0:
            raise C2KDError(f"--stage1-holdout must be between 0 and 1 (exclusive), got {self.stage1_holdout}")
        if self.router == "probe" and self.stage1_epochs == 0 and self.filter_init == "random":
            raise C2KDError("--router probe follows stage 1's probes: train them (--stage1-epochs >= 1) or start them "
                            "from the teacher's head (--filter-init lens)")
        for name in ("tau", "stage1_lr"):
            if getattr(self, name) <= 0:
                raise C2KDError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("max_train", "max_val", "eval_batch_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise C2KDError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.select_metric not in SELECT_METRICS:
            raise C2KDError(f"--select-metric {self.select_metric!r}: expected one of {', '.join(SELECT_METRICS)}")

    def router_candidates(self, spec: CacheSpec) -> tuple[int, ...]:
        """C2KD's candidate teacher layers: --router-layers, each of them cached, or every cached layer (a
        cache may also hold the early layers a feature-KD student of the same teacher reads); () otherwise."""
        if self.method != "c2kd":
            return ()
        if self.router_layers is None:
            return tuple(spec.layers)
        missing = [l for l in self.router_layers if l not in spec.layers]
        if missing:
            raise C2KDError(f"--router-layers: layers {missing} are not cached (cached: {list(spec.layers)})")
        return tuple(self.router_layers)

    def check_cache(self, spec: CacheSpec) -> None:
        """What the recipe asks of the cache: item-token answers for --kd-over items, cached router layers."""
        if self.kd_over in ITEM_SUPPORTS and spec.prompt_format != "ids":
            raise C2KDError(f"--kd-over {self.kd_over} compares item-token distributions: it needs an ids cache, this one "
                            f"is {spec.prompt_format!r} (use --kd-over vocab)")
        candidates = self.router_candidates(spec)
        kind, fixed_layer = parse_router(self.router)
        if self.method == "c2kd" and kind == "fixed" and fixed_layer not in spec.layers:
            raise C2KDError(f"--router {self.router}: layer {fixed_layer} is not cached (cached: {list(spec.layers)})")
        if self.method == "c2kd" and kind == "fixed" and fixed_layer not in candidates:
            raise C2KDError(f"--router {self.router}: layer {fixed_layer} is not one of --router-layers {list(candidates)}")

    def probe_classes(self, student: RecLM) -> torch.Tensor | None:
        """What stage 1's probe head classifies: None = the vocabulary, or (--kd-over items|candidates)
        the item tokens' ids, in item order."""
        return support_columns(self.kd_over, student.item_token_ids)

    def layer_filters(self, spec: CacheSpec, student: RecLM) -> LayerFilters:
        """C2KD's stage-1 filters over the router's candidate layers, for this student and cache."""
        classes = self.probe_classes(student)
        return LayerFilters(self.router_candidates(spec), spec.hidden_size, student.hidden_size,
                            spec.vocab_size if classes is None else len(classes))

    def check_student(self, student: RecLM, spec: CacheSpec) -> None:
        """A method that compares the student's own logits with the teacher's needs one vocabulary."""
        own_head = self.method == "logit-kd" or (self.method == "c2kd" and (not self.cross_head or self.w_own_logit > 0))
        if own_head and student.vocab_size != spec.vocab_size:
            raise C2KDError(
                f"--method {self.method}{'' if self.cross_head else ' --no-cross-head'}"
                f"{' --w-own-logit' if self.w_own_logit > 0 else ''} compares the student's "
                f"own logits with the teacher's, but their vocabularies differ ({student.vocab_size} vs {spec.vocab_size})"
            )


def build_student(recipe: DistillRecipe, cache: TeacherCache, seed: int) -> RecLM:
    """The student over the cache's tokenizer and item embeddings (`c2kd.recmodel.build`); a saved
    or pretrained model must have the cache's tokenizer, format and data."""
    spec = cache.spec
    tokenizer = cache.tokenizer()
    student = build_model(recipe.student, fmt=spec.prompt_format, item_embeddings=cache.item_embeddings(),
                          data_fingerprint=spec.data_fingerprint, seed=seed, item_head=recipe.item_head,
                          shrink=recipe.shrink, preset_tokenizer=lambda: tokenizer)
    problems = []
    if student.tokenizer.get_vocab() != tokenizer.get_vocab():
        problems.append("its tokenizer differs from the cache's tokenizer (token-level distillation needs the same one)")
    if student.spec.format != spec.prompt_format:
        problems.append(f"prompt format {student.spec.format!r} != cache {spec.prompt_format!r}")
    if problems:
        raise C2KDError(f"--student {recipe.student}: " + "; ".join(problems))
    recipe.check_student(student, spec)
    return student


def _stage1_split(recipe: DistillRecipe, cache: TeacherCache, train_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(what stage 1 trains on, what its probes are judged on): the cached validation split when there
    is one (its first --max-val examples), else a fixed `stage1_holdout` share of the train examples,
    which then only stage 2 trains on (at most STAGE1_HOLDOUT_MAX: the probes are judged every epoch,
    and a share of a large cache would be a read of much of it each time)."""
    if "validation" in cache.spec.splits:
        return train_ids, cache.split_ids("validation")[: recipe.max_val]
    held = min(max(1, round(recipe.stage1_holdout * len(train_ids))), STAGE1_HOLDOUT_MAX)
    order = np.random.default_rng(0).permutation(len(train_ids))
    return train_ids[np.sort(order[held:])], train_ids[np.sort(order[:held])]


def _stage1(recipe: DistillRecipe, cache: TeacherCache, train_ids: np.ndarray, config: TrainConfig, student: RecLM,
            head_weight: torch.Tensor, work: Path) -> tuple[LayerFilters, TrainResult | None, dict]:
    """C2KD stage 1: the layer filters g_l of the router's candidate layers on the cached teacher states
    (the teacher frozen by construction), the best epoch chosen on held-out examples by the probes'
    CE or their HR@1 (`stage1_select`).
    Returns the filters, the run and the probes' report on the held-out examples."""
    classes = recipe.probe_classes(student)
    torch.manual_seed(config.seed)
    filters = recipe.layer_filters(cache.spec, student)
    if recipe.filter_init == "lens" or (recipe.filter_init == "auto" and student.hidden_size == cache.spec.hidden_size):
        init_as_lens(filters, head_weight.float() if classes is None else head_weight.float()[classes])
    fit_ids, judge_ids = _stage1_split(recipe, cache, train_ids)
    judge = lambda f: probe_report(f, cache, judge_ids, classes, student.item_token_ids, head_weight)  # noqa: E731
    if recipe.stage1_epochs == 0:
        return filters, None, judge(filters)
    stage1 = TrainConfig(out_dir=work / "stage1", lr=recipe.stage1_lr, weight_decay=config.weight_decay,
                         epochs=recipe.stage1_epochs, batch_size=config.batch_size, seed=config.seed,
                         max_steps=config.max_steps,  # --max-steps bounds each stage: a short run is short
                         device=config.device, checkpoint_every=config.checkpoint_every, log_every=config.log_every,
                         progress=config.progress, bf16=config.bf16)
    source = CacheBatches(cache, fit_ids, stage1.batch_size, stage1.seed, block=recipe.shuffle_block,
                          layers=filters.teacher_layers, final_hidden=False, logits=False)
    result = train(filters, lambda net, batch: stage1_loss(net, batch, classes), source, judge, STAGE1_SELECT[recipe.stage1_select], stage1)
    return filters, result, result.best_metrics


@leaves_nothing_when_refused
def distill(
    cache: str | os.PathLike,
    data: str | Path | ExampleSet,
    out: str | Path,
    recipe: DistillRecipe,
    train_config: dict | None = None,
    overwrite: bool = False,
    keep_checkpoints: bool = False,
    read_cache: str | Path | None = None,
    final_splits: tuple[str, ...] = ("validation", "test"),
) -> dict:
    """Distil a student from a teacher cache and save it at `out`; returns `out/distill.json`.

    `final_splits`: the splits the selected student is evaluated on at the end (a recipe search
    leaves test out: it reads test once, for the recipe it chose).
    `train_config`: TrainConfig fields for stage 2 (all but out_dir). Re-running after an
    interruption with the same arguments resumes. A cache at a URL is read through a local read
    cache (`read_cache`, default $C2KD_HOME/remote-caches): every file is fetched once."""
    wall = time.perf_counter()
    out, work = claim(out)
    config = TrainConfig(out_dir=work / "stage2", **(train_config or {}))
    examples = data if isinstance(data, ExampleSet) else load_examples(data)

    # Refusals before anything is trained or written: cache schema, integrity and fit, data, layers.
    if read_cache is None and "://" in str(cache):
        read_cache = c2kd_home() / "remote-caches"
    teacher_cache = TeacherCache.open(cache, expect={"splits": ["train"], "data_fingerprint": examples.fingerprint},
                                      read_cache=read_cache)
    spec = teacher_cache.spec
    # the cache by its identity, not its path: a moved or re-served cache is the same cache
    recipe_record = {"recipe": "distill", **asdict(recipe), "train": comparable_config(config),
                     "cache_digest": teacher_cache.digest, "data_fingerprint": examples.fingerprint}
    finished = finished_run(out, recipe_record, "distill.json", overwrite, SETTINGS_ADDED)
    if finished is not None:
        return {**finished, "already_complete": True}
    recipe.check_cache(spec)
    candidates = recipe.router_candidates(spec)
    student = build_student(recipe, teacher_cache, seed=config.seed)
    teacher_cache.teacher_config()  # with the tokenizer, embeddings and head: every asset checksummed before training
    layer_map = None
    if recipe.method == "feature-kd":
        layer_map = uniform_layer_map(student.num_layers, spec.teacher_num_layers, spec.layers)
    head_weight = teacher_cache.head_weight()

    rank = dist_env()[0]
    check_or_write_recipe(work, recipe_record, rank, SETTINGS_ADDED)  # only once everything could be opened and built
    cached = teacher_cache.split_ids("train")
    train_ids = cached[fixed_subset(len(cached), recipe.max_train)]

    filters, stage1_result, probes = None, None, None
    if recipe.method == "c2kd":
        filters, stage1_result, probes = _stage1(recipe, teacher_cache, train_ids, config, student, head_weight, work)

    # Stage 2: each method reads only what it uses (sft: the token ids alone). Feature KD's adapters start
    # from the run's seed: loading a pretrained student leaves the global generator in a state that differs
    # from one process to the next (C2KD's cross-head follows stage 1, which reseeds).
    if filters is None:
        torch.manual_seed(config.seed)
    model = DistillModel(student, recipe, spec, head_weight, filters, layer_map)
    kd = recipe.method in ("c2kd", "logit-kd")
    layers = list(candidates) if recipe.method == "c2kd" else sorted(set((layer_map or {}).values()))
    source = CacheBatches(teacher_cache, train_ids, config.batch_size, config.seed, block=recipe.shuffle_block,
                          layers=layers, final_hidden=kd, logits=kd)
    evaluator = RecLMEvaluator(examples, "validation", limit=recipe.max_val, batch_size=recipe.eval_batch_size,
                               generation=False, full_catalog=False, progress=False)
    first_batch = teacher_cache.get(train_ids[: config.batch_size], layers=layers, final_hidden=kd, logits=kd)
    result = train(model, lambda net, batch: net(batch), source, lambda m: evaluator(m.student), recipe.select_metric,
                   config, trainable_parameters=model.trainable_parameters(),
                   on_epoch_end=epoch_diagnostics(model, first_batch, term_weights(recipe)), on_device=prepare_for_training)
    record = distill_record(recipe, teacher_cache, str(cache), model, examples, len(train_ids), evaluator, config,
                            stage1_result, result, layer_map)
    record["diagnostics"] = run_diagnostics(probes, work / "stage2")
    if rank != 0:
        return record
    evaluated = {split: RecLMEvaluator(examples, split, batch_size=recipe.eval_batch_size, progress=False)
                 .evaluate_with_predictions(model.student) for split in final_splits}
    record["metrics"] = {split: metrics for split, (metrics, _) in evaluated.items()}
    record["timings"]["this_run_s"] = round(time.perf_counter() - wall, 3)
    finish(model.student, work, out, record, overwrite, keep_checkpoints, [rows for _, rows in evaluated.values()])
    return record
