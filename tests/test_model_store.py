"""The model store's command (`python -m c2kd.recmodel.pretrained`, run by scripts/setup.sh on every
call): with every alias converted it only reports the folders, without importing torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from c2kd.recmodel.pretrained import WHEEL_MODELS, is_converted

REPORT_AND_CHECK_TORCH = (
    "import runpy, sys; runpy.run_module('c2kd.recmodel.pretrained', run_name='__main__'); "
    "print('torch imported' if 'torch' in sys.modules else 'torch not imported')"
)


def _store_command(home, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "C2KD_HOME": str(home)}
    return subprocess.run([sys.executable, "-c", REPORT_AND_CHECK_TORCH, *args], env=env, capture_output=True, text=True)


def test_a_converted_store_is_reported_without_importing_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("C2KD_HOME", str(tmp_path))
    assert not any(map(is_converted, WHEEL_MODELS))
    for alias in WHEEL_MODELS:  # what a finished conversion leaves: the folder and its marker, written last
        (tmp_path / "models" / alias).mkdir(parents=True)
        (tmp_path / "models" / alias / "c2kd-source.json").write_text(json.dumps({"alias": alias}))
    assert all(map(is_converted, WHEEL_MODELS))

    done = _store_command(tmp_path, *WHEEL_MODELS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{a}: {tmp_path / 'models' / a}" for a in WHEEL_MODELS] + ["torch not imported"]


def test_an_unknown_alias_is_one_line(tmp_path):
    done = _store_command(tmp_path, "smollm2-135m", "llama-9b")
    assert done.returncode == 1
    assert done.stderr.strip() == "error: unknown model alias llama-9b; expected one of smollm2-135m, gemma3-270m"
