"""Real pretrained teachers end to end: SmolLM2-135M and Gemma-3-270M distilled into students >= 8x smaller.

    python benchmarks/real_llm.py --out runs/bench/real_llm [--families smollm2 gemma] [--no-bf16] [--gemma-seeds 3] [--quick]

Per family, on ML-100k (<= 5 train windows per user), `ids` prompts, the hybrid item head:
teacher fine-tune (full, pretrained vocabulary frozen) -> test evaluation -> one cache of its train
split (C2KD's late layers and feature KD's uniform-map layers) -> students sharing its tokenizer
(its first K layers, pretrained weights): trained alone (`train-teacher --shrink first:K`), and
from the cache with SFT, logit KD, feature KD and C2KD (their logit losses over the item
tokens), over seeds -> batch-1 latency and parameters. SASRec over three seeds on the same data.

Every step is one `c2kd` command writing its own folder and is skipped when its output exists;
the commands resume on their own, so a run cut short continues where it stopped. Teachers run one
at a time on both cores, the students two at a time with one thread each, Gemma's first seed in one
pool with SmolLM2's last (see PHASES); the timed steps (latency, the head step ratio) run last.
Writes summary.json (every number, the commands, the goals) and summary.md.
timings.json keeps each finished step's seconds and the tier's wall time summed over resumed
runs (a run killed mid-step loses at most StepClock.HEARTBEAT_S of it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from c2kd.atomic import write_json
from c2kd.hardware import cpu_description
from c2kd.recmodel.layers import late_layers
from c2kd.student.layer_map import uniform_layer_map

if __package__ in (None, ""):  # run as a file (python benchmarks/real_llm.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import mean_std, write_result  # noqa: E402

FAMILIES = {
    # name: alias, teacher layers, layers the student keeps (>= 8x fewer non-embedding parameters),
    # seeds, teacher epochs (both select their best validation after epoch 1; Gemma on a 1-epoch
    # schedule ended below its own student, 0.305 vs 0.355 test HR@1, so it gets the 3-epoch one), and the
    # support of the logit losses (distill --kd-over): the item tokens. Over Gemma's 263,827-token vocabulary
    # C2KD's stage-1 probe has 169M parameters (900 of its C2KD student's 2,466 s), over the items 1.1M; on
    # SmolLM2 the items gave the vocabulary's quality over three seeds (README) for less work
    "smollm2": {"alias": "smollm2-135m", "layers": 30, "keep": 3, "seeds": [0, 1, 2], "teacher_epochs": 2,
                "kd_over": "items"},
    "gemma": {"alias": "gemma3-270m", "layers": 18, "keep": 2, "seeds": [0], "teacher_epochs": 3, "kd_over": "items"},
}
# Phases of (family, first seed, end seed) — indices into the family's seeds: each trains its families'
# teachers (both cores), then all its students in one pool, two at a time, so that the last student of one
# family does not leave a core idle. Cheap seeds first, so a run cut short still has every family: SmolLM2
# seeds 0-1; Gemma seed 0 (its longer students first) with SmolLM2 seed 2; then Gemma's further seeds when
# --gemma-seeds asks for them.
PHASES = ((("smollm2", 0, 2),), (("gemma", 0, 1), ("smollm2", 2, 3)), (("gemma", 1, 3),))
METHODS = {
    "SFT from cache": ["--method", "sft"],
    "logit KD": ["--method", "logit-kd"],
    "feature KD": ["--method", "feature-kd"],
    "C2KD": ["--method", "c2kd"],
}
# C2KD right after SFT: a run cut short still compares them; the student alone (the cheapest) last
TRAIN_ORDER = ("SFT from cache", "C2KD", "logit KD", "feature KD", "student alone")
WITH_LOGIT_LOSSES = ("logit KD", "C2KD")  # the methods --kd-over applies to
METRICS = (("candidates", "HR@1"), ("candidates", "NDCG@10"), ("candidates", "MRR"), ("full_catalog", "NDCG@10"))


def c2kd(args: list[str], log: Path, threads: int) -> list[str]:
    """Run one c2kd command (its output into `log`); returns the command as run."""
    cmd = [sys.executable, "-m", "c2kd.cli", *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(log, "a") as f:
        f.write(f"$ c2kd {' '.join(args)}\n")
        f.flush()
        subprocess.run(cmd, check=True, env=env, stdout=f, stderr=subprocess.STDOUT)
    return ["c2kd", *args]


def _done(output: Path) -> bool:
    """An output exists (a cache counts once its manifest says it is complete)."""
    if output.name == "manifest.json":
        return output.is_file() and json.loads(output.read_text()).get("complete") is True
    return output.exists()


def flat_metrics(split_metrics: dict) -> dict[str, float]:
    """One split's metrics as {"group/metric": value} over METRICS."""
    return {f"{g}/{m}": split_metrics[g][m] for g, m in METRICS}


