"""Do C2KD's parts do their job, and is a recipe chosen on validation better than tuned logit KD?

On a finished `c2kd demo` run folder (its SmolLM2-135M teacher, data, settings), with the demo's
student (the teacher's first 2 layers, 3 epochs on 512 cached examples, logit losses over items):

1. cache: the teacher's train examples the demo cached, plus the validation split (stage 1 judges
   its probes there);
2. parts (seed 0; read on validation only): the paper's C2KD, then one change at a time — stage 1
   at the authors' schedule (3 epochs at 8e-4, best epoch on validation), filters started as a
   logit lens, the soft and probe routers, the last student layer;
3. tune: `c2kd tune` for C2KD and for logit KD, the same number of trials each, on validation;
4. seeds: the chosen C2KD, the tuned logit KD, the student alone and the paper's C2KD on the
   test split, paired per user over seeds (c2kd.compare).

Every step resumes (each student is a distill run folder); the result JSON holds what each step
measured. Usage:

    python benchmarks/c2kd_parts.py --run runs/demo-base --out runs/bench/c2kd_parts [--trials 10] [--seeds 5]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from c2kd.compare import paired_comparison
from c2kd.data.examples import load_examples
from c2kd.demo import DemoSettings
from c2kd.hardware import native_bf16
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, cache_teacher
from c2kd.predictions import PREDICTIONS_FILE
from c2kd.student.distill import DistillRecipe, distill
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a finished `c2kd demo` run folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, help="result file [default: OUT/c2kd_parts.json]")
    args = p.parse_args()
    results = args.run / "results.json"  # a finished demo; else its default settings (float32 where no native bf16)
    settings = (json.loads(results.read_text())["settings"] if results.exists()
                else {**asdict(DemoSettings()), "bf16": native_bf16()})
    examples = load_examples(args.run / "data")
    cache = args.out / "cache"
    if not cache.exists():
        cache_teacher(args.run / "teacher", examples, cache,
                      CacheTeacherSettings(splits=("train", "validation"), max_examples=settings["student_max_train"]))
    base = DistillRecipe(student=settings["student"], shrink=settings["student_shrink"], kd_over=settings["kd_over"],
                         max_train=settings["student_max_train"], max_val=settings["max_val"])
    train = {"epochs": settings["student_epochs"], "lr": settings["student_lr"], "batch_size": settings["batch_size"],
             "bf16": bool(settings["bf16"]), "progress": False}
    target = args.json or args.out / "c2kd_parts.json"
    result: dict = {"settings": settings, "base": asdict(base), "train": train, "parts": {}, "tune": {}, "seeds": {}}

    for name, change in PARTS.items():  # 2. one change at a time, seed 0, validation only
        record = distill(cache, examples, args.out / "parts" / name, replace(base, **change), {**train, "seed": 0},
                         final_splits=("validation",))
        result["parts"][name] = {"change": change, "validation": record["metrics"]["validation"]["candidates"],
                                 "diagnostics": record["diagnostics"]}
        write_result(target, result)  # what is measured so far: a run cut short keeps it

    chosen = {}
    authors = replace(base, **PARTS["stage1-authors"])  # stage 1 at the authors' schedule under every trial
    for method in ("c2kd", "logit-kd"):  # 3. the same budget each, on validation
        record = tune(cache, examples, args.out / "tune" / method, replace(authors, method=method),
                      read_space(None, method), args.trials, {**train, "seed": 0}, progress=False)
        result["tune"][method] = record
        chosen[method] = record["chosen"]["recipe"]
        write_result(target, result)

    rows = {"c2kd-tuned": DistillRecipe(**{**chosen["c2kd"], "router_layers": None}),
            "logit-kd-tuned": DistillRecipe(**{**chosen["logit-kd"], "router_layers": None}),
            "sft": replace(base, method="sft", kd_over="vocab"), "c2kd-paper": base}
    predictions: dict[str, dict[int, Path]] = {}
    for name, recipe in rows.items():  # 4. test, per seed
        seeds = range(args.seeds if name != "c2kd-paper" else min(3, args.seeds))
        runs = {s: distill(cache, examples, args.out / "seeds" / name / f"s{s}", recipe, {**train, "seed": s})
                for s in seeds}
        predictions[name] = {s: args.out / "seeds" / name / f"s{s}" / PREDICTIONS_FILE for s in seeds}
        result["seeds"][name] = {"recipe": asdict(recipe),
                                 "test_HR@1": {s: r["metrics"]["test"]["candidates"]["HR@1"] for s, r in runs.items()}}
    comparisons = {}
    for a, b in (("c2kd-tuned", "logit-kd-tuned"), ("c2kd-tuned", "sft"), ("c2kd-tuned", "c2kd-paper"),
                 ("logit-kd-tuned", "sft")):
        seeds = sorted(set(predictions[a]) & set(predictions[b]))
        c = paired_comparison({s: predictions[a][s] for s in seeds}, {s: predictions[b][s] for s in seeds},
                              name_a=a, name_b=b, split="test")
        comparisons[f"{a} vs {b}"] = {**asdict(c), "line": str(c)}
        print(c)
    result["comparisons"] = comparisons
    write_result(target, result)


if __name__ == "__main__":
    main()
