"""`c2kd demo`: the whole pipeline on MovieLens-100k, small, in minutes on a CPU (timings: docs/RESULTS.md).

prepare → SASRec → teacher (pretrained SmolLM2-135M, or Gemma-3-270M with `--family`; `ids`, hybrid
item head) → teacher cache → a student trained alone from the cache (SFT) and a C2KD student (with
the own-head logit term, `--w-own-logit`, its logit losses over the item tokens), both of the same
pretrained family and size → evaluation on the test split → a comparison table (quality, share of
the teacher-student gap the distilled student recovers, parameters, per-request latency) → the C2KD
student exported to ONNX, recommending to one user with onnxruntime alone. Everything goes under one
run folder.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from c2kd.deploy.export import export_ranker
from c2kd.deploy.recommend import rank, user_request
from c2kd.errors import C2KDError
from c2kd.evaluate import evaluate_reclm
from c2kd.hardware import cpu_description, native_bf16
from c2kd.latency import interleaved_latency, reclm_request, sasrec_request
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, cache_teacher
from c2kd.data.examples import load_examples
from c2kd.data.prepare import prepare
from c2kd.sasrec.train import SASRecTrainConfig, evaluate_sasrec, load_sasrec, train_sasrec
from c2kd.finetune.teacher import TeacherRecipe, train_teacher
from c2kd.recmodel.model import RecLM
from c2kd.student.distill import DistillRecipe, distill, recipe_preset

console = Console()


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of the demo run; the defaults were chosen to fit in a few minutes on two CPU cores."""

    seed: int = 0
    max_train_per_user: int = 3  # train windows per user (the most recent ones)
    sasrec_epochs: int = 20  # its best validation state at 30 epochs was epoch 20's
    # SmolLM2-135M whole, on 512 examples (16 steps): on validation the whole model beat a shallower
    # teacher trained on more examples, and 512 examples keep the demo short on a CPU without AMX
    teacher: str = "smollm2-135m"
    teacher_shrink: str | None = None
    teacher_epochs: int = 1
    teacher_lr: float = 1e-4
    teacher_max_train: int | None = 512
    # train-teacher --sasrec-kd: SASRec's catalog distribution distilled into the teacher; 4.0 lifted
    # the teacher and the C2KD student over 3 demo seeds (docs/RESULTS.md, the demo)
    teacher_sasrec_kd: float = 4.0
    student: str = "smollm2-135m"
    student_shrink: str | None = "first:2"  # about 15x fewer non-embedding parameters than the teacher
    student_epochs: int = 3
    student_lr: float = 1e-3
    student_max_train: int | None = 512  # the examples the teacher trained on, cached
    # the C2KD student's recipe: `distill --recipe default` (DEFAULT_RECIPES, chosen on validation on
    # this demo's pair by `c2kd tune`; benchmarks/results/c2kd_parts/demo.json)
    # the C2KD student's `--kd-over`: its logit losses over the item tokens, not the whole vocabulary:
    # faster at the same test HR@1 (docs/RESULTS.md, the demo's students)
    kd_over: str = "items"
    max_val: int | None = 200  # validation examples that select the best state
    batch_size: int = 32
    latency_requests: int = 30
    # bfloat16 autocast for the teacher's and the students' training and the validation that selects
    # their best states (the table's test metrics stay float32). None: on where `native_bf16()` says so
    bf16: bool | None = None


def _step(title: str) -> float:
    console.rule(f"[bold]{title}")
    return time.perf_counter()


