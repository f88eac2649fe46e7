"""`c2kd demo` end to end on MovieLens-100k, shrunk to the smallest sizes (the pipeline, not the quality)."""

import json

import pytest

from c2kd.demo import DemoSettings, run_demo
from c2kd.hardware import native_bf16
from c2kd.student.distill import DEFAULT_RECIPES


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [None, not native_bf16()], ids=["bf16-as-the-cpu", "bf16-overridden"])
def test_demo_runs_every_stage_into_one_folder(tmp_path, bf16):
    settings = DemoSettings(max_train_per_user=1, sasrec_epochs=1, teacher="tiny-teacher", teacher_shrink=None,
                            teacher_epochs=1, teacher_max_train=64, student="micro", student_shrink=None,
                            student_epochs=1, student_max_train=64, max_val=16, latency_requests=3, bf16=bf16)
    run = tmp_path / "demo"
    result = run_demo(run, settings)

    for stage in ("data", "sasrec", "teacher", "cache", "student-sft", "student-c2kd", "student-onnx"):
        assert (run / stage).is_dir(), stage
    saved = json.loads((run / "results.json").read_text())
    assert saved["results"].keys() == {"SASRec", "teacher", "student alone (SFT)", "C2KD student"}
    assert "share_recovered_by_c2kd" in saved["gap"]
    for name, row in result["results"].items():
        assert 0.0 <= row["HR@1"] <= row["NDCG@10"] <= 1.0, name
        assert row["latency_ms"] > 0, name
    assert result["results"]["teacher"]["parameters"] > 0
    # bf16 as asked, else as the CPU has it, and every training stage ran the same way
    expected = native_bf16() if bf16 is None else bf16
    assert saved["settings"]["bf16"] is expected
    for stage, record in (("teacher", "train.json"), ("student-sft", "distill.json"), ("student-c2kd", "distill.json")):
        assert f'"bf16": {json.dumps(expected)}' in (run / stage / record).read_text(), stage
    # the table's student rows are the test metrics their distill run measured
    for name, method in (("student alone (SFT)", "sft"), ("C2KD student", "c2kd")):
        measured = json.loads((run / f"student-{method}" / "distill.json").read_text())["metrics"]["test"]["candidates"]
        assert {k: saved["results"][name][k] for k in measured} == measured, name
    assert saved["machine"]["cpu"] and saved["machine"]["cores"] >= 1
    # the default recipe goes to the C2KD student only
    recipes = {m: json.loads((run / f"student-{m}" / "recipe.json").read_text()) for m in ("sft", "c2kd")}
    assert {k: recipes["c2kd"][k] for k in DEFAULT_RECIPES["c2kd"]} == DEFAULT_RECIPES["c2kd"]
    assert recipes["c2kd"]["w_own_logit"] > 0 and recipes["sft"]["w_own_logit"] == 0.0
    assert recipes["c2kd"]["kd_over"] == settings.kd_over == "items"
    # the teacher's SASRec distillation weight reaches the teacher
    assert json.loads((run / "teacher" / "recipe.json").read_text())["sasrec_kd"] == settings.teacher_sasrec_kd
    assert set(saved["timings_s"]) >= {"teacher", "cache", "student-sft", "student-c2kd", "evaluation"}


def test_demo_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "old.txt").write_text("x")
    from c2kd.errors import C2KDError

    with pytest.raises(C2KDError, match="not empty"):
        run_demo(tmp_path, DemoSettings())
