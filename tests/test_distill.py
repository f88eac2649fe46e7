"""Stage two: distilling from a teacher cache (fidelity to the live teacher, methods, refusals, DDP)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import run_two_nodes, save_random_teacher
from safetensors.torch import load_file
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from c2kd.cache_schema.reader import TeacherCache
from c2kd.cli import app
from c2kd.errors import C2KDError
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, cache_teacher
from c2kd.data.examples import load_examples
from c2kd.data.prepare import prepare
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.prompts import PromptEncoder, collate, encode_frame
from c2kd.recmodel.tokenizer import build_word_tokenizer
from c2kd.recmodel.prompts import answer_index
from c2kd.student.filters import LayerFilters, stage1_loss
from c2kd.student.cache_batches import CacheBatches
import c2kd.student.distill as distill_module
from c2kd.student.distill import DEFAULT_RECIPES, PAPER_RECIPE, DistillRecipe, build_student, distill
from c2kd.student.losses import logit_kd_loss, soft_cross_entropy
from c2kd.student.objective import DistillModel
from c2kd.training import TrainConfig, epoch_batches, read_log, train

from live_teacher import live_teacher_batch

# ---------------------------------------------------------------- fixtures: teacher and caches


@pytest.fixture(scope="module")
def examples(tiny_examples_dir):
    return load_examples(tiny_examples_dir)


@pytest.fixture(scope="module")
def teacher_dir(examples, tmp_path_factory) -> Path:
    return save_random_teacher(examples, tmp_path_factory.mktemp("teacher"), seed=3)


@pytest.fixture(scope="module")
def teacher(teacher_dir) -> RecLM:
    return RecLM.load(teacher_dir).eval()


def write_cache(teacher_dir: Path, examples, out: Path, **settings) -> Path:
    """Stage one (`cache_teacher`) over the train split: what stage two trains from."""
    cache_teacher(teacher_dir, examples, out, CacheTeacherSettings(splits=("train",), progress=False, device="cpu",
                                                                   examples_per_shard=64, **settings))
    return out


@pytest.fixture(scope="module")
def caches(teacher_dir, examples, tmp_path_factory):
    """Caches of the same teacher with several policies, written on first use."""
    root = tmp_path_factory.mktemp("caches")
    made: dict = {}

    def get(positions="all", dtype="bfloat16", logits="exact") -> Path:
        key = (positions, dtype, logits)
        if key not in made:
            made[key] = write_cache(teacher_dir, examples, root / "-".join(key).replace(":", ""),
                                    positions=positions, dtype=dtype, logits=logits)
        return made[key]

    return get


def _live_tokens(teacher, examples, example_ids):
    """The same examples encoded with the teacher's tokenizer, as a live pipeline would feed them."""
    encoder = PromptEncoder(teacher.tokenizer, "ids", examples.titles())
    frame = examples.split("train")
    by_id = {e.example_id: e for e in encode_frame(encoder, frame)}
    return collate([by_id[i] for i in example_ids], encoder.pad_id)


def _live_batch(teacher, examples, example_ids, layers, positions):
    """The live teacher's batch for these train examples, with their candidates from the examples."""
    frame = examples.split("train")
    candidates = dict(zip(frame["example_id"].to_list(), frame["candidates"].to_list()))
    return live_teacher_batch(teacher, _live_tokens(teacher, examples, example_ids), layers, positions,
                              torch.tensor([candidates[i] for i in example_ids]))


def _model(cache: TeacherCache, recipe: DistillRecipe, seed=0) -> DistillModel:
    torch.manual_seed(seed)
    student = build_student(recipe, cache, seed=seed)
    filters = recipe.layer_filters(cache.spec, student) if recipe.method == "c2kd" else None
    layer_map = {1: 3} if recipe.method == "feature-kd" else None
    return DistillModel(student, recipe, cache.spec, cache.head_weight(), filters, layer_map).eval()


# ---------------------------------------------------------------- fidelity: cache == live teacher

RECIPES = {
    "c2kd": DistillRecipe(student="micro"),
    "c2kd-soft": DistillRecipe(student="micro", router="soft"),
    "c2kd-no-cross-head": DistillRecipe(student="micro", cross_head=False),
    "logit-kd": DistillRecipe(student="micro", method="logit-kd"),
    "feature-kd": DistillRecipe(student="micro", method="feature-kd"),
    "c2kd-items": DistillRecipe(student="micro", kd_over="items"),
    "c2kd-no-cross-head-items": DistillRecipe(student="micro", cross_head=False, kd_over="items"),
    "logit-kd-items": DistillRecipe(student="micro", method="logit-kd", kd_over="items"),
    "c2kd-candidates": DistillRecipe(student="micro", kd_over="candidates"),
    "logit-kd-candidates": DistillRecipe(student="micro", method="logit-kd", kd_over="candidates"),
    "c2kd-own-logit": DistillRecipe(student="micro", w_own_logit=0.5),
    "c2kd-own-logit-items": DistillRecipe(student="micro", w_own_logit=0.5, kd_over="items"),
}


