"""Run the whole benchmark suite into one folder: JSON + markdown per benchmark, PNGs where made.

    python benchmarks/run_all.py [--out runs/bench] [--quick]

Each benchmark is its own script (see benchmarks/README.md) and runs as a subprocess, so one
failing benchmark is reported and the others still run; they run one at a time, the timed ones
last. suite.json records the machine and each step's time; report.py then renders report.md and
speed.png from the JSON. The default run took 65 minutes on two CPU cores.
`--quick` shrinks every run to a smoke test (minutes) to check the suite itself; its numbers
mean nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


SMOLLM2_SHAPE = "576,30,9,1536"  # width, layers, heads, MLP width of SmolLM2-135M (random weights)


def plan(out: Path, quick: bool, with_lm_quality: bool) -> dict[str, list[str]]:
    """Benchmark name -> script and arguments, in the order they run (timed ones last, alone)."""
    data = out / "data" / "ml100k-c5"
    dq = out / "distill_quality"  # its SASRec, teacher, cache and students feed the later steps
    steps = {
        "sasrec_quality": ["sasrec_quality.py", "--data", str(data), "--json", str(out / "sasrec_quality.json")],
        "distill_quality": ["distill_quality.py", "--data", str(data), "--out", str(dq), "--jobs", "2"],
        "deployment": ["deployment.py", "--data", str(data), "--teacher", str(dq / "teacher"), "--student",
                       str(dq / "c2kd-s0"), "--sasrec", str(dq / "sasrec"), "--json", str(out / "deployment.json")],
        "stage_one": ["stage_one.py", "--data", str(data), "--json", str(out / "stage_one.json")],
        "stage_two": ["stage_two.py", "--data", str(data), "--teacher", str(dq / "teacher"), "--cache", str(dq / "cache"),
                      "--json", str(out / "stage_two.json")],
        "stage_two_smollm2_shape": ["stage_two.py", "--data", str(data), "--teacher-shape", SMOLLM2_SHAPE,
                                    "--json", str(out / "stage_two_smollm2_shape.json")],
    }
    if with_lm_quality:
        steps["lm_quality"] = ["lm_quality.py", "--data", str(data), "--out", str(out / "lm_quality"), "--llara", "--jobs", "2"]
    if quick:
        steps["sasrec_quality"] += ["--seeds", "0", "--epochs", "2"]
        steps["distill_quality"] += ["--quick"]
        steps["deployment"] += ["--requests", "10"]
        steps["stage_one"] += ["--smollm2-examples", "0", "--tiny-examples", "256", "--repeats", "1"]
        steps["stage_two"] += ["--steps", "4", "--block", "2"]
        steps["stage_two_smollm2_shape"] += ["--steps", "4", "--block", "2", "--cache-examples", "64"]
        if with_lm_quality:
            steps["lm_quality"] += ["--seeds", "0", "--teacher-epochs", "1", "--student-epochs", "1", "--max-train", "200",
                                    "--max-val", "50", "--test-limit", "50", "--llara-max-train", "50",
                                    "--llara-epochs", "1", "--llara-test-limit", "10", "--llara-max-val", "50",
                                    "--sasrec-epochs", "2"]
    return steps


def machine() -> dict:
    """Where the absolute times came from."""
    import platform

    import torch

    from c2kd.hardware import cpu_description

    return {**cpu_description(), "python": platform.python_version(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="+", help="run only these benchmarks")
    parser.add_argument("--with-lm-quality", action="store_true",
                        help="also the recommender-LM benchmark (teacher and student trained alone, llara; ~40 CPU-min)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.out / "data" / "ml100k-c5").exists():
        subprocess.run([sys.executable, "-m", "c2kd.cli", "prepare", "movielens-100k", "--out",
                        str(args.out / "data" / "ml100k-c5"), "--max-train-per-user", "5", "--seed", "0"], check=True)
    status: dict = {"machine": machine(), "quick": args.quick, "benchmarks": {}}
    previous = args.out / "suite.json"
    if args.only and previous.is_file():  # a partial rerun keeps the other benchmarks' records
        status["benchmarks"] = json.loads(previous.read_text())["benchmarks"]
    for name, (script, *script_args) in plan(args.out, args.quick, args.with_lm_quality).items():
        if args.only and name not in args.only:
            continue
        if not (HERE / script).exists():
            status["benchmarks"][name] = {"status": "missing script"}
            continue
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        rc = subprocess.run([sys.executable, str(HERE / script), *script_args]).returncode
        status["benchmarks"][name] = {"status": "ok" if rc == 0 else f"failed (exit {rc})",
                                      "seconds": round(time.perf_counter() - start)}
        (args.out / "suite.json").write_text(json.dumps(status, indent=2) + "\n")
    subprocess.run([sys.executable, str(HERE / "report.py"), str(args.out)], check=False)
    print(json.dumps(status, indent=2))
    sys.exit(0 if all(s["status"] == "ok" for s in status["benchmarks"].values()) else 1)


if __name__ == "__main__":
    main()