def by_metric(runs: list[dict[str, float]]) -> dict[str, list[float]]:
    """Flattened metrics of several runs (seeds) as one list per metric, in run order."""
    return {key: [run[key] for run in runs] for key in runs[0]}


def student_metrics(run: Path, split: str = "test") -> dict[str, float]:
    """A distilled student's metrics on `split` (its distill.json), flattened."""
    metrics = json.loads((run / "distill.json").read_text())["metrics"]
    if split not in metrics:
        raise SystemExit(f"{run}: no {split} metrics in its distill.json (a run made before they were recorded)")
    return flat_metrics(metrics[split])


class StepClock:
    """Seconds per finished step and the wall time of the whole tier, summed over resumed runs, in
    OUT/timings.json; a step skipped because its output exists costs nothing and is not re-timed.

    A run killed mid-step (a session's end) loses at most HEARTBEAT_S: every HEARTBEAT_S the file
    takes the wall time so far and, under "running", the seconds each unfinished step has run; the
    next run carries those into the wall time and into the step's seconds when it finishes."""

    HEARTBEAT_S = 30.0

    def __init__(self, path: Path):
        self.path, self.lock, self.started = path, threading.Lock(), time.perf_counter()
        self.record = json.loads(path.read_text()) if path.exists() else {"wall_s": 0.0, "steps_s": {}}
        self.before = self.record["wall_s"]
        self.carried: dict[str, float] = self.record.pop("running", {})  # steps a killed run had begun
        self.active: dict[str, float] = {}
        threading.Thread(target=self._beat, daemon=True).start()

    @contextmanager
    def timing(self, name: str) -> Iterator[None]:
        with self.lock:
            self.active[name] = time.perf_counter()
        yield
        with self.lock:
            start = self.active.pop(name)
            self.record["steps_s"][name] = round(self.carried.pop(name, 0.0) + time.perf_counter() - start, 1)
            self._write()

    def _write(self) -> None:
        now = time.perf_counter()
        self.record["wall_s"] = round(self.before + now - self.started, 1)
        running = self.carried | {n: self.carried.get(n, 0.0) + now - s for n, s in self.active.items()}
        self.record.pop("running", None)
        if running:
            self.record["running"] = {n: round(v, 1) for n, v in running.items()}
        write_json(self.path, self.record)  # whole or not at all: a run may be killed mid-write

    def _beat(self) -> None:
        while True:
            time.sleep(self.HEARTBEAT_S)
            with self.lock:
                if self.active:
                    self._write()