# Tolerances: a float32 cache holds the teacher's values exactly, so the losses come out equal
# (measured: bit-identical). bfloat16 keeps 8 significant bits (relative rounding <= 2^-9 ~ 0.2%
# per element), which moves these averaged losses far less (measured: <= 1e-4 relative); 1e-3.
@pytest.mark.parametrize("positions,dtype,rtol", [("all", "float32", 1e-6), ("answer", "float32", 1e-6),
                                                  ("all", "bfloat16", 1e-3), ("answer", "bfloat16", 1e-3)])
def test_every_loss_from_the_cache_equals_the_live_teacher(caches, teacher, examples, positions, dtype, rtol):
    cache = TeacherCache.open(caches(positions, dtype))
    ids = cache.split_ids("train")[:12].tolist()
    cached = cache.get(ids)
    live = _live_batch(teacher, examples, ids, cache.spec.layers, positions)
    for key in ("input_ids", "slot_items", "labels", "attention_mask", "answer_positions", "answer_mask", "candidates"):
        assert torch.equal(getattr(cached, key), getattr(live, key).to(getattr(cached, key).dtype)), key
    for name, recipe in RECIPES.items():
        model = _model(cache, recipe)
        from_cache, from_teacher = model(cached), model(live)
        assert set(from_cache) == set(from_teacher)
        for term, value in from_cache.items():
            assert torch.allclose(value, from_teacher[term], rtol=rtol, atol=1e-7), (name, term, value, from_teacher[term])


def test_router_picks_the_same_layers_from_cache_and_live_teacher(caches, teacher, examples):
    cache = TeacherCache.open(caches("all", "float32"))
    ids = cache.split_ids("train")[:12].tolist()
    model = _model(cache, DistillRecipe(student="micro")).train()
    counts = lambda out: {k: int(v) for k, v in out.items() if k.startswith("count/")}  # noqa: E731
    from_cache = counts(model(cache.get(ids)))
    assert counts(model(_live_batch(teacher, examples, ids, cache.spec.layers, "all"))) == from_cache
    assert sum(from_cache.values()) == 12


@pytest.mark.parametrize("logits", ["full", "topk:K"])
def test_full_and_topk_caches_give_the_exact_logit_loss(caches, teacher, examples, logits):
    vocab = teacher.vocab_size
    logits = logits.replace("K", str(vocab))  # top-V holds every logit: must equal exact mode
    exact = TeacherCache.open(caches("answer", "float32", "exact"))
    other = TeacherCache.open(caches("answer", "float32", logits))
    ids = exact.split_ids("train")[:8].tolist()
    for recipe in (RECIPES["c2kd"], RECIPES["logit-kd"], RECIPES["c2kd-items"], RECIPES["logit-kd-items"]):
        a = _model(exact, recipe)(exact.get(ids))
        b = _model(other, recipe)(other.get(ids))
        assert torch.allclose(a["logit"], b["logit"], rtol=1e-5)


def test_small_topk_cache_gives_a_finite_loss_close_to_exact(caches):
    exact = TeacherCache.open(caches("answer", "float32", "exact"))
    top = TeacherCache.open(caches("answer", "float32", "topk:8"))
    ids = exact.split_ids("train")[:8].tolist()
    a = _model(exact, RECIPES["logit-kd"])(exact.get(ids))["logit"]
    b = _model(top, RECIPES["logit-kd"])(top.get(ids))["logit"]
    assert torch.isfinite(b) and b.item() != pytest.approx(a.item(), rel=1e-6)
    # with --kd-over items|candidates a top-8 row may hold no item (candidate) token: no teacher signal, and no NaN
    batch = top.get(ids)
    for name in ("logit-kd-items", "c2kd-items", "logit-kd-candidates", "c2kd-candidates", "c2kd-own-logit-items"):
        model = _model(top, RECIPES[name]).train()
        out = model(batch)
        assert torch.isfinite(out["loss"]), name
        out["loss"].backward()
        assert all(torch.isfinite(p.grad).all() for p in model.trainable_parameters() if p.grad is not None), name


def test_answer_index_matches_the_cache(caches, teacher, examples):
    cache = TeacherCache.open(caches("answer", "float32"))
    ids = cache.split_ids("train")[:5].tolist()
    batch = cache.get(ids)
    positions, mask = answer_index(batch.labels)
    assert torch.equal(mask, batch.answer_mask)
    assert torch.equal(positions[mask], batch.answer_positions[batch.answer_mask])


