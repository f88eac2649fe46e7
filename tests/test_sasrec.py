"""SASRec baseline: learning, validation-only selection, determinism, run folder, evaluate CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from typer.testing import CliRunner

import c2kd.sasrec.train as sasrec
from c2kd.cli import app
from c2kd.errors import C2KDError
from c2kd.data.examples import load_examples
from c2kd.data.prepare import prepare
from c2kd.predictions import read_predictions
from c2kd.sasrec.train import (
    SASRecTrainConfig,
    evaluate_sasrec,
    evaluate_sasrec_with_predictions,
    fit,
    load_item_embeddings,
    load_sasrec,
    train_sasrec,
)

FAST = SASRecTrainConfig(epochs=3, batch_size=64, patience=3)
# Expected NDCG@10 of a random ranking of 20 candidates: mean over ranks 1..20 of [r <= 10] / log2(r + 1).
RANDOM_NDCG10 = sum(1 / math.log2(r + 1) for r in range(1, 11)) / 20


@pytest.fixture(scope="module")
def ring_examples_dir(tmp_path_factory) -> Path:
    """A tiny source with sequential structure SASRec can learn: each user walks a ring of
    40 items one step at a time from a random start (the tiny fixture's items are random, so
    nothing beyond noise can be learnt from it)."""
    rng = np.random.default_rng(3)
    rows = []
    for user in range(48):
        start, length = int(rng.integers(0, 40)), int(rng.integers(8, 14))
        rows += [(f"u{user}", 1000 + (start + step) % 40, 10 * step) for step in range(length)]
    folder = tmp_path_factory.mktemp("ring")
    source = folder / "interactions.csv"
    pl.DataFrame(rows, schema=["user", "item", "timestamp"], orient="row").write_csv(source)
    prepare(source, folder / "examples", seed=0)
    return folder / "examples"


@pytest.fixture(scope="module")
def tiny_run(tiny_examples_dir, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sasrec") / "run"
    train_sasrec(tiny_examples_dir, run, FAST)
    return run


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_training_reduces_loss_and_beats_random(ring_examples_dir):
    ex = load_examples(ring_examples_dir)
    result = fit(ex.num_items, ex.split("train"), ex.split("validation"), SASRecTrainConfig(epochs=8, batch_size=64, lr=5e-3, dropout=0.1, patience=8))
    losses = [entry["train_loss"] for entry in result.log]
    assert losses[-1] < 0.5 * losses[0]
    val = result.best_validation["candidates"]
    assert val["NDCG@10"] > RANDOM_NDCG10 + 0.3
    assert val["HR@1"] > 0.5  # random: 1/20


def test_selection_reads_test_split_only_after_training(tiny_examples_dir, tmp_path, monkeypatch):
    events: list[str] = []

    class RecordingSplits(dict):
        def __getitem__(self, name):
            events.append(f"read {name}")
            return super().__getitem__(name)

    real_fit = sasrec.fit

    def recording_fit(*args, **kwargs):
        events.append("fit start")
        result = real_fit(*args, **kwargs)
        events.append("fit end")
        return result

    monkeypatch.setattr(sasrec, "fit", recording_fit)
    ex = load_examples(tiny_examples_dir)
    ex = dataclasses.replace(ex, splits=RecordingSplits(ex.splits))
    metrics = train_sasrec(ex, tmp_path / "run", dataclasses.replace(FAST, epochs=5, patience=5))

    assert events.count("read test") == 1
    assert events.index("read test") > events.index("fit end")
    # The selected epoch is the best validation epoch, and its validation score is the one reported.
    scores = [entry["validation_NDCG@10"] for entry in metrics["log"]]
    assert metrics["selected_epoch"] == 1 + int(np.argmax(scores))
    assert metrics["validation"]["candidates"]["NDCG@10"] == pytest.approx(max(scores))


def test_test_split_content_does_not_change_the_model(tiny_examples_dir, tmp_path):
    ex = load_examples(tiny_examples_dir)
    scrambled = ex.split("test").with_columns(pl.col("candidates").list.reverse(), pl.col("example_id") + 10_000)
    other = dataclasses.replace(ex, splits={**ex.splits, "test": scrambled})
    train_sasrec(ex, tmp_path / "a", FAST)
    train_sasrec(other, tmp_path / "b", FAST)
    assert _same_weights(load_sasrec(tmp_path / "a")[0], load_sasrec(tmp_path / "b")[0])


def test_fixed_seed_is_deterministic(tiny_examples_dir):
    ex = load_examples(tiny_examples_dir)
    args = (ex.num_items, ex.split("train"), ex.split("validation"))
    a, b = fit(*args, FAST), fit(*args, FAST)
    c = fit(*args, dataclasses.replace(FAST, seed=1))
    assert a.log == b.log and _same_weights(a.model, b.model)
    assert not _same_weights(a.model, c.model)


def test_fit_does_not_disturb_callers_random_state(tiny_examples_dir):
    ex = load_examples(tiny_examples_dir)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    fit(ex.num_items, ex.split("train"), ex.split("validation"), dataclasses.replace(FAST, epochs=1))
    assert torch.equal(torch.rand(3), expected)


def test_run_folder_and_item_embeddings(tiny_run, tiny_examples_dir):
    ex = load_examples(tiny_examples_dir)
    assert sorted(p.name for p in tiny_run.iterdir()) == [
        "config.json", "item_embeddings.safetensors", "metrics.json", "model.safetensors", "predictions.parquet"
    ]
    config = json.loads((tiny_run / "config.json").read_text())
    assert config["kind"] == "sasrec" and config["data_fingerprint"] == ex.fingerprint
    emb = load_item_embeddings(tiny_run)
    assert emb.dtype == torch.float32 and tuple(emb.shape) == (ex.num_items + 1, 64)
    assert torch.count_nonzero(emb[0]) == 0 and torch.count_nonzero(emb[1:]) > 0
    model, _ = load_sasrec(tiny_run)
    assert torch.equal(emb, model.item_emb.weight)
    metrics = json.loads((tiny_run / "metrics.json").read_text())
    assert set(metrics["test"]["candidates"]) == {"HR@1", "HR@5", "HR@10", "NDCG@5", "NDCG@10", "MRR"}
    assert set(metrics["test"]["full_catalog"]) == {"HR@10", "NDCG@10"}


def test_load_item_embeddings_checks_shape(tiny_run, tmp_path):
    from safetensors.torch import save_file

    broken = tmp_path / "run"
    shutil.copytree(tiny_run, broken)
    save_file({"item_embeddings": torch.zeros(5, 64)}, str(broken / "item_embeddings.safetensors"))
    with pytest.raises(C2KDError, match=r"expected torch.float32 \(61, 64\)"):
        load_item_embeddings(broken)


def test_evaluate_matches_training_metrics(tiny_run, tiny_examples_dir):
    metrics = json.loads((tiny_run / "metrics.json").read_text())
    for split in ("validation", "test"):
        result = evaluate_sasrec(tiny_run, tiny_examples_dir, split)
        assert result["examples"] == metrics[split]["examples"]
        assert result["candidates"] == pytest.approx(metrics[split]["candidates"])
        assert result["full_catalog"] == pytest.approx(metrics[split]["full_catalog"])


def assert_rows_match_metrics(rows: pl.DataFrame, metrics: dict, frame: pl.DataFrame) -> None:
    """Per-example rows of one split: the split's examples, in order, whose means are the metrics."""
    assert rows["example_id"].to_list() == frame["example_id"].to_list()
    assert rows["user"].to_list() == frame["user"].to_list()
    assert rows["target"].to_list() == frame["target"].to_list()
    assert rows.height == metrics["examples"]
    assert rows["hit@1"].mean() == pytest.approx(metrics["candidates"]["HR@1"], abs=1e-12)
    assert rows["hit@10"].mean() == pytest.approx(metrics["candidates"]["HR@10"], abs=1e-12)
    assert rows["ndcg@10"].mean() == pytest.approx(metrics["candidates"]["NDCG@10"], abs=1e-12)
    assert (1 / rows["rank"]).mean() == pytest.approx(metrics["candidates"]["MRR"], abs=1e-12)
    assert (rows["catalog_rank"] <= 10).mean() == pytest.approx(metrics["full_catalog"]["HR@10"], abs=1e-12)