class Bench:
    def __init__(self, args: argparse.Namespace, timings: Path | None = None):
        """`timings`: where the steps' seconds go (default OUT/timings.json, the tier's own; a script
        adding other steps to the folder passes its own file so as not to count them in the tier)."""
        self.args, self.out = args, args.out
        self.data, self.sasrec = self.out / "data", self.out / "sasrec-s0"
        self.commands: dict[str, list[str]] = {}
        self.log = self.out / "commands.log"
        self.clock = StepClock(timings or self.out / "timings.json")
        self.seeds = {name: fam["seeds"] for name, fam in FAMILIES.items()} | {"gemma": list(range(args.gemma_seeds))}

    def step(self, name: str, output: Path, args: list[str], threads: int = 2) -> None:
        """Run a command unless its output exists; remember the command either way."""
        self.commands[name] = ["c2kd", *args]
        if not _done(output):
            print(f"== {name}", flush=True)
            with self.clock.timing(name):
                c2kd(args, self.log, threads)

    def data_and_sasrec(self, seeds: tuple[int, ...] = (0, 1, 2)) -> None:
        self.step("prepare", self.data, ["prepare", "movielens-100k", "--out", str(self.data), "--max-train-per-user", "5"])
        for seed in seeds:
            run = self.out / f"sasrec-s{seed}"
            self.step(f"sasrec-s{seed}", run, ["train-sasrec", "--data", str(self.data), "--out", str(run), "--seed", str(seed)])

    def quick(self) -> list[str]:
        return ["--max-train", "64", "--max-val", "32"] if self.args.quick else []

    def common(self) -> list[str]:
        return ["--data", str(self.data), "--format", "ids", "--item-head", "hybrid", "--no-progress", *self.quick()]

    def run_folder(self, name: str, label: str, seed: int) -> Path:
        """Where the family's student `label` (a method, maybe with a suffix) of one seed lives."""
        return self.out / name / f"{label.replace(' ', '-')}-s{seed}"

    def teacher(self, name: str) -> None:
        """The family's teacher fine-tuned, its test metrics, and the cache of its train split."""
        a, fam, root = self.args, FAMILIES[name], self.out / name
        root.mkdir(parents=True, exist_ok=True)
        self.step(f"{name}/teacher", root / "teacher", [
            "train-teacher", *self.common(), "--sasrec", str(self.sasrec), "--out", str(root / "teacher"),
            "--model", fam["alias"], "--lr", str(a.teacher_lr),
            "--epochs", str(1 if a.quick else a.teacher_epochs or fam["teacher_epochs"]), "--batch-size", "32",
            "--checkpoint-every", "25", *self.history_loss(), *self.sasrec_kd(), *self.bf16()])
        self.step(f"{name}/teacher-test", root / "teacher-test.json", [
            "evaluate", "--model", str(root / "teacher"), "--data", str(self.data), "--split", "test",
            "--out", str(root / "teacher-test.json")])
        self.step(f"{name}/cache", root / "cache" / "manifest.json", [
            "cache-teacher", "--teacher", str(root / "teacher"), "--data", str(self.data), "--out", str(root / "cache"),
            "--splits", "train", "--layers", ",".join(map(str, cached_layers(name))), "--no-progress"])

    def history_loss(self) -> list[str]:
        """The teacher's next-history-item loss weight, when the run asks for one."""
        return ["--history-loss", str(self.args.history_loss)] if self.args.history_loss else []

    def sasrec_kd(self) -> list[str]:
        """The teacher's SASRec distillation weight, when the run asks for one (the students never get it)."""
        return ["--sasrec-kd", str(self.args.teacher_sasrec_kd)] if self.args.teacher_sasrec_kd else []

    def bf16(self) -> list[str]:
        """bfloat16 autocast for every training command (teacher and students), when the run asks for it."""
        return ["--bf16"] if self.args.bf16 else []

    def student_args(self) -> list[str]:
        a = self.args
        return ["--lr", str(a.student_lr), "--epochs", str(1 if a.quick else a.student_epochs), "--batch-size", "32",
                *self.bf16()]

    def distill_job(self, name: str, label: str, flags: list[str], seed: int) -> tuple:
        """(step name, output folder, command) of one student distilled from the family's cache."""
        root, keep, run = self.out / name, f"first:{FAMILIES[name]['keep']}", self.run_folder(name, label, seed)
        return (f"{name}/{label}-s{seed}", run, [
            "distill", "--cache", str(root / "cache"), "--data", str(self.data), "--out", str(run),
            "--student", FAMILIES[name]["alias"], "--shrink", keep, "--item-head", "hybrid", "--seed", str(seed),
            "--no-progress", *self.student_args(), *flags, *self.quick()])  # flags last: they may override

    def alone_job(self, name: str, label: str, seed: int, flags: list[str] | None = None) -> tuple:
        """(step name, output folder, command) of one student trained alone (`train-teacher --shrink`)."""
        fam, run = FAMILIES[name], self.run_folder(name, label, seed)
        return (f"{name}/{label}-s{seed}", run, [
            "train-teacher", *self.common(), "--sasrec", str(self.sasrec), "--out", str(run), "--model", fam["alias"],
            "--shrink", f"first:{fam['keep']}", "--seed", str(seed), *self.student_args(), *(flags or [])])

    def run_jobs(self, jobs: list[tuple]) -> None:
        with ThreadPoolExecutor(max_workers=2) as pool:  # small students: two at a time, one thread each
            for done in [pool.submit(self.step, n, o, c, 1) for n, o, c in jobs]:
                done.result()

    def method_flags(self, name: str, method: str) -> list[str]:
        """The distill flags of a method's students: the method, the family's support of the logit losses
        (or the run's --kd-over) for those that have them, and C2KD's candidate layers in the shared cache."""
        support = self.args.kd_over or FAMILIES[name]["kd_over"]
        flags = [*METHODS[method], *(["--kd-over", support] if method in WITH_LOGIT_LOSSES and support != "vocab" else [])]
        if method == "C2KD":
            flags += ["--router-layers", ",".join(map(str, late_layers(FAMILIES[name]["layers"])))]
        return flags

    def student_jobs(self, name: str, first: int, end: int) -> list[tuple]:
        """The family's students of its seeds[first:end] (at most --max-seeds, or 1 under --quick, in all),
        in TRAIN_ORDER per seed; finished ones are skipped when run."""
        jobs = []
        for seed in self.seeds[name][first: min(end, 1 if self.args.quick else self.args.max_seeds)]:
            for method in TRAIN_ORDER:
                if method == "student alone":
                    jobs.append(self.alone_job(name, "student-alone", seed))
                    if self.args.history_loss:  # the teacher's objective given to the student alone too
                        jobs.append(self.alone_job(name, "student-alone-history", seed, self.history_loss()))
                else:
                    jobs.append(self.distill_job(name, method, self.method_flags(name, method), seed))
        return jobs

    def train(self) -> None:
        """Every phase of PHASES for the run's families: the teachers, then the students in one pool."""
        for phase in PHASES:
            active = [(name, first, end) for name, first, end in phase if name in self.args.families]
            for name, _, _ in active:
                self.teacher(name)
            self.run_jobs([job for name, first, end in active for job in self.student_jobs(name, first, end)])

    def timed(self, name: str) -> None:
        """Batch-1 latency (teacher vs student, interleaved) and parameters; alone, one thread."""
        root = self.out / name
        path = root / "latency.json"
        self.commands[f"{name}/latency"] = ["python", "benchmarks/real_llm.py", "--out", str(self.out)]
        if path.exists():
            return
        print(f"== {name}/latency", flush=True)
        code = (
            "import json, sys, torch; torch.set_num_threads(1)\n"
            "from c2kd.latency import interleaved_latency, reclm_request\n"
            "from c2kd.data.examples import load_examples\n"
            "from c2kd.recmodel.model import RecLM\n"
            f"ex = load_examples({str(self.data)!r}); test = ex.split('test')\n"
            f"models = {{'teacher': RecLM.load({str(root / 'teacher')!r}).eval(), "
            f"'student': RecLM.load({str(self.run_folder(name, 'student-alone', 0))!r}).eval()}}\n"  # every student has this shape
            "reqs = {k: reclm_request(m, test, ex.titles()) for k, m in models.items()}\n"
            f"ms = interleaved_latency(reqs, {10 if self.args.quick else 100})\n"
            "out = {k: {'latency_ms': ms[k], 'non_embedding_parameters': m.non_embedding_parameters(),\n"
            "           'parameters': sum(p.numel() for p in m.parameters())} for k, m in models.items()}\n"
            f"open({str(path)!r}, 'w').write(json.dumps(out, indent=2))\n"
        )
        with self.clock.timing(f"{name}/latency"):
            subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def head_step(self) -> None:
        """A student step with the head at the answer positions only ÷ with it everywhere (timed, alone)."""
        path = self.out / "head_step.json"
        cmd = [sys.executable, str(Path(__file__).with_name("head_step.py")), "--data", str(self.data), "--sasrec",
               str(self.sasrec), "--json", str(path), "--families", *self.args.families]
        self.commands["head_step"] = ["python", "benchmarks/head_step.py", *cmd[3:]]
        if not path.exists():
            print("== head_step", flush=True)
            with self.clock.timing("head_step"):
                subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def summary(self) -> dict:
        sasrec = [flat_metrics(json.loads((self.out / f"sasrec-s{s}" / "metrics.json").read_text())["test"])
                  for s in (0, 1, 2)]
        result = {"sasrec": by_metric(sasrec), "families": {},
                  "commands": self.commands, "settings": vars(self.args) | {"out": str(self.out)},
                  "timings": self.clock.record}
        for name in self.args.families:
            root, seeds = self.out / name, self.seeds[name][: 1 if self.args.quick else None]
            if not (root / "teacher-test.json").exists():
                continue
            fam: dict = {"rows": {}}
            fam["rows"]["teacher"] = by_metric([flat_metrics(json.loads((root / "teacher-test.json").read_text()))])
            runs = {"student alone": ("student-alone", "train.json"),
                    "student alone, history loss": ("student-alone-history", "train.json")}
            runs.update({m: (m, "distill.json") for m in METHODS})
            for label, (folder, record) in runs.items():
                done = [(s, run) for s, run in ((s, self.run_folder(name, folder, s)) for s in seeds)
                        if (run / record).exists()]
                if record == "train.json":
                    done = [(s, d) for s, d in done if (d / "metrics-test.json").exists()]
                metrics = [flat_metrics(json.loads((d / "metrics-test.json").read_text())) if record == "train.json"
                           else student_metrics(d) for _, d in done]
                if metrics:  # the seeds beside the values: methods are paired by seed, not by list position
                    fam["rows"][label] = {**by_metric(metrics), "seeds": [s for s, _ in done]}
            if (root / "latency.json").exists():
                fam["latency"] = json.loads((root / "latency.json").read_text())
            fam["goals"] = goals(result["sasrec"], fam["rows"])
            result["families"][name] = fam
        if (self.out / "head_step.json").exists():
            result["head_step"] = json.loads((self.out / "head_step.json").read_text())
        return result

    def student_tests(self) -> None:
        """Test metrics of the students trained alone (train-teacher selects on validation only)."""
        for name in self.args.families:
            for seed in self.seeds[name]:
                for run in (self.run_folder(name, label, seed) for label in ("student-alone", "student-alone-history")):
                    if (run / "train.json").exists():
                        self.step(f"{name}/{run.name}-test", run / "metrics-test.json", [
                            "evaluate", "--model", str(run), "--data", str(self.data), "--split", "test",
                            "--out", str(run / "metrics-test.json")])