def test_kd_over_items_is_the_catalog_distribution_at_the_item_answer(caches):
    """--kd-over items: the logit losses over the item tokens' columns, at the answer positions
    that predict an item (the `<eos>` positions drop out), written out by hand here."""
    cache = TeacherCache.open(caches("answer", "float32"))
    batch = cache.get(cache.split_ids("train")[:6])
    model = _model(cache, DistillRecipe(student="micro", method="logit-kd", kd_over="items"))
    items = model.student.item_token_ids[1:]
    targets = batch.answer_targets()
    rows = torch.isin(targets, items)
    assert 0 < int(rows.sum()) < len(rows) and int(rows.sum()) == len(batch)  # one item answer per example
    out = model.run_student(batch)
    z_t = cache.head_weight().float()[items] @ batch.final_hidden[batch.answer_mask][rows].float().T
    expected = logit_kd_loss(out.logits[rows][:, items], z_t.T, None)
    torch.testing.assert_close(model(batch)["logit"], expected)
    vocab = _model(cache, DistillRecipe(student="micro", method="logit-kd"))(batch)["logit"]
    assert not torch.allclose(vocab, expected)
    with pytest.raises(C2KDError, match="--kd-over 'tokens'"):
        DistillRecipe(kd_over="tokens")
    with pytest.raises(C2KDError, match="--method sft has none"):
        DistillRecipe(method="sft", kd_over="items")
    # stage 1's probe head classifies the item answers among the items
    filters = LayerFilters(cache.spec.layers, cache.spec.hidden_size, 32, len(items))
    batch = cache.get(cache.split_ids("train")[:6], layers=cache.spec.layers)
    labels = torch.tensor([(items == t).nonzero().item() for t in targets[rows]])
    by_hand = sum(F.cross_entropy(filters.head(filters.norm(filters.filters[str(l)](batch.hidden_at_answers(l)[rows].float()))),
                                  labels) for l in cache.spec.layers)
    torch.testing.assert_close(stage1_loss(filters, batch, items)["loss"], by_hand)
    llara = dataclasses.replace(cache.spec, prompt_format="llara")  # its answers are titles, not item tokens
    with pytest.raises(C2KDError, match="needs an ids cache, this one is 'llara'"):
        DistillRecipe(student="micro", kd_over="items").check_cache(llara)


def test_kd_over_candidates_is_the_teachers_ranking_of_each_examples_candidates(caches):
    """--kd-over candidates: at each example's item answer, the teacher's and the student's logits
    on that example's 20 candidates only (in prompt order), compared by the same losses; written
    out by hand here for logit KD and for C2KD's cross-head."""
    cache = TeacherCache.open(caches("answer", "float32"))
    batch = cache.get(cache.split_ids("train")[:6], layers=cache.spec.layers)
    recipe = DistillRecipe(student="micro", method="logit-kd", kd_over="candidates")
    model = _model(cache, recipe)
    rows = torch.isin(batch.answer_targets(), model.student.item_token_ids[1:])
    assert int(rows.sum()) == len(batch)  # one item answer per example, in example order
    columns = model.student.item_token_ids[batch.candidates]  # [B, 20] token ids of each example's candidates
    assert columns.shape == (len(batch), 20)
    z_t = torch.stack([cache.head_weight().float()[c] @ h.float()
                       for c, h in zip(columns, batch.final_hidden[batch.answer_mask][rows])])
    z_s = torch.stack([z[c] for z, c in zip(model.run_student(batch).logits[rows], columns)])
    torch.testing.assert_close(model(batch)["logit"], logit_kd_loss(z_s, z_t, None))
    items = _model(cache, dataclasses.replace(recipe, kd_over="items"))(batch)["logit"]
    assert not torch.allclose(items, model(batch)["logit"])
    # C2KD: the cross-head's scores through the teacher head's rows of the same candidates
    c2kd = _model(cache, dataclasses.replace(recipe, method="c2kd")).eval()
    out = c2kd.run_student(batch, hidden=True)
    features = c2kd.cross_head.feat_mlp(batch.answer_rows(out.hidden_states[c2kd.student_layer])[rows])
    z_x = torch.stack([cache.head_weight().float()[c] @ f for c, f in zip(columns, features)])
    torch.testing.assert_close(c2kd(batch)["logit"], soft_cross_entropy(z_x, z_t, None))
    with pytest.raises(C2KDError, match="--kd-over candidates changes the logit losses"):
        DistillRecipe(method="feature-kd", kd_over="candidates")