def test_run_folder_predictions_are_the_metrics_per_example(tiny_run, tiny_examples_dir):
    metrics = json.loads((tiny_run / "metrics.json").read_text())
    rows = read_predictions(tiny_run)
    ex = load_examples(tiny_examples_dir)
    assert rows["split"].unique(maintain_order=True).to_list() == ["validation", "test"]
    for split in ("validation", "test"):
        assert_rows_match_metrics(rows.filter(pl.col("split") == split), metrics[split], ex.split(split))
    # evaluating the run again gives the same rows, and the same metrics as without rows
    result, again = evaluate_sasrec_with_predictions(tiny_run, tiny_examples_dir, "test")
    assert again.equals(rows.filter(pl.col("split") == "test"))
    assert result == evaluate_sasrec(tiny_run, tiny_examples_dir, "test")


def test_refuses_model_trained_on_other_data(tiny_run, tiny_examples_dir, tmp_path):
    other = tmp_path / "run"
    shutil.copytree(tiny_run, other)
    config = json.loads((other / "config.json").read_text())
    config["data_fingerprint"] = "0" * 64
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(C2KDError, match="fingerprint"):
        evaluate_sasrec(other, tiny_examples_dir, "test")
    result = CliRunner().invoke(app, ["evaluate", "--model", str(other), "--data", str(tiny_examples_dir)])
    assert result.exit_code == 1
    assert "fingerprint" in result.output and "Traceback" not in result.output