def cached_layers(name: str) -> list[int]:
    """The teacher layers a family's cache holds: the late layers C2KD's router chooses among (DESIGN §3)
    and the early ones feature KD's uniform map pairs with student layer i, round(i·L_t/L_s); one teacher
    pass serves every student (two caches, one per layer set, took 261 + 285 s for Gemma)."""
    fam = FAMILIES[name]
    uniform = uniform_layer_map(fam["keep"], fam["layers"], range(1, fam["layers"] + 1)).values()
    return sorted({*late_layers(fam["layers"]), *uniform})


def hr1_by_seed(row: dict) -> dict[int, float]:
    """A row's test HR@1 keyed by seed (its "seeds"; rows recorded before they were kept held seeds 0, 1, ... in order)."""
    values = row["candidates/HR@1"]
    seeds = row.get("seeds", list(range(len(values))))
    if len(seeds) != len(values):
        raise ValueError(f"a row with {len(values)} HR@1 values and {len(seeds)} seeds")
    return dict(zip(seeds, values))


def goals(sasrec: dict, rows: dict) -> dict:
    """The issue's goals on test HR@1, measured and stated plainly."""
    hr = {k: statistics.mean(v["candidates/HR@1"]) for k, v in rows.items()}
    out: dict = {}
    if "teacher" in hr:
        out["teacher >= SASRec"] = {"teacher": hr["teacher"], "SASRec": statistics.mean(sasrec["candidates/HR@1"]),
                                    "holds": hr["teacher"] >= statistics.mean(sasrec["candidates/HR@1"])}
    if {"teacher", "student alone"} <= set(hr):
        ratio = hr["teacher"] / hr["student alone"]
        out["teacher >= 1.15 x student alone"] = {"ratio": ratio, "holds": ratio >= 1.15}
    if {"teacher", "C2KD"} <= set(hr):
        share = hr["C2KD"] / hr["teacher"]
        out["C2KD >= 95% of teacher"] = {"share": share, "holds": share >= 0.95}
    if {"C2KD", "SFT from cache"} <= set(hr):
        ratio = hr["C2KD"] / hr["SFT from cache"]
        out["C2KD >= 1.2 x SFT student"] = {"ratio": ratio, "holds": ratio >= 1.2}
    if {"C2KD", "logit KD"} <= set(hr):
        c2kd, logit = hr1_by_seed(rows["C2KD"]), hr1_by_seed(rows["logit KD"])
        paired = sorted(c2kd.keys() & logit.keys())  # only the seeds both methods ran
        if paired:
            diffs = [c2kd[s] - logit[s] for s in paired]
            out["C2KD - logit KD (paired over seeds)"] = {
                "seeds": paired, "differences": diffs, "mean": statistics.mean(diffs),
                "std": statistics.stdev(diffs) if len(diffs) > 1 else None}
    return out


