"""`c2kd tune`: a recipe search from one teacher cache, chosen on validation, tested once.

    space (DistillRecipe fields -> ranges) --Optuna (TPE, study in OUT/study.journal)--> trials
      each trial: `distill` into OUT/trials/<recipe hash>/, scored on the validation split only
      -> the best trial's student evaluated on test -> OUT/tune.json + OUT/tune.md

Several students from one teacher pass is what the cache is for. The study lives in an Optuna
journal file, so an interrupted search resumes (the same command again), and several processes
or machines sharing the folder can run trials of one study at once. A trial's folder is named
by its recipe, so a trial cut short resumes its `distill` from the last checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from c2kd.atomic import check_destination, write_json
from c2kd.cache_schema import TeacherCache
from c2kd.data.examples import ExampleSet, load_examples
from c2kd.errors import C2KDError
from c2kd.evaluate import RecLMEvaluator
from c2kd.recmodel.model import RecLM
from c2kd.student.distill import DistillRecipe, distill

STUDY_FILE, RESULT_FILE, TABLE_FILE = "study.journal", "tune.json", "tune.md"
OBJECTIVES = ("HR@1", "HR@5", "HR@10", "NDCG@5", "NDCG@10", "MRR")

# What each method's weights may be, when no --space is given: the losses' weights on a log scale
# around the paper's 0.5, and C2KD's own options.
DEFAULT_SPACES: dict[str, dict[str, dict]] = {
    "c2kd": {
        "w_logit": {"low": 0.25, "high": 16.0, "log": True},
        "w_feat": {"low": 0.05, "high": 4.0, "log": True},
        "w_own_logit": {"choices": [0.0, 1.0, 4.0, 8.0]},
        # the parts that made C2KD's own terms act on the demo's pair (docs/RESULTS.md, C2KD's parts)
        "router": {"choices": ["top1", "soft:8", "probe"]},
        "student_layer": {"choices": ["penultimate", "last"]},
        "filter_init": {"choices": ["random", "auto"]},
    },
    "logit-kd": {"w_logit": {"low": 0.25, "high": 16.0, "log": True}},
    "feature-kd": {"w_feat": {"low": 0.05, "high": 4.0, "log": True}},
}


_C2KD_ONLY = ("router", "router_layers", "cross_head", "orth", "w_orth", "w_own_logit", "student_layer", "filter_init",
              "stage1_epochs", "stage1_lr", "stage1_holdout")
UNUSED_BY = {  # settings a method ignores: searching them would spend trials on nothing
    "logit-kd": (*_C2KD_ONLY, "w_feat"),
    "feature-kd": (*_C2KD_ONLY, "w_logit", "tau", "kd_over"),
    "sft": (*_C2KD_ONLY, "w_feat", "w_logit", "tau", "kd_over"),
}


@dataclass(frozen=True)
class Dimension:
    """One searched DistillRecipe field: a float range (log or not) or a list of choices."""

    name: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple | None = None

    def suggest(self, trial: Any) -> Any:
        if self.choices is not None:
            return trial.suggest_categorical(self.name, list(self.choices))
        return trial.suggest_float(self.name, self.low, self.high, log=self.log)


def parse_space(space: dict[str, Any], method: str, where: str = "--space") -> tuple[Dimension, ...]:
    """The search space as Dimensions, every field and range checked (one clear line otherwise)."""
    if not isinstance(space, dict) or not space:
        raise C2KDError(f"{where}: the search space is empty; give at least one DistillRecipe field with a range, "
                        'e.g. {"w_logit": {"low": 0.25, "high": 16, "log": true}}')
    known = {f.name for f in fields(DistillRecipe)} - {"method", "student", "shrink"}
    dims = []
    for name, spec in space.items():
        if name not in known:
            raise C2KDError(f"{where}: {name!r} is not a searchable setting (expected among {', '.join(sorted(known))})")
        if not isinstance(spec, dict):
            raise C2KDError(f"{where}: {name}: expected {{\"low\": .., \"high\": ..}} or {{\"choices\": [..]}}, got {spec!r}")
        if "choices" in spec:
            choices = spec["choices"]
            if not isinstance(choices, list) or not choices:
                raise C2KDError(f"{where}: {name}.choices must be a non-empty list, got {choices!r}")
            dims.append(Dimension(name, choices=tuple(choices)))
            continue
        low, high, log = spec.get("low"), spec.get("high"), bool(spec.get("log", False))
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (low, high))
        if not numbers or low > high or (log and low <= 0) or set(spec) - {"low", "high", "log"}:
            raise C2KDError(f"{where}: {name}: expected finite low <= high (low > 0 with log) and no other keys, got {spec!r}")
        dims.append(Dimension(name, float(low), float(high), log))
    unused = [d.name for d in dims if d.name in UNUSED_BY.get(method, ())]
    if unused:
        raise C2KDError(f"{where}: {', '.join(unused)} is not valid for --method {method}: the method does not use it")
    # every corner of the space must be a recipe the method accepts, before any trial runs
    for dim in dims:
        for value in (dim.choices or (dim.low, dim.high)):
            try:
                DistillRecipe(method=method, **{dim.name: value})
            except (C2KDError, TypeError) as e:
                raise C2KDError(f"{where}: {dim.name} = {value!r} is not valid for --method {method}: {e}") from None
    return tuple(dims)


def read_space(path: Path | None, method: str) -> tuple[Dimension, ...]:
    """--space FILE (JSON), or the method's default space."""
    if path is None:
        if method not in DEFAULT_SPACES:
            raise C2KDError(f"--method {method}: nothing to tune by default (methods with a default space: "
                            f"{', '.join(DEFAULT_SPACES)}); give --space FILE")
        return parse_space(DEFAULT_SPACES[method], method, where=f"default space of {method}")
    try:
        space = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise C2KDError(f"--space {path}: cannot read a JSON object ({e})") from None
    return parse_space(space, method, where=f"--space {path}")


