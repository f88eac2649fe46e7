"""What a run records about its CPU, and whether the demo turns bf16 on there."""

import sys

import pytest

from c2kd.hardware import BF16_FLAGS, cpu_description, native_bf16


def test_cpu_description_names_the_cpu_and_its_bf16_instructions():
    d = cpu_description()
    assert d["cpu"] and d["cores"] >= 1 and d["torch"]
    assert set(d["bf16_instructions"]) <= set(BF16_FLAGS)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/cpuinfo")
def test_native_bf16_agrees_with_the_cpu_flags():
    assert native_bf16() is bool(cpu_description()["bf16_instructions"])