def markdown(result: dict) -> str:
    lines = []
    sasrec = result["sasrec"]
    for name, fam in result["families"].items():
        lines += [f"### {FAMILIES[name]['alias']}", "",
                  "| model | n | test HR@1 | NDCG@10 | MRR | full-catalog NDCG@10 |", "|---|---|---|---|---|---|",
                  "| SASRec | 3 | " + " | ".join(mean_std(sasrec[f"{g}/{m}"]) for g, m in METRICS) + " |"]
        for label, row in fam["rows"].items():
            n = len(row["candidates/HR@1"])
            lines.append(f"| {label} | {n} | " + " | ".join(mean_std(row[f"{g}/{m}"]) for g, m in METRICS) + " |")
        if "latency" in fam:
            t, s = fam["latency"]["teacher"], fam["latency"]["student"]
            lines += ["", f"non-embedding parameters: teacher {t['non_embedding_parameters']:,}, student "
                          f"{s['non_embedding_parameters']:,} ({t['non_embedding_parameters'] / s['non_embedding_parameters']:.1f}x fewer); "
                          f"batch-1 latency {t['latency_ms']:.1f} / {s['latency_ms']:.1f} ms "
                          f"(student ÷ teacher {s['latency_ms'] / t['latency_ms']:.2f})"]
        lines += ["", "| goal | measured | holds |", "|---|---|---|"]
        for goal, value in fam["goals"].items():
            shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in value.items() if k != "holds"}
            lines.append(f"| {goal} | {shown} | {value.get('holds', '–')} |")
        lines.append("")
    if result.get("timings", {}).get("steps_s"):
        lines += [f"The tier's wall time: {result['timings']['wall_s'] / 60:.0f} min (summed over resumed runs; "
                  "per-step seconds in timings.json).", ""]
    for name, h in result.get("head_step", {}).items():
        lines.append(f"{h['model']}: a student step with the head at the answer positions only takes {h['ratio']:.2f}x "
                     f"the time of one with the head everywhere (vocabulary {h['vocabulary']:,}, batch {h['batch']}).")
    return "\n".join(lines)