def run_demo(out: Path | None = None, settings: DemoSettings = DemoSettings()) -> dict:
    """Run every stage into `out` (default runs/demo-<time>) and return the comparison rows."""
    run = Path(out) if out is not None else Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    if run.exists() and any(run.iterdir()):
        raise C2KDError(f"{run} exists and is not empty; choose another --out")
    run.mkdir(parents=True, exist_ok=True)
    console.print(f"run folder: [bold]{run}[/]")
    s = settings
    torch.manual_seed(s.seed)
    timings: dict[str, float] = {}
    bf16 = native_bf16() if s.bf16 is None else s.bf16
    train_common = {"batch_size": s.batch_size, "seed": s.seed, "checkpoint_every": 10_000, "warmup_ratio": 0.05,
                    "bf16": bf16}
    console.print(f"training and validation in {'bfloat16 autocast' if bf16 else 'float32'}; test metrics in float32")

    t = _step("1/7 prepare MovieLens-100k")
    prepare("movielens-100k", run / "data", seed=s.seed, max_train_per_user=s.max_train_per_user)
    examples = load_examples(run / "data")
    st = examples.manifest["stats"]
    console.print(f"{st['users']} users, {st['items']} items, {st['interactions']} interactions → "
                  f"{st['train']} train / {st['validation']} validation / {st['test']} test examples")
    timings["prepare"] = time.perf_counter() - t

    t = _step("2/7 SASRec (baseline and item embeddings)")
    train_sasrec(examples, run / "sasrec", SASRecTrainConfig(seed=s.seed, epochs=s.sasrec_epochs), progress=True)
    timings["sasrec"] = time.perf_counter() - t

    t = _step(f"3/7 teacher ({s.teacher}{' ' + s.teacher_shrink if s.teacher_shrink else ''}, ids format)")
    train_teacher(examples, run / "sasrec", run / "teacher",
                  TeacherRecipe(fmt="ids", model=s.teacher, shrink=s.teacher_shrink, max_train=s.teacher_max_train,
                                max_val=s.max_val, sasrec_kd=s.teacher_sasrec_kd),
                  {**train_common, "epochs": s.teacher_epochs, "lr": s.teacher_lr})
    timings["teacher"] = time.perf_counter() - t

    t = _step("4/7 stage one: teacher cache (the examples the students train on, and validation ones)")
    # the validation split too: stage 1 of the C2KD student judges its probes there, as `c2kd tune` did
    cache_teacher(run / "teacher", examples, run / "cache",
                  CacheTeacherSettings(splits=("train", "validation"), max_examples=s.student_max_train))
    timings["cache"] = time.perf_counter() - t

    students = {"student alone (SFT)": "sft", "C2KD student": "c2kd"}
    student_tests = {}  # distill ends by evaluating its student on the test split: not done twice
    for i, (name, method) in enumerate(students.items()):
        # the default recipe and the logit support go to the C2KD student only (SFT has no such terms)
        terms = {**recipe_preset("default", "c2kd"), "kd_over": s.kd_over} if method == "c2kd" else {}
        flags = f" (the default recipe, --kd-over {s.kd_over})" if terms else ""
        t = _step(f"{5 + i}/7 stage two: {name}{flags}, from the cache only")
        record = distill(run / "cache", examples, run / f"student-{method}",
                         DistillRecipe(method=method, student=s.student, shrink=s.student_shrink,
                                       max_train=s.student_max_train, max_val=s.max_val, **terms),
                         {**train_common, "epochs": s.student_epochs, "lr": s.student_lr})
        student_tests[name] = record["metrics"]["test"]["candidates"]
        timings[f"student-{method}"] = time.perf_counter() - t

    t = _step("results (test split, 20 candidates)")  # timed as "evaluation": loads, test metrics, latency
    rows = _compare(run, examples, students, student_tests, s.latency_requests)
    timings["evaluation"] = time.perf_counter() - t
    teacher, alone, c2kd = (rows[k]["HR@1"] for k in ("teacher", "student alone (SFT)", "C2KD student"))
    gap = teacher - alone
    recovered = (c2kd - alone) / gap if gap > 0 else float("nan")
    console.print(f"teacher − student alone: {gap:+.3f} HR@1; the C2KD student recovers {recovered:.0%} of it")

    t = _step("7/7 the C2KD student on a device: ONNX, onnxruntime alone")
    with warnings.catch_warnings():  # the tracer's notes about Python control flow
        warnings.simplefilter("ignore")
        export_ranker(run / "student-c2kd", run / "student-onnx", examples.titles())
    request = user_request(examples, 0)
    titles = examples.titles()
    console.print("user 0 watched: " + "; ".join(titles[i] for i in request.history[-5:]))
    for k, (item, score) in enumerate(rank(run / "student-onnx", request, examples, top=5), 1):
        mark = "  ← watched next" if item == request.target else ""
        console.print(f"  {k}. {titles[item]} ({score:.2f}){mark}")
    timings["export"] = time.perf_counter() - t

    result = {"run": str(run), "settings": {**asdict(s), "bf16": bf16}, "results": rows,
              "gap": {"teacher_minus_student_alone_HR@1": gap, "share_recovered_by_c2kd": recovered},
              "timings_s": {k: round(v, 1) for k, v in timings.items()},
              "machine": {**cpu_description(), "torch_threads": torch.get_num_threads(), "device": "cpu"}}
    (run / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"stage times (s): {result['timings_s']}")
    console.print(f"everything is in [bold]{run}[/] (results.json, each stage's folder)")
    return result


def _compare(run: Path, examples, students: dict[str, str], student_tests: dict[str, dict],
             latency_requests: int) -> dict:
    """Test metrics, parameters and batch-1 latency of SASRec, the teacher and the students (their test
    metrics as distill measured them), as a table."""
    test, titles = examples.split("test"), examples.titles()
    sasrec_model, _ = load_sasrec(run / "sasrec")
    models = {"teacher": RecLM.load(run / "teacher").eval()}
    models.update({name: RecLM.load(run / f"student-{m}").eval() for name, m in students.items()})
    requests = {"SASRec": sasrec_request(sasrec_model, test)}
    requests.update({name: reclm_request(model, test, titles) for name, model in models.items()})
    latency = interleaved_latency(requests, latency_requests)
    rows = {"SASRec": {**evaluate_sasrec(run / "sasrec", examples, "test")["candidates"],
                       "parameters": sum(p.numel() for p in sasrec_model.parameters()), "non_embedding": None}}
    for name, model in models.items():
        metrics = student_tests.get(name) or evaluate_reclm(model, examples, "test", generation=False,
                                                            progress=False)["candidates"]
        rows[name] = {**metrics, "parameters": sum(p.numel() for p in model.parameters()),
                      "non_embedding": model.non_embedding_parameters()}
    for name, row in rows.items():
        row["latency_ms"] = latency[name]
    table = Table()
    for col in ("model", "HR@1", "NDCG@10", "MRR", "parameters", "non-embedding", "latency ms (batch 1)"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, r in rows.items():
        table.add_row(name, f"{r['HR@1']:.3f}", f"{r['NDCG@10']:.3f}", f"{r['MRR']:.3f}", f"{r['parameters']:,}",
                      "-" if r["non_embedding"] is None else f"{r['non_embedding']:,}", f"{r['latency_ms']:.2f}")
    console.print(table)
    return rows
