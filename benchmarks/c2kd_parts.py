"""Do C2KD's parts do their job, and is a recipe chosen on validation better than tuned logit KD?

On a finished `c2kd demo` run folder (its SmolLM2-135M teacher, data, settings), with the demo's
student (the teacher's first 2 layers, or `--shrink` another; 3 epochs on 512 cached examples,
logit losses over items):

1. cache: the teacher's train examples the demo cached, plus the validation split (stage 1 judges
   its probes there);
2. parts (seed 0; read on validation only): the paper's C2KD, then one change at a time — stage 1
   at the authors' schedule (3 epochs at 8e-4, best epoch on validation), filters started as a
   logit lens, the soft and probe routers, the last student layer;
3. tune: `c2kd tune` for C2KD and for logit KD, the same number of trials each, on validation; for
   feature KD too when its row is asked for: its uniform layer map needs a middle teacher layer, so
   that run caches one (`--layers`, e.g. 15,26,27,28,29 for SmolLM2) and keeps C2KD's router on
   the demo's layers (`--router-layers 26,27,28,29`);
4. seeds: the chosen C2KD, the tuned logit KD, the student alone and the paper's C2KD on the
   test split, paired per user over seeds (c2kd.compare);
5. terms: the shipped default (`--recipe default`, the chosen weights rounded) and the default with
   one C2KD term taken out at a time: the feature term, the cross-head term, and both (what is left
   is logit KD on the student's own head at the default's weight), each paired per user against
   the default on test, to show which of its terms the gain over tuned logit KD comes from;
6. routers (seed 0, validation only): the default with the probe router and with each cached layer
   fixed, each paired per user against the default, to show whether the router's choice of layer
   matters when it settles on one.

Every step resumes (each student is a distill run folder); the result JSON holds what each step
measured. `--steps` and `--rows` run part of it (e.g. on another family's demo run: the shipped
defaults against the student alone, no search); the comparisons are those whose two rows ran, and
what an earlier run wrote into the same result file for the steps and rows not run is kept. Usage:

    python benchmarks/c2kd_parts.py --run runs/demo-base --out runs/bench/c2kd_parts [--trials 10] [--seeds 5]
    python benchmarks/c2kd_parts.py --run runs/demo-gemma --out runs/bench/c2kd_parts_gemma \
        --steps test --rows sft,c2kd-default,own-head-only
    python benchmarks/c2kd_parts.py --run runs/demo-base --out runs/bench/c2kd_parts_first3 --shrink first:3 \
        --steps tune,test --rows c2kd-tuned,logit-kd-tuned,sft,c2kd-default,own-head-only,c2kd-paper
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from c2kd.cache_schema import TeacherCache
from c2kd.compare import paired_comparison
from c2kd.data.examples import load_examples
from c2kd.demo import DemoSettings
from c2kd.hardware import native_bf16
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, cache_teacher
from c2kd.predictions import PREDICTIONS_FILE
from c2kd.student.distill import DistillRecipe, distill, recipe_preset
from c2kd.student.tune import read_space, tune

if __package__ in (None, ""):  # run as a file: the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_result  # noqa: E402

PARTS = {  # name -> the change from the paper's C2KD (the demo's student settings)
    "paper": {},
    "stage1-authors": {"stage1_epochs": 3, "stage1_lr": 8e-4},
    "stage1-authors-lens": {"stage1_epochs": 3, "stage1_lr": 8e-4, "filter_init": "lens"},
    "stage1-authors-hr1": {"stage1_epochs": 3, "stage1_lr": 8e-4, "stage1_select": "hr1"},
    "router-soft": {"stage1_epochs": 3, "stage1_lr": 8e-4, "filter_init": "lens", "router": "soft:8"},
    "router-probe": {"stage1_epochs": 3, "stage1_lr": 8e-4, "filter_init": "lens", "router": "probe"},
    "student-layer-last": {"stage1_epochs": 3, "stage1_lr": 8e-4, "filter_init": "lens", "student_layer": "last"},
}
# step 5: name -> (the change from the shipped C2KD default, seeds at most); "own-head-only" keeps
# only the own-head term, which is logit KD at the default's own-head weight
TERMS = {
    "c2kd-default": ({}, 5),
    "own-head-only": ({"method": "logit-kd", "w_logit": recipe_preset("default", "c2kd")["w_own_logit"],
                       "w_own_logit": 0.0}, 5),
    "no-feature-term": ({"w_feat": 0.0}, 3),
    "no-cross-head-term": ({"w_logit": 0.0}, 3),
}

TUNED = ("c2kd", "logit-kd", "feature-kd")  # step 3's searches; step 4 tests each one's choice
FEWER_SEEDS = {"c2kd-paper": 3, "feature-kd-tuned": 3}  # rows no goal compares: 3 seeds at most
STEPS = ("parts", "tune", "test", "routers")
ROWS = (*(f"{m}-tuned" for m in TUNED), "sft", "c2kd-paper", *TERMS)
NEEDS_A_MIDDLE_LAYER = ("feature-kd-tuned",)  # not among the default rows: the demo's cache holds late layers only


def _subset(text: str, allowed: tuple[str, ...], flag: str) -> set[str]:
    chosen = {x.strip() for x in text.split(",") if x.strip()}
    if not chosen or chosen - set(allowed):
        raise SystemExit(f"{flag} {text!r}: expected a comma list of {','.join(allowed)}")
    return chosen


def _ints(text: str | None) -> tuple[int, ...] | None:
    return tuple(int(x) for x in text.split(",")) if text else None


def for_method(recipe: DistillRecipe, method: str, router_layers: tuple[int, ...] | None) -> DistillRecipe:
    """`recipe` for `method`: C2KD reads the router's layers; no other method takes them, and feature
    KD and SFT have no logit loss to put over items."""
    if method == "c2kd":
        return replace(recipe, method=method, router_layers=router_layers)
    return replace(recipe, method=method, router_layers=None,
                   kd_over="vocab" if method in ("feature-kd", "sft") else recipe.kd_over)


def carried_over(previous: dict) -> dict:
    """What an earlier result file keeps in the next: each step's measurements, and the provenance of
    every run that wrote them (write_result's provenance names only the newest command)."""
    kept = {k: dict(previous.get(k, {})) for k in ("parts", "tune", "seeds", "comparisons", "comparisons_validation",
                                                    "routers")}
    earlier = [*previous.get("earlier_runs", []), *([previous["provenance"]] if "provenance" in previous else [])]
    return {**kept, "earlier_runs": earlier}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a finished `c2kd demo` run folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, help="result file [default: OUT/c2kd_parts.json]")
    p.add_argument("--steps", default=",".join(STEPS), help=f"steps to run, of {','.join(STEPS)} (test: 4 and 5; routers: 6)")
    p.add_argument("--rows", default=None, help=f"test rows to train [default: all but {','.join(NEEDS_A_MIDDLE_LAYER)}], "
                                                f"of {','.join(ROWS)}")
    p.add_argument("--layers", default=None, help="teacher layers OUT/cache holds [default: the demo's, its late layers]")
    p.add_argument("--router-layers", default=None, help="the layers C2KD's router reads [default: every cached layer]")
    p.add_argument("--shrink", default=None, help="the student's layers, e.g. first:3 [default: the demo's student]")
    args = p.parse_args()
    default_rows = ",".join(r for r in ROWS if r not in NEEDS_A_MIDDLE_LAYER)
    steps, rows_wanted = _subset(args.steps, STEPS, "--steps"), _subset(args.rows or default_rows, ROWS, "--rows")
    router_layers = _ints(args.router_layers)
    fit = lambda recipe, method=None: for_method(recipe, method or recipe.method, router_layers)  # noqa: E731

    results = args.run / "results.json"  # a finished demo; else its default settings (float32 where no native bf16)
    demo = json.loads(results.read_text()) if results.exists() else {}
    settings = demo.get("settings") or {**asdict(DemoSettings()), "bf16": native_bf16()}
    examples = load_examples(args.run / "data")
    cache = args.out / "cache"
    if not cache.exists():
        cache_teacher(args.run / "teacher", examples, cache,
                      CacheTeacherSettings(splits=("train", "validation"), max_examples=settings["student_max_train"],
                                           layers=_ints(args.layers)))
    base = DistillRecipe(student=settings["student"], shrink=args.shrink or settings["student_shrink"],
                         kd_over=settings["kd_over"],
                         max_train=settings["student_max_train"], max_val=settings["max_val"],
                         shuffle_block=0)  # the order these runs were made with: 512 examples (< a block) are fully shuffled either way
    train = {"epochs": settings["student_epochs"], "lr": settings["student_lr"], "batch_size": settings["batch_size"],
             "bf16": bool(settings["bf16"]), "progress": False}
    target = args.json or args.out / "c2kd_parts.json"
    previous = json.loads(target.read_text()) if target.exists() else {}
    # what the result file holds for steps and rows this run does not redo stays as it was measured
    teacher = demo.get("results", {}).get("teacher", {}).get("HR@1")  # the demo's teacher on test, for the share of it reached
    result: dict = {"settings": settings, "base": asdict(base), "train": train, "teacher_test_HR@1": teacher,
                    **carried_over(previous)}

    for name, change in PARTS.items() if "parts" in steps else ():  # 2. one change at a time, seed 0, validation only
        record = distill(cache, examples, args.out / "parts" / name, fit(replace(base, **change)), {**train, "seed": 0},
                         final_splits=("validation",))
        result["parts"][name] = {"change": change, "validation": record["metrics"]["validation"]["candidates"],
                                 "diagnostics": record["diagnostics"]}
        write_result(target, result)  # what is measured so far: a run cut short keeps it

    chosen = {}
    authors = replace(base, **PARTS["stage1-authors"])  # stage 1 at the authors' schedule under every trial
    for method in TUNED if "tune" in steps else ():  # 3. the same budget each, on validation
        if f"{method}-tuned" not in rows_wanted:  # a search no wanted row tests
            continue
        # a search already in the result file is kept as measured (its record holds its space and base)
        record = result["tune"].get(method) or tune(
            cache, examples, args.out / "tune" / method, fit(authors, method), read_space(None, method),
            args.trials, {**train, "seed": 0}, progress=False)
        result["tune"][method] = record
        chosen[method] = record["chosen"]["recipe"]
        write_result(target, result)

    rows = {f"{m}-tuned": DistillRecipe(**{**chosen[m], "router_layers": None, "shuffle_block": 0}) for m in chosen}
    rows.update({"sft": fit(base, "sft"), "c2kd-paper": base})
    rows = {name: fit(recipe) for name, recipe in rows.items() if name in rows_wanted and "test" in steps}
    predictions: dict[str, dict[int, Path]] = {}
    for name, recipe in rows.items():  # 4. test, per seed
        seeds = range(min(FEWER_SEEDS.get(name, args.seeds), args.seeds))
        runs = {s: distill(cache, examples, args.out / "seeds" / name / f"s{s}", recipe, {**train, "seed": s})
                for s in seeds}
        predictions[name] = {s: args.out / "seeds" / name / f"s{s}" / PREDICTIONS_FILE for s in seeds}
        result["seeds"][name] = {"recipe": asdict(recipe),
                                 "test_HR@1": {s: r["metrics"]["test"]["candidates"]["HR@1"] for s, r in runs.items()}}
        write_result(target, result)
    default = replace(base, **recipe_preset("default", "c2kd"))
    for name, (change, most) in TERMS.items():  # 5. the default's terms, one out at a time
        if name not in rows_wanted or "test" not in steps:
            continue
        recipe = fit(replace(default, **change))
        seeds = range(min(most, args.seeds))
        runs = {s: distill(cache, examples, args.out / "terms" / name / f"s{s}", recipe, {**train, "seed": s})
                for s in seeds}
        predictions[name] = {s: args.out / "terms" / name / f"s{s}" / PREDICTIONS_FILE for s in seeds}
        result["seeds"][name] = {"recipe": asdict(recipe), "change": change,
                                 "test_HR@1": {s: r["metrics"]["test"]["candidates"]["HR@1"] for s, r in runs.items()},
                                 "diagnostics_s0": runs[0]["diagnostics"]}
        write_result(target, result)
    comparisons = {"test": result["comparisons"], "validation": result["comparisons_validation"]}  # validation: what a choice may read
    for a, b in (("c2kd-tuned", "logit-kd-tuned"), ("c2kd-tuned", "sft"), ("c2kd-tuned", "c2kd-paper"),
                 ("logit-kd-tuned", "sft"), ("c2kd-default", "c2kd-tuned"), ("c2kd-default", "logit-kd-tuned"),
                 ("c2kd-default", "own-head-only"), ("c2kd-default", "no-feature-term"),
                 ("c2kd-default", "no-cross-head-term"), ("own-head-only", "logit-kd-tuned"),
                 ("c2kd-default", "sft"), ("own-head-only", "sft"), ("c2kd-default", "feature-kd-tuned"),
                 ("c2kd-tuned", "feature-kd-tuned"), ("feature-kd-tuned", "sft"), ("c2kd-default", "c2kd-paper")):
        seeds = sorted(set(predictions.get(a, ())) & set(predictions.get(b, ())))
        if not seeds:  # a row this run did not train
            continue
        for split in comparisons:
            c = paired_comparison({s: predictions[a][s] for s in seeds}, {s: predictions[b][s] for s in seeds},
                                  name_a=a, name_b=b, split=split)
            comparisons[split][f"{a} vs {b}"] = {**asdict(c), "line": str(c)}
            print(f"{split}: {c}")
    write_result(target, result)

    if "routers" in steps:  # 6. the default's router against the others and each layer alone, seed 0
        reference = args.out / "terms" / "c2kd-default" / "s0"
        ours = distill(cache, examples, reference, fit(default), {**train, "seed": 0})  # step 5's default, seed 0
        result["routers"][default.router] = {"validation": ours["metrics"]["validation"]["candidates"],
                                             "diagnostics": ours["diagnostics"]}
        for router in ("probe", *(f"fixed:{l}" for l in router_layers or TeacherCache.open(cache).spec.layers)):
            folder = args.out / "routers" / router.replace(":", "-")
            record = distill(cache, examples, folder, fit(replace(default, router=router)), {**train, "seed": 0},
                             final_splits=("validation",))
            c = paired_comparison({0: folder / PREDICTIONS_FILE}, {0: reference / PREDICTIONS_FILE},
                                  name_a=router, name_b=default.router, split="validation")
            result["routers"][router] = {"validation": record["metrics"]["validation"]["candidates"],
                                         "diagnostics": record["diagnostics"], "vs_default": {**asdict(c), "line": str(c)}}
            print(f"validation: {c}")
            write_result(target, result)


if __name__ == "__main__":
    main()
