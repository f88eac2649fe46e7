"""The prepared-examples folder written by `c2kd prepare`, and its reader.

Layout of a prepared folder (all item ids are internal: 1..num_items, 0 is padding):

    manifest.json          format, parameters, statistics, content fingerprint
    items.parquet          item:int32, raw_id:str, title:str
    train.parquet          example_id:int64, user:int32, history:list<int32>,
    validation.parquet       target:int32, candidates:list<int32>
    test.parquet

`history` is oldest first (3..10 items); `candidates` holds NUM_CANDIDATES items in a
seeded random order, the target among them, sampled once by `prepare` and never again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from c2kd.errors import DataError

EXAMPLES_FORMAT = "c2kd-examples"
EXAMPLES_VERSION = 1
SPLITS = ("train", "validation", "test")
NUM_CANDIDATES = 20
MAX_HISTORY = 10
MIN_HISTORY = 3



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


def target_indices(frame: pl.DataFrame) -> np.ndarray:
    """Position of the target inside each row's candidate list."""
    cands = np.asarray(frame["candidates"].to_list(), dtype=np.int64)
    targets = frame["target"].to_numpy().astype(np.int64)
    hits = cands == targets[:, None]
    if not hits.any(axis=1).all():
        raise DataError("a target is missing from its candidate list")
    return hits.argmax(axis=1)


def load_examples(root: str | Path) -> ExampleSet:
    """Read a folder written by `c2kd prepare`, refusing one that is not complete."""
    root = Path(root)
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        raise DataError(f"{root}: not a prepared data folder (no manifest.json); run `c2kd prepare` first")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != EXAMPLES_FORMAT or manifest.get("version") != EXAMPLES_VERSION:
        raise DataError(
            f"{manifest_path}: format {manifest.get('format')!r} v{manifest.get('version')!r}, "
            f"expected {EXAMPLES_FORMAT!r} v{EXAMPLES_VERSION}"
        )
    items = pl.read_parquet(root / "items.parquet")
    splits = {name: pl.read_parquet(root / f"{name}.parquet") for name in SPLITS}
    return ExampleSet(root=root, manifest=manifest, items=items, splits=splits)
