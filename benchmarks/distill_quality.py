"""Stage-two quality: every method and ablation distilled from ONE teacher cache, over seeds.

    python benchmarks/distill_quality.py --data DATA --out runs/bench/distill_quality
        [--cache CACHE]  (default: train tiny-teacher on DATA, cache its train split under --out)

Methods (same student preset, epochs, lr and batch size for all — one training budget):
sft, logit-kd, feature-kd, c2kd, c2kd with a fixed layer (no router), without cross-head, with
the soft router. Each run selects its checkpoint on validation; the table is on the test split.
Writes summary.json and summary.md under --out; runs already finished are kept (resumable).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python benchmarks/distill_quality.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import mean_std, write_result  # noqa: E402

METHODS = {
    "sft": ["--method", "sft"],
    "logit-kd": ["--method", "logit-kd"],
    "feature-kd": ["--method", "feature-kd"],
    "c2kd": ["--method", "c2kd"],
    "c2kd, no router (fixed last cached layer)": ["--method", "c2kd", "--router", "fixed:LAST"],
    "c2kd, no cross-head": ["--method", "c2kd", "--no-cross-head"],
    "c2kd, soft router": ["--method", "c2kd", "--router", "soft"],
}
COLUMNS = (("candidates", "HR@1"), ("candidates", "NDCG@10"), ("candidates", "MRR"), ("full_catalog", "NDCG@10"))


def c2kd(*args: str, threads: int | None = None) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    subprocess.run([sys.executable, "-m", "c2kd.cli", *args], check=True, env=env)


def teacher_cache(data: Path, out: Path, sasrec_seed: int, epochs: int, lr: float) -> Path:
    """Train tiny-teacher on `data`, test it, and cache its train split (each skipped when already there)."""
    if not (out / "sasrec").exists():
        c2kd("train-sasrec", "--data", str(data), "--out", str(out / "sasrec"), "--seed", str(sasrec_seed))
    if not (out / "teacher").exists():
        c2kd("train-teacher", "--data", str(data), "--sasrec", str(out / "sasrec"), "--out", str(out / "teacher"),
             "--model", "tiny-teacher", "--format", "ids", "--epochs", str(epochs), "--lr", str(lr), "--no-progress")
    if not (out / "teacher-test.json").exists():
        c2kd("evaluate", "--model", str(out / "teacher"), "--data", str(data), "--split", "test",
             "--out", str(out / "teacher-test.json"))
    if not (out / "cache").exists():
        c2kd("cache-teacher", "--teacher", str(out / "teacher"), "--data", str(data), "--out", str(out / "cache"),
             "--splits", "train", "--no-progress")
    return out / "cache"


def plot_summary(summary: dict, path: Path) -> None:
    """Bars of test HR@1 and NDCG@10 (mean, with the std over seeds as error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, metric in zip(axes, ("candidates/HR@1", "candidates/NDCG@10")):
        values = [summary[n][metric] for n in names]
        means = [statistics.mean(v) for v in values]
        stds = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
        ax.barh(names, means, xerr=stds, color="tab:blue", alpha=0.8)
        ax.invert_yaxis()
        ax.set_xlabel(f"test {metric.split('/')[1]} (20 candidates)")
        ax.set_xlim(min(means) - 0.1, max(means) + 0.08)
    axes[1].set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/distill_quality"))
    parser.add_argument("--cache", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--student", default="tiny-student")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--teacher-epochs", type=int, default=8)
    parser.add_argument("--teacher-lr", type=float, default=3e-3)
    parser.add_argument("--jobs", type=int, default=2, help="distill runs at a time (each with one torch thread when > 1)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 seed, 1 epoch, small subsets")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.epochs, args.teacher_epochs = [0], 1, 1
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.cache or teacher_cache(args.data, args.out, 0, args.teacher_epochs, args.teacher_lr)
    last_layer = json.loads((Path(cache) / "manifest.json").read_text())["spec"]["layers"][-1]
    extra = ["--max-train", "200", "--max-val", "100"] if args.quick else []

    def run_dir(name: str, seed: int) -> Path:
        return args.out / (name.replace(", ", "-").replace(" ", "_").replace("(", "").replace(")", "") + f"-s{seed}")

    def distill(name: str, seed: int) -> None:
        flags = [f.replace("LAST", str(last_layer)) for f in METHODS[name]]
        run = run_dir(name, seed)
        if not (run / "distill.json").exists():
            c2kd("distill", "--cache", str(cache), "--data", str(args.data), "--out", str(run), "--student",
                 args.student, "--seed", str(seed), "--epochs", str(args.epochs), "--lr", str(args.lr),
                 "--batch-size", str(args.batch_size), "--no-progress", *flags, *extra,
                 threads=1 if args.jobs > 1 else None)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:  # each run is its own process
        for done in [pool.submit(distill, name, seed) for name in METHODS for seed in args.seeds]:
            done.result()

    summary = {}
    for name in METHODS:
        runs = [json.loads((run_dir(name, seed) / "distill.json").read_text()) for seed in args.seeds]
        summary[name] = {
            "seeds": args.seeds,
            **{f"{group}/{metric}": [r["metrics"]["test"][group][metric] for r in runs] for group, metric in COLUMNS},
            "validation NDCG@10": [r["validation"]["best"]["NDCG@10"] for r in runs],
            "train_s": [r["timings"]["train_s"] + r["timings"]["stage1_s"] for r in runs],
        }
    write_result(args.out / "summary.json", summary)
    lines = ["| method | test HR@1 | test NDCG@10 | test MRR | full-catalog NDCG@10 | val NDCG@10 |", "|---|---|---|---|---|---|"]
    for name, row in summary.items():
        cells = [mean_std(row[f"{g}/{m}"]) for g, m in COLUMNS] + [mean_std(row["validation NDCG@10"])]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    plot_summary(summary, args.out / "summary.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
