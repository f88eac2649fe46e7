"""Run folders of the training recipes (train-teacher, distill): work in `OUT.partial/`, publish
`OUT` whole.

A recipe works in `OUT.partial/` (checkpoints, logs, `recipe.json`); rerunning the same command
resumes there, and a changed recipe is refused. At the end the staged model folder is renamed
into place, so a folder at `OUT` is always complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from c2kd.atomic import publish_dir, write_json
from c2kd.errors import C2KDError


def partial_dir(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".partial")


def claim(out: str | Path, overwrite: bool) -> tuple[Path, Path]:
    """(out, its work folder), refusing an existing `out` unless `overwrite`."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise C2KDError(f"{out} already exists; choose another --out or pass --overwrite")
    return out, partial_dir(out)


def check_or_write_recipe(work: Path, record: dict, rank: int) -> None:
    """The recipe of an interrupted run must match the one being resumed."""
    path = work / "recipe.json"
    if path.exists():
        previous = json.loads(path.read_text())
        if previous != json.loads(json.dumps(record)):
            changed = sorted(k for k in {*previous, *record} if previous.get(k) != record.get(k))
            raise C2KDError(f"{work} holds an interrupted run with other settings ({', '.join(changed)}); "
                            f"rerun with those settings to resume, or delete {work}")
    elif rank == 0:
        work.mkdir(parents=True, exist_ok=True)
        write_json(path, record)


def publish(staged: Path, out: Path, work: Path, overwrite: bool, keep_work: bool) -> None:
    """Rename the finished folder `staged` to `out` (replacing it when `overwrite`), then drop `work`."""
    publish_dir(staged, out, replace=overwrite)
    if not keep_work:
        shutil.rmtree(work)
