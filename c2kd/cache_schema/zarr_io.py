"""How one shard's arrays are put into and taken out of a Zarr v3 group.

Each array is one Zarr shard file (the sharding codec) of inner chunks of about
CHUNK_TARGET_BYTES, so a reader fetches only the chunks it needs; every inner chunk carries a
crc32c so a corrupted byte fails loudly on read even without compression.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec, TransposeCodec, ZstdCodec

from c2kd.cache_schema.schema import CHUNK_TARGET_BYTES, FORMAT, Compression


def _codecs(compression: Compression) -> list[Any]:
    if compression.codec == "zstd":
        return [ZstdCodec(level=compression.level), Crc32cCodec()]
    return [Crc32cCodec()]


def chunk_rows(shape: tuple[int, ...], itemsize: int) -> int:
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * itemsize)
    return max(1, min(max(shape[0], 1), CHUNK_TARGET_BYTES // row_bytes))


def write_group(
    path: Path,
    arrays: dict[str, tuple[np.ndarray, dict, tuple[str, ...], bool]],
    attributes: dict,
    compression: Compression,
    schema_version: int,
) -> None:
    """Write a new group at `path`: arrays maps name -> (data, array attributes, dim names, feature-major).
    A feature-major array keeps its [rows, features] shape; only its chunks' bytes are laid out by
    feature (Zarr's `transpose` codec), which zstd compresses better when a feature's values are alike."""
    group = zarr.open_group(str(path), mode="w", zarr_format=3,
                            attributes={"format": FORMAT, "schema_version": schema_version, **attributes})
    for name, (data, array_attributes, dims, feature_major) in arrays.items():
        rows = chunk_rows(data.shape, data.dtype.itemsize)
        shard_rows = math.ceil(max(data.shape[0], 1) / rows) * rows
        arr = zarr.create_array(
            group.store,
            name=name,
            shape=data.shape,
            dtype=data.dtype,
            chunks=(rows, *data.shape[1:]),
            shards=(shard_rows, *data.shape[1:]),
            filters=[TransposeCodec(order=(1, 0))] if feature_major else None,
            compressors=_codecs(compression),
            fill_value=0,
            attributes=array_attributes,
            dimension_names=dims,
            chunk_key_encoding={"name": "default", "separator": "."},  # c.0.0 files: fewer folders to fsync
            config={"write_empty_chunks": True},
        )
        if data.size:
            arr[...] = data


def open_array(store: Any, name: str) -> zarr.Array:
    return zarr.open_array(store, path=name, mode="r", zarr_format=3)


def read_rows(arr: zarr.Array, rows: np.ndarray | slice) -> np.ndarray:
    """Rows of a token-, answer- or example-major array (all columns)."""
    if isinstance(rows, slice):
        return np.asarray(arr[rows])
    if rows.size == 0:
        return np.zeros((0, *arr.shape[1:]), dtype=arr.dtype)
    return np.asarray(arr.get_orthogonal_selection((rows, *([slice(None)] * (arr.ndim - 1)))))
