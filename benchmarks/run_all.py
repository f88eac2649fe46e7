"""Run the whole benchmark suite into one folder: JSON + markdown per benchmark, PNGs where made.

    python benchmarks/run_all.py [--out runs/bench] [--quick]

Each benchmark is its own script (see benchmarks/README.md) and runs as a subprocess, so one
failing benchmark is reported and the others still run. `--quick` shrinks every run to a smoke
test (minutes) to check the suite itself; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def plan(out: Path, quick: bool) -> dict[str, list[str]]:
    data = out / "data" / "ml100k-c5"
    lm = out / "lm_quality"
    steps = {
        "sasrec_quality": ["sasrec_quality.py", "--data", str(data), "--json", str(out / "sasrec_quality.json")],
        "lm_quality": ["lm_quality.py", "--data", str(data), "--out", str(lm), "--llara"],
        "distill_quality": ["distill_quality.py", "--data", str(data), "--out", str(out / "distill_quality")],
        "stage_one": ["stage_one.py", "--data", str(data), "--json", str(out / "stage_one.json")],
        "stage_two": ["stage_two.py", "--data", str(data), "--json", str(out / "stage_two.json")],
    }
    if quick:
        steps["sasrec_quality"] += ["--seeds", "0", "--epochs", "2"]
        steps["lm_quality"] += ["--seeds", "0", "--teacher-epochs", "1", "--student-epochs", "1", "--max-train", "200",
                                "--max-val", "50", "--test-limit", "50", "--llara-max-train", "50",
                                "--llara-epochs", "1", "--llara-test-limit", "10", "--llara-max-val", "50", "--sasrec-epochs", "2"]
        steps["distill_quality"] += ["--quick"]
        steps["stage_one"] += ["--smollm2-examples", "0", "--tiny-examples", "256", "--repeats", "1"]
        steps["stage_two"] += ["--steps", "4", "--block", "2"]
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="+", help="run only these benchmarks")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.out / "data" / "ml100k-c5").exists():
        subprocess.run([sys.executable, "-m", "c2kd.cli", "prepare", "movielens-100k", "--out",
                        str(args.out / "data" / "ml100k-c5"), "--max-train-per-user", "5", "--seed", "0"], check=True)
    status = {}
    for name, (script, *script_args) in plan(args.out, args.quick).items():
        if args.only and name not in args.only:
            continue
        if not (HERE / script).exists():
            status[name] = {"status": "missing script"}
            continue
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        rc = subprocess.run([sys.executable, str(HERE / script), *script_args]).returncode
        status[name] = {"status": "ok" if rc == 0 else f"failed (exit {rc})", "seconds": round(time.perf_counter() - start)}
    (args.out / "suite.json").write_text(json.dumps(status, indent=2) + "\n")
    print(json.dumps(status, indent=2))
    sys.exit(0 if all(s["status"] == "ok" for s in status.values()) else 1)


if __name__ == "__main__":
    main()