def recipe_key(recipe: DistillRecipe, train_config: dict) -> str:
    """A trial's folder name: the hash of everything that makes its student."""
    text = json.dumps({"recipe": asdict(recipe), "train": train_config}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _study(out: Path, identity: dict, seed: int) -> Any:
    """The Optuna study of this folder: created with `identity` (cache, data, method, space, fixed
    settings) or, when it exists, resumed if and only if its identity is the same."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = JournalStorage(JournalFileBackend(str(out / STUDY_FILE)))
    study = optuna.create_study(study_name="c2kd-tune", storage=storage, direction="maximize", load_if_exists=True,
                                sampler=optuna.samplers.TPESampler(seed=seed))
    recorded = study.user_attrs.get("identity")
    if recorded is None:
        study.set_user_attr("identity", identity)
    elif recorded != identity:
        changed = sorted(k for k in set(recorded) | set(identity) if recorded.get(k) != identity.get(k))
        raise C2KDError(f"{out}: holds a study of other settings ({', '.join(changed)} differ); use another --out")
    # A trial cut short (its process killed) stays RUNNING in the journal: run its recipe again as a
    # fresh trial (its distill folder resumes). Only this machine's dead processes' trials: another
    # worker's running trial is left to it.
    for stale in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        host, _, pid = str(stale.user_attrs.get("owner", "")).rpartition(":")
        if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
            study.enqueue_trial(stale.params, skip_if_exists=False)
            study.tell(stale.number, state=optuna.trial.TrialState.FAIL)
    return study


def tune(cache: str | os.PathLike, data: str | Path | ExampleSet, out: str | Path, base: DistillRecipe,
         space: tuple[Dimension, ...], trials: int, train_config: dict | None = None, objective: str = "HR@1",
         seed: int = 0, read_cache: str | Path | None = None, progress: bool = True) -> dict:
    """Search `space` around `base` for `trials` trials (in all, over every run of this study) on the
    validation split; evaluate the best recipe's student on test; write OUT/tune.json and OUT/tune.md."""
    import optuna

    if trials < 1:
        raise C2KDError(f"--trials must be >= 1, got {trials}")
    if objective not in OBJECTIVES:
        raise C2KDError(f"--objective {objective!r}: expected one of {', '.join(OBJECTIVES)}")
    if not space:
        raise C2KDError("the search space is empty")
    out = Path(out)
    check_destination(out)
    examples = data if isinstance(data, ExampleSet) else load_examples(data)
    train_config = {**(train_config or {}), "progress": False}
    opened = TeacherCache.open(cache, expect={"splits": ["train"], "data_fingerprint": examples.fingerprint},
                               read_cache=read_cache)
    base.check_cache(opened.spec)
    identity = {"cache": opened.digest, "data": examples.fingerprint, "base": asdict(base),
                "space": [asdict(d) for d in space], "train": {k: str(v) for k, v in sorted(train_config.items())},
                "objective": objective, "seed": seed}
    out.mkdir(parents=True, exist_ok=True)
    study = _study(out, json.loads(json.dumps(identity, default=str)), seed)
    if not study.trials:
        study.enqueue_trial({d.name: getattr(base, d.name) for d in space if _inside(d, getattr(base, d.name))})

    def run_trial(trial: optuna.Trial) -> float:
        recipe = replace(base, **{d.name: d.suggest(trial) for d in space})
        folder = out / "trials" / recipe_key(recipe, train_config)
        trial.set_user_attr("folder", str(folder.relative_to(out)))
        trial.set_user_attr("owner", f"{socket.gethostname()}:{os.getpid()}")
        record = distill(cache, examples, folder, recipe, train_config, read_cache=read_cache, final_splits=("validation",))
        return float(record["metrics"]["validation"]["candidates"][objective])

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    done = lambda: sum(t.state.is_finished() and t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)  # noqa: E731
    with Progress(TextColumn("[bold]tune"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[best]}"),
                  TimeElapsedColumn(), disable=not progress) as bar:
        task = bar.add_task("tune", total=trials, completed=done(), best="")
        while done() < trials:
            study.optimize(run_trial, n_trials=1, catch=())
            best = f"best validation {objective} {study.best_value:.4f}" if done() else ""
            bar.update(task, completed=done(), best=best)
    return _report(out, study, examples, base, objective)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _inside(dim: Dimension, value: Any) -> bool:
    return value in dim.choices if dim.choices is not None else dim.low <= value <= dim.high


def _report(out: Path, study: Any, examples: ExampleSet, base: DistillRecipe, objective: str) -> dict:
    """Every trial's validation figure and the chosen trial's test figures, read once."""
    import optuna

    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = max(complete, key=lambda t: (t.value, -t.number))
    model = RecLM.load(out / best.user_attrs["folder"])
    test = RecLMEvaluator(examples, "test", progress=False).evaluate(model)
    record = {
        "method": base.method, "objective": f"validation {objective}",
        "trials": [{"number": t.number, "params": t.params, f"validation_{objective}": t.value,
                    "folder": t.user_attrs["folder"]} for t in complete],
        "chosen": {"number": best.number, "params": best.params, f"validation_{objective}": best.value,
                   "folder": best.user_attrs["folder"], "recipe": asdict(replace(base, **best.params)), "test": test},
    }
    write_json(out / RESULT_FILE, record)
    names = sorted({k for t in complete for k in t.params})
    lines = [f"| trial | {' | '.join(names)} | validation {objective} |", "|---" * (len(names) + 2) + "|"]
    for t in sorted(complete, key=lambda t: -t.value):
        mark = " (chosen)" if t.number == best.number else ""
        lines.append(f"| {t.number}{mark} | " + " | ".join(_fmt(t.params.get(n)) for n in names) + f" | {t.value:.4f} |")
    lines += ["", f"Chosen trial {best.number}: test {objective} {test['candidates'][objective]:.4f} "
              f"(test read once, for the chosen recipe only)."]
    (out / TABLE_FILE).write_text("\n".join(lines) + "\n")
    return record


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
