"""Run the benchmark suite: every script it knows, in order, each result as OUT/<script>/<variant>.json.

    python benchmarks/run.py --tier quick --out runs/bench-quick     # a smoke run of the suite (minutes; numbers mean nothing)
    python benchmarks/run.py --tier full --out runs/bench            # every measurement a CPU machine can make (hours)
    python benchmarks/run.py --list                                  # every step, its tier and its command
    python benchmarks/run.py --only stage_one/default stage_two/tiny --out runs/bench

Resumable: a step whose result file exists is skipped, so the same command continues a run that
stopped (and the scripts themselves reuse finished trainings in OUT/work/). Each step runs as its
own process, so one failure is reported and the others still run; the timed steps run after the
trainings, alone. OUT/suite.json records the machine and each step's status and seconds.
Steps that need another environment (the vLLM venv, a GPU) belong to no tier: name them with
`--only`. `python benchmarks/render_results.py` turns benchmarks/results/ into docs/RESULTS.md;
copy a result there (OUT/<script>/<variant>.json -> benchmarks/results/<script>/<variant>.json)
to publish it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python benchmarks/run.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ROOT, machine, provenance  # noqa: E402

SMOLLM2_SHAPE = "576,30,9,1536"  # width, layers, heads, MLP width of SmolLM2-135M (random weights)
TIERS = ("quick", "full")


@dataclass
class Step:
    """One result: `script` run with `args(out, quick)`; the script writes `produces(out)` (default: the
    result path itself, passed through the arguments), which is copied to OUT/<script>/<variant>.json."""

    script: str
    variant: str
    args: Callable[[Path, bool], list[str]]
    tiers: tuple[str, ...] = TIERS
    produces: Callable[[Path], Path] | None = None
    python: Callable[[], str] = lambda: sys.executable
    needs: str = ""  # what the step needs beyond this repository's venv (then it is in no tier)
    module: bool = True  # run as `python -m benchmarks.<script>`; False: a c2kd command
    timed: bool = False  # measures time: runs after the trainings
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.script}/{self.variant}"

    def result(self, out: Path) -> Path:
        return out / self.script / f"{self.variant}.json"


def work(out: Path, *parts: str) -> Path:
    return out / "work" / Path(*parts)


def data(out: Path) -> Path:
    return work(out, "data", "ml100k-c5")


def res(out: Path, name: str) -> str:
    return str(out / f"{name}.json")


def vllm_python() -> str:
    """The vLLM venv's python (scripts/setup_vllm.sh builds it on first use and prints its path)."""
    return subprocess.run(["bash", str(ROOT / "scripts" / "setup_vllm.sh")], capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]


DQ = ("distill_quality", "tiny")
RL = ("real_llm", "tier")