def kept_from_earlier(result: dict, path: Path) -> dict:
    """The families (and their commands) an earlier run summarised in this folder and this run, naming fewer
    --families, did not: one family added to a folder must not drop another's table."""
    if not path.exists():
        return result
    earlier = json.loads(path.read_text())
    others = {name: fam for name, fam in earlier["families"].items() if name not in result["families"]}
    commands = {k: v for k, v in earlier["commands"].items() if k.split("/")[0] in others}
    return result | {"families": others | result["families"], "commands": commands | result["commands"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/real_llm"))
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--teacher-lr", type=float, default=1e-4)
    parser.add_argument("--teacher-epochs", type=int, default=None, help="default: the family's (see FAMILIES)")
    parser.add_argument("--student-lr", type=float, default=3e-4)
    parser.add_argument("--student-epochs", type=int, default=3)
    parser.add_argument("--history-loss", type=float, default=0.0, help="the teacher's next-history-item loss weight "
                        "(train-teacher --history-loss); the students alone are also trained with it, as an extra row")
    parser.add_argument("--teacher-sasrec-kd", type=float, default=0.0, help="train the teacher with "
                        "train-teacher --sasrec-kd W (SASRec seed 0's catalog distribution distilled into its answer item)")
    parser.add_argument("--kd-over", choices=("vocab", "items"), default=None, help="the logit losses' support for "
                        "every family (distill --kd-over); default: the family's (see FAMILIES: the item tokens "
                        "for both; the paper's is the vocabulary)")
    parser.add_argument("--max-seeds", type=int, default=3, help="train at most this many seeds per family now "
                        "(a later run without it adds the rest)")
    parser.add_argument("--gemma-seeds", type=int, default=1, choices=(1, 2, 3), help="seeds of Gemma's students "
                        "(the tier's 3-hour budget holds for 1; each further seed adds about 40 minutes under --bf16 "
                        "on the AMX machine)")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="train the teacher and "
                        "the students under bfloat16 autocast (--bf16 of train-teacher and distill, their validation "
                        "too); caches, test evaluations and the timed steps stay float32. On by default: it keeps the "
                        "tier under 3 hours on a 2-core CPU with AMX (141 min against 220 in float32; slower on CPUs "
                        "with only AVX512-BF16, see README); --no-bf16 for float32 (the README's main tables, and CPUs "
                        "without bf16 arithmetic)")
    parser.add_argument("--quick", action="store_true", help="a smoke run on tiny subsets (the numbers mean nothing)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    started = time.perf_counter()
    bench.data_and_sasrec()
    bench.train()
    bench.student_tests()
    for name in args.families:
        bench.timed(name)
    bench.head_step()
    result = kept_from_earlier(bench.summary(), args.out / "summary.json")
    result["seconds_this_run"] = round(time.perf_counter() - started)
    result["machine"] = cpu_description()  # of this run; a resumed tier may have trained earlier steps elsewhere
    write_result(args.out / "summary.json", result)
    (args.out / "summary.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
