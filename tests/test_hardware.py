"""What a run records about its CPU, and whether the demo turns bf16 on there."""

import platform
import sys

import pytest

from c2kd.hardware import cpu_description, native_bf16

CPUINFO = """processor\t: 0
model name\t: Example CPU @ 2.00GHz
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16

processor\t: 1
model name\t: Example CPU @ 2.00GHz
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16
"""


def test_cpu_description_reads_the_model_and_the_bf16_flags(tmp_path):
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    d = cpu_description(tmp_path / "cpuinfo")
    assert d["cpu"] == "Example CPU @ 2.00GHz"
    assert d["bf16_instructions"] == ["amx_bf16", "avx512_bf16"]
    assert d["cores"] >= 1 and d["torch"]
    (tmp_path / "plain").write_text(CPUINFO.replace(" avx512_bf16 amx_tile amx_bf16", ""))
    assert cpu_description(tmp_path / "plain")["bf16_instructions"] == []


def test_cpu_description_without_cpuinfo_names_the_platform(tmp_path):
    d = cpu_description(tmp_path / "missing")
    assert d["cpu"] == (platform.processor() or platform.machine()) and d["bf16_instructions"] == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/cpuinfo")
def test_native_bf16_agrees_with_this_cpus_flags():
    assert native_bf16() is bool(cpu_description()["bf16_instructions"])
