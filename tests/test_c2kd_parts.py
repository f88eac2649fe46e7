"""Whether C2KD's parts do their job: what a run reports about them, and the options that change them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from c2kd.cache_schema import TeacherCache
from c2kd.data.examples import load_examples
from c2kd.errors import C2KDError
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, cache_teacher
from c2kd.student.diagnostics import probe_report
from c2kd.student.distill import DistillRecipe, build_student, distill
from c2kd.student.filters import init_as_lens, probe_scores
from c2kd.student.objective import DistillModel
from c2kd.student.report import choice_entropy, diagnostics_line
from c2kd.student.tune import parse_space, read_space, tune

from tests.conftest import save_random_teacher

TRAIN = {"epochs": 2, "batch_size": 16, "progress": False, "seed": 0, "checkpoint_every": 0}


@pytest.fixture(scope="module")
def examples(tiny_examples_dir):
    return load_examples(tiny_examples_dir)


@pytest.fixture(scope="module")
def teacher_dir(examples, tmp_path_factory) -> Path:
    return save_random_teacher(examples, tmp_path_factory.mktemp("teacher"), seed=3)


@pytest.fixture(scope="module")
def cache(teacher_dir, examples, tmp_path_factory) -> Path:
    """A cache of the train and validation splits (stage 1 judges its probes on validation)."""
    out = tmp_path_factory.mktemp("cache") / "cache"
    cache_teacher(teacher_dir, examples, out, CacheTeacherSettings(splits=("train", "validation"), progress=False,
                                                                   device="cpu", examples_per_shard=64))
    return out


@pytest.fixture(scope="module")
def train_only_cache(teacher_dir, examples, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cache") / "train-only"
    cache_teacher(teacher_dir, examples, out, CacheTeacherSettings(splits=("train",), progress=False, device="cpu",
                                                                   examples_per_shard=64))
    return out


def test_a_c2kd_run_reports_its_probes_router_and_gradient_shares(cache, examples, tmp_path):
    recipe = DistillRecipe(student="micro", stage1_epochs=2, max_val=20)
    record = distill(cache, examples.root, tmp_path / "s", recipe, TRAIN)
    diag = record["diagnostics"]
    stage1 = diag["stage1"]
    assert set(stage1["layers"]) == {str(l) for l in TeacherCache.open(cache).spec.layers}
    assert stage1["chance_HR@1"] == pytest.approx(1 / 20)
    for layer in stage1["layers"].values():
        assert 0.0 <= layer["HR@1"] <= 1.0 and math.isfinite(layer["ce"]) and layer["ce"] > 0
    assert 0.0 <= stage1["teacher_HR@1"] <= 1.0
    assert len(diag["epochs"]) == 2
    for epoch in diag["epochs"]:
        assert sum(epoch["router_counts"].values()) == TeacherCache.open(cache).split_ids("train").size
        assert 0.0 <= epoch["router_entropy"] <= math.log(len(epoch["router_counts"])) + 1e-9
        shares = {k: v for k, v in epoch.items() if k.startswith("grad_share/")}
        assert set(shares) == {"grad_share/lm", "grad_share/feat", "grad_share/logit", "grad_share/orth"}
        assert sum(shares.values()) == pytest.approx(1.0)
        assert {"lm", "feat", "logit", "orth", "loss"} <= set(epoch)
    line = diagnostics_line(record)
    assert "probes HR@1" in line and "router (last epoch)" in line and "gradient shares" in line
    saved = json.loads((tmp_path / "s" / "distill.json").read_text())
    assert saved["diagnostics"] == json.loads(json.dumps(diag))
    # stage 1 chose its best epoch on the held-out probes
    stage1_evals = [json.loads(l) for l in (tmp_path / "s" / "stage1_log.jsonl").read_text().splitlines()]
    assert [r for r in stage1_evals if r["kind"] == "eval" and "neg_probe_ce" in r]


def test_without_a_validation_split_stage1_holds_out_train_examples(train_only_cache, examples, tmp_path):
    record = distill(train_only_cache, examples.root, tmp_path / "s",
                     DistillRecipe(student="micro", stage1_holdout=0.25, stage1_epochs=3, stage1_select="hr1"),
                     {**TRAIN, "epochs": 1})
    assert record["diagnostics"]["stage1"]["layers"]
    train = TeacherCache.open(train_only_cache).split_ids("train").size
    stage1_lines = [json.loads(l) for l in (tmp_path / "s" / "stage1_log.jsonl").read_text().splitlines()]
    epoch = [r for r in stage1_lines if r["kind"] == "epoch"][0]
    assert epoch["step"] == math.ceil(round(0.75 * train) / 16)  # stage 1 saw only the rest
    evals = [r for r in stage1_lines if r["kind"] == "eval"]
    kept = max(evals, key=lambda r: (r["probe_HR@1_mean"], -r["step"]))  # the first epoch with the best mean HR@1
    assert [r["step"] for r in evals if r["best"]][-1] == kept["step"]
    with pytest.raises(C2KDError, match="--stage1-select 'auc'"):
        DistillRecipe(stage1_select="auc")
    assert record["data"]["train_examples"] == train  # stage 2 trains on all of them


def test_stage1_holds_out_a_share_of_train_but_never_more_than_its_cap():
    from types import SimpleNamespace

    import numpy as np

    from c2kd.student.distill import STAGE1_HOLDOUT_MAX, _stage1_split

    train_only = SimpleNamespace(spec=SimpleNamespace(splits=("train",)))
    for n, held in ((1_000, 100), (100_000, STAGE1_HOLDOUT_MAX)):  # 10 % of 100,000 would be read every epoch
        ids = np.arange(7, 7 + n)
        fit, judge = _stage1_split(DistillRecipe(), train_only, ids)
        assert len(judge) == held and len(fit) == n - held
        assert np.array_equal(np.sort(np.concatenate([fit, judge])), ids)


def test_lens_init_starts_each_probe_as_the_teachers_head(cache, teacher_dir, examples):
    opened = TeacherCache.open(cache)
    recipe = DistillRecipe(student=str(teacher_dir), shrink="first:2", filter_init="lens", kd_over="items")
    student = build_student(recipe, opened, seed=0)
    filters = recipe.layer_filters(opened.spec, student)
    classes = recipe.probe_classes(student)
    head = opened.head_weight().float()
    val = opened.split_ids("validation")
    before = probe_report(filters, opened, val, classes, student.item_token_ids, head)
    init_as_lens(filters, head[classes])
    after = probe_report(filters, opened, val, classes, student.item_token_ids, head)
    top = max(opened.spec.layers)
    assert after[f"ce_layer_{top}"] < before[f"ce_layer_{top}"]
    with pytest.raises(C2KDError, match="--filter-init lens needs the student's width"):
        small = build_student(DistillRecipe(student="micro"), opened, seed=0)
        init_as_lens(DistillRecipe(student="micro").layer_filters(opened.spec, small), head)


def test_auto_filter_init_is_lens_where_the_widths_allow(cache, teacher_dir, tmp_path):
    from c2kd.student.distill import _stage1
    from c2kd.training import TrainConfig

    opened = TeacherCache.open(cache)
    head = opened.head_weight()
    for source, lens in ((dict(student=str(teacher_dir), shrink="first:2"), True), (dict(student="micro"), False)):
        recipe = DistillRecipe(**source, filter_init="auto", stage1_epochs=0, kd_over="items")
        student = build_student(recipe, opened, seed=0)
        filters, _, _ = _stage1(recipe, opened, opened.split_ids("train"), TrainConfig(out_dir=tmp_path, progress=False),
                                student, head, tmp_path)
        weight = next(iter(filters.filters.values())).weight
        is_identity = weight.shape[0] == weight.shape[1] and torch.equal(weight, torch.eye(weight.shape[0]))
        assert is_identity == lens


def test_student_layer_last_reads_the_final_normed_state(cache, examples):
    opened = TeacherCache.open(cache)
    for layer, expected in (("penultimate", 1), ("last", 2)):
        recipe = DistillRecipe(student="micro", student_layer=layer)
        student = build_student(recipe, opened, seed=0)
        model = DistillModel(student, recipe, opened.spec, opened.head_weight(), recipe.layer_filters(opened.spec, student))
        assert model.student_layer == expected
        out = model(opened.get(opened.split_ids("train")[:4]))
        assert torch.isfinite(out["loss"])
    with pytest.raises(C2KDError, match="--student-layer 'first'"):
        DistillRecipe(student_layer="first")


def test_probe_router_scores_are_minus_each_layers_probe_ce(cache):
    opened = TeacherCache.open(cache)
    recipe = DistillRecipe(student="micro", router="probe")
    student = build_student(recipe, opened, seed=0)
    filters = recipe.layer_filters(opened.spec, student)
    batch = opened.get(opened.split_ids("train")[:6], layers=opened.spec.layers)
    scores = probe_scores(filters, batch, None)
    assert scores.shape == (6, len(opened.spec.layers)) and (scores < 0).all()
    model = DistillModel(student, recipe, opened.spec, opened.head_weight(), filters).train()
    out = model(opened.get(opened.split_ids("train")[:6]))
    chosen = {k: int(v) for k, v in out.items() if k.startswith("count/")}
    best = [opened.spec.layers[i] for i in scores.argmax(dim=1).tolist()]
    assert chosen == {f"count/router_layer_{l}": best.count(l) for l in opened.spec.layers}
    with pytest.raises(C2KDError, match="--router probe follows stage 1's probes"):
        DistillRecipe(router="probe", stage1_epochs=0)


def test_choice_entropy():
    assert choice_entropy([10, 0, 0]) == 0.0
    assert choice_entropy([5, 5]) == pytest.approx(math.log(2))


# ---------------------------------------------------------------- c2kd tune


def test_tune_searches_on_validation_tests_the_chosen_recipe_once_and_resumes(cache, examples, tmp_path):
    space = parse_space({"w_logit": {"low": 0.25, "high": 4.0, "log": True}}, "logit-kd")
    base = DistillRecipe(student="micro", method="logit-kd", max_val=20)
    out = tmp_path / "tune"
    config = {"epochs": 1, "batch_size": 16, "seed": 0}
    record = tune(cache, examples.root, out, base, space, 2, config, progress=False)
    assert len(record["trials"]) == 2
    assert record["trials"][0]["params"] == {"w_logit": 0.5}  # the base recipe is always tried first
    chosen = record["chosen"]
    assert chosen["validation_HR@1"] == max(t["validation_HR@1"] for t in record["trials"])
    assert "test" in chosen and "HR@1" in chosen["test"]["candidates"]
    for trial in record["trials"]:  # trials never read test
        assert set(json.loads((out / trial["folder"] / "metrics.json").read_text())) == {"validation"}
    assert (out / "tune.md").read_text().count("(chosen)") == 1
    # the same command with a larger budget runs only the missing trial
    again = tune(cache, examples.root, out, base, space, 3, config, progress=False)
    assert len(again["trials"]) == 3 and again["trials"][:2] == record["trials"]


def test_tune_refuses_bad_searches_before_writing(cache, train_only_cache, examples, tmp_path):
    base = DistillRecipe(student="micro", method="logit-kd")
    space = parse_space({"w_logit": {"low": 0.5, "high": 2.0}}, "logit-kd")
    with pytest.raises(C2KDError, match="search space is empty"):
        parse_space({}, "logit-kd")
    with pytest.raises(C2KDError, match="'w_nothing' is not a searchable setting"):
        parse_space({"w_nothing": {"low": 0, "high": 1}}, "logit-kd")
    with pytest.raises(C2KDError, match="expected finite low <= high"):
        parse_space({"w_logit": {"low": 2, "high": 1}}, "logit-kd")
    with pytest.raises(C2KDError, match="not valid for --method logit-kd"):
        parse_space({"router": {"choices": ["top1"]}}, "logit-kd")
    with pytest.raises(C2KDError, match="nothing to tune by default"):
        read_space(None, "sft")
    with pytest.raises(C2KDError, match="--trials must be >= 1"):
        tune(cache, examples.root, tmp_path / "zero", base, space, 0)
    assert not (tmp_path / "zero").exists()
    config = {"epochs": 1, "batch_size": 16}
    tune(cache, examples.root, tmp_path / "study", base, space, 1, config, progress=False)
    with pytest.raises(C2KDError, match="holds a study of other settings"):
        tune(train_only_cache, examples.root, tmp_path / "study", base, space, 1, config, progress=False)
