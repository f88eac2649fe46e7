"""The prepared-examples folder written by `c2kd prepare`, and its reader.

Layout of a prepared folder (all item ids are internal: 1..num_items, 0 is padding):

    manifest.json          format, parameters, statistics, content fingerprint
    items.parquet          item:int32, raw_id:str, title:str
    train.parquet          example_id:int64, user:int32, history:list<int32>,
    validation.parquet       target:int32, candidates:list<int32>
    test.parquet

`history` is oldest first (3..10 items); `candidates` holds NUM_CANDIDATES items in a
seeded random order, the target among them, sampled once by `prepare` and never again.

The manifest's `fingerprint` is `content_fingerprint(items, splits)`: a sha256 over the table
contents (not over the Parquet bytes), so it identifies the examples whatever wrote the files.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

from c2kd.errors import DataError

EXAMPLES_FORMAT = "c2kd-examples"
EXAMPLES_VERSION = 1
SPLITS = ("train", "validation", "test")
NUM_CANDIDATES = 20
MAX_HISTORY = 10
MIN_HISTORY = 3

ITEMS_SCHEMA = pa.schema([("item", pa.int32()), ("raw_id", pa.string()), ("title", pa.string())])
EXAMPLES_SCHEMA = pa.schema(
    [
        ("example_id", pa.int64()),
        ("user", pa.int32()),
        ("history", pa.list_(pa.int32())),
        ("target", pa.int32()),
        ("candidates", pa.list_(pa.int32())),
    ]
)


@dataclass(frozen=True)
class ExampleSet:
    """A prepared data folder: the item table, the three splits and the manifest."""

    root: Path
    manifest: dict
    items: pl.DataFrame
    splits: dict[str, pl.DataFrame]

    @property
    def num_items(self) -> int:
        return int(self.manifest["stats"]["items"])

    @property
    def fingerprint(self) -> str:
        return str(self.manifest["fingerprint"])

    def titles(self) -> list[str]:
        """Titles indexed by internal item id (index 0 is the padding item, "")."""
        out = [""] * (self.num_items + 1)
        for item, title in self.items.select("item", "title").iter_rows():
            out[item] = title
        return out

    def split(self, name: str) -> pl.DataFrame:
        if name not in self.splits:
            raise DataError(f"{self.root}: unknown split {name!r}; expected one of {', '.join(SPLITS)}")
        return self.splits[name]


def fixed_subset(total: int, size: int | None) -> np.ndarray:
    """Sorted positions of a fixed random subset of `size` of `total` rows (all rows when size is None
    or not smaller): the same for every run seed, so runs with different seeds, the teacher and its
    cache see the same examples."""
    if size is None or size >= total:
        return np.arange(total)
    return np.sort(np.random.default_rng(0).choice(total, size=size, replace=False))


def target_indices(frame: pl.DataFrame) -> np.ndarray:
    """Position of the target inside each row's candidate list."""
    cands = np.asarray(frame["candidates"].to_list(), dtype=np.int64)
    targets = frame["target"].to_numpy().astype(np.int64)
    hits = cands == targets[:, None]
    if not hits.any(axis=1).all():
        raise DataError("a target is missing from its candidate list")
    return hits.argmax(axis=1)


def content_fingerprint(items: pl.DataFrame, splits: Mapping[str, pl.DataFrame]) -> str:
    """sha256 of the examples' content, independent of how the Parquet files were written.

    Serialisation: a version line; then for `items` and each split in SPLITS order a line
    ``table <name> rows <n>`` and, per column of its schema in order, a line
    ``column <name> <type>`` followed by the values: integers as little-endian int64, lists as
    their int64 lengths then their int64 values, strings as their int64 UTF-8 byte lengths then
    the concatenated UTF-8 bytes. Row order matters (it is part of the data).
    """
    digest = hashlib.sha256(b"c2kd-examples-fingerprint v1\n")
    tables = [("items", items, ITEMS_SCHEMA)] + [(name, splits[name], EXAMPLES_SCHEMA) for name in SPLITS]
    for name, frame, schema in tables:
        digest.update(f"table {name} rows {frame.height}\n".encode())
        for column in schema:
            kind = f"list<{column.type.value_type}>" if pa.types.is_list(column.type) else str(column.type)
            digest.update(f"column {column.name} {kind}\n".encode())
            series = frame[column.name]
            if series.null_count():
                raise DataError(f"{name}: column {column.name!r} has missing values")
            if pa.types.is_list(column.type):
                values = series.to_arrow()
                digest.update(np.asarray(values.value_lengths(), dtype="<i8").tobytes())
                digest.update(np.asarray(values.flatten(), dtype="<i8").tobytes())
            elif pa.types.is_string(column.type):
                encoded = [text.encode("utf-8") for text in series.to_list()]
                digest.update(np.asarray([len(b) for b in encoded], dtype="<i8").tobytes())
                digest.update(b"".join(encoded))
            else:
                digest.update(series.to_numpy().astype("<i8").tobytes())
    return digest.hexdigest()


def load_examples(root: str | Path, verify: bool = False) -> ExampleSet:
    """Read a folder written by `c2kd prepare`, refusing one that is not complete.

    With `verify`, the tables' content fingerprint is recomputed and must match the manifest.
    """
    root = Path(root)
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        raise DataError(f"{root}: not a prepared data folder (no manifest.json); run `c2kd prepare` first")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as error:
        raise DataError(f"{manifest_path}: not valid JSON ({error})") from None
    if manifest.get("format") != EXAMPLES_FORMAT or manifest.get("version") != EXAMPLES_VERSION:
        raise DataError(
            f"{manifest_path}: format {manifest.get('format')!r} v{manifest.get('version')!r}, "
            f"expected {EXAMPLES_FORMAT!r} v{EXAMPLES_VERSION}"
        )
    items = _read_table(root / "items.parquet", ITEMS_SCHEMA)
    splits = {name: _read_table(root / f"{name}.parquet", EXAMPLES_SCHEMA) for name in SPLITS}
    if verify and content_fingerprint(items, splits) != manifest.get("fingerprint"):
        raise DataError(
            f"{root}: the tables do not match the manifest's fingerprint (files changed after `c2kd prepare`)"
        )
    return ExampleSet(root=root, manifest=manifest, items=items, splits=splits)


def _read_table(path: Path, schema: pa.Schema) -> pl.DataFrame:
    if not path.is_file():
        raise DataError(f"{path}: missing from the prepared data folder; run `c2kd prepare` again")
    frame = pl.read_parquet(path)
    missing = [name for name in schema.names if name not in frame.columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {', '.join(missing)}")
    return frame
