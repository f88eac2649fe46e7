"""Other recipes for the demo's students, on the cache of a finished `c2kd demo` run.

    c2kd demo --out runs/demo0
    c2kd cache-teacher --teacher runs/demo0/teacher --data runs/demo0/data --out runs/demo0/cache2829 --splits train
    python benchmarks/demo_students.py runs/demo0 --out runs/exp/demo_students \\
        'sft={"method": "sft"}' 'c2kd={"method": "c2kd"}' \\
        'c2kd_all={"method": "c2kd", "epochs": 1, "cache": "cache2829", "max_train": 2829}'

Each NAME=JSON is one student: `distill` with the run's settings (its results.json: seed, bf16,
the student, its cached examples, epochs, lr, batch, the validation examples that select the best
state) and the JSON's overrides: DistillRecipe fields, and `epochs`, `lr`, `cache` (a cache folder
inside the run), `max_train`, `bf16`, `seed`. The method and its weights come from the JSON alone: the
run's `w_own_logit` is not applied (`{"method": "c2kd"}` is the paper's C2KD). A line per
student (validation and test HR@1, test NDCG@10, wall seconds) goes to OUT/results.jsonl; a
finished student is reported again, not retrained.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from c2kd.data.examples import load_examples
from c2kd.student.distill import DistillRecipe, distill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a finished `c2kd demo` run folder")
    parser.add_argument("students", nargs="+", help="NAME=JSON overrides, one student each")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    ran = json.loads((args.run / "results.json").read_text())["settings"]
    examples = load_examples(args.run / "data")
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in args.students:
        name, _, text = spec.partition("=")
        overrides = json.loads(text or "{}")
        train = {"batch_size": ran["batch_size"], "seed": overrides.pop("seed", ran["seed"]),
                 "checkpoint_every": 10_000, "warmup_ratio": 0.05,
                 "epochs": overrides.pop("epochs", ran["student_epochs"]), "lr": overrides.pop("lr", ran["student_lr"]),
                 "bf16": overrides.pop("bf16", ran.get("bf16") or False)}  # runs before bf16: float32
        cache = args.run / overrides.pop("cache", "cache")
        recipe = DistillRecipe(**{"student": ran["student"], "shrink": ran["student_shrink"],
                                  "max_train": ran["student_max_train"], "max_val": ran["max_val"], **overrides})
        start = time.perf_counter()
        record = distill(cache, examples, args.out / name, recipe, train)
        metrics = record["metrics"]
        line = {"name": name, "cache": cache.name, "overrides": overrides, **train,
                "val_HR@1": metrics["validation"]["candidates"]["HR@1"], "test_HR@1": metrics["test"]["candidates"]["HR@1"],
                "test_NDCG@10": metrics["test"]["candidates"]["NDCG@10"], "wall_s": round(time.perf_counter() - start, 1),
                "timings": record["timings"]}
        print(json.dumps(line), flush=True)
        with open(args.out / "results.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
