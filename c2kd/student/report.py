"""What a finished `distill` run leaves behind: distill.json, metrics.json, predictions.parquet, the logs and distill.png."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from c2kd.atomic import write_json
from c2kd.cache_schema import TeacherCache
from c2kd.data.examples import ExampleSet
from c2kd.predictions import PREDICTIONS_FILE, write_predictions
from c2kd.recmodel.model import RecLM
from c2kd.run_folder import publish
from c2kd.student.diagnostics import gradient_shares
from c2kd.training import COUNT_PREFIX, TrainConfig, TrainResult, read_log

DISTILL_KIND = "c2kd-distill"
DISTILL_VERSION = 1
PLOT_FILE = "distill.png"


def epoch_diagnostics(model: Any, batch: Any, weights: dict[str, float]) -> Callable[[int, dict], dict | None]:
    """Trainer hook, for the epoch line of the log: the router's layer choices of the epoch (the
    `count/router_layer_L` terms the trainer summed over the epoch and the ranks) with their entropy,
    and each weighted loss term's share of the gradient norm on one fixed `batch`."""
    layers = model.router_layers

    def hook(epoch: int, stats: dict) -> dict | None:
        extra = {}
        if layers:
            counts = {str(l): int(round(stats.pop(f"{COUNT_PREFIX}router_layer_{l}", 0.0))) for l in layers}
            extra |= {"router_counts": counts, "router_entropy": choice_entropy(counts.values())}
        if sum(w > 0 for w in weights.values()) > 1:  # one term alone has all of the gradient
            extra |= gradient_shares(model, batch.to(model.teacher_head.device), weights)
        return extra or None

    return hook


def choice_entropy(counts: Iterable[int]) -> float:
    """Entropy (nats) of the router's choices: 0 when one layer takes every example, ln K when K share them evenly."""
    p = np.array([c for c in counts if c > 0], dtype=np.float64)
    p = p / max(p.sum(), 1.0)
    return float(abs((p * np.log(p)).sum())) if p.size else 0.0  # abs: one layer gives 0.0, not -0.0


def distill_record(recipe: Any, cache: TeacherCache, cache_path: str, model: Any, examples: ExampleSet,
                   train_examples: int, evaluator: Any, config: TrainConfig, stage1: TrainResult | None,
                   result: TrainResult, layer_map: dict[int, int] | None) -> dict:
    """The content of distill.json (without the final metrics, which rank 0 adds)."""
    spec, student = cache.spec, model.student
    return {
        "kind": DISTILL_KIND, "version": DISTILL_VERSION, "recipe": asdict(recipe),
        "cache": {"path": cache_path, "content_id": cache.content_id, "digest": cache.digest, "layers": list(spec.layers), "positions": spec.positions, "logits": str(spec.logits),
                  "dtype": spec.dtype, "teacher": spec.teacher_description, "teacher_fingerprint": spec.teacher_fingerprint,
                  "spec_hash": spec.spec_hash},
        "student": {"source": recipe.student, "shrink": recipe.shrink, "base": student.spec.base,
                    "layers": student.num_layers, "hidden_size": student.hidden_size,
                    "distilled_layer": model.student_layer, "non_embedding_parameters": student.non_embedding_parameters()},
        "feature_kd_layer_map": {str(k): v for k, v in (layer_map or {}).items()} or None,
        "data": {"dir": str(examples.root), "fingerprint": examples.fingerprint, "train_examples": train_examples,
                 "validation_examples": evaluator.frame.height},
        "train": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items() if k != "out_dir"},
        "stage1_steps": stage1.final_step if stage1 else 0,
        "validation": {"select_metric": recipe.select_metric, "best_step": result.best_step, "best": result.best_metrics},
        "final_step": result.final_step,
        "timings": {"stage1_s": round(stage1.total_train_s, 3) if stage1 else 0.0,
                    "train_s": round(result.total_train_s, 3), "resumed_from_step": result.resumed_from},
    }


def run_diagnostics(probes: dict | None, stage2_dir: Path) -> dict:
    """Whether C2KD's parts did their job (distill.json's `diagnostics`): stage 1's probes on held-out
    examples against chance and the teacher, the router's choices per epoch with their entropy, and
    each loss term's mean and gradient share per epoch."""
    epochs = read_log(stage2_dir, "epoch")
    out: dict = {"epochs": [{k: v for k, v in r.items() if k not in ("kind", "step")} for r in epochs]}
    if probes:
        layers = sorted(int(k.rsplit("_", 1)[1]) for k in probes if k.startswith("HR@1_layer_"))
        out["stage1"] = {"layers": {str(l): {"ce": probes[f"ce_layer_{l}"], "HR@1": probes[f"HR@1_layer_{l}"]} for l in layers},
                         **{k: probes[k] for k in ("teacher_HR@1", "chance_HR@1", "chance_ce", "probe_HR@1_best")}}
    return out


