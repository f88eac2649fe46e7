"""The real-LLM benchmark's step clock: a run killed mid-step keeps the seconds it ran."""

import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.real_llm import StepClock

KILLED_RUN = """
import sys, time
from pathlib import Path
from benchmarks.real_llm import StepClock
StepClock.HEARTBEAT_S = 0.05
clock = StepClock(Path(sys.argv[1]))
with clock.timing("done"):
    time.sleep(0.1)
step = clock.timing("cut short")
step.__enter__()
print("started", flush=True)
time.sleep(60)
"""


def test_a_step_cut_short_keeps_its_seconds_in_the_next_run(tmp_path, monkeypatch):
    path = tmp_path / "timings.json"
    run = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(path)], stdout=subprocess.PIPE, text=True,
                           cwd=Path(__file__).parents[2])  # the repository root
    assert run.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 60
    while json.loads(path.read_text()).get("running", {}).get("cut short", 0) < 0.3:  # a heartbeat or more
        assert time.monotonic() < deadline, "the running step's seconds never reached the file"
        time.sleep(0.05)
    run.kill()
    run.wait()
    killed = json.loads(path.read_text())
    assert killed["steps_s"]["done"] >= 0.1 and "cut short" not in killed["steps_s"]
    assert killed["running"]["cut short"] >= 0.3 and killed["wall_s"] >= killed["running"]["cut short"]

    monkeypatch.setattr(StepClock, "HEARTBEAT_S", 0.05)
    clock = StepClock(path)  # the resumed run finishes the step
    with clock.timing("cut short"):
        time.sleep(0.3)  # the asserts below allow 0.1 for the file's rounding
    resumed = json.loads(path.read_text())
    assert resumed["steps_s"]["cut short"] >= killed["running"]["cut short"] + 0.2
    assert resumed["wall_s"] >= killed["wall_s"] + 0.2 and "running" not in resumed
    assert resumed["steps_s"]["done"] == killed["steps_s"]["done"]
