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


# --- float8 e4m3 with one scale per row -----------------------------------------------------------
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_e4m3(x: torch.Tensor | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of `x` [rows, d] as float8 e4m3 bytes [rows, d] uint8 and their float32 scales [rows]:
    scale = max |row| / 448 (1 for an all-zero row), byte = e4m3(row / scale), rounded to nearest even.
    The largest value of each row uses e4m3's whole range; the error is at most half a step of 3 mantissa
    bits, relative to each value (values below 2^-6 * scale: absolute, e4m3's subnormal step)."""
    t = torch.as_tensor(x).detach().to(device="cpu")
    if not t.is_floating_point() or t.ndim != 2:
        raise CacheError(f"float8: expected a 2-D float array [rows, features], got {tuple(t.shape)} {t.dtype}")
    t = t.float()
    amax = t.abs().amax(dim=1) if t.shape[1] else torch.zeros(t.shape[0])
    if not torch.isfinite(amax).all():
        raise CacheError("float8: the hidden states hold inf or NaN; a scale cannot represent them")
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    # the division can land a hair above 448: e4m3fn has no inf, and casting past its range gives NaN
    q = (t / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).numpy(), scale.numpy().astype(np.float32)


def dequantize_e4m3(q: np.ndarray, scale: np.ndarray, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of `quantize_e4m3` (to the float8 rounding): e4m3(byte) * scale, for any leading shape
    `q` [..., d] uint8 with `scale` [...] float32, as `dtype`."""
    if q.dtype != np.uint8 or scale.dtype != np.float32 or q.shape[:-1] != scale.shape:
        raise CacheError(f"float8: bytes {q.dtype} {q.shape} and scales {scale.dtype} {scale.shape} do not fit "
                         "(expected uint8 [..., d] and float32 [...])")
    values = torch.from_numpy(np.ascontiguousarray(q)).view(torch.float8_e4m3fn).float()
    return (values * torch.from_numpy(np.ascontiguousarray(scale))[..., None]).to(dtype)


def e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn bytes, by the rule SCHEMA.md gives (NaN for 0x7f, 0xff):
    a reader without torch decodes `table[byte] * scale`."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exponent, mantissa = (b >> 3) & 0xF, b & 0x7
    value = np.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7.0))
    value = np.where((b & 0x7F) == 0x7F, np.nan, sign * value)
    return value.astype(np.float32)
