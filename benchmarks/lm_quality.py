"""Recommender-LM quality on MovieLens-100k (`ids` format): teacher and SFT student beside SASRec.

    python benchmarks/lm_quality.py                                  # the full benchmark
    python benchmarks/lm_quality.py --seeds 0 --teacher-epochs 1 --student-epochs 1 \\
        --max-train 256 --max-val 128 --out runs/bench/lm_smoke      # a smoke run (minutes)
    python benchmarks/lm_quality.py --llara                          # also the llara format

Steps (each one reuses its output when it is already there, so an interrupted run picks up where
it stopped; a finished run with other settings is refused, not silently reused):
1. `prepare` ML-100k into --data if that folder does not exist (cap --max-train-per-user, seed 0).
2. `train_sasrec` for every seed; the run of --embeddings-seed provides the item embeddings of
   every LM prompt (one embedding table for all LM runs, so LM seeds vary only the LM).
3. `train_teacher` for the teacher preset and the student preset (the student trained alone is
   the SFT baseline), one run per seed, model chosen on validation NDCG@10 over the 20 candidates.
4. `evaluate_reclm` of each model on the test split (read only after model selection).
5. `results.json` (settings, every run, mean ± std) and `results.md` (tables) in --out.

With --llara, one extra model is trained in the `llara` format (titles + slot embeddings, answer
= title text) and evaluated with the generation protocol (ValidRatio, HR@1 over valid answers and
over all) and by candidate log-likelihood ranking.

Timings: `train wall s` is the trainer loop's wall time (from train.json); `train CPU s` is the
CPU time of the process over the whole train_teacher call. On a shared machine the CPU time is
the steadier number. std is the sample standard deviation (ddof = 1) over seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python benchmarks/lm_quality.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_result  # noqa: E402

DEFAULT_DATA = Path("runs/data/ml100k-c5")
METRICS = [("candidates", "HR@1"), ("candidates", "NDCG@10"), ("candidates", "MRR"), ("full_catalog", "NDCG@10")]
LLARA_METRICS = [("generation", "ValidRatio"), ("generation", "HR@1_valid"), ("generation", "HR@1"),
                 ("candidates", "HR@1"), ("candidates", "NDCG@10"), ("candidates", "MRR")]


# ------------------------------------------------------------------------------ jobs (run in workers)


def _limit_threads(threads: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def sasrec_job(data: str, out: str, seed: int, threads: int, epochs: int | None = None) -> dict:
    """Train SASRec for one seed (or read the finished run) and return its test metrics."""
    _limit_threads(threads)
    from c2kd.sasrec.train import SASRecTrainConfig, train_sasrec

    run = Path(out)
    config = SASRecTrainConfig(seed=seed) if epochs is None else SASRecTrainConfig(seed=seed, epochs=epochs)
    if (run / "metrics.json").is_file():
        previous = json.loads((run / "config.json").read_text())["train"]
        if previous != asdict(config):
            raise SystemExit(f"{run} was trained with other settings {previous}; use another --out")
        metrics, cpu = json.loads((run / "metrics.json").read_text()), None
    else:
        cpu0 = time.process_time()
        metrics = train_sasrec(data, run, config)
        cpu = time.process_time() - cpu0
        _write_json(run / "cpu_seconds.json", {"train_cpu_s": round(cpu, 2)})
    cpu_file = run / "cpu_seconds.json"
    cpu = json.loads(cpu_file.read_text())["train_cpu_s"] if cpu_file.is_file() else cpu
    return {
        "model": "SASRec", "seed": seed, "run": str(run), "test": metrics["test"],
        "selected_epoch": metrics["selected_epoch"], "epochs_run": metrics["epochs_run"],
        "train_wall_s": metrics["train_seconds"], "train_cpu_s": cpu,
    }


def lm_job(role: str, data: str, sasrec: str, out: str, recipe: dict, train_config: dict, threads: int,
           test_limit: int | None) -> dict:
    """Train one recommender LM (or reuse the finished folder), evaluate it on test, return a row."""
    _limit_threads(threads)
    from c2kd.finetune.teacher import TeacherRecipe, read_train_record, train_teacher
    from c2kd.evaluate import evaluate_reclm

    run = Path(out)
    result_path = run / "bench_result.json"
    wanted = {"recipe": recipe, "train": train_config, "sasrec": sasrec, "test_limit": test_limit}
    if result_path.is_file():
        done = json.loads(result_path.read_text())
        if done["settings"] != wanted:
            raise SystemExit(f"{run} holds a run with other settings; use another --out or delete it")
        return done["row"]
    train_cpu = train_call_wall = None
    if run.exists():  # trained, but stopped before its evaluation: reuse it when the settings fit
        record = read_train_record(run)
        same_train = all(record["train"].get(k) == v for k, v in train_config.items())
        if not same_train or record["model"]["source"] != recipe["model"] or record["format"] != recipe["fmt"]:
            raise SystemExit(f"{run} was trained with other settings; use another --out or delete it")
    else:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        train_teacher(data, sasrec, run, TeacherRecipe(**recipe), train_config)
        train_cpu = round(time.process_time() - cpu0, 2)
        train_call_wall = round(time.perf_counter() - wall0, 2)

    eval0 = time.perf_counter()
    test = evaluate_reclm(run, data, "test", limit=test_limit, progress=False)
    eval_wall = time.perf_counter() - eval0
    record = read_train_record(run)
    row = {
        "model": role, "preset": recipe["model"], "format": recipe["fmt"], "seed": train_config["seed"],
        "run": str(run), "test": test,
        "validation_best": record["validation"]["best"], "best_step": record["validation"]["best_step"],
        "final_step": record["final_step"],
        "non_embedding_parameters": record["model"]["non_embedding_parameters"],
        "trainable_parameters": record["model"]["trainable_parameters"],
        "train_examples": record["data"]["train_examples"],
        "train_wall_s": record["timings"]["train_s"], "train_call_wall_s": train_call_wall,
        "train_cpu_s": train_cpu, "eval_wall_s": round(eval_wall, 2),
    }
    _write_json(result_path, {"settings": wanted, "row": row})
    return row


# ------------------------------------------------------------------------------ summary


def _get(row: dict, group: str, metric: str) -> float:
    return float(row["test"][group][metric])


def _mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def summarise(rows: list[dict], metrics: list[tuple[str, str]]) -> dict:
    summary: dict = {}
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        entry = {f"{g}/{m}": _mean_std([_get(r, g, m) for r in mine]) for g, m in metrics if g in mine[0]["test"]}
        for key in ("train_wall_s", "train_cpu_s"):
            values = [r[key] for r in mine if r.get(key) is not None]
            if values:
                entry[key] = _mean_std(values)
        entry["seeds"] = [r["seed"] for r in mine]
        summary[name] = entry
    return summary


def _fmt(entry: dict | None, digits: int = 4) -> str:
    if entry is None:
        return "-"
    if entry["n"] == 1:
        return f"{entry['mean']:.{digits}f}"
    return f"{entry['mean']:.{digits}f} ± {entry['std']:.{digits}f}"


def markdown(results: dict) -> str:
    s = results["settings"]
    summary, rows = results["summary"], results["runs"]
    lines = [f"# LM quality on {s['data']} (test split, {results['test_examples']} users)", ""]
    if s.get("test_limit"):
        lines += [f"LMs are evaluated on the first {s['test_limit']} test users only; SASRec on all of them.", ""]
    names = {f"{g}/{m}": (f"full-catalog {m}" if g == "full_catalog" else m) for g, m in METRICS}
    header = ["model", "non-emb. params", *names.values(), "train wall s", "train CPU s", "seeds"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    params = {r["model"]: r.get("non_embedding_parameters") for r in rows}
    for name, entry in summary.items():
        if name.startswith("llara"):
            continue
        p = params.get(name)
        cells = [name, f"{p:,}" if p else "-", *(_fmt(entry.get(k)) for k in names),
                 _fmt(entry.get("train_wall_s"), 1), _fmt(entry.get("train_cpu_s"), 1),
                 ",".join(map(str, entry["seeds"]))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "train CPU s: mean over the runs that were not resumed after an interruption; "
              "train wall s includes the time before a resumption. Candidate metrics rank the 20 stored candidates; full-catalog NDCG@10 ranks all items "
              "(padding and history items excluded). mean ± sample std over seeds.", ""]
    if results.get("parameter_ratio"):
        lines += [f"Non-embedding parameter ratio teacher / student: {results['parameter_ratio']:.2f}×", ""]
    lines += ["## Settings", "", "```json", json.dumps({k: v for k, v in s.items()}, indent=2), "```", ""]
    lines += ["## Per run", "", "| model | seed | " + " | ".join(names.values())
              + " | best val NDCG@10 | best step / steps | train wall s | train CPU s |", "|" + "---|" * 10]
    for r in rows:
        if r["model"].startswith("llara"):
            continue
        cells = [r["model"], str(r["seed"]),
                 *(f"{_get(r, g, m):.4f}" if g in r["test"] else "-" for g, m in METRICS)]
        if r["model"] == "SASRec":
            val = r.get("validation_ndcg10")
            cells += [f"{val:.4f}" if val is not None else "-", f"epoch {r['selected_epoch']} / {r['epochs_run']}"]
        else:
            cells += [f"{r['validation_best']['NDCG@10']:.4f}", f"{r['best_step']} / {r['final_step']}"]
        cpu = f"{r['train_cpu_s']:.1f}" if r.get("train_cpu_s") is not None else "-"
        if r.get("resumed_from_step") is not None:
            cpu = f"- (resumed at step {r['resumed_from_step']})"
        cells += [f"{r['train_wall_s']:.1f}", cpu]
        lines.append("| " + " | ".join(cells) + " |")
    llara = [r for r in rows if r["model"].startswith("llara")]
    if llara:
        lines += ["", "## llara format (generation protocol + candidate log-likelihood ranking)", ""]
        head = ["model", "seed", "train examples", "test examples", "ValidRatio", "HR@1 (valid)", "HR@1 (all)",
                "rank HR@1", "rank NDCG@10", "rank MRR", "train wall s", "train CPU s", "eval wall s"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in llara:
            cells = [r["model"], str(r["seed"]), str(r["train_examples"]), str(r["test"]["examples"]),
                     *(f"{_get(r, g, m):.4f}" for g, m in LLARA_METRICS),
                     f"{r['train_wall_s']:.1f}", f"{r['train_cpu_s']:.1f}" if r.get("train_cpu_s") is not None else "-",
                     f"{r['eval_wall_s']:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/bench/lm_quality"))
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="prepared folder (prepared here if missing)")
    p.add_argument("--max-train-per-user", type=int, default=5, help="cap used when preparing ML-100k")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="LM and SASRec seeds")
    p.add_argument("--embeddings-seed", type=int, default=0, help="SASRec seed whose item embeddings feed all LMs")
    p.add_argument("--teacher", default="tiny-teacher", help="teacher preset")
    p.add_argument("--student", default="tiny-student", help="student preset (trained alone = SFT)")
    # Chosen on validation (seed 0, see README.md): lr 1e-3 beat 3e-3 and 1e-2 for the 6-layer
    # teacher; 3e-3 beat 1e-3 for the 2-layer student; 8 epochs ~ 5 CPU-minutes for the teacher.
    p.add_argument("--teacher-epochs", type=int, default=8)
    p.add_argument("--teacher-lr", type=float, default=1e-3)
    p.add_argument("--student-epochs", type=int, default=8)
    p.add_argument("--student-lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--weight-decay", type=float, default=1e-5)
    p.add_argument("--warmup-ratio", type=float, default=0.05)
    p.add_argument("--max-train", type=int, help="train on a fixed random subset (smoke runs)")
    p.add_argument("--max-val", type=int, help="select on the first N validation examples (smoke runs)")
    p.add_argument("--test-limit", type=int, help="evaluate on the first N test examples (smoke runs)")
    p.add_argument("--llara", action="store_true", help="also train + evaluate one llara-format model")
    p.add_argument("--llara-model", default="tiny-student")
    p.add_argument("--llara-seeds", type=int, nargs="+", default=[0])
    p.add_argument("--llara-epochs", type=int, default=12)  # 4 epochs: ValidRatio 0; 12: 0.065
    p.add_argument("--llara-lr", type=float, default=3e-3)
    p.add_argument("--llara-max-train", type=int, help="llara train subset (default: the whole train split)")
    p.add_argument("--llara-max-val", type=int, default=300, help="llara model selection on the first N validation examples")
    p.add_argument("--llara-test-limit", type=int, help="evaluate llara on the first N test examples")
    p.add_argument("--sasrec-epochs", type=int, help="SASRec epoch cap (default: the library's; smoke runs)")
    p.add_argument("--skip-lm", action="store_true", help="only SASRec (+ llara when asked)")
    p.add_argument("--jobs", type=int, default=1, help="training processes at a time")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    _limit_threads(args.threads)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    data = args.data
    if not (data / "manifest.json").is_file():
        from c2kd.data.prepare import prepare

        print(f"preparing movielens-100k into {data}", flush=True)
        prepare("movielens-100k", data, seed=0, max_train_per_user=args.max_train_per_user or None)
    from c2kd.data.examples import load_examples

    examples = load_examples(data)
    test_examples = min(examples.split("test").height, args.test_limit or 10**9)

    def lm_settings(model: str, fmt: str, epochs: int, lr: float, seed: int, max_train, max_val) -> tuple[dict, dict]:
        recipe = {"fmt": fmt, "model": model, "max_train": max_train, "max_val": max_val}
        config = {"epochs": epochs, "lr": lr, "batch_size": args.batch_size, "weight_decay": args.weight_decay,
                  "warmup_ratio": args.warmup_ratio, "seed": seed, "progress": False,
                  "checkpoint_every": 150}  # an interrupted run resumes from its last checkpoint
        return recipe, config

    sasrec_dir = lambda seed: str(out / "sasrec" / f"seed{seed}")  # noqa: E731
    emb_run = sasrec_dir(args.embeddings_seed)
    sasrec_seeds = list(dict.fromkeys([args.embeddings_seed, *args.seeds]))
    settings = {
        "data": str(data), "fingerprint": examples.fingerprint, "seeds": args.seeds,
        "sasrec_embeddings": emb_run, "sasrec_epochs": args.sasrec_epochs, "threads": args.threads, "jobs": args.jobs,
        "teacher": {"preset": args.teacher, "epochs": args.teacher_epochs, "lr": args.teacher_lr},
        "student": {"preset": args.student, "epochs": args.student_epochs, "lr": args.student_lr},
        "batch_size": args.batch_size, "weight_decay": args.weight_decay, "warmup_ratio": args.warmup_ratio,
        "max_train": args.max_train, "max_val": args.max_val, "test_limit": args.test_limit,
        "select_metric": "validation NDCG@10 (20 candidates)",
    }
    if args.llara:
        settings["llara"] = {"preset": args.llara_model, "seeds": args.llara_seeds, "epochs": args.llara_epochs,
                             "lr": args.llara_lr, "max_train": args.llara_max_train, "max_val": args.llara_max_val,
                             "test_limit": args.llara_test_limit}

    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as pool:
        # The embedding run comes first: every LM needs it.
        first = pool.submit(sasrec_job, str(data), emb_run, args.embeddings_seed, args.threads, args.sasrec_epochs).result()
        print(f"SASRec seed {args.embeddings_seed}: test NDCG@10 {_get(first, 'candidates', 'NDCG@10'):.4f}", flush=True)
        futures = [pool.submit(sasrec_job, str(data), sasrec_dir(s), s, args.threads, args.sasrec_epochs)
                   for s in sasrec_seeds[1:]]
        if not args.skip_lm:
            for role, preset, epochs, lr in (("teacher", args.teacher, args.teacher_epochs, args.teacher_lr),
                                             ("SFT student", args.student, args.student_epochs, args.student_lr)):
                for seed in args.seeds:
                    recipe, config = lm_settings(preset, "ids", epochs, lr, seed, args.max_train, args.max_val)
                    folder = out / role.split()[-1] / f"seed{seed}"
                    futures.append(pool.submit(lm_job, role, str(data), emb_run, str(folder), recipe, config,
                                               args.threads, args.test_limit))
        if args.llara:
            for seed in args.llara_seeds:
                recipe, config = lm_settings(args.llara_model, "llara", args.llara_epochs, args.llara_lr, seed,
                                             args.llara_max_train, args.llara_max_val)
                futures.append(pool.submit(lm_job, f"llara {args.llara_model}", str(data), emb_run,
                                           str(out / "llara" / f"seed{seed}"), recipe, config, args.threads,
                                           args.llara_test_limit))
        rows = [first]
        for future in futures:
            row = future.result()
            extra = f" valid {_get(row, 'generation', 'ValidRatio'):.3f}" if "generation" in row["test"] else ""
            print(f"{row['model']} seed {row['seed']}: test NDCG@10 {_get(row, 'candidates', 'NDCG@10'):.4f}{extra}"
                  f"  ({row['train_wall_s']:.0f} s)", flush=True)
            rows.append(row)

    for r in rows:
        if r["model"] == "SASRec":  # its own validation score, for the per-run table
            r["validation_ndcg10"] = json.loads((Path(r["run"]) / "metrics.json").read_text())["validation"]["candidates"]["NDCG@10"]
        else:  # a run resumed after an interruption: its CPU time covers only the last part
            r["resumed_from_step"] = json.loads((Path(r["run"]) / "train.json").read_text())["timings"]["resumed_from_step"]
            if r["resumed_from_step"] is not None:
                r["train_cpu_s"] = None
    order = {"SASRec": 0, "teacher": 1, "SFT student": 2}
    rows.sort(key=lambda r: (order.get(r["model"], 3), r["seed"]))
    params = {r["model"]: r.get("non_embedding_parameters") for r in rows}
    ratio = params["teacher"] / params["SFT student"] if params.get("teacher") and params.get("SFT student") else None
    results = {
        "benchmark": "lm_quality", "settings": settings, "test_examples": test_examples,
        "parameter_ratio": ratio, "runs": rows,
        "summary": summarise([r for r in rows if not r["model"].startswith("llara")], METRICS)
        | summarise([r for r in rows if r["model"].startswith("llara")], LLARA_METRICS),
        "wall_s": round(time.perf_counter() - started, 1),
        "python": sys.version.split()[0],
    }
    write_result(out / "results.json", results)
    (out / "results.md").write_text(markdown(results))
    print(markdown(results))
    print(f"written {out / 'results.json'} and {out / 'results.md'}")
    return results


if __name__ == "__main__":
    main()
