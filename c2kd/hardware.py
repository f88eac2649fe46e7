"""The CPU a run is on: recorded beside results, because speed and the last digits of every trained
number depend on it (other kernels, other rounding), and whether bf16 autocast pays off on it."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of native bf16 matrix instructions


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AMX tiles or AVX512-BF16), where a bf16-autocast
    training step is clearly faster than a float32 one (benchmarks/bf16_step.py; docs/RESULTS.md);
    elsewhere bf16 is emulated."""
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


def cpu_description(cpuinfo_path: Path = Path("/proc/cpuinfo")) -> dict:
    """Model name, native bf16 instructions, cores and torch version of this machine."""
    cpuinfo = cpuinfo_path.read_text() if cpuinfo_path.exists() else ""  # Linux; elsewhere no flags
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)}
    return {"cpu": fields.get("model name", platform.processor() or platform.machine()),
            "bf16_instructions": sorted(set(fields.get("flags", "").split()) & set(BF16_FLAGS)),
            "cores": os.cpu_count(), "torch": torch.__version__}
