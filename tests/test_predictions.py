"""The predictions file (c2kd.predictions): its rows agree with the metrics, its reader checks columns."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch

from c2kd.errors import C2KDError
from c2kd.metrics import candidate_metrics, candidate_ranks
from c2kd.predictions import COLUMNS, prediction_rows, predictions_path, read_predictions, write_predictions


def examples(n: int) -> pl.DataFrame:
    return pl.DataFrame({"example_id": np.arange(n) * 7, "user": np.arange(n) % 5, "target": 1 + np.arange(n)})


def test_rows_are_the_metrics_per_example():
    torch.manual_seed(0)
    scores = torch.randint(0, 4, (64, 20)).float()  # many ties: the pessimistic rule matters
    target = torch.randint(0, 20, (64,))
    rows = prediction_rows(examples(64), "test", candidate_ranks(scores, target))
    metrics = candidate_metrics(scores, target)
    assert rows["hit@1"].mean() == metrics["HR@1"]
    assert rows["hit@10"].mean() == metrics["HR@10"]
    assert rows["ndcg@10"].mean() == pytest.approx(metrics["NDCG@10"], abs=1e-15)
    assert (1 / rows["rank"].cast(pl.Float64)).mean() == pytest.approx(metrics["MRR"])
    assert rows["catalog_rank"].null_count() == 64
    assert dict(rows.schema) == COLUMNS


def test_write_then_read_round_trip(tmp_path):
    parts = [prediction_rows(examples(4), "validation", torch.tensor([1, 2, 11, 3]), torch.tensor([5, 9, 40, 1])),
             prediction_rows(examples(3), "test", torch.tensor([20, 1, 1]))]
    path = write_predictions(tmp_path / "run" / "predictions.parquet", parts)
    back = read_predictions(tmp_path / "run")
    assert back.equals(pl.concat(parts))
    assert read_predictions(path)["split"].to_list() == ["validation"] * 4 + ["test"] * 3
    assert back["hit@10"].to_list() == [True, True, False, True, False, True, True]


def test_reader_names_the_file_and_the_problem(tmp_path):
    with pytest.raises(C2KDError, match=r"run: .*no such predictions file"):
        read_predictions(tmp_path / "run")
    rows = prediction_rows(examples(3), "test", torch.tensor([1, 2, 3]))
    bad = tmp_path / "bad.parquet"
    rows.drop("rank").write_parquet(bad)
    with pytest.raises(C2KDError, match=r"bad.parquet: missing column\(s\) rank"):
        read_predictions(bad)
    rows.with_columns(pl.col("user").cast(pl.Int64)).write_parquet(bad)
    with pytest.raises(C2KDError, match=r"bad.parquet: user is Int64, expected Int32"):
        read_predictions(bad)
    bad.write_text("not parquet")
    with pytest.raises(C2KDError, match="bad.parquet: not a readable Parquet file"):
        read_predictions(bad)
    with pytest.raises(C2KDError, match="example 0 appears twice in split 'test'"):
        write_predictions(tmp_path / "twice.parquet", [rows, rows])
    assert not (tmp_path / "twice.parquet").exists()


def test_predictions_path_beside_a_metrics_file(tmp_path):
    assert predictions_path(tmp_path / "metrics.json") == tmp_path / "predictions.parquet"
    assert predictions_path(tmp_path / "teacher-test.json") == tmp_path / "teacher-test.predictions.parquet"
