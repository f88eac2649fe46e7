"""The real-LLM benchmark's schedule: every student once, after its family's teacher, and Gemma's first
seed in one pool with SmolLM2's last so that no core idles between the families."""

import argparse
from collections import Counter

from benchmarks.real_llm import FAMILIES, TRAIN_ORDER, Bench


def scheduled(tmp_path, **overrides) -> list[tuple]:
    """(what, names) events of a Bench whose teachers and pools are recorded instead of run."""
    settings = dict(out=tmp_path, families=list(FAMILIES), gemma_seeds=3, max_seeds=3, quick=False, history_loss=0.0,
                    kd_over=None, bf16=True, student_lr=3e-4, student_epochs=3, teacher_lr=1e-4, teacher_epochs=None,
                    teacher_sasrec_kd=4.0)
    bench = Bench(argparse.Namespace(**settings | overrides), timings=tmp_path / "timings.json")
    events: list[tuple] = []
    bench.teacher = lambda name: events.append(("teacher", name))
    bench.run_jobs = lambda jobs: events.append(("pool", [step for step, _output, _command in jobs]))
    bench.train()
    return events


def test_every_student_is_scheduled_once_after_its_teacher(tmp_path):
    events = scheduled(tmp_path)
    trained: set[str] = set()
    students: list[str] = []
    for what, names in events:
        if what == "teacher":
            trained.add(names)
        else:
            assert all(step.split("/")[0] in trained for step in names), names
            students += names
    per_method = {m: "student-alone" if m == "student alone" else m for m in TRAIN_ORDER}
    expected = [f"{name}/{label}-s{seed}" for name in FAMILIES for seed in range(3) for label in per_method.values()]
    assert Counter(students) == Counter(expected)


def test_gemma_first_seed_shares_a_pool_with_smollm2_last_seed_longest_first(tmp_path):
    pools = [names for what, names in scheduled(tmp_path) if what == "pool"]
    shared = next(pool for pool in pools if any(step.startswith("gemma/") for step in pool))
    assert {step.rsplit("-s", 1)[1] for step in shared if step.startswith("gemma/")} == {"0"}
    assert {step.rsplit("-s", 1)[1] for step in shared if step.startswith("smollm2/")} == {"2"}
    assert all(step.startswith("gemma/") for step in shared[:len(TRAIN_ORDER)])  # the longer students first
    assert shared[:2] == ["gemma/SFT from cache-s0", "gemma/C2KD-s0"]  # a run cut short still compares them


def test_one_family_and_fewer_seeds_schedule_only_those(tmp_path):
    events = scheduled(tmp_path, families=["gemma"], gemma_seeds=1)
    students = [step for what, names in events if what == "pool" for step in names]
    assert {names for what, names in events if what == "teacher"} == {"gemma"}
    assert sorted(students) == sorted(f"gemma/{'student-alone' if m == 'student alone' else m}-s0" for m in TRAIN_ORDER)
