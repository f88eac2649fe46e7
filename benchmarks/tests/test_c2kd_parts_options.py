"""c2kd_parts runs part of itself by name: every tuned method has its test row, and a misspelt
step or row is refused before any work starts."""

from __future__ import annotations

import pytest

from benchmarks.c2kd_parts import FEWER_SEEDS, ROWS, STEPS, TERMS, TUNED, _subset, carried_over, for_method
from c2kd.student.distill import DistillRecipe


def test_every_tuned_method_and_term_is_a_row():
    assert {f"{m}-tuned" for m in TUNED} | set(TERMS) | {"sft", "c2kd-paper"} == set(ROWS)
    assert set(FEWER_SEEDS) <= set(ROWS)


def test_subset_reads_a_comma_list():
    assert _subset(" sft, c2kd-default ,", ROWS, "--rows") == {"sft", "c2kd-default"}
    assert _subset(",".join(STEPS), STEPS, "--steps") == set(STEPS)


@pytest.mark.parametrize("text", ["", " , ", "sft,own-head", "seeds"])
def test_subset_refuses_an_unknown_or_empty_list(text):
    with pytest.raises(SystemExit, match="expected a comma list of"):
        _subset(text, ROWS, "--rows")


def test_each_method_gets_the_router_layers_and_logit_support_it_takes():
    demo = DistillRecipe(student="micro", kd_over="items")
    assert for_method(demo, "c2kd", (26, 27)).router_layers == (26, 27)  # C2KD keeps the demo's layers in a wider cache
    logit = for_method(demo, "logit-kd", (26, 27))
    assert logit.method == "logit-kd" and logit.router_layers is None and logit.kd_over == "items"
    feature = for_method(demo, "feature-kd", (26, 27))  # the demo's items support is refused for feature KD
    assert feature.method == "feature-kd" and feature.router_layers is None and feature.kd_over == "vocab"


def test_a_rerun_keeps_the_measurements_and_the_commands_that_made_them():
    assert carried_over({}) == {k: {} for k in ("parts", "tune", "seeds", "comparisons", "comparisons_validation",
                                                "routers")} | {"earlier_runs": []}
    first = {"tune": {"c2kd": {"chosen": 1}}, "provenance": {"command": "--steps tune"}}
    second = {**carried_over(first), "seeds": {"sft": {}}, "provenance": {"command": "--steps test"}}
    third = carried_over(second)
    assert third["tune"] == {"c2kd": {"chosen": 1}} and third["seeds"] == {"sft": {}}
    assert [run["command"] for run in third["earlier_runs"]] == ["--steps tune", "--steps test"]
