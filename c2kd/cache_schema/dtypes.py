"""Conversions between a float array's logical dtype and the numpy dtype its bytes are stored as.

bfloat16 has no Zarr dtype, so its 16 bits are kept as uint16 and the logical dtype is recorded
in the array attributes; float16/float32 are stored natively.
"""

from __future__ import annotations

import numpy as np
import torch

from c2kd.cache_schema.schema import STORAGE_DTYPES
from c2kd.errors import CacheError

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def to_storage(x: torch.Tensor | np.ndarray, logical: str) -> np.ndarray:
    """Cast `x` to `logical` (round to nearest even) and return the array as it is stored."""
    if logical not in STORAGE_DTYPES:
        raise CacheError(f"unknown logical dtype {logical!r}")
    t = torch.as_tensor(x).detach()
    if not t.is_floating_point():
        raise CacheError(f"expected a float array for a {logical} field, got {t.dtype}")
    t = t.to(device="cpu", dtype=TORCH_DTYPES[logical]).contiguous()
    if logical == "bfloat16":
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_storage(a: np.ndarray, logical: str) -> torch.Tensor:
    """Inverse of `to_storage`: a tensor of the logical dtype, bit-exact."""
    expected = np.dtype(STORAGE_DTYPES[logical])
    if a.dtype != expected:
        raise CacheError(f"stored dtype {a.dtype} does not match logical {logical} (expected {expected})")
    a = np.ascontiguousarray(a)
    if not a.flags.writeable:  # torch.from_numpy needs writable memory
        a = a.copy()
    if logical == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