# ---------------------------------------------------------------- what each method trains


@pytest.mark.parametrize("recipe,terms", [
    (DistillRecipe(student="micro", method="sft"), {"loss", "lm"}),
    (DistillRecipe(student="micro", method="logit-kd"), {"loss", "lm", "logit"}),
    (DistillRecipe(student="micro", method="feature-kd"), {"loss", "lm", "feat"}),
    (DistillRecipe(student="micro"), {"loss", "lm", "feat", "logit", "orth"}),
    (DistillRecipe(student="micro", orth=False), {"loss", "lm", "feat", "logit"}),
    (DistillRecipe(student="micro", cross_head=False), {"loss", "lm", "feat", "logit"}),
    (DistillRecipe(student="micro", router="fixed:4"), {"loss", "lm", "feat", "logit", "orth"}),
    (DistillRecipe(student="micro", kd_over="items"), {"loss", "lm", "feat", "logit", "orth"}),
    (DistillRecipe(student="micro", method="logit-kd", kd_over="items"), {"loss", "lm", "logit"}),
    (DistillRecipe(student="micro", kd_over="candidates"), {"loss", "lm", "feat", "logit", "orth"}),
    (DistillRecipe(student="micro", method="logit-kd", kd_over="candidates"), {"loss", "lm", "logit"}),
    (DistillRecipe(student="micro", w_own_logit=0.5), {"loss", "lm", "feat", "logit", "orth", "own_logit"}),
    (DistillRecipe(student="micro", w_own_logit=0.5, kd_over="items"), {"loss", "lm", "feat", "logit", "orth", "own_logit"}),
])
def test_loss_terms_and_gradients_per_method(caches, recipe, terms):
    cache = TeacherCache.open(caches("all", "bfloat16"))
    model = _model(cache, recipe).train()
    out = model(cache.get(cache.split_ids("train")[:6]))
    counts = {k: out.pop(k) for k in list(out) if k.startswith("count/")}
    assert set(out) == terms
    assert (sum(counts.values()) == 6) if recipe.method == "c2kd" else not counts  # each example routed once
    weights = {"feat": recipe.w_feat, "logit": recipe.w_logit, "orth": recipe.w_orth, "own_logit": recipe.w_own_logit}
    assert torch.allclose(out["loss"], out["lm"] + sum(weights[t] * out[t] for t in terms - {"loss", "lm"}))
    out["loss"].backward()
    assert model.teacher_head.grad is None  # frozen teacher head
    if model.filters is not None:
        assert all(p.grad is None for p in model.filters.parameters())  # frozen after stage 1
    trained = model.trainable_parameters()
    assert trained and all(p.grad is not None for p in trained)
    if recipe.method == "c2kd" and recipe.router == "fixed:4":
        assert counts["count/router_layer_4"] == 6


# ---------------------------------------------------------------- the recipe end to end


MICRO = dataclasses.asdict(DistillRecipe(student="micro"))


@pytest.mark.parametrize("flags, expected", [
    ([], {**MICRO, **DEFAULT_RECIPES["c2kd"]}),
    (["--w-feat", "0.25"], {**MICRO, **DEFAULT_RECIPES["c2kd"], "w_feat": 0.25}),
    (["--method", "logit-kd"], {**MICRO, **DEFAULT_RECIPES["logit-kd"], "method": "logit-kd"}),
    (["--no-cross-head"], {**MICRO, **DEFAULT_RECIPES["c2kd"], "cross_head": False, "w_own_logit": 0.0}),
    (["--method", "sft"], {**MICRO, "method": "sft"}),
    (["--recipe", "paper"], {**MICRO, **PAPER_RECIPE}),
    (["--recipe", "paper", "--w-logit", "2.0", "--router", "probe"], {**MICRO, **PAPER_RECIPE, "w_logit": 2.0, "router": "probe"}),
])
def test_recipe_presets_and_the_options_given_beside_them(flags, expected, tmp_path, monkeypatch):
    from c2kd.student import distill as module

    seen = {}

    def fake(cache, data, out, recipe, config, **kw):  # what the command would train
        seen["recipe"] = recipe
        raise C2KDError("stop here")

    monkeypatch.setattr(module, "distill", fake)
    result = CliRunner().invoke(app, ["distill", "--cache", "c", "--data", str(tmp_path), "--out", str(tmp_path / "o"),
                                      "--student", "micro", *flags])
    assert result.exit_code == 1 and "stop here" in result.output
    assert dataclasses.asdict(seen["recipe"]) == {**expected, "router_layers": None}
    bad = CliRunner().invoke(app, ["distill", "--cache", "c", "--data", str(tmp_path), "--out", str(tmp_path / "o"),
                                   "--recipe", "papers"])
    assert bad.exit_code == 1 and "--recipe 'papers': expected one of default, paper" in bad.output


