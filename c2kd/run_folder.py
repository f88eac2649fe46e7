"""Run folders of the training recipes (train-teacher, distill): work in `OUT.partial/`, publish
`OUT` whole.

A recipe works in `OUT.partial/` (checkpoints, logs, `recipe.json`); rerunning the same command
resumes there, and a changed recipe is refused. At the end the staged model folder (with its
`recipe.json`) is renamed into place, so a folder at `OUT` is always complete; rerunning the
same command then reports the finished run instead of training again. A run refused before its
first checkpoint leaves no `OUT.partial/` behind (`leaves_nothing_when_refused`).
"""

from __future__ import annotations

import functools
import inspect
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from c2kd.atomic import check_destination, publish_dir, write_json
from c2kd.distributed import dist_env
from c2kd.errors import C2KDError

Fn = TypeVar("Fn", bound=Callable[..., Any])
# Recipe fields whose command-line option has another name than the field.
_OPTION_NAMES = {"fmt": "--format", "cache_digest": "--cache", "data_fingerprint": "--data", "recipe": "the command",
                 "lora.r": "--lora-r", "lora.alpha": "--lora-alpha", "lora.dropout": "--lora-dropout", "lora": "--lora-r"}


def partial_dir(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".partial")


def claim(out: str | Path) -> tuple[Path, Path]:
    """(out, its work folder), refusing a destination that cannot be created."""
    out = Path(out)
    if out.name in ("", ".", ".."):
        raise C2KDError(f"--out {str(out)!r}: give the path of a new folder (e.g. runs/student)")
    check_destination(out)
    return out, partial_dir(out)


def has_checkpoints(work: Path) -> bool:
    """Whether a work folder holds anything to resume from (a checkpoint of any stage)."""
    return work.is_dir() and any(p.is_dir() for p in work.rglob("checkpoints/step-*"))


def leaves_nothing_when_refused(fn: Fn) -> Fn:
    """For a recipe `fn(..., out, ...)`: when it fails before the first checkpoint of a run it started,
    the `out.partial/` it created is removed, so a refused run leaves nothing that blocks the
    corrected command. A resumed run's folder (there before the call) is never touched."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = Path(signature.bind(*args, **kwargs).arguments["out"])
        work = partial_dir(out) if out.name not in ("", ".", "..") else None
        existed = work is None or work.exists()
        try:
            return fn(*args, **kwargs)
        except BaseException:
            if not existed and dist_env()[0] == 0 and work.exists() and not has_checkpoints(work):
                shutil.rmtree(work, ignore_errors=True)
            raise

    return wrapper  # type: ignore[return-value]


def finished_run(out: Path, record: dict, summary_file: str, overwrite: bool, added: dict | None = None) -> dict | None:
    """The summary of a finished run at `out` made with this recipe (None when there is none, or
    when it is to be overwritten); an existing `out` made otherwise is refused. `added`: settings
    newer than some recorded runs, with the value those runs used (a record without one had it)."""
    if not out.exists() or overwrite:
        return None
    try:
        previous = json.loads((out / "recipe.json").read_text())
        summary = json.loads((out / summary_file).read_text())
    except (OSError, ValueError):
        raise C2KDError(f"{out} already exists and is not a finished run of this command; choose another --out "
                        "or pass --overwrite") from None
    changed = _changed(previous, record, added)
    if changed:
        raise C2KDError(f"{out} already holds a run with other settings ({_describe(changed)}); choose another --out "
                        "or pass --overwrite")
    return summary


def _changed(previous: dict, record: dict, added: dict | None = None) -> list[tuple[str, Any, Any]]:
    """(setting, recorded value, value now) of each setting that differs; nested settings by dotted
    name (train.lr), so a difference names the setting, not its group."""
    return _differences({**(added or {}), **previous}, json.loads(json.dumps(record)))


def _differences(before: dict, now: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    out = []
    for key in sorted({*before, *now}):
        then, value = before.get(key), now.get(key)
        if isinstance(then, dict) and isinstance(value, dict):
            out += _differences(then, value, f"{prefix}{key}.")
        elif then != value:
            out.append((f"{prefix}{key}", then, value))
    return out


def _describe(changed: list[tuple[str, Any, Any]]) -> str:
    """'--lr was 0.001, now 0.002; ...': each differing setting by its option name."""
    parts = []
    for name, then, now in changed[:4]:
        option = _OPTION_NAMES.get(name) or "--" + name.rsplit(".", 1)[-1].replace("_", "-")
        if name == "lora":  # LoRA on or off: say it by its rank
            then, now = (v.get("r") if isinstance(v, dict) else v for v in (then, now))
        parts.append(f"{option} was {_short(then)}, now {_short(now)}")
    more = f"; and {len(changed) - 4} more" if len(changed) > 4 else ""
    return "; ".join(parts) + more


def _short(value: Any) -> str:
    text = "unset" if value is None else json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 24 else text[:16] + "…"


def check_or_write_recipe(work: Path, record: dict, rank: int, added: dict | None = None) -> None:
    """The recipe of an interrupted run must match the one being resumed (`added`: see finished_run).
    A work folder without a checkpoint holds nothing to resume: its recipe is replaced."""
    path = work / "recipe.json"
    if path.exists():
        changed = _changed(json.loads(path.read_text()), record, added)
        if not changed:
            return
        if has_checkpoints(work):
            raise C2KDError(f"{work} holds an interrupted run with other settings ({_describe(changed)}); "
                            f"rerun with those settings to resume, or delete {work}")
    if rank == 0:
        work.mkdir(parents=True, exist_ok=True)
        write_json(path, record)


def publish(staged: Path, out: Path, work: Path, overwrite: bool, keep_work: bool) -> None:
    """Rename the finished folder `staged` (with the run's recipe.json) to `out` (replacing it when
    `overwrite`), then drop `work`."""
    shutil.copyfile(work / "recipe.json", staged / "recipe.json")
    publish_dir(staged, out, replace=overwrite)
    if not keep_work:
        shutil.rmtree(work)
