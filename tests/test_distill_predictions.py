"""A finished `distill` run holds predictions.parquet: its validation and test rows are its metrics per example."""

from __future__ import annotations

import json

import polars as pl
import pytest
from conftest import save_random_teacher

from c2kd.data.examples import load_examples
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, cache_teacher
from c2kd.predictions import read_predictions
from c2kd.student.distill import DistillRecipe, distill


def test_distill_writes_per_example_rows_of_both_splits(tiny_examples_dir, tmp_path):
    examples = load_examples(tiny_examples_dir)
    teacher = save_random_teacher(examples, tmp_path, seed=3)
    cache = tmp_path / "cache"
    cache_teacher(teacher, examples, cache, CacheTeacherSettings(splits=("train",), progress=False, device="cpu",
                                                                max_examples=16, positions="answer"))
    out = tmp_path / "student"
    distill(cache, tiny_examples_dir, out, DistillRecipe(student="micro", method="sft", max_train=16, eval_batch_size=32),
            {"max_steps": 1, "batch_size": 16, "progress": False})
    metrics = json.loads((out / "metrics.json").read_text())
    rows = read_predictions(out)
    assert rows["split"].unique(maintain_order=True).to_list() == ["validation", "test"]
    for split in ("validation", "test"):
        part, frame = rows.filter(pl.col("split") == split), examples.split(split)
        assert part["example_id"].to_list() == frame["example_id"].to_list()
        assert part["user"].to_list() == frame["user"].to_list()
        assert part["hit@1"].mean() == pytest.approx(metrics[split]["candidates"]["HR@1"], abs=1e-12)
        assert part["ndcg@10"].mean() == pytest.approx(metrics[split]["candidates"]["NDCG@10"], abs=1e-12)
        assert (part["catalog_rank"] <= 10).mean() == pytest.approx(metrics[split]["full_catalog"]["HR@10"], abs=1e-12)