def test_existing_output_is_refused_and_failed_writes_leave_nothing(tiny_run, tiny_examples_dir, tmp_path, monkeypatch):
    with pytest.raises(C2KDError, match="already exists"):
        train_sasrec(tiny_examples_dir, tiny_run, FAST)

    def failing_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(sasrec, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        train_sasrec(tiny_examples_dir, tmp_path / "run", dataclasses.replace(FAST, epochs=1))
    assert list(tmp_path.iterdir()) == []


def test_cli_train_then_evaluate_round_trip(tiny_examples_dir, tmp_path):
    runner = CliRunner()
    run = tmp_path / "run"
    trained = runner.invoke(
        app, ["train-sasrec", "--data", str(tiny_examples_dir), "--out", str(run), "--epochs", "2", "--batch-size", "64"]
    )
    assert trained.exit_code == 0, trained.output
    assert "NDCG@10" in trained.output
    out = tmp_path / "eval" / "test.json"
    evaluated = runner.invoke(app, ["evaluate", "--model", str(run), "--data", str(tiny_examples_dir), "--out", str(out)])
    assert evaluated.exit_code == 0, evaluated.output
    assert "HR@1" in evaluated.output and "full_catalog" in evaluated.output
    written = json.loads(out.read_text())
    expected = json.loads((run / "metrics.json").read_text())["test"]
    assert written["split"] == "test" and written["kind"] == "sasrec"
    assert written["candidates"] == pytest.approx(expected["candidates"])
    assert (run / "predictions.parquet").is_file()
    rows = read_predictions(tmp_path / "eval" / "test.predictions.parquet")
    assert_rows_match_metrics(rows, written, load_examples(tiny_examples_dir).split("test"))


def test_cli_reports_bad_inputs_in_one_line(tiny_examples_dir, tmp_path):
    runner = CliRunner()
    missing = runner.invoke(app, ["evaluate", "--model", str(tmp_path), "--data", str(tiny_examples_dir)])
    assert missing.exit_code == 1 and "no config.json" in missing.output
    (tmp_path / "config.json").write_text(json.dumps({"kind": "tree"}))
    unknown = runner.invoke(app, ["evaluate", "--model", str(tmp_path), "--data", str(tiny_examples_dir)])
    assert unknown.exit_code == 1 and "unknown model kind 'tree'" in unknown.output
    no_data = runner.invoke(app, ["train-sasrec", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "r")])
    assert no_data.exit_code == 1 and "manifest.json" in no_data.output


def test_model_is_causal_and_ignores_padding():
    from c2kd.sasrec.model import SASRec, SASRecSpec

    torch.manual_seed(0)
    model = SASRec(SASRecSpec(num_items=30, hidden=16, max_len=10)).eval()
    seq = torch.tensor([[0, 0, 0, 0, 0, 4, 9, 2, 7, 1]])
    with torch.no_grad():
        out = model(seq)
        # Left padding is invisible: the same history in a shorter window gives the same states.
        assert torch.allclose(model(seq[:, 5:]), out[:, 5:], atol=1e-6)
        # Causal: changing the last item changes nothing before it.
        changed = seq.clone()
        changed[0, -1] = 13
        assert torch.allclose(model(changed)[:, :-1], out[:, :-1], atol=1e-6)
        assert not torch.allclose(model(changed)[:, -1], out[:, -1])
        assert model.last_scores(seq)[0, 0] == float("-inf")  # padding is never recommended