STEPS: list[Step] = [
    Step("sasrec_quality", "default", lambda o, q: [
        "--data", str(data(o)), "--json", res(o, "sasrec_quality/default"), *(["--seeds", "0", "--epochs", "2"] if q else [])]),
    Step(*DQ, lambda o, q: ["--data", str(data(o)), "--out", str(work(o, *DQ)), "--jobs", "2", *(["--quick"] if q else [])],
         produces=lambda o: work(o, *DQ, "summary.json")),
    Step("lm_quality", "tiny", lambda o, q: [
        "--data", str(data(o)), "--out", str(work(o, "lm_quality")), "--llara", "--jobs", "2"],
        tiers=("full",), produces=lambda o: work(o, "lm_quality", "results.json")),
    Step("demo", "default", lambda o, q: ["demo", "--out", str(work(o, "demo"))], tiers=("full",), module=False,
         produces=lambda o: work(o, "demo", "results.json")),
    Step("demo_students", "kd-over-items", lambda o, q: [
        str(work(o, "demo")), "--out", str(work(o, "demo_students")),
        'c2kd_vocab={"method": "c2kd", "w_own_logit": 4.0, "kd_over": "vocab"}',
        'c2kd_items={"method": "c2kd", "w_own_logit": 4.0, "kd_over": "items"}'],
        tiers=("full",), produces=lambda o: work(o, "demo_students", "results.jsonl")),
    Step(*RL, lambda o, q: ["--out", str(work(o, *RL)), "--teacher-sasrec-kd", "4.0", *(["--quick"] if q else [])],
         tiers=("full",), produces=lambda o: work(o, *RL, "summary.json")),
    *(Step("student_variants", f"{family}-{variant}", (lambda f, v: lambda o, q: [
        "--family", f, "--variant", v, "--out", str(work(o, *RL)), "--summary", str(work(o, *RL, "summary.json")),
        "--seeds", "0", "1", "2", "--json", res(o, f"student_variants/{f}-{v}")])(family, variant), tiers=("full",))
      for family in ("smollm2", "gemma") for variant in ("own-logit-8", "logit-8")),
    Step("c2kd_parts", "demo", lambda o, q: [
        "--run", str(work(o, "demo")), "--out", str(work(o, "c2kd_parts")), "--trials", "5", "--seeds", "3",
        "--json", res(o, "c2kd_parts/demo")], tiers=("full",)),
    Step("cache_dtype", "smollm2", lambda o, q: [
        "--teacher", str(work(o, "demo", "teacher")), "--data", str(work(o, "demo", "data")), "--max-examples", "256",
        "--splits", "train", "--work", str(work(o, "cache_dtype")), "--student-seeds", "0,1",
        "--json", res(o, "cache_dtype/smollm2")], tiers=("full",)),
    Step("prompt_copy", "tier-teachers", lambda o, q: [
        "--model", str(work(o, *RL, "smollm2", "teacher")), "--data", str(work(o, *RL, "data")),
        "--json", res(o, "prompt_copy/tier-teachers")], tiers=("full",)),
    Step("item_mass", "tiny", lambda o, q: [str(work(o, *DQ, "cache")), "--json", res(o, "item_mass/tiny")]),
    Step("item_mass", "smollm2", lambda o, q: [str(work(o, *RL, "smollm2", "cache")), "--json", res(o, "item_mass/smollm2")],
         tiers=("full",)),
    Step("remote_read", "default", lambda o, q: [
        "--work", str(work(o, "remote_read")), "--json", res(o, "remote_read/default"), *(["--epochs", "1"] if q else [])]),
    # timed steps: after the trainings, alone
    Step("deployment", "tiny", lambda o, q: [
        "--data", str(data(o)), "--teacher", str(work(o, *DQ, "teacher")), "--student", str(work(o, *DQ, "c2kd-s0")),
        "--sasrec", str(work(o, *DQ, "sasrec")), "--out", str(work(o, "deployment-tiny")),
        *(["--requests", "10"] if q else [])], produces=lambda o: work(o, "deployment-tiny", "deployment.json"), timed=True),
    Step("deployment", "smollm2", lambda o, q: [
        "--data", str(work(o, *RL, "data")), "--teacher", str(work(o, *RL, "smollm2", "teacher")),
        "--student", str(work(o, *RL, "smollm2", "C2KD-s0")), "--sasrec", str(work(o, *RL, "sasrec-s0")),
        "--out", str(work(o, "deployment-smollm2"))], tiers=("full",),
        produces=lambda o: work(o, "deployment-smollm2", "deployment.json"), timed=True),
    Step("stage_one", "default", lambda o, q: [
        "--data", str(data(o)), "--threads", "1", "--json", res(o, "stage_one/default"),
        *(["--smollm2-examples", "0", "--tiny-examples", "256", "--repeats", "1"] if q else [])], timed=True),
    Step("stage_two", "tiny", lambda o, q: [
        "--data", str(data(o)), "--teacher", str(work(o, *DQ, "teacher")), "--cache", str(work(o, *DQ, "cache")),
        "--json", res(o, "stage_two/tiny"), *(["--steps", "4", "--block", "2"] if q else [])], timed=True),
    Step("stage_two", "smollm2-shape", lambda o, q: [
        "--data", str(data(o)), "--teacher-shape", SMOLLM2_SHAPE, "--json", res(o, "stage_two/smollm2-shape"),
        *(["--steps", "4", "--block", "2", "--cache-examples", "64"] if q else [])], timed=True),
    Step("stage_two", "smollm2-first3", lambda o, q: [
        "--data", str(work(o, *RL, "data")), "--teacher", str(work(o, *RL, "smollm2", "teacher")),
        "--cache", str(work(o, *RL, "smollm2", "cache")), "--student", "smollm2-135m", "--shrink", "first:3",
        "--steps", "24", "--block", "8", "--json", res(o, "stage_two/smollm2-first3")], tiers=("full",), timed=True),
    *(Step(script, "tier", (lambda s: lambda o, q: [
        "--data", str(work(o, *RL, "data")), "--sasrec", str(work(o, *RL, "sasrec-s0")), "--json", res(o, f"{s}/tier")])(script),
        tiers=("full",), timed=True) for script in ("head_step", "bf16_step", "cpu_step")),
    # other environments: no tier, run with --only
    Step("vllm_stage_one", "default", lambda o, q: [
        "--work", str(work(o, "vllm")), "--json", res(o, "vllm_stage_one/default")], tiers=(), python=vllm_python,
        needs="the vLLM venv (scripts/setup_vllm.sh)", timed=True),
    Step("gpu_stage_one", "default", lambda o, q: [
        "--work", str(work(o, "gpu")), "--json", res(o, "gpu_stage_one/default")], tiers=(), needs="a CUDA GPU", timed=True),
]


