"""`c2kd train-teacher` end to end on the tiny examples with the `micro` preset (CPU, seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from c2kd.cli import app
from c2kd.errors import C2KDError
from c2kd.finetune import teacher
from c2kd.data.examples import load_examples
from c2kd.sasrec.train import (SASRecTrainConfig, SplitTensors, catalog_scores, load_item_embeddings, load_sasrec,
                                  train_sasrec)
from c2kd.finetune.teacher import LoraSettings, TeacherRecipe, build_model, train_teacher
from c2kd.run_folder import partial_dir
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.prompts import PromptEncoder, collate, encode_frame
from c2kd.evaluate import RecLMEvaluator
from c2kd.predictions import read_predictions

FAST = ["--model", "micro", "--max-train", "40", "--batch-size", "8", "--epochs", "2", "--max-val", "16",
        "--checkpoint-every", "3", "--lr", "3e-3", "--no-progress"]
FAST_CONFIG = dict(epochs=2, batch_size=8, lr=3e-3, checkpoint_every=3, log_every=1, progress=False)


@pytest.fixture(scope="module")
def sasrec_run(tiny_examples_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sasrec") / "run"
    train_sasrec(tiny_examples_dir, out, SASRecTrainConfig(epochs=1, patience=1))
    return out


def _validation_metric(model_dir: Path, data: Path, limit: int) -> float:
    evaluator = RecLMEvaluator(load_examples(data), "validation", limit=limit, generation=False, full_catalog=False,
                               progress=False)
    return evaluator(RecLM.load(model_dir))["NDCG@10"]


def test_cli_trains_saves_and_records_validation(tiny_examples_dir, sasrec_run, tmp_path):
    out = tmp_path / "teacher"
    result = CliRunner().invoke(app, ["train-teacher", "--data", str(tiny_examples_dir), "--sasrec", str(sasrec_run),
                                      "--out", str(out), "--format", "ids", *FAST])
    assert result.exit_code == 0, result.output
    assert "best validation NDCG@10" in result.output
    record = json.loads((out / "train.json").read_text())
    assert record["final_step"] == 10  # 40 examples / 8 per step x 2 epochs
    assert record["data"]["train_examples"] == 40 and record["data"]["validation_examples"] == 16
    assert record["data"]["fingerprint"] == load_examples(tiny_examples_dir).fingerprint
    assert record["validation"]["best_step"] in (5, 10)  # evaluated after each epoch
    best = record["validation"]["best"]["NDCG@10"]
    # the saved model IS the selected state: it reproduces the recorded validation metric
    assert _validation_metric(out, tiny_examples_dir, 16) == pytest.approx(best, abs=1e-9)
    # beside it, the selected model's validation metrics and the per-example rows they are the means of
    metrics = json.loads((out / "metrics.json").read_text())["validation"]
    assert metrics["candidates"]["NDCG@10"] == pytest.approx(best, abs=1e-9)
    rows = read_predictions(out)
    first16 = load_examples(tiny_examples_dir).split("validation").head(16)
    assert rows["example_id"].to_list() == first16["example_id"].to_list() and set(rows["split"]) == {"validation"}
    assert rows["ndcg@10"].mean() == pytest.approx(best, abs=1e-9)
    assert rows["hit@1"].mean() == pytest.approx(metrics["candidates"]["HR@1"], abs=1e-12)
    model = RecLM.load(out)
    assert model.spec.format == "ids" and model.spec.preset == "micro"
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["kind"] == "train"][-1] == 10
    assert all("tokens_per_s" in r for r in log if r["kind"] == "train")
    assert not partial_dir(out).exists()  # work folder removed once the model is in place

    # the same command again: the finished run is reported, nothing is trained
    again = CliRunner().invoke(app, ["train-teacher", "--data", str(tiny_examples_dir), "--sasrec", str(sasrec_run),
                                     "--out", str(out), *FAST])
    assert again.exit_code == 0 and "already complete" in again.output, again.output
    assert not partial_dir(out).exists()
    # other settings into the same folder: refused, naming what differs
    other = CliRunner().invoke(app, ["train-teacher", "--data", str(tiny_examples_dir), "--sasrec", str(sasrec_run),
                                     "--out", str(out), *FAST, "--lr", "0.5"])
    assert other.exit_code == 1 and "other settings (--lr was" in other.output, other.output


def test_lora_trains_adapters_item_tokens_and_projector(tiny_examples_dir, sasrec_run, tmp_path):
    out = tmp_path / "lora"
    recipe = TeacherRecipe(fmt="ids", model="micro", lora=LoraSettings(r=4), max_train=40, max_val=16)
    record = train_teacher(tiny_examples_dir, sasrec_run, out, recipe, FAST_CONFIG)
    examples = load_examples(tiny_examples_dir)
    start = build_model(TeacherRecipe(fmt="ids", model="micro"), examples, load_item_embeddings(sasrec_run), seed=0)
    trained = RecLM.load(out)
    assert record["model"]["trainable_parameters"] < sum(p.numel() for p in start.parameters())
    emb0, emb1 = start.lm.get_input_embeddings().weight, trained.lm.get_input_embeddings().weight
    items = torch.tensor(start.spec.item_token_ids[1:])
    others = torch.ones(len(emb0), dtype=torch.bool)
    others[items] = False
    others[start.spec.slot_token_id] = False
    assert torch.equal(emb0[others], emb1[others])  # ordinary words frozen
    assert not torch.allclose(emb0[items], emb1[items])  # item tokens trained
    q0, q1 = start.lm.model.layers[0].self_attn.q_proj.weight, trained.lm.model.layers[0].self_attn.q_proj.weight
    assert not torch.allclose(q0, q1)  # LoRA merged into the saved projection
    assert not torch.allclose(start.projector[0].weight, trained.projector[0].weight)
    assert _validation_metric(out, tiny_examples_dir, 16) == pytest.approx(record["validation"]["best"]["NDCG@10"], abs=1e-9)


def test_interrupted_run_resumes_to_the_same_model(tiny_examples_dir, sasrec_run, tmp_path, monkeypatch):
    recipe = TeacherRecipe(fmt="ids", model="micro", max_train=40, max_val=16)
    train_teacher(tiny_examples_dir, sasrec_run, tmp_path / "a", recipe, FAST_CONFIG)

    calls = {"n": 0}
    real_loss = teacher.answer_loss

    def crashing(model, batch):
        calls["n"] += 1
        if calls["n"] == 8:  # step 8; the last checkpoint is step 6
            raise KeyboardInterrupt
        return real_loss(model, batch)

    monkeypatch.setattr(teacher, "answer_loss", crashing)
    with pytest.raises(KeyboardInterrupt):
        train_teacher(tiny_examples_dir, sasrec_run, tmp_path / "b", recipe, FAST_CONFIG)
    monkeypatch.setattr(teacher, "answer_loss", real_loss)
    assert not (tmp_path / "b").exists() and (partial_dir(tmp_path / "b") / "checkpoints" / "step-000006").is_dir()

    with pytest.raises(C2KDError, match="other settings"):
        train_teacher(tiny_examples_dir, sasrec_run, tmp_path / "b", TeacherRecipe(fmt="ids", model="micro", max_train=30),
                      FAST_CONFIG)
    record = train_teacher(tiny_examples_dir, sasrec_run, tmp_path / "b", recipe, FAST_CONFIG)
    assert record["timings"]["resumed_from_step"] == 6
    for name in ("model.safetensors", "projector.safetensors"):
        a, b = load_file(tmp_path / "a" / name), load_file(tmp_path / "b" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_llara_format_trains(tiny_examples_dir, sasrec_run, tmp_path):
    recipe = TeacherRecipe(fmt="llara", model="micro", max_train=16, max_val=8)
    record = train_teacher(tiny_examples_dir, sasrec_run, tmp_path / "llara", recipe,
                           dict(FAST_CONFIG, epochs=1))
    assert record["format"] == "llara" and record["final_step"] == 2
    assert 0.0 <= record["validation"]["best"]["NDCG@10"] <= 1.0
    assert RecLM.load(tmp_path / "llara").spec.format == "llara"


@pytest.mark.parametrize("setting, term", [("history_loss", "history"), ("sasrec_kd", "sasrec_kd")])
def test_an_added_term_trains_and_is_logged_beside_the_answer_loss(tiny_examples_dir, sasrec_run, tmp_path, setting, term):
    recipe = TeacherRecipe(fmt="ids", model="micro", max_train=16, max_val=8, **{setting: 0.5})
    record = train_teacher(tiny_examples_dir, sasrec_run, tmp_path / "t", recipe, dict(FAST_CONFIG, epochs=1))
    assert record["final_step"] == 2
    log = [json.loads(line) for line in (tmp_path / "t" / "log.jsonl").read_text().splitlines()]
    step = next(r for r in log if r["kind"] == "train")
    assert step["loss"] == pytest.approx(step["answer"] + 0.5 * step[term], rel=1e-5)
    assert step[term] > 0


def test_sasrec_kd_term_is_the_kl_from_sasrec_at_the_answer_item(tiny_examples_dir, sasrec_run):
    examples = load_examples(tiny_examples_dir)
    model = build_model(TeacherRecipe(fmt="ids", model="micro"), examples, load_item_embeddings(sasrec_run), seed=0)
    frame = examples.split("train")[:6]
    encoder = PromptEncoder(model.tokenizer, "ids", examples.titles())
    batch_of = teacher.with_sasrec_logits(lambda b: collate(b, encoder.pad_id), sasrec_run, frame)
    encoded = encode_frame(encoder, frame)
    batch = batch_of(encoded[::-1])  # any order: the scores follow their examples
    sasrec, _ = load_sasrec(sasrec_run)
    expected_scores = catalog_scores(sasrec, SplitTensors.from_frame(frame).seq).flip(0)
    assert torch.equal(batch["sasrec_logits"], expected_scores)
    terms = teacher.teacher_loss(0.0, 1.0, model.item_token_ids)(model, batch)
    # the same KL, from the model's item scores at the position that predicts the answer item
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "sasrec_logits")}
    h = model.decode(**inputs).last_hidden_state
    at = torch.tensor([e.prompt_length - 1 for e in encoded[::-1]])
    items = model.item_scores(h[torch.arange(len(at)), at])[:, 1:]
    kl = torch.nn.functional.kl_div(items.log_softmax(-1), expected_scores[:, 1:].log_softmax(-1), log_target=True,
                                    reduction="batchmean")
    assert terms["sasrec_kd"].item() == pytest.approx(kl.item(), rel=1e-4)
    assert terms["loss"].item() == pytest.approx((terms["answer"] + terms["sasrec_kd"]).item(), rel=1e-6)


def test_clear_errors(tiny_examples_dir, sasrec_run, tmp_path):
    runner = CliRunner()
    base = ["train-teacher", "--data", str(tiny_examples_dir), "--sasrec", str(sasrec_run), "--out", str(tmp_path / "x")]
    for extra, message in [
        (["--model", "no-such-model"], "neither a preset"),
        (["--model", "micro", "--format", "text"], "unknown prompt format"),
        (["--model", "micro", "--eval-every", "often"], "--eval-every"),
        (["--model", "micro", "--batch-size", "0"], "batch_size must be >= 1"),
        (["--model", "micro", "--format", "llara", "--history-loss", "1"], "--history-loss"),
        (["--model", "micro", "--history-loss", "-1"], "--history-loss must be >= 0"),
        (["--model", "micro", "--format", "llara", "--sasrec-kd", "1"], "--sasrec-kd"),
        (["--model", "micro", "--sasrec-kd", "-1"], "--sasrec-kd must be >= 0"),
    ]:
        result = runner.invoke(app, base + extra)
        assert result.exit_code == 1 and message in result.output, result.output
    other = tmp_path / "other"
    (other / "config.json").parent.mkdir()
    (other / "config.json").write_text(json.dumps({"kind": "sasrec", "data_fingerprint": "deadbeef"}))
    result = runner.invoke(app, ["train-teacher", "--data", str(tiny_examples_dir), "--sasrec", str(other),
                                 "--out", str(tmp_path / "y"), "--model", "micro"])
    assert result.exit_code == 1 and "fingerprint" in result.output


@pytest.mark.slow
def test_torchrun_two_ranks_match_one_process(tiny_examples_dir, sasrec_run, tmp_path):
    # The micro Llama has no dropout, so 2 ranks x half batches (gradients averaged) follow the
    # single-process run up to float32 summation order.
    import os
    import subprocess
    import sys

    args = ["train-teacher", "--data", str(tiny_examples_dir), "--sasrec", str(sasrec_run), "--model", "micro",
            "--max-train", "32", "--batch-size", "8", "--epochs", "1", "--max-val", "8", "--no-progress"]
    single = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "one")])
    assert single.exit_code == 0, single.output
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "c2kd.cli", *args, "--out", str(tmp_path / "two")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-5)
    log = [json.loads(line) for line in (tmp_path / "two" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["kind"] == "eval"] == [4]  # written once, by rank 0