def diagnostics_line(record: dict) -> str:
    """One line for the end of `distill`: what the probes, the router and each term's gradient did."""
    diag = record.get("diagnostics") or {}
    parts = []
    if "stage1" in diag:
        s1 = diag["stage1"]
        best = max(s1["layers"].items(), key=lambda kv: kv[1]["HR@1"])
        parts.append(f"probes HR@1 {min(v['HR@1'] for v in s1['layers'].values()):.3f}-{best[1]['HR@1']:.3f} (best layer "
                     f"{best[0]}; chance {s1['chance_HR@1']:.3f}, teacher {s1['teacher_HR@1']:.3f})")
    last = (diag.get("epochs") or [{}])[-1]
    if "router_counts" in last:
        counts = last["router_counts"]
        used = ", ".join(f"{l}: {c}" for l, c in counts.items() if c)
        parts.append(f"router (last epoch) {used}, entropy {last['router_entropy']:.2f}")
    shares = {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith("grad_share/")}
    if shares:
        parts.append("gradient shares " + ", ".join(f"{k} {v:.0%}" for k, v in shares.items()))
    return "; ".join(parts)


_NOT_TERMS = {"kind", "step", "epoch", "lr", "grad_norm", "examples_per_s", "tokens_per_s"}  # the rest of a train line


def finish(student: RecLM, work: Path, out: Path, record: dict, overwrite: bool, keep_checkpoints: bool,
           predictions: Sequence[pl.DataFrame] = ()) -> None:
    """Save the selected student with its records, per-example results (`predictions`: one frame per
    evaluated split, c2kd.predictions) and plot, then rename it into place at `out`."""
    staged = student.save(work / "model")
    shutil.copyfile(work / "stage2" / "log.jsonl", staged / "log.jsonl")
    if (work / "stage1" / "log.jsonl").exists():
        shutil.copyfile(work / "stage1" / "log.jsonl", staged / "stage1_log.jsonl")
    write_json(staged / "distill.json", record)
    write_json(staged / "metrics.json", record["metrics"])
    if predictions:
        write_predictions(staged / PREDICTIONS_FILE, predictions)
    plot_run(staged, record)
    publish(staged, out, work, overwrite, keep_work=keep_checkpoints)


def plot_run(run_dir: Path, record: dict) -> Path:
    """distill.png: loss terms per step, router layer choices per epoch, each term's gradient share per
    epoch, validation metric; the stage-1 probes' summary in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train_lines, epochs, evals = (read_log(run_dir, kind) for kind in ("train", "epoch", "eval"))
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    ax = axes[0]
    logged = [k for k in (train_lines[0] if train_lines else {}) if k not in _NOT_TERMS and "/" not in k]
    for term in logged:
        points = [(r["step"], r[term]) for r in train_lines if term in r]
        if points:
            ax.plot(*zip(*points), label=term)
    ax.set(title="training loss terms", xlabel="optimizer step", yscale="log")
    ax.legend()

    ax = axes[1]
    counted = [r for r in epochs if "router_counts" in r]
    if counted:
        layers = list(counted[0]["router_counts"])
        bottom = np.zeros(len(counted))
        for layer in layers:
            share = np.array([r["router_counts"][layer] / max(1, sum(r["router_counts"].values())) for r in counted])
            ax.bar([r["epoch"] + 1 for r in counted], share, bottom=bottom, label=f"layer {layer}")
            bottom += share
        ax.set(title="router: teacher layer chosen (share of examples)", xlabel="epoch", ylim=(0, 1),
               xticks=[r["epoch"] + 1 for r in counted])
        ax.legend()
    else:
        ax.text(0.5, 0.5, f"no router (method {record['recipe']['method']})", ha="center", va="center")
        ax.set_axis_off()

    ax = axes[2]
    shared = [r for r in epochs if any(k.startswith("grad_share/") for k in r)]
    if shared:
        terms = [k for k in shared[0] if k.startswith("grad_share/")]
        bottom = np.zeros(len(shared))
        for term in terms:
            share = np.array([r.get(term, 0.0) for r in shared])
            ax.bar([r["epoch"] + 1 for r in shared], share, bottom=bottom, label=term.split("/", 1)[1])
            bottom += share
        ax.set(title="share of the gradient norm per weighted term", xlabel="epoch", ylim=(0, 1),
               xticks=[r["epoch"] + 1 for r in shared])
        ax.legend()
    else:
        ax.text(0.5, 0.5, "one loss term: all of the gradient", ha="center", va="center")
        ax.set_axis_off()

    ax = axes[3]
    metric = record["validation"]["select_metric"]
    points = [(r["step"], r[metric]) for r in evals if metric in r]
    if points:
        ax.plot(*zip(*points), marker="o")
    ax.set(title=f"validation {metric}", xlabel="optimizer step")
    line = diagnostics_line(record)
    fig.suptitle(f"distill {record['recipe']['method']} (router {record['recipe']['router']})" + (f"\n{line}" if line else ""))
    fig.tight_layout()
    path = run_dir / PLOT_FILE
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
