"""Evaluation of recommender LMs: batched scores equal naive ones, trained models rank right."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from c2kd.errors import C2KDError
from c2kd.metrics import candidate_metrics
from c2kd.data.examples import load_examples, target_indices
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.prompts import PromptEncoder, collate, encode_frame
from c2kd.recmodel.tokenizer import build_word_tokenizer
from c2kd.evaluate import (evaluate_reclm, evaluate_reclm_with_predictions, generate_answers, left_pad, rank_scores,
                           RecLMEvaluator)
from c2kd.predictions import read_predictions

NUM_ITEMS = 30
WORDS = ["red", "blue", "green", "night", "day", "city", "river", "star", "king", "dream"]


def _unlabelled(batch: dict) -> dict:
    """A collated batch without labels: the model then returns logits at every position."""
    return {k: v for k, v in batch.items() if k != "labels"}


def _titles() -> list[str]:
    # two or three words per title, all distinct, none a whole-word part of another
    rng = np.random.default_rng(0)
    titles, seen = [""], set()
    while len(titles) <= NUM_ITEMS:
        title = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 4)), replace=False))
        if title not in seen and not any(title in t or t in title for t in seen):
            seen.add(title)
            titles.append(title.title())
    return titles


FAVOURITE = 7  # every user's next item: a rule a tiny model learns in a few dozen steps


def _split(rng: np.random.Generator, rows: int, first_id: int) -> pl.DataFrame:
    """Random histories and shuffled candidates (the target's position varies), target FAVOURITE."""
    recs = []
    for r in range(rows):
        pool = np.array([i for i in range(1, NUM_ITEMS + 1) if i != FAVOURITE])
        history = [int(x) for x in rng.choice(pool, size=int(rng.integers(3, 7)), replace=False)]
        target = FAVOURITE
        others = [i for i in range(1, NUM_ITEMS + 1) if i != target]
        candidates = [int(x) for x in rng.permutation([target, *rng.choice(others, size=19, replace=False)])]
        recs.append({"example_id": first_id + r, "user": r, "history": history, "target": target, "candidates": candidates})
    return pl.DataFrame(
        recs,
        schema={"example_id": pl.Int64, "user": pl.Int32, "history": pl.List(pl.Int32), "target": pl.Int32, "candidates": pl.List(pl.Int32)},
    )


def write_examples(root: Path, train_rows: int = 64, eval_rows: int = 24, fingerprint: str = "test-fp") -> Path:
    rng = np.random.default_rng(1)
    root.mkdir(parents=True)
    titles = _titles()
    pl.DataFrame(
        {"item": list(range(1, NUM_ITEMS + 1)), "raw_id": [str(i) for i in range(1, NUM_ITEMS + 1)], "title": titles[1:]},
        schema={"item": pl.Int32, "raw_id": pl.Utf8, "title": pl.Utf8},
    ).write_parquet(root / "items.parquet")
    _split(rng, eval_rows, 0).write_parquet(root / "test.parquet")
    _split(rng, eval_rows, eval_rows).write_parquet(root / "validation.parquet")
    _split(rng, train_rows, 2 * eval_rows).write_parquet(root / "train.parquet")
    manifest = {"format": "c2kd-examples", "version": 1, "stats": {"items": NUM_ITEMS}, "fingerprint": fingerprint}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    return load_examples(write_examples(tmp_path_factory.mktemp("data") / "examples"))


@pytest.fixture(scope="module")
def tokenizer(examples):
    return build_word_tokenizer(examples.titles()[1:], examples.num_items)


@pytest.fixture(scope="module")
def item_embeddings(examples):
    emb = torch.randn(examples.num_items + 1, 64, generator=torch.Generator().manual_seed(0))
    emb[0] = 0
    return emb


def _model(tokenizer, item_embeddings, fmt, seed=0, fingerprint="test-fp") -> RecLM:
    return RecLM.from_preset("micro", tokenizer, item_embeddings, fmt, seed=seed, data_fingerprint=fingerprint).eval()


def _fit(model: RecLM, encoded, steps: int, lr: float = 3e-3, batch_size: int = 32) -> RecLM:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(len(encoded), (batch_size,), generator=g).tolist()
        loss = model(**collate([encoded[i] for i in idx], model.tokenizer.pad_token_id)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _naive_llara_scores(model: RecLM, encoder: PromptEncoder, history, candidates) -> torch.Tensor:
    """One full right-padded forward pass per candidate answer; sum of its token log-probs."""
    scores = []
    with torch.no_grad():
        for c in candidates:
            e = encoder.encode(0, history, candidates, c)
            batch = collate([e], encoder.pad_id)
            logprobs = model(**_unlabelled(batch)).logits[0].log_softmax(-1)
            answer = range(e.prompt_length, len(e))
            scores.append(sum(float(logprobs[p - 1, e.input_ids[p]]) for p in answer))
    return torch.tensor(scores)


def test_llara_batched_ranking_equals_naive(examples, tokenizer, item_embeddings):
    model = _model(tokenizer, item_embeddings, "llara", seed=3)
    encoder = PromptEncoder(tokenizer, "llara", examples.titles())
    frame = examples.split("test").head(3)
    prompts = encode_frame(encoder, frame, with_target=False)
    candidates = torch.tensor(frame["candidates"].to_list())
    assert len({e.prompt_length for e in prompts}) > 1  # the batch really is padded
    got = rank_scores(model, encoder, prompts, candidates)
    assert got.full_catalog is None and got.candidates.shape == (3, 20)
    for row, (history, cands) in enumerate(zip(frame["history"].to_list(), frame["candidates"].to_list())):
        naive = _naive_llara_scores(model, encoder, history, cands)
        torch.testing.assert_close(got.candidates[row], naive, atol=1e-4, rtol=1e-4)


def test_ids_scores_are_the_answer_position_logits(examples, tokenizer, item_embeddings):
    model = _model(tokenizer, item_embeddings, "ids", seed=4)
    encoder = PromptEncoder(tokenizer, "ids", examples.titles())
    frame = examples.split("test").head(4)
    prompts = encode_frame(encoder, frame, with_target=False)
    got = rank_scores(model, encoder, prompts, torch.tensor(frame["candidates"].to_list()))
    with torch.no_grad():  # right-padded, as in training
        logits = model(**_unlabelled(collate(prompts, encoder.pad_id))).logits
    for row, e in enumerate(prompts):
        expected = logits[row, e.prompt_length - 1, model.item_token_ids]
        torch.testing.assert_close(got.full_catalog[row, 1:], expected[1:], atol=1e-4, rtol=1e-4)
        assert got.full_catalog[row, 0] == float("-inf")
        torch.testing.assert_close(got.candidates[row], expected[frame["candidates"][row].to_list()], atol=1e-4, rtol=1e-4)


def test_greedy_generation_equals_naive_decoding(examples, tokenizer, item_embeddings):
    model = _model(tokenizer, item_embeddings, "llara", seed=5)
    encoder = PromptEncoder(tokenizer, "llara", examples.titles())
    prompts = encode_frame(encoder, examples.split("test").head(3), with_target=False)
    got = generate_answers(model, left_pad(prompts, encoder.pad_id, model.device), max_new_tokens=6)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        for row, e in enumerate(prompts):
            ids, slots, expected = list(e.input_ids), list(e.slot_items), []
            for _ in range(6):
                batch = collate([type(e)(0, ids, slots, [-100] * len(ids), len(ids))], encoder.pad_id)
                token = int(model(**_unlabelled(batch)).logits[0, -1].argmax())
                if token == eos:
                    break
                expected.append(token)
                ids, slots = ids + [token], slots + [0]
            assert got[row] == expected


@pytest.mark.parametrize("fmt", ["ids", "llara"])
def test_trained_model_ranks_and_answers_right(examples, tokenizer, item_embeddings, fmt):
    model = _model(tokenizer, item_embeddings, fmt, seed=6)
    evaluator = RecLMEvaluator(examples, "test", limit=12, batch_size=6, progress=False)
    before = evaluator.evaluate(model)
    encoder = PromptEncoder(tokenizer, fmt, examples.titles())
    _fit(model, encode_frame(encoder, examples.split("train")), steps=30, lr=1e-2, batch_size=8)
    after = evaluator.evaluate(model)
    assert after["examples"] == 12
    assert after["candidates"]["HR@1"] >= 0.9 > before["candidates"]["HR@1"]
    assert after["candidates"]["MRR"] > before["candidates"]["MRR"]
    if fmt == "ids":
        assert after["full_catalog"]["HR@10"] >= 0.9 and "generation" not in after
    else:
        assert "full_catalog" not in after
        assert after["generation"]["ValidRatio"] >= 0.9 and after["generation"]["HR@1"] >= 0.9
        assert before["generation"]["HR@1"] < 0.5
    # the flat view for the trainer
    flat = evaluator(model)
    assert flat["HR@1"] == after["candidates"]["HR@1"]
    assert ("full_catalog/NDCG@10" in flat) == (fmt == "ids") and ("generation/ValidRatio" in flat) == (fmt == "llara")


@pytest.mark.parametrize("fmt", ["ids", "llara"])
def test_metrics_come_from_the_scores(examples, tokenizer, item_embeddings, fmt):
    """evaluate = metrics of rank_scores / of separately generated answers, batch by batch."""
    model = _model(tokenizer, item_embeddings, fmt, seed=7)
    frame = examples.split("validation")
    encoder = PromptEncoder(tokenizer, fmt, examples.titles())
    prompts = encode_frame(encoder, frame, with_target=False)
    scores = rank_scores(model, encoder, prompts, torch.tensor(frame["candidates"].to_list()))
    expected = candidate_metrics(scores.candidates, torch.as_tensor(target_indices(frame)))
    got = evaluate_reclm(model, examples, "validation", batch_size=5, progress=False, keep_answers=True)
    assert got["candidates"] == pytest.approx(expected, abs=1e-6)
    assert got["split"] == "validation" and got["format"] == fmt and got["examples"] == frame.height
    if fmt == "llara":
        generated = generate_answers(model, left_pad(prompts, encoder.pad_id, model.device), max_new_tokens=6)
        assert got["answers"] == [tokenizer.decode(ids, skip_special_tokens=True) for ids in generated]


@pytest.mark.parametrize("fmt", ["ids", "llara"])
def test_per_example_rows_are_the_metrics_per_example(examples, tokenizer, item_embeddings, fmt):
    model = _model(tokenizer, item_embeddings, fmt, seed=7)
    frame = examples.split("validation")
    result, rows = evaluate_reclm_with_predictions(model, examples, "validation", batch_size=5, progress=False)
    assert result == evaluate_reclm(model, examples, "validation", batch_size=5, progress=False)
    assert rows["example_id"].to_list() == frame["example_id"].to_list()
    assert rows["user"].to_list() == frame["user"].to_list() and set(rows["split"]) == {"validation"}
    cand = result["candidates"]
    assert rows["hit@1"].mean() == pytest.approx(cand["HR@1"], abs=1e-12)
    assert rows["hit@10"].mean() == pytest.approx(cand["HR@10"], abs=1e-12)
    assert rows["ndcg@10"].mean() == pytest.approx(cand["NDCG@10"], abs=1e-12)
    assert (1 / rows["rank"]).mean() == pytest.approx(cand["MRR"], abs=1e-12)
    if fmt == "ids":
        assert (rows["catalog_rank"] <= 10).mean() == pytest.approx(result["full_catalog"]["HR@10"], abs=1e-12)
    else:
        assert rows["catalog_rank"].null_count() == frame.height


def test_evaluate_saved_model_from_folders(examples, tokenizer, item_embeddings, tmp_path):
    model = _model(tokenizer, item_embeddings, "llara", seed=8)
    model.save(tmp_path / "m")
    direct = evaluate_reclm(model, examples, "test", limit=5, progress=False, keep_answers=True)
    from_disk = evaluate_reclm(tmp_path / "m", examples.root, "test", limit=5, progress=False)
    assert direct["examples"] == 5 and len(direct["answers"]) == 5
    assert direct["candidates"] == from_disk["candidates"] and direct["generation"] == from_disk["generation"]


def test_evaluate_refuses_other_data(examples, tokenizer, item_embeddings, tmp_path):
    model = _model(tokenizer, item_embeddings, "ids", fingerprint="another-fp")
    with pytest.raises(C2KDError, match="fingerprint"):
        evaluate_reclm(model, examples, "test", progress=False)
    with pytest.raises(C2KDError, match="unknown split"):
        evaluate_reclm(_model(tokenizer, item_embeddings, "ids"), examples, "dev", progress=False)


def test_cli_evaluates_a_reclm_folder(tiny_examples_dir, tmp_path):
    """`c2kd evaluate` on a prepared folder and a saved recommender LM (both formats' outputs)."""
    from typer.testing import CliRunner

    from c2kd.cli import app

    data = load_examples(tiny_examples_dir)
    tok = build_word_tokenizer(data.titles()[1:], data.num_items)
    emb = torch.randn(data.num_items + 1, 64, generator=torch.Generator().manual_seed(1))
    for fmt in ("ids", "llara"):
        RecLM.from_preset("micro", tok, emb, fmt, data_fingerprint=data.fingerprint).save(tmp_path / fmt)
        out = tmp_path / f"{fmt}.json"
        args = ["evaluate", "--model", str(tmp_path / fmt), "--data", str(tiny_examples_dir), "--out", str(out)]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        metrics = json.loads(out.read_text())
        assert metrics["kind"] == "reclm" and metrics["examples"] == data.split("test").height
        assert ("full_catalog" in metrics) == (fmt == "ids") and ("generation" in metrics) == (fmt == "llara")
        assert metrics["candidates"] == evaluate_reclm(tmp_path / fmt, data, "test", progress=False)["candidates"]
        rows = read_predictions(tmp_path / f"{fmt}.predictions.parquet")
        assert rows.height == metrics["examples"] and rows["hit@1"].mean() == pytest.approx(metrics["candidates"]["HR@1"])
    # a model trained on other data is refused with one clear line
    RecLM.from_preset("micro", tok, emb, "ids", data_fingerprint="other").save(tmp_path / "other")
    result = CliRunner().invoke(app, ["evaluate", "--model", str(tmp_path / "other"), "--data", str(tiny_examples_dir)])
    assert result.exit_code == 1 and "fingerprint" in result.output
