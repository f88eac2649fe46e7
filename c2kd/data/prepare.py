"""The data protocol: raw interactions → leave-one-out examples with 20 stored candidates.

Protocol (DESIGN §1), applied by `build_examples`:

1. Ids. Items that occur in the interactions get internal ids 1..N (0 is padding), users
   0..U-1, both in raw-id order: numeric when every raw id is an integer, else by text.
   Users are numbered after dropping the short ones (step 3).
2. Order. Each user's interactions are sorted by (timestamp, internal item id): timestamps tie
   often. A repeated (user, item) pair keeps only its earliest interaction, so a target is never
   in its own history and "never interacted" is well defined.
3. Users with fewer than MIN_HISTORY + 2 = 5 interactions are dropped and counted.
4. Windows. For a user's sequence s of length n: test target s[n-1], validation target s[n-2],
   train targets s[t] for t = 3..n-3 (at least MIN_HISTORY items before them); with
   `max_train_per_user` = K only the K latest train targets are kept. The history of target s[t]
   is s[max(0, t-10):t], oldest first.
5. Candidates. NUM_CANDIDATES - 1 = 19 negatives per example, drawn uniformly without
   replacement from the items the user never interacted with (in any split), plus the target,
   in a shuffled order. Each split draws from its own generator ``default_rng([seed, k])``
   (k = 0 test, 1 validation, 2 train), row by row in example order, so the test and validation
   candidates do not depend on `max_train_per_user`.
6. Example ids: a running index over test, then validation, then train; within a split users
   ascend and a user's train targets go oldest first. So a test example's id is its user id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from c2kd.atomic import check_destination, staged_dir
from c2kd.errors import C2KDError, DataError
from c2kd.data.examples import (
    EXAMPLES_FORMAT,
    EXAMPLES_SCHEMA,
    EXAMPLES_VERSION,
    ITEMS_SCHEMA,
    MAX_HISTORY,
    MIN_HISTORY,
    NUM_CANDIDATES,
    SPLITS,
    content_fingerprint,
)
from c2kd.data.sources import Interactions, read_source

MIN_INTERACTIONS = MIN_HISTORY + 2  # history + validation target + test target
_SPLIT_STREAMS = {"test": 0, "validation": 1, "train": 2}

PROTOCOL_NOTES = {
    "order": "per user by (timestamp, item); repeated (user, item) pairs keep the earliest",
    "split": "leave-one-out: last target -> test, second last -> validation, earlier -> train",
    "history": f"up to {MAX_HISTORY} items before the target, oldest first, at least {MIN_HISTORY}",
    "candidates": f"target + {NUM_CANDIDATES - 1} items the user never interacted with, shuffled; "
    "rng = numpy default_rng([seed, k]), k = 0 test, 1 validation, 2 train",
    "example_id": "running index over test, validation, train; users ascending; train targets oldest first",
}


@dataclass(frozen=True)
class Examples:
    """The prepared tables in memory (Arrow, in the folder's schemas) and their statistics."""

    items: pa.Table
    splits: dict[str, pa.Table]
    stats: dict[str, int]

    def fingerprint(self) -> str:
        return content_fingerprint(pl.from_arrow(self.items), {n: pl.from_arrow(t) for n, t in self.splits.items()})


# --------------------------------------------------------------------------- public entry point


def prepare(
    source: str | Path,
    out: str | Path,
    *,
    seed: int = 0,
    max_train_per_user: int | None = None,
    items: str | Path | None = None,
    overwrite: bool = False,
) -> dict:
    """Read `source`, apply the protocol and write the examples folder `out`; returns the manifest."""
    out = Path(out)
    _check_target(out, overwrite)
    if seed < 0:
        raise C2KDError(f"--seed must be >= 0, got {seed}")
    if max_train_per_user is not None and max_train_per_user < 1:
        raise C2KDError(f"--max-train-per-user must be >= 1 (leave it out for no cap), got {max_train_per_user}")
    interactions = read_source(source, items)
    examples = build_examples(interactions, seed=seed, max_train_per_user=max_train_per_user)
    manifest = {
        "format": EXAMPLES_FORMAT,
        "version": EXAMPLES_VERSION,
        "source": {"name": str(source), **interactions.description},
        "parameters": {
            "seed": seed,
            "max_train_per_user": max_train_per_user,
            "num_candidates": NUM_CANDIDATES,
            "max_history": MAX_HISTORY,
            "min_history": MIN_HISTORY,
            "min_interactions": MIN_INTERACTIONS,
        },
        "protocol": PROTOCOL_NOTES,
        "stats": examples.stats,
        "fingerprint": examples.fingerprint(),
    }
    write_examples(examples, manifest, out, overwrite=overwrite)
    return manifest


# --------------------------------------------------------------------------- the protocol


def build_examples(interactions: Interactions, *, seed: int = 0, max_train_per_user: int | None = None) -> Examples:
    """Apply the protocol of the module docstring to raw interactions."""
    name = interactions.name
    events = interactions.events
    if events.height == 0:
        raise DataError(f"{name}: no interactions")

    item_raw = _ordered_ids(events["item"])
    num_items = len(item_raw)
    events = events.join(
        pl.DataFrame({"item": item_raw, "item_id": np.arange(1, num_items + 1, dtype=np.int32)}), on="item"
    )
    distinct = events.sort(["timestamp", "item_id"]).unique(
        subset=["user", "item_id"], keep="first", maintain_order=True
    )
    duplicates = events.height - distinct.height

    lengths = distinct.group_by("user").len()
    kept = lengths.filter(pl.col("len") >= MIN_INTERACTIONS)
    if kept.height == 0:
        raise DataError(
            f"{name}: no user has at least {MIN_INTERACTIONS} distinct interactions "
            f"({MIN_HISTORY} history items + validation + test); {lengths.height} users, "
            f"the longest has {lengths['len'].max()}"
        )
    user_raw = _ordered_ids(kept["user"])
    users = pl.DataFrame({"user": user_raw, "user_id": np.arange(len(user_raw), dtype=np.int32)})
    ordered = distinct.join(users, on="user").sort(["user_id", "timestamp", "item_id"])

    seq = ordered["item_id"].to_numpy().astype(np.int64)  # every kept interaction, user by user in time order
    counts = np.bincount(ordered["user_id"].to_numpy(), minlength=len(user_raw)).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    too_full = np.flatnonzero(num_items - counts < NUM_CANDIDATES - 1)
    if len(too_full):
        u = int(too_full[0])
        raise DataError(
            f"{name}: user {user_raw[u]!r} interacted with {counts[u]} of the {num_items} items, leaving fewer than "
            f"{NUM_CANDIDATES - 1} never-interacted items to sample as negatives"
        )
    seen = _seen_index(seq, counts, offsets, num_items)

    windows = _windows(counts, max_train_per_user)
    tables: dict[str, pa.Table] = {}
    next_id = 0
    for split in ("test", "validation", "train"):  # example-id order
        row_users, positions = windows[split]
        rng = np.random.default_rng([seed, _SPLIT_STREAMS[split]])
        history = _histories(seq, offsets, row_users, positions)
        targets = seq[offsets[row_users] + positions]
        negatives = _sample_negatives(rng, row_users, counts, seen, offsets, num_items)
        candidates = rng.permuted(np.concatenate([negatives, targets[:, None]], axis=1), axis=1)
        tables[split] = pa.Table.from_arrays(
            [
                pa.array(np.arange(next_id, next_id + len(row_users), dtype=np.int64)),
                pa.array(row_users.astype(np.int32)),
                history,
                pa.array(targets.astype(np.int32)),
                _fixed_lists(candidates),
            ],
            schema=EXAMPLES_SCHEMA,
        )
        next_id += len(row_users)

    titles = dict(interactions.titles.select("item", "title").iter_rows())
    items = pa.Table.from_arrays(
        [
            pa.array(np.arange(1, num_items + 1, dtype=np.int32)),
            pa.array(item_raw, type=pa.string()),
            pa.array([titles.get(raw) or f"item {raw}" for raw in item_raw], type=pa.string()),
        ],
        schema=ITEMS_SCHEMA,
    )
    stats = {
        "users": len(user_raw),
        "items": num_items,
        "interactions": int(len(seq)),
        "dropped_users": lengths.height - kept.height,
        "dropped_interactions": int(distinct.height - len(seq)),
        "duplicates_removed": int(duplicates),
        **{split: tables[split].num_rows for split in SPLITS},
    }
    return Examples(items=items, splits={split: tables[split] for split in SPLITS}, stats=stats)


def _ordered_ids(raw: pl.Series) -> list[str]:
    """Distinct raw ids, numerically ordered when all are integers, else by text."""
    distinct = pl.DataFrame({"raw": raw.unique()})
    number = distinct["raw"].cast(pl.Int64, strict=False)
    if number.null_count() == 0:
        distinct = distinct.with_columns(number=number).sort(["number", "raw"])
    else:
        distinct = distinct.sort("raw")
    return distinct["raw"].to_list()


def _windows(counts: np.ndarray, max_train_per_user: int | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(user, target position) rows of each split, in example order."""
    all_users = np.arange(len(counts), dtype=np.int64)
    train_per_user = counts - MIN_INTERACTIONS  # t = 3..n-3 gives n-5 train targets
    if max_train_per_user is not None:
        train_per_user = np.minimum(train_per_user, max_train_per_user)
    train_users = np.repeat(all_users, train_per_user)
    first = np.concatenate([[0], np.cumsum(train_per_user)[:-1]])
    rank = np.arange(len(train_users)) - np.repeat(first, train_per_user)  # 0 = oldest kept window
    train_positions = (counts - 2 - train_per_user)[train_users] + rank
    return {
        "test": (all_users, counts - 1),
        "validation": (all_users, counts - 2),
        "train": (train_users, train_positions),
    }


def _histories(seq: np.ndarray, offsets: np.ndarray, users: np.ndarray, positions: np.ndarray) -> pa.Array:
    """list<int32> of s[max(0, t-10):t] per row, gathered without a Python loop."""
    end = offsets[users] + positions
    start = offsets[users] + np.maximum(0, positions - MAX_HISTORY)
    lengths = end - start
    list_offsets = np.concatenate([[0], np.cumsum(lengths)])
    gather = np.repeat(start - list_offsets[:-1], lengths) + np.arange(list_offsets[-1])
    return pa.ListArray.from_arrays(pa.array(list_offsets.astype(np.int32)), pa.array(seq[gather].astype(np.int32)))


def _fixed_lists(matrix: np.ndarray) -> pa.Array:
    rows, width = matrix.shape
    offsets = np.arange(0, rows * width + 1, width, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(matrix.reshape(-1).astype(np.int32)))


def _seen_index(seq: np.ndarray, counts: np.ndarray, offsets: np.ndarray, num_items: int) -> np.ndarray:
    """Sorted keys that turn "k-th item the user never interacted with" into a searchsorted.

    For user u with interacted items S (ascending), key_i = u*(N+1) + (S_i - 1 - i), the number
    of never-interacted items below S_i, offset per user so the keys of all users are sorted.
    """
    owner = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    by_item = seq[np.lexsort((seq, owner))]
    rank = np.arange(len(seq)) - offsets[owner]
    return owner * (num_items + 1) + (by_item - 1 - rank)


def _sample_negatives(
    rng: np.random.Generator,
    users: np.ndarray,
    counts: np.ndarray,
    seen: np.ndarray,
    offsets: np.ndarray,
    num_items: int,
) -> np.ndarray:
    """[rows, 19] distinct items each row's user never interacted with, uniformly at random.

    Floyd's algorithm picks 19 distinct indices into the user's never-interacted items (all rows
    at once, 19 vectorised steps, no rejection); `seen` maps each index to its item id.
    """
    k = NUM_CANDIDATES - 1
    allowed = num_items - counts[users]
    picks = np.zeros((len(users), k), dtype=np.int64)
    for step in range(k):
        high = allowed - k + step  # inclusive bound of this step
        draw = rng.integers(0, high + 1)
        clash = (picks[:, :step] == draw[:, None]).any(axis=1)
        picks[:, step] = np.where(clash, high, draw)
    keys = users[:, None] * (num_items + 1) + picks
    interacted_below = np.searchsorted(seen, keys, side="right") - offsets[users][:, None]
    return picks + 1 + interacted_below


# --------------------------------------------------------------------------- the folder


def _check_target(out: Path, overwrite: bool) -> None:
    """Refuse to replace anything but an empty folder, or (with `overwrite`) a prepared folder."""
    check_destination(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise C2KDError(f"{out}: exists and is not a folder")
    if not any(out.iterdir()):
        return
    if not overwrite:
        raise C2KDError(f"{out}: already exists; pass --overwrite to replace it")
    if not (out / "manifest.json").is_file():
        raise C2KDError(
            f"{out}: not a prepared data folder (no manifest.json); refusing to replace it even with --overwrite"
        )


def write_examples(examples: Examples, manifest: dict, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write the folder beside `out` under a temporary name and rename it into place when whole."""
    out = Path(out)
    _check_target(out, overwrite)
    with staged_dir(out, replace=True) as staged:  # an existing (prepared or empty) folder is replaced whole
        _write_parquet(examples.items, staged / "items.parquet")
        for split, table in examples.splits.items():
            _write_parquet(table, staged / f"{split}.parquet")
        (staged / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def _write_parquet(table: pa.Table, path: Path) -> None:
    # Every option pinned, one row group: the same table gives the same bytes.
    pq.write_table(
        table,
        path,
        row_group_size=max(1, table.num_rows),
        compression="zstd",
        compression_level=3,
        use_dictionary=True,
        write_statistics=True,
        data_page_version="1.0",
    )
