"""Per-example results of an evaluation: `predictions.parquet`, one row per evaluated example.

Every evaluation that writes metrics also writes what each example got, so that methods can be
compared user by user (`c2kd.compare`) instead of only by their means. One file holds every split
an evaluation read (the `split` column); its mean `hit@1` over a split is that split's HR@1, its
mean `ndcg@10` the NDCG@10 over the 20 candidates (the same ranks, `c2kd.metrics`).

Columns (COLUMNS):

    example_id    int64    the example's id in the prepared folder
    user          int32    its user
    split         string   train | validation | test
    target        int32    the target item id
    rank          int32    the target's rank among the example's 20 stored candidates (1 = first;
                           pessimistic ties, as the metrics)
    hit@1         bool     rank <= 1
    hit@10        bool     rank <= 10
    ndcg@10       float64  [rank <= 10] / log2(rank + 1)
    catalog_rank  int32    the target's full-catalog rank (history and padding excluded); null where
                           the evaluation did not rank the catalog (llara, model selection)
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import polars as pl
import torch

from c2kd.atomic import write_bytes
from c2kd.errors import C2KDError
from c2kd.metrics import per_example_gains

PREDICTIONS_FILE = "predictions.parquet"
COLUMNS: dict[str, pl.DataType] = {
    "example_id": pl.Int64(),
    "user": pl.Int32(),
    "split": pl.String(),
    "target": pl.Int32(),
    "rank": pl.Int32(),
    "hit@1": pl.Boolean(),
    "hit@10": pl.Boolean(),
    "ndcg@10": pl.Float64(),
    "catalog_rank": pl.Int32(),
}


def prediction_rows(
    frame: pl.DataFrame, split: str, ranks: torch.Tensor | np.ndarray, catalog_ranks: torch.Tensor | np.ndarray | None = None
) -> pl.DataFrame:
    """The rows of one evaluated split: `frame` is the split's examples (example_id, user, target) in
    the order of `ranks` (candidate ranks [B]); `catalog_ranks` [B] where the catalog was ranked."""
    ranks = torch.as_tensor(ranks).reshape(-1)
    if ranks.shape[0] != frame.height:
        raise ValueError(f"{ranks.shape[0]} ranks for {frame.height} examples of split {split!r}")
    gains = per_example_gains(ranks, (1, 10), (10,), mrr=False)
    if catalog_ranks is None:
        catalog = pl.Series("catalog_rank", [None] * frame.height, dtype=pl.Int32)
    else:
        catalog_ranks = torch.as_tensor(catalog_ranks).reshape(-1)
        if catalog_ranks.shape[0] != frame.height:
            raise ValueError(f"{catalog_ranks.shape[0]} catalog ranks for {frame.height} examples of split {split!r}")
        catalog = pl.Series("catalog_rank", catalog_ranks.cpu().numpy().astype(np.int32))
    return pl.DataFrame({
        "example_id": frame["example_id"].cast(pl.Int64),
        "user": frame["user"].cast(pl.Int32),
        "split": pl.Series([split] * frame.height, dtype=pl.String),
        "target": frame["target"].cast(pl.Int32),
        "rank": ranks.cpu().numpy().astype(np.int32),
        "hit@1": gains["HR@1"].cpu().numpy() > 0,
        "hit@10": gains["HR@10"].cpu().numpy() > 0,
        "ndcg@10": gains["NDCG@10"].cpu().numpy(),
        "catalog_rank": catalog,
    }, schema=COLUMNS)


def check_predictions(frame: pl.DataFrame, source: str) -> pl.DataFrame:
    """`frame` with exactly COLUMNS (in that order), or a one-line error naming `source`."""
    missing = [name for name in COLUMNS if name not in frame.columns]
    if missing:
        raise C2KDError(f"{source}: missing column(s) {', '.join(missing)}; a predictions file has "
                        f"{', '.join(COLUMNS)}")
    wrong = [f"{name} is {frame.schema[name]}, expected {dtype}" for name, dtype in COLUMNS.items()
             if frame.schema[name] != dtype]
    if wrong:
        raise C2KDError(f"{source}: {'; '.join(wrong)}")
    if frame.height == 0:
        raise C2KDError(f"{source}: no rows")
    duplicated = frame.select("split", "example_id").is_duplicated()
    if duplicated.any():
        row = frame.filter(duplicated).row(0, named=True)
        raise C2KDError(f"{source}: example {row['example_id']} appears twice in split {row['split']!r}")
    return frame.select(list(COLUMNS))


def write_predictions(path: str | os.PathLike, parts: pl.DataFrame | Sequence[pl.DataFrame]) -> Path:
    """Write the rows of one evaluation (one frame per split, or one frame) to `path`, atomically."""
    frames = [parts] if isinstance(parts, pl.DataFrame) else list(parts)
    frame = check_predictions(pl.concat(frames, how="vertical"), str(path))
    buffer = io.BytesIO()
    frame.write_parquet(buffer)
    path = Path(path)
    write_bytes(path, buffer.getvalue())
    return path


def read_predictions(path: str | os.PathLike) -> pl.DataFrame:
    """A predictions file, or the `predictions.parquet` of a run folder, its columns checked."""
    path = Path(path)
    if path.is_dir():
        path = path / PREDICTIONS_FILE
    if not path.is_file():
        raise C2KDError(f"{path}: no such predictions file (evaluations write {PREDICTIONS_FILE} next to their metrics)")
    try:
        frame = pl.read_parquet(path)
    except Exception as err:  # polars raises several kinds for a broken file
        raise C2KDError(f"{path}: not a readable Parquet file ({err})") from None
    return check_predictions(frame, str(path))


def predictions_path(metrics_file: str | os.PathLike) -> Path:
    """Where the predictions of a metrics JSON file go: `metrics.json` -> `predictions.parquet` beside
    it, any other `NAME.json` -> `NAME.predictions.parquet` (so two evaluations in one folder keep
    their own rows)."""
    metrics_file = Path(metrics_file)
    if metrics_file.name == "metrics.json":
        return metrics_file.with_name(PREDICTIONS_FILE)
    return metrics_file.with_name(f"{metrics_file.stem}.{PREDICTIONS_FILE}")
