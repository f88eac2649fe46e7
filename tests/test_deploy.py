"""Export to ONNX and ExecuTorch, rank with their runtimes alone, and `c2kd recommend`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from c2kd.cli import main
from c2kd.deploy.export import export_ranker
from c2kd.deploy.runtime import Ranker, RankerError
from c2kd.evaluate import rank_scores
from c2kd.data.examples import load_examples
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.prompts import PromptEncoder, encode_frame
from c2kd.recmodel.tokenizer import build_word_tokenizer


@pytest.fixture(scope="module")
def examples(tiny_examples_dir):
    return load_examples(tiny_examples_dir)


def _model(examples, item_head: str, frozen: bool, seed: int = 0) -> RecLM:
    torch.manual_seed(seed)
    tokenizer = build_word_tokenizer(examples.titles()[1:], examples.num_items)
    emb = torch.randn(examples.num_items + 1, 64)
    emb[0] = 0
    model = RecLM.from_preset("micro", tokenizer, emb, "ids", seed=seed, item_head=item_head,
                              data_fingerprint=examples.fingerprint)
    if frozen:
        model.freeze_vocabulary()
        with torch.no_grad():  # trained rows differ from the table's
            model.added.input_rows.add_(torch.randn_like(model.added.input_rows))
    return model.eval()


@pytest.fixture(scope="module")
def exported(examples, tmp_path_factory):
    root = tmp_path_factory.mktemp("deploy")
    model = _model(examples, "hybrid", frozen=True)
    model.save(root / "model")
    export_ranker(root / "model", root / "onnx", examples.titles())
    export_ranker(root / "model", root / "int8", examples.titles(), quantize="int8")
    return root


def _reference(model: RecLM, examples, frame):
    encoder = PromptEncoder(model.tokenizer, "ids", examples.titles())
    prompts = encode_frame(encoder, frame, with_target=False)
    return rank_scores(model, encoder, prompts, torch.tensor(frame["candidates"].to_list()))


@pytest.mark.parametrize("item_head,frozen", [("token", False), ("hybrid", False), ("hybrid", True)])
def test_exported_scores_equal_pytorch(examples, tmp_path, item_head, frozen):
    model = _model(examples, item_head, frozen)
    model.save(tmp_path / "model")
    export_ranker(tmp_path / "model", tmp_path / "onnx", examples.titles())
    ranker = Ranker.load(tmp_path / "onnx")
    frame = examples.split("test")
    ref = _reference(model, examples, frame)
    rows = list(zip(frame["history"].to_list(), frame["candidates"].to_list()))
    got = np.stack([ranker.scores(h, c) for h, c in rows])
    assert np.abs(got - ref.candidates.numpy()).max() < 1e-4
    # a left-padded batch scores the whole catalog like the model's full-catalog ranking
    batch = ranker.catalog_scores([ranker.prompt(h, c) for h, c in rows[:7]])
    assert np.abs(batch[:, 1:] - ref.full_catalog[:7, 1:].numpy()).max() < 1e-4
    assert ranker.spec["vocabulary"] < len(model.tokenizer)  # only the tokens an ids prompt can hold


def test_executorch_program_scores_equal_pytorch(examples, tmp_path):
    model = _model(examples, "hybrid", frozen=True, seed=1)
    model.save(tmp_path / "model")
    assert main(["export", "--model", str(tmp_path / "model"), "--data", str(examples.root), "--out",
                 str(tmp_path / "pte"), "--format", "executorch"]) == 0
    assert (tmp_path / "pte" / "model.pte").is_file() and not (tmp_path / "pte" / "model.onnx").exists()
    ranker = Ranker.load(tmp_path / "pte")
    frame = examples.split("test").head(12)
    ref = _reference(model, examples, frame)
    got = np.stack([ranker.scores(h, c) for h, c in zip(frame["history"].to_list(), frame["candidates"].to_list())])
    assert np.abs(got - ref.candidates.numpy()).max() < 1e-4  # prompts of different lengths: one dynamic graph
    prompts = [ranker.prompt(h) for h in frame["history"].to_list()[:3]]
    batched = ranker.catalog_scores(prompts)
    assert batched.shape[0] == 3 and np.allclose(batched[:, 1:], np.stack([ranker.catalog_scores([p])[0] for p in prompts])[:, 1:], atol=1e-4)
    with pytest.raises(RankerError, match="at most 512"):
        ranker.catalog_scores([[1] * 513])


def test_executorch_refuses_int8(exported, examples, tmp_path, capsys):
    assert main(["export", "--model", str(exported / "model"), "--data", str(examples.root), "--out",
                 str(tmp_path / "q"), "--format", "executorch", "--quantize", "int8"]) == 1
    assert "int8 for onnx only" in capsys.readouterr().err and not (tmp_path / "q").exists()


def test_int8_is_smaller_and_ranks_alike(exported, examples):
    fp32, int8 = Ranker.load(exported / "onnx"), Ranker.load(exported / "int8")
    assert (exported / "int8" / "model.onnx").stat().st_size < (exported / "onnx" / "model.onnx").stat().st_size
    assert int8.spec["quantize"] == "int8"
    frame = examples.split("test")
    a = np.stack([fp32.scores(h, c) for h, c in zip(frame["history"].to_list(), frame["candidates"].to_list())])
    b = np.stack([int8.scores(h, c) for h, c in zip(frame["history"].to_list(), frame["candidates"].to_list())])
    corr = np.corrcoef(a.ravel(), b.ravel())[0, 1]
    assert corr > 0.95, corr


def test_the_runtime_needs_no_pytorch(exported, examples):
    test = examples.split("test").row(0, named=True)
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # importing torch now fails
        from c2kd.deploy.runtime import Ranker, RankerError
        r = Ranker.load({str(exported / "onnx")!r})
        print(r.recommend({test["history"]}, {test["candidates"]}, top=3))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(eval(out.stdout)) == 3


def test_recommend_prints_titles_for_a_known_user(exported, examples, capsys):
    for model in ("model", "onnx"):
        assert main(["recommend", "--model", str(exported / model), "--data", str(examples.root), "--user", "3",
                     "--top", "5"]) == 0
        printed = capsys.readouterr().out
        test = examples.split("test").filter(examples.split("test")["user"] == 3).row(0, named=True)
        assert "user 3 watched" in printed and examples.titles()[test["history"][-1]] in printed
        assert printed.count("\n│") >= 5  # five ranked rows


def test_recommend_for_a_made_up_user(exported, examples, capsys):
    titles = [t for t in examples.titles()[1:] if t and not t.startswith("item ")]
    code = main(["recommend", "--model", str(exported / "onnx"), "--data", str(examples.root),
                 "--history", f"{titles[0]}; {titles[1]}", "--top", "3"])
    assert code == 0 and "a made-up user watched" in capsys.readouterr().out


@pytest.mark.parametrize("args,says", [
    (["--user", "999"], "--user 999"),
    (["--history", "A Film That Does Not Exist"], "unknown title 'A Film That Does Not Exist'"),
    (["--user", "1", "--history", "x"], "either --user"),
])
def test_recommend_refusals(exported, examples, capsys, args, says):
    assert main(["recommend", "--model", str(exported / "onnx"), "--data", str(examples.root), *args]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and says in err[0], err


def test_recommend_and_export_refuse_a_folder_that_is_not_a_model(examples, tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert main(["recommend", "--model", str(tmp_path / "x"), "--data", str(examples.root), "--user", "1"]) == 1
    assert main(["export", "--model", str(tmp_path / "x"), "--data", str(examples.root), "--out", str(tmp_path / "o")]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 2 and all("not a saved recommender" in line for line in err), err
    assert not (tmp_path / "o").exists()


def test_export_cli_writes_a_ranker(exported, examples, tmp_path, capsys):
    assert main(["export", "--model", str(exported / "model"), "--data", str(examples.root), "--out",
                 str(tmp_path / "e"), "--quantize", "int8"]) == 0
    spec = json.loads((tmp_path / "e" / "ranker.json").read_text())
    assert spec["kind"] == "c2kd-ranker" and spec["quantize"] == "int8" and spec["num_items"] == examples.num_items