def test_distill_runs_with_the_teacher_checkpoint_deleted(teacher, examples, tmp_path):
    teacher_dir = teacher.save(tmp_path / "teacher")
    cache = write_cache(teacher_dir, examples, tmp_path / "cache", positions="all")
    shutil.rmtree(teacher_dir)  # stage two must not need it
    out = tmp_path / "student"
    result = CliRunner().invoke(app, [
        "distill", "--cache", str(cache), "--data", str(examples.root), "--out", str(out), "--student", "micro",
        "--epochs", "2", "--batch-size", "32", "--max-train", "64", "--stage1-epochs", "1", "--no-progress",
        "--seed", "1",
    ])
    assert result.exit_code == 0, result.output
    assert "test HR@1" in result.output
    for name in ("distill.json", "metrics.json", "log.jsonl", "stage1_log.jsonl", "distill.png", "reclm.json"):
        assert (out / name).is_file(), name
    assert not Path(str(out) + ".partial").exists()
    record = json.loads((out / "distill.json").read_text())
    train_count = 64
    epochs = [r for r in read_log(out, "epoch")]
    assert len(epochs) == 2
    for line in epochs:  # every train example is routed once per epoch
        assert set(line["router_counts"]) == {"2", "3", "4", "5"}
        assert sum(line["router_counts"].values()) == train_count
        assert {"lm", "feat", "logit", "orth", "loss"} <= set(line)
    assert record["metrics"]["test"]["examples"] == examples.split("test").height
    assert "NDCG@10" in record["metrics"]["validation"]["candidates"]
    assert "NDCG@10" in record["metrics"]["test"]["full_catalog"]
    assert record["stage1_steps"] > 0 and record["student"]["distilled_layer"] == 1
    stage1 = [json.loads(line) for line in (out / "stage1_log.jsonl").read_text().splitlines()]
    assert {"ce_layer_2", "ce_layer_3", "ce_layer_4", "ce_layer_5"} <= set(stage1[0])
    student = RecLM.load(out)  # a normal model folder
    assert student.tokenizer.get_vocab() == teacher.tokenizer.get_vocab()


def test_distill_with_kd_over_items_end_to_end(caches, examples, tmp_path):
    cache = caches("all", "bfloat16")
    record = distill(cache, examples.root, tmp_path / "student",
                     DistillRecipe(student="micro", kd_over="items", max_train=32, eval_batch_size=16),
                     {"max_steps": 2, "batch_size": 16, "progress": False})
    assert record["recipe"]["kd_over"] == "items" and record["final_step"] == 2 and record["stage1_steps"] > 0
    first = json.loads((tmp_path / "student" / "stage1_log.jsonl").read_text().splitlines()[0])
    vocab = TeacherCache.open(cache).spec.vocab_size
    # stage 1's head starts near-uniform over its classes: the catalog's items, not the vocabulary
    assert all(first[f"ce_layer_{l}"] < (np.log(examples.num_items) + np.log(vocab)) / 2 for l in (2, 3, 4, 5)), first


def test_router_layers_choose_the_candidates_in_a_cache_holding_more_layers(caches, teacher_dir, examples, tmp_path):
    late = caches("all", "bfloat16")  # layers 2-5
    more = write_cache(teacher_dir, examples, tmp_path / "more", positions="all", dtype="bfloat16", layers=(1, 2, 3, 4, 5))
    config = {"max_steps": 2, "batch_size": 16, "progress": False}
    recipe = DistillRecipe(student="micro", max_train=32, eval_batch_size=16)
    records = {name: distill(cache, examples.root, tmp_path / name, dataclasses.replace(recipe, router_layers=layers), config)
               for name, cache, layers in (("late", late, None), ("chosen", more, (2, 3, 4, 5)), ("all", more, None))}
    stage1 = {name: json.loads((tmp_path / name / "stage1_log.jsonl").read_text().splitlines()[0]) for name in records}
    # the same candidates read from either cache: the same filters, routes and student
    assert records["chosen"]["metrics"] == records["late"]["metrics"]
    assert {k: v for k, v in stage1["chosen"].items() if k.startswith("ce_layer")} == \
        {k: v for k, v in stage1["late"].items() if k.startswith("ce_layer")}
    assert "ce_layer_1" not in stage1["chosen"] and "ce_layer_1" in stage1["all"]  # default: every cached layer
    with pytest.raises(C2KDError, match=r"layers \[9\] are not cached"):
        distill(more, examples.root, tmp_path / "x", dataclasses.replace(recipe, router_layers=(5, 9)), config)
    with pytest.raises(C2KDError, match=r"layer 1 is not one of --router-layers \[2, 3\]"):
        distill(more, examples.root, tmp_path / "y", dataclasses.replace(recipe, router="fixed:1", router_layers=(2, 3)), config)
    for bad in ({"router_layers": (2, 2)}, {"router_layers": ()}, {"method": "logit-kd", "router_layers": (2,)}):
        with pytest.raises(C2KDError, match="--router-layers"):
            dataclasses.replace(recipe, **bad)