def ordered(steps: list[Step]) -> list[Step]:
    return [s for s in steps if not s.timed] + [s for s in steps if s.timed]


def command(step: Step, out: Path, quick: bool) -> list[str]:
    if not step.module:
        return [sys.executable, "-m", "c2kd.cli", *step.args(out, quick)]
    return [step.python(), "-m", f"benchmarks.{step.script}", *step.args(out, quick)]


def run_step(step: Step, out: Path, quick: bool) -> str:
    cmd = command(step, out, quick)
    print(f"== {step.name}: {' '.join(cmd)}", flush=True)
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    if rc != 0:
        return f"failed (exit {rc})"
    target = step.result(out)
    if step.produces is not None:  # a script that writes into its own folder: its summary becomes the result
        produced = step.produces(out)
        if not produced.is_file():
            return f"failed (no {produced})"
        target.parent.mkdir(parents=True, exist_ok=True)
        if produced.suffix == ".jsonl":
            target = target.with_suffix(".jsonl")
            shutil.copyfile(produced, target)
        else:
            payload = json.loads(produced.read_text())
            payload.setdefault("provenance", provenance(" ".join(cmd)))
            target.write_text(json.dumps(payload, indent=2) + "\n")
    return "ok" if target.is_file() else f"failed (no {target})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", choices=TIERS, default="quick")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--only", nargs="+", metavar="SCRIPT[/VARIANT]", help="run only these steps, whatever their tier")
    parser.add_argument("--list", action="store_true", help="list the steps and their commands, run nothing")
    args = parser.parse_args()
    quick = args.tier == "quick"
    if args.only:
        steps = [s for s in STEPS if s.name in args.only or s.script in args.only]
        unknown = set(args.only) - {s.name for s in steps} - {s.script for s in steps}
        if unknown:
            parser.error(f"unknown steps: {', '.join(sorted(unknown))} (see --list)")
    else:
        steps = [s for s in STEPS if args.tier in s.tiers]
    steps = ordered(steps)
    if args.list:
        for s in ordered(STEPS):
            where = ", ".join(s.tiers) or f"no tier: needs {s.needs}"
            print(f"{s.name:34} [{where}]\n    {' '.join(command(s, args.out, quick)[1:]) if s.module else 'c2kd ' + ' '.join(s.args(args.out, quick))}")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if not data(args.out).exists():
        subprocess.run([sys.executable, "-m", "c2kd.cli", "prepare", "movielens-100k", "--out", str(data(args.out)),
                        "--max-train-per-user", "5", "--seed", "0"], check=True, cwd=ROOT)
    suite_path = args.out / "suite.json"
    status = json.loads(suite_path.read_text()) if suite_path.is_file() else {"steps": {}}
    status.update(machine=machine(), tier=args.tier)
    for step in steps:
        if step.result(args.out).is_file() or step.result(args.out).with_suffix(".jsonl").is_file():
            print(f"== {step.name}: done before, skipped ({step.result(args.out)})", flush=True)
            status["steps"].setdefault(step.name, {"status": "ok"})
            continue
        start = time.perf_counter()
        outcome = run_step(step, args.out, quick)
        status["steps"][step.name] = {"status": outcome, "seconds": round(time.perf_counter() - start)}
        suite_path.write_text(json.dumps(status, indent=2) + "\n")
    suite_path.write_text(json.dumps(status, indent=2) + "\n")
    failed = {n: s["status"] for n, s in status["steps"].items() if s["status"] != "ok"}
    print(json.dumps(status["steps"], indent=2))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
