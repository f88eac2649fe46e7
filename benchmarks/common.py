"""What the benchmark scripts share: mean ± std, markdown tables, and writing a result with its provenance.

Every result a benchmark writes goes through `write_result`, which adds where it came from: the
command that made it, the machine (CPU model, cores, torch), the commit of the code and the date.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def mean_std(values: Sequence[float], digits: int = 3) -> str:
    """'0.333 ± 0.006' over seeds (sample std), or the one value."""
    values = list(values)
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def mean_std_dict(values: Sequence[float]) -> dict[str, float]:
    """{"mean", "std"} over seeds; std 0 for one value."""
    values = list(values)
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table as lines."""
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def commit() -> str | None:
    """The commit of the working tree ('+dirty' when it has uncommitted changes), or None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def machine() -> dict[str, Any]:
    """The machine a result was measured on: CPU model, cores, bf16 support, torch, GPU."""
    try:
        from c2kd.hardware import cpu_description

        description = dict(cpu_description())
    except Exception:  # noqa: BLE001 - provenance must not stop a result from being written
        description = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    try:
        import torch

        description["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        pass
    description["python"] = platform.python_version()
    return description


def this_command() -> str:
    """The command line that is running, as one would type it again."""
    return shlex.join(["python", *sys.argv])


def provenance(command: str | None = None) -> dict[str, Any]:
    return {"command": command or this_command(), "machine": machine(), "commit": commit(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def write_result(path: str | Path, payload: dict[str, Any], command: str | None = None) -> Path:
    """Write a benchmark result as JSON with its provenance (command, machine, commit, date).

    Written to a temporary file and renamed, so a reader never sees half a result."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**payload, "provenance": provenance(command)}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path


def load_result(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
