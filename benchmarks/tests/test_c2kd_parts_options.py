"""c2kd_parts runs part of itself by name: every tuned method has its test row, and a misspelt
step or row is refused before any work starts."""

from __future__ import annotations

import pytest

from benchmarks.c2kd_parts import FEWER_SEEDS, ROWS, STEPS, TERMS, TUNED, _subset


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
