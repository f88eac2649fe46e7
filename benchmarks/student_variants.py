"""A student recipe variant against the real-LLM benchmark's own students, paired by seed (one family's pair).

    python benchmarks/student_variants.py --variant items --out runs/bench/real_llm --seeds 0 1 2 --json runs/bench/kd_over_items.json
    python benchmarks/student_variants.py --variant 6-epochs --methods "SFT from cache" C2KD "logit KD" ...
    python benchmarks/student_variants.py --variant own-logit --out runs/bench/real_llm_bf16 \
        --summary runs/bench/real_llm_bf16/summary.json --json runs/bench/own_logit.json

Variants (VARIANTS): `items` / `candidates` = `--kd-over items|candidates` against the paper's
`vocab`; `6-epochs` = twice the benchmark's 3 student epochs; `own-logit` / `own-logit-1` / `-2` /
`-4` / `-8` = C2KD with `--w-own-logit` 0.5 / 1.0 / 2.0 / 4.0 / 8.0 (vanilla logit KD on the
student's own head added); `logit-4` = logit KD and `cross-head-4` = C2KD with `--w-logit 4.0`
(the weight of their KD term; 0.5 by default); `logit-8` = logit KD with `--w-logit 8.0`, the
own-head weight of `own-logit-8`. Builds (or reuses) the benchmark's data, SASRec
seed 0, the family's teacher and cache with `real_llm.py`'s own commands and settings, then distils the
variant's students per method and seed. The baseline students are the benchmark's: read from the same
folder where they exist, otherwise from its recorded summary, which is only valid when the
rebuilt teacher's test metrics equal the recorded ones (checked; the script stops otherwise).
`--summary` names the benchmark run paired with (its settings, teacher and rows; default: the
recorded float32 run, `results/real_llm/f32.json`).
The JSON holds the paired differences, and the benchmark's table and goals with the variant's
students in place of its own (printed as markdown too). Resumable like the benchmark: finished
students are reused.

Variants are compared on the validation split (`--split validation`, the default; the baseline's
students must then be in the folder, since recorded summaries hold test figures only). Run
`--split test` once, for the variant validation chose.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python benchmarks/student_variants.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_result  # noqa: E402
from benchmarks.real_llm import (FAMILIES, METHODS, Bench, by_metric, flat_metrics, goals, hr1_by_seed,  # noqa: E402
                                  markdown, student_metrics)


RECORDED = Path(__file__).parent / "results" / "real_llm" / "f32.json"  # the default --summary
METRIC = ("candidates", "HR@1")
# name: (flags added to the benchmark's distill command, the methods compared by default)
VARIANTS = {
    "items": (["--kd-over", "items"], ("C2KD", "logit KD")),
    "candidates": (["--kd-over", "candidates"], ("C2KD", "logit KD")),
    "6-epochs": (["--epochs", "6"], ("SFT from cache", "C2KD", "logit KD")),  # after the benchmark's --epochs 3: wins
    "own-logit": (["--w-own-logit", "0.5"], ("C2KD",)),  # C2KD plus vanilla logit KD on the student's own head
    "own-logit-1": (["--w-own-logit", "1.0"], ("C2KD",)),  # the same term at twice the weight
    "own-logit-2": (["--w-own-logit", "2.0"], ("C2KD",)),  # and at four times
    "own-logit-4": (["--w-own-logit", "4.0"], ("C2KD",)),  # and at eight
    "own-logit-8": (["--w-own-logit", "8.0"], ("C2KD",)),  # and at sixteen: where does the gain stop?
    # is the own-head term's gain only a heavier KD weight? plain logit KD, and C2KD's cross-head term, at 4.0
    "logit-4": (["--w-logit", "4.0"], ("logit KD",)),
    "cross-head-4": (["--w-logit", "4.0"], ("C2KD",)),
    "logit-8": (["--w-logit", "8.0"], ("logit KD",)),  # plain logit KD at own-logit-8's own-head weight
}


def baseline_hr1(bench: Bench, recorded: dict, family: str, method: str, seed: int, split: str = "test") -> float:
    run = bench.run_folder(family, method, seed)
    if (run / "distill.json").exists():
        return student_metrics(run, split)["/".join(METRIC)]
    if split != "test":
        raise SystemExit(f"{method} seed {seed}: no run folder {run}, and the recorded summary has test figures only")
    recorded_hr1 = hr1_by_seed(recorded["families"][family]["rows"][method])  # by seed, not by list position
    if seed not in recorded_hr1:
        raise SystemExit(f"{method} seed {seed}: no run folder {run} and no recorded test HR@1 for that seed "
                         f"(recorded seeds: {sorted(recorded_hr1)})")
    return recorded_hr1[seed]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/real_llm"), help="the real_llm.py folder")
    parser.add_argument("--family", choices=list(FAMILIES), default="smollm2")
    parser.add_argument("--variant", choices=list(VARIANTS), required=True)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=None, help="default: the variant's")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--summary", type=Path, default=RECORDED, help="the benchmark run's summary.json to pair with")
    parser.add_argument("--split", choices=("validation", "test"), default="validation",
                        help="where the variants are compared; test once, for the variant validation chose")
    args = parser.parse_args()
    recorded = json.loads(args.summary.read_text())
    # runs recorded before --history-loss, --teacher-sasrec-kd, --bf16, --gemma-seeds and --kd-over existed had
    # none of them (the last: the vocabulary for every family)
    settings = argparse.Namespace(**{"history_loss": 0.0, "teacher_sasrec_kd": 0.0, "bf16": False, "gemma_seeds": 1,
                                     "kd_over": "vocab",
                                     **recorded["settings"],
                                     "out": args.out, "families": [args.family], "quick": False})
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(settings, timings=args.json.with_name(f"{args.json.stem}_timings.json"))
    bench.data_and_sasrec(seeds=(0,))
    bench.teacher(args.family)
    teacher = flat_metrics(json.loads((args.out / args.family / "teacher-test.json").read_text()))
    expected = {k: v[0] for k, v in recorded["families"][args.family]["rows"]["teacher"].items()}
    if teacher != expected:
        raise SystemExit(f"the rebuilt teacher's test metrics {teacher} differ from the recorded {expected}: the "
                         "recorded vocab students do not belong to it (a teacher trained on another CPU differs in its "
                         "last digits); run real_llm.py in this folder first")
    flags, default_methods = VARIANTS[args.variant]
    methods = args.methods or default_methods
    bench.run_jobs([bench.distill_job(args.family, f"{m} {args.variant}", [*bench.method_flags(args.family, m), *flags],
                                      seed) for seed in args.seeds for m in methods])
    # The benchmark's table and goals with the variant's students (the teacher is the recorded one).
    rows = {"teacher": recorded["families"][args.family]["rows"]["teacher"]}
    for method in methods:
        runs = [student_metrics(bench.run_folder(args.family, f"{method} {args.variant}", s), args.split)
                for s in args.seeds]
        rows[method] = {**by_metric(runs), "seeds": list(args.seeds)}
    result: dict = {"variant": args.variant, "flags": flags, "split": args.split, "teacher_test": teacher, "seeds": args.seeds,
                    "commands": bench.commands, "methods": {}}
    for method in methods:
        variant = rows[method]["/".join(METRIC)]
        baseline = [baseline_hr1(bench, recorded, args.family, method, s, args.split) for s in args.seeds]
        diffs = [v - b for v, b in zip(variant, baseline)]
        result["methods"][method] = {
            args.variant: variant, "baseline": baseline, "variant - baseline": diffs,
            "mean difference": statistics.mean(diffs), "std difference": statistics.stdev(diffs) if len(diffs) > 1 else None}
        line = (f"{method}: {args.variant} {statistics.mean(variant):.3f} vs baseline {statistics.mean(baseline):.3f} "
                f"{args.split} HR@1; paired difference {statistics.mean(diffs):+.3f} ({', '.join(f'{d:+.3f}' for d in diffs)})")
        if args.variant.startswith("own-logit"):  # the added term is plain logit KD's: is C2KD with it above logit KD alone?
            vs_logit = [v - baseline_hr1(bench, recorded, args.family, "logit KD", s, args.split)
                        for v, s in zip(variant, args.seeds)]
            result["methods"][method]["variant - benchmark's logit KD"] = vs_logit
            line += f"; minus the benchmark's logit KD {', '.join(f'{d:+.3f}' for d in vs_logit)}"
        print(line)
    if args.split == "test":  # the benchmark's test table and goals, for the chosen variant
        if "SFT from cache" in rows:  # the same training as `train-teacher --shrink` (README: they agree to the digit)
            rows = {"teacher": rows["teacher"], "student alone": rows["SFT from cache"], **rows}
        result["rows"], result["goals"] = rows, goals(recorded["sasrec"], rows)
        print(f"The benchmark's table with the variant's students ({args.variant}: {' '.join(flags)}) in place of its own:")
        print(markdown({"sasrec": recorded["sasrec"], "families": {args.family: {"rows": rows, "goals": result["goals"]}}}))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.json, result)


if __name__ == "__main__":
    main()