def test_the_methods_own_pieces_start_from_the_seed_whatever_building_the_student_drew(caches, examples, tmp_path,
                                                                                    monkeypatch):
    """A pretrained student's loading draws from the global generator a number of times that varies between
    processes; feature KD's adapters and C2KD's cross-head must not inherit that."""
    build, draws = distill_module.build_student, iter([1, 7, 1, 7])

    def drawing(*args, **kwargs):
        student = build(*args, **kwargs)
        torch.rand(next(draws))
        return student

    monkeypatch.setattr(distill_module, "build_student", drawing)
    for method in ("feature-kd", "c2kd"):
        recipe = DistillRecipe(student="micro", method=method, max_train=32, eval_batch_size=16)
        for name in ("a", "b"):
            distill(caches("all", "bfloat16"), examples.root, tmp_path / method / name, recipe,
                    {"max_steps": 2, "batch_size": 16, "progress": False})
        a, b = (RecLM.load(tmp_path / method / name).state_dict() for name in ("a", "b"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), method


def test_bf16_autocast_reaches_both_stages(caches, examples, tmp_path):
    cache = caches("all", "bfloat16")
    recipe = DistillRecipe(student="micro", max_train=32, eval_batch_size=16)
    first_lines = {}
    for bf16 in (False, True):
        out = tmp_path / f"bf16-{bf16}"
        distill(cache, examples.root, out, recipe, {"max_steps": 2, "batch_size": 16, "progress": False, "bf16": bf16})
        first_lines[bf16] = [json.loads((out / name).read_text().splitlines()[0]) for name in ("stage1_log.jsonl", "log.jsonl")]
    for fp32, bf16 in zip(first_lines[False], first_lines[True]):
        assert np.isfinite(bf16["loss"]) and bf16["loss"] != fp32["loss"], (fp32, bf16)  # bf16 matmuls round differently
        assert bf16["loss"] == pytest.approx(fp32["loss"], rel=0.05)


def test_a_run_recorded_before_kd_over_and_w_own_logit_existed_is_still_the_same_run(caches, examples, tmp_path):
    cache, out = caches("all", "bfloat16"), tmp_path / "student"
    recipe, train_config = DistillRecipe(student="micro", max_train=16, eval_batch_size=16), {"max_steps": 1, "batch_size": 16, "progress": False}
    distill(cache, examples.root, out, recipe, train_config)
    recorded = json.loads((out / "recipe.json").read_text())
    del recorded["kd_over"], recorded["w_own_logit"]  # as a run from before the settings wrote them
    (out / "recipe.json").write_text(json.dumps(recorded))
    assert distill(cache, examples.root, out, recipe, train_config)["already_complete"]
    for field, value in (("kd_over", "items"), ("w_own_logit", 0.5)):
        with pytest.raises(C2KDError, match=rf"other settings \(--{field.replace('_', '-')} was "):
            distill(cache, examples.root, out, DistillRecipe(student="micro", max_train=16, eval_batch_size=16,
                                                             **{field: value}), train_config)


def test_sft_from_the_cache_reads_no_teacher_states(caches, examples, tmp_path, monkeypatch):
    cache = caches("all", "bfloat16")
    asked = []
    original = TeacherCache.get_batches

    def spy(self, groups, **kw):
        asked.append(kw)
        return original(self, groups, **kw)

    monkeypatch.setattr(TeacherCache, "get_batches", spy)
    record = distill(cache, examples.root, tmp_path / "sft", DistillRecipe(method="sft", student="micro", max_val=10),
                     {"max_steps": 3, "batch_size": 16, "progress": False})
    assert record["final_step"] == 3 and record["stage1_steps"] == 0
    what = [{k: v for k, v in kw.items() if k != "whole_shards"} for kw in asked]  # how to read, not what
    assert what and all(kw == {"layers": [], "final_hidden": False, "logits": False} for kw in what)


def test_own_head_term_of_c2kd_is_vanilla_logit_kd(caches):
    """--w-own-logit adds to C2KD exactly the loss --method logit-kd trains (the same student, batch)."""
    cache = TeacherCache.open(caches("all", "bfloat16"))
    batch = cache.get(cache.split_ids("train")[:6], layers=cache.spec.layers)
    for kd_over in ("vocab", "items", "candidates"):
        both = _model(cache, DistillRecipe(student="micro", w_own_logit=0.5, kd_over=kd_over))(batch)
        plain = _model(cache, DistillRecipe(student="micro", kd_over=kd_over))(batch)
        vanilla = _model(cache, DistillRecipe(student="micro", method="logit-kd", kd_over=kd_over))(batch)
        torch.testing.assert_close(both["own_logit"], vanilla["logit"])
        torch.testing.assert_close(both["loss"], plain["loss"] + 0.5 * vanilla["logit"])
        assert both["own_logit"].item() > 0
    for wrong in (dict(method="logit-kd"), dict(cross_head=False)):
        with pytest.raises(C2KDError, match="--w-own-logit .* needs --method c2kd with the cross-head"):
            DistillRecipe(w_own_logit=0.5, **wrong)
    with pytest.raises(C2KDError, match="--w-own-logit must be >= 0"):
        DistillRecipe(w_own_logit=-1.0)


def test_refusals_before_training(caches, examples, tmp_path_factory, tiny_source, tmp_path):
    cache = caches("all", "bfloat16")
    other_data = tmp_path_factory.mktemp("other") / "examples"
    prepare(tiny_source[0], other_data, seed=1, items=tiny_source[1])
    with pytest.raises(C2KDError, match="data fingerprint"):
        distill(cache, other_data, tmp_path / "a", DistillRecipe(student="micro"))
    with pytest.raises(C2KDError, match="layer 9 is not cached"):
        distill(cache, examples.root, tmp_path / "b", DistillRecipe(student="micro", router="fixed:9"))
    with pytest.raises(C2KDError, match="expected one of top1, soft, soft:T"):
        DistillRecipe(router="fixed")
    with pytest.raises(C2KDError, match="--method"):
        DistillRecipe(method="dpo")
    # a saved student with another tokenizer cannot learn token by token from this teacher
    foreign = build_word_tokenizer(["Something else entirely"] + examples.titles()[2:], examples.num_items)
    emb = torch.zeros(examples.num_items + 1, 64)
    RecLM.from_preset("micro", foreign, emb, "ids").save(tmp_path / "foreign")
    with pytest.raises(C2KDError, match="tokenizer differs"):
        distill(cache, examples.root, tmp_path / "c", DistillRecipe(student=str(tmp_path / "foreign")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign"]  # nothing half-made


# ---------------------------------------------------------------- many processes


@pytest.mark.slow
def test_ddp_two_ranks_each_read_their_part(caches, examples, tmp_path):
    cache = caches("answer", "bfloat16")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}

    def distill_args(out: Path) -> list[str]:
        return ["-m", "c2kd.cli", "distill", "--cache", str(cache), "--data", str(examples.root), "--out", str(out),
                "--student", "micro", "--epochs", "1", "--batch-size", "16", "--max-train", "64", "--max-val", "10",
                "--no-progress"]

    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29613",
           *distill_args(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    epochs = read_log(out, "epoch")
    # counts are summed over the ranks: each example was read (and routed) by exactly one rank
    assert sum(epochs[0]["router_counts"].values()) == 64
    assert (out / "metrics.json").is_file()
    # the same run on two "nodes" (`torchrun --nnodes 2`, c10d rendezvous; one process each, the run
    # folder shared): the same student, bit for bit
    nodes = tmp_path / "nodes"
    done = run_two_nodes([distill_args(nodes)] * 2, env)
    assert all(code == 0 for code, _ in done), [text[-3000:] for _, text in done]
    a, b = load_file(out / "model.safetensors"), load_file(nodes / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- the batch source


def test_decoded_shards_give_the_same_batches_and_stay_bounded(caches, monkeypatch):
    import platform

    import c2kd.cache_schema.reader as reader
    from c2kd.heap import trim

    assert trim() == (platform.libc_ver()[0] == "glibc")  # a no-op only where there is no malloc_trim
    trims = []
    monkeypatch.setattr(reader, "trim", lambda: trims.append(1))
    cache = TeacherCache.open(caches("all", "bfloat16"))
    ids = cache.split_ids("train")
    groups = [np.random.default_rng(s).choice(ids, 24, replace=False) for s in range(6)]
    plain = [cache.get(g) for g in groups]
    cache.keep_decoded(2)
    for g, expected in zip(groups, plain):
        got = cache.get(g, whole_shards=True)
        assert torch.equal(got.input_ids, expected.input_ids) and torch.equal(got.labels, expected.labels)
        assert all(torch.equal(got.outputs[k], expected.outputs[k]) for k in expected.outputs)
        assert 0 < len(cache._decoded) <= 2
    assert trims  # dropped shards' pages are handed back, or RSS would grow with the cache
    # a read that does not ask for whole shards (a held-out subset, spread thin) decodes none
    cache.keep_decoded(0), cache.keep_decoded(2)
    cache.get(groups[0])
    assert len(cache._decoded) == 0
    # CacheBatches keeps a block's shards decoded when its examples fill their shards; none for sparse subsets
    dense = CacheBatches(cache, ids, batch_size=8, seed=0, block=64, layers=cache.spec.layers)
    in_use = len(set(dense.shards.tolist()))
    assert cache._decoded_capacity == min(in_use, int(np.ceil(64 / (len(ids) / in_use))) + 2) > 0
    assert dense.whole_shards
    sparse = CacheBatches(cache, ids[::16], batch_size=8, seed=0, block=64, layers=cache.spec.layers)
    assert cache._decoded_capacity == 0 and not sparse.whole_shards


def test_cache_batches_follow_the_trainer_order_and_resume_by_position(caches):
    cache = TeacherCache.open(caches("answer", "bfloat16", "topk:4"))
    ids = cache.split_ids("train")[:40]
    source = CacheBatches(cache, ids, batch_size=8, seed=5, group=3, layers=cache.spec.layers)
    assert len(source) == 5 and source.num_examples == 40
    for epoch in range(2):
        order = [ids[b].tolist() for b in epoch_batches(40, 8, 5, epoch)]
        assert [b.example_ids.tolist() for b in source.batches(epoch)] == order
        assert [b.example_ids.tolist() for b in source.batches(epoch, start=3)] == order[3:]
    # shard-aware: with a block smaller than the data, the trainer's block order over the examples' shards
    every = cache.split_ids("train")
    shards = cache.shards_of(every)
    assert len(set(shards.tolist())) > 2
    blocked = CacheBatches(cache, every, batch_size=8, seed=5, group=3, block=64, layers=cache.spec.layers)
    order = [every[b].tolist() for b in epoch_batches(len(every), 8, 5, 1, 1, shards, 64)]
    assert [b.example_ids.tolist() for b in blocked.batches(1)] == order
    assert order != [every[b].tolist() for b in epoch_batches(len(every), 8, 5, 1)]
    # stopping early (end of training) leaves no reader behind
    it = source.batches(0)
    next(it)
    it.close()


def test_a_crashed_distill_resumes_to_the_same_student(caches, examples, tmp_path, monkeypatch):
    cache = caches("answer", "bfloat16")
    recipe = DistillRecipe(student="micro", max_train=48, max_val=10)
    config = {"epochs": 2, "batch_size": 8, "checkpoint_every": 2, "progress": False, "seed": 3}
    distill(cache, examples.root, tmp_path / "a", recipe, config)

    from c2kd.student import objective

    real, calls = objective.OBJECTIVES["c2kd"], {"n": 0}

    def crashing(model, batch):
        calls["n"] += 1
        if calls["n"] == 10:  # step 9: six steps, the end of epoch 0's gradient-share batch, two more steps
            raise KeyboardInterrupt
        return real(model, batch)

    monkeypatch.setitem(objective.OBJECTIVES, "c2kd", crashing)
    with pytest.raises(KeyboardInterrupt):
        distill(cache, examples.root, tmp_path / "b", recipe, config)
    monkeypatch.setitem(objective.OBJECTIVES, "c2kd", real)
    record = distill(cache, examples.root, tmp_path / "b", recipe, config)
    assert record["timings"]["resumed_from_step"] == 8
    a, b = RecLM.load(tmp_path / "a"), RecLM.load(tmp_path / "b")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_grouped_reads_give_the_same_batches_as_single_reads(caches):
    cache = TeacherCache.open(caches("answer", "bfloat16", "topk:4"))
    ids = cache.split_ids("train")[:20].tolist()
    groups = [ids[:7], ids[7:8], ids[8:20]]
    for kw in ({"layers": cache.spec.layers}, {"layers": [], "final_hidden": False, "logits": False}):
        together = cache.get_batches(groups, **kw)
        for g, batch in zip(groups, together):
            alone = cache.get(g, **kw)
            for field in ("input_ids", "labels", "answer_positions", "answer_mask", "final_hidden", "topk_values"):
                x, y = getattr(alone, field), getattr(batch, field)
                assert (x is None and y is None) or torch.equal(x, y), field
            assert alone.hidden.keys() == batch.hidden.keys()
            assert all(torch.equal(alone.hidden[l], batch.hidden[l]) for l in alone.hidden)
