"""SASRec quality on MovieLens-100k: test metrics over several seeds, mean ± std.

    python benchmarks/sasrec_quality.py                       # prepares ML-100k (cap 10) itself
    python benchmarks/sasrec_quality.py --data DIR --seeds 0 1 2 --threads 1

Trains one SASRec run per seed (model selected on validation NDCG@10 over the 20 candidates),
then prints test HR@1, NDCG@10, MRR over the 20 candidates, full-catalog NDCG@10 (history items
excluded) and the training time of each seed. std is the sample standard deviation (ddof = 1).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from c2kd.sasrec.train import SASRecTrainConfig, train_sasrec

if __package__ in (None, ""):  # run as a file (python benchmarks/sasrec_quality.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_result  # noqa: E402

COLUMNS = [("candidates", "HR@1"), ("candidates", "NDCG@10"), ("candidates", "MRR"), ("full_catalog", "NDCG@10")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="prepared folder; default: prepare ML-100k into a temp folder")
    parser.add_argument("--max-train-per-user", type=int, default=10, help="cap used when preparing ML-100k (0 = none)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--epochs", type=int, default=SASRecTrainConfig.epochs)
    parser.add_argument("--batch-size", type=int, default=SASRecTrainConfig.batch_size)
    parser.add_argument("--lr", type=float, default=SASRecTrainConfig.lr)
    parser.add_argument("--last-position", action="store_true", help="supervise the target only")
    parser.add_argument("--json", type=Path, help="also write per-seed results and the summary here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="sasrec-bench-") as tmp:
        data = args.data
        if data is None:
            data = Path(tmp) / "ml-100k"
            cmd = [sys.executable, "-m", "c2kd.cli", "prepare", "movielens-100k", "--out", str(data)]
            if args.max_train_per_user:
                cmd += ["--max-train-per-user", str(args.max_train_per_user)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        runs = []
        for seed in args.seeds:
            config = SASRecTrainConfig(
                seed=seed, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                all_positions=not args.last_position,
            )
            metrics = train_sasrec(data, Path(tmp) / f"seed{seed}", config, progress=sys.stderr.isatty())
            row = {f"{g}/{m}": metrics["test"][g][m] for g, m in COLUMNS}
            row.update(seed=seed, selected_epoch=metrics["selected_epoch"], epochs_run=metrics["epochs_run"],
                       train_seconds=metrics["train_seconds"])
            runs.append(row)
            print(f"seed {seed}: " + "  ".join(f"{g}/{m} {row[f'{g}/{m}']:.4f}" for g, m in COLUMNS)
                  + f"  epoch {row['selected_epoch']}/{row['epochs_run']}  {row['train_seconds']:.1f} s", flush=True)

    summary = {}
    for g, m in COLUMNS + [("", "train_seconds")]:
        key = f"{g}/{m}" if g else m
        values = [r[key] for r in runs]
        summary[key] = {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}
    print(f"\nSASRec on {data if args.data else 'ML-100k'} test, {len(runs)} seeds (mean ± std):")
    for key, s in summary.items():
        print(f"  {key:<22} {s['mean']:.4f} ± {s['std']:.4f}")
    if args.json:
        write_result(args.json, {"runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
