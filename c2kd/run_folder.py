"""Run folders of the training recipes (train-teacher, distill): work in `OUT.partial/`, publish
`OUT` whole.

A recipe works in `OUT.partial/` (checkpoints, logs, `recipe.json`); rerunning the same command
resumes there, and a changed recipe is refused. At the end the staged model folder (with its
`recipe.json`) is renamed into place, so a folder at `OUT` is always complete; rerunning the
same command then reports the finished run instead of training again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from c2kd.atomic import check_destination, publish_dir, write_json
from c2kd.errors import C2KDError


def partial_dir(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".partial")


def claim(out: str | Path) -> tuple[Path, Path]:
    """(out, its work folder), refusing a destination that cannot be created."""
    out = Path(out)
    check_destination(out)
    return out, partial_dir(out)


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
        raise C2KDError(f"{out} already holds a run with other settings ({', '.join(changed)}); choose another --out "
                        "or pass --overwrite")
    return summary


def _changed(previous: dict, record: dict, added: dict | None = None) -> list[str]:
    record = json.loads(json.dumps(record))
    previous = {**(added or {}), **previous}
    return sorted(k for k in {*previous, *record} if previous.get(k) != record.get(k))


def check_or_write_recipe(work: Path, record: dict, rank: int, added: dict | None = None) -> None:
    """The recipe of an interrupted run must match the one being resumed (`added`: see finished_run)."""
    path = work / "recipe.json"
    if path.exists():
        changed = _changed(json.loads(path.read_text()), record, added)
        if changed:
            raise C2KDError(f"{work} holds an interrupted run with other settings ({', '.join(changed)}); "
                            f"rerun with those settings to resume, or delete {work}")
    elif rank == 0:
        work.mkdir(parents=True, exist_ok=True)
        write_json(path, record)


def publish(staged: Path, out: Path, work: Path, overwrite: bool, keep_work: bool) -> None:
    """Rename the finished folder `staged` (with the run's recipe.json) to `out` (replacing it when
    `overwrite`), then drop `work`."""
    shutil.copyfile(work / "recipe.json", staged / "recipe.json")
    publish_dir(staged, out, replace=overwrite)
    if not keep_work:
        shutil.rmtree(work)
