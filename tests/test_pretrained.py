"""The pretrained families shipped as wheels (SmolLM2-135M, Gemma-3-270M) as teachers and students.

Each alias is converted from its GGUF once per machine (the model store, $C2KD_HOME) and loaded
once per module here; each test works on copies. Covered per family: the alias loads with its
real shapes and the item tokens; the head runs where it is read (answer-only loss = full-head
loss, item scores = the head's item columns); end to end in both prompt formats (train steps,
evaluation, save and reload); a truncated student (`--shrink first:K`) trains a few steps from a
cache the teacher wrote.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import c2kd.evaluate as evaluate_module
from c2kd.cache_schema import TeacherCache
from c2kd.evaluate import evaluate_reclm, left_pad, llara_candidate_scores
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, cache_teacher
from c2kd.data.examples import load_examples
from c2kd.recmodel.layers import late_layers
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.pretrained import converted_folder, model_store
from c2kd.recmodel.prompts import PromptEncoder, answer_mask, collate, encode_frame
from c2kd.recmodel.tokenizer import SLOT, item_token
from c2kd.student.distill import DistillRecipe, distill

pytestmark = pytest.mark.slow

FAMILIES = {
    # alias: (layers, width, vocabulary, layers a >= 8x smaller student keeps)
    "smollm2-135m": (30, 576, 49_152, 3),
    "gemma3-270m": (18, 640, 262_144, 2),
}


@pytest.fixture(scope="module")
def examples(tiny_examples_dir):
    return load_examples(tiny_examples_dir)


@pytest.fixture(scope="module", params=list(FAMILIES))
def pretrained(request, examples) -> tuple[str, RecLM]:
    emb = torch.randn(examples.num_items + 1, 64, generator=torch.Generator().manual_seed(0))
    emb[0] = 0
    alias = request.param
    return alias, RecLM.from_pretrained(alias, emb, "llara", data_fingerprint=examples.fingerprint)


def _as_format(loaded: RecLM, fmt: str, item_head: str = "token") -> RecLM:
    model = RecLM(copy.deepcopy(loaded.lm), loaded.tokenizer, loaded.item_embeddings, fmt,
                  data_fingerprint=loaded.spec.data_fingerprint, base=loaded.spec.base, item_head=item_head,
                  frozen_vocab=True)
    model.projector.load_state_dict(loaded.projector.state_dict())
    return model


def _unlabelled(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "labels"}


def test_alias_loads_with_its_shapes_and_item_tokens(pretrained, examples):
    alias, model = pretrained
    layers, width, vocab, _ = FAMILIES[alias]
    assert converted_folder(alias).parent == model_store()
    assert (model.num_layers, model.hidden_size) == (layers, width)
    assert late_layers(model.num_layers) == sorted(layers - k * max(1, layers // 16) for k in (1, 2, 3, 4))
    tok = model.tokenizer
    assert len(tok) == vocab + examples.num_items + 1  # its vocabulary + items + <slot>
    assert model.vocab_size >= len(tok)
    assert tok.convert_tokens_to_ids(item_token(examples.num_items)) == model.item_token_ids[-1]
    # the pretrained vocabulary is frozen; only the added tokens' rows (and the body) train
    assert model.spec.frozen_vocab and not model.base_lm().get_input_embeddings().weight.requires_grad
    assert model.added.input_rows.shape == (examples.num_items + 1, width) and model.added.input_rows.requires_grad


def test_gemma_knows_films():
    folder = converted_folder("gemma3-270m")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    lm = AutoModelForCausalLM.from_pretrained(folder)
    ids = tok("The Godfather is a movie directed by", return_tensors="pt")
    with torch.no_grad():
        out = lm.generate(**ids, max_new_tokens=6, do_sample=False)
    assert "Coppola" in tok.decode(out[0, ids["input_ids"].shape[1]:])


@pytest.mark.parametrize("item_head", ["token", "hybrid"])
def test_the_head_runs_only_where_it_is_read(pretrained, examples, item_head):
    _, loaded = pretrained
    model = _as_format(loaded, "ids", item_head).eval()
    encoder = PromptEncoder(model.tokenizer, "ids", examples.titles())
    batch = collate(encode_frame(encoder, examples.split("train").head(3)), encoder.pad_id)
    with torch.no_grad():
        answer_only = model(**batch)
        everywhere = model(**_unlabelled(batch)).logits
    mask = answer_mask(batch["labels"])
    # equal up to float32 summation order (the matmuls have other shapes)
    torch.testing.assert_close(answer_only.logits, everywhere[mask], atol=2e-4, rtol=1e-4)
    targets = batch["input_ids"][:, 1:][mask[:, :-1]]
    torch.testing.assert_close(answer_only.loss, F.cross_entropy(everywhere[mask], targets), atol=1e-5, rtol=1e-5)
    # ids ranking reads the item rows only: the same numbers as the head's item columns
    h = model.decode(batch["input_ids"], batch["attention_mask"], batch["slot_items"]).last_hidden_state[:, 5]
    with torch.no_grad():
        scores = model.item_scores(h)
        full = model.head_logits(h)
    torch.testing.assert_close(scores[:, 1:], full[:, model.item_token_ids[1:]], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(full, h @ model.effective_head_weight().T, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["llara", "ids"])
def test_teacher_end_to_end(pretrained, examples, fmt, tmp_path, monkeypatch):
    _, loaded = pretrained
    model = _as_format(loaded, fmt)
    encoder = PromptEncoder(model.tokenizer, fmt, examples.titles())
    batch = collate(encode_frame(encoder, examples.split("train").head(1)), encoder.pad_id)

    # hybrid embeddings: the slot positions get the projected SASRec embedding
    slots = batch["slot_items"] > 0
    if fmt == "llara":
        assert (batch["input_ids"][slots] == model.tokenizer.convert_tokens_to_ids(SLOT)).all()
    else:
        assert (batch["input_ids"][slots] == model.item_token_ids[batch["slot_items"][slots]]).all()

    # two training steps lower the loss on the example they saw, and move only trainable rows
    frozen_table = model.base_lm().get_input_embeddings().weight.clone()
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    first = None
    for _ in range(2):
        loss = model(**batch).loss
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert float(model(**batch).loss) < first
    assert torch.equal(model.base_lm().get_input_embeddings().weight, frozen_table)

    model.eval()
    result = evaluate_reclm(model, examples, "test", limit=3, batch_size=3, progress=False, keep_answers=True)
    assert result["examples"] == 3 and 0.0 <= result["candidates"]["HR@1"] <= 1.0
    if fmt == "llara":
        assert 0.0 <= result["generation"]["ValidRatio"] <= 1.0 and len(result["answers"]) == 3
        # batched candidate scores = one full forward pass per candidate (two prompts of different length)
        frame = examples.split("test").head(2)
        prompts = encode_frame(encoder, frame, with_target=False)
        cands = torch.tensor(frame["candidates"].to_list())[:, :3]
        got = llara_candidate_scores(model, encoder, left_pad(prompts, encoder.pad_id, model.device), cands)
        full = [encoder.encode(0, h, c, x) for h, c in zip(frame["history"].to_list(), frame["candidates"].to_list())
                for x in c[:3]]
        with torch.no_grad():
            logprobs = model(**_unlabelled(collate(full, encoder.pad_id))).logits.float().log_softmax(-1)
        naive = [sum(float(logprobs[r, p - 1, e.input_ids[p]]) for p in range(e.prompt_length, len(e)))
                 for r, e in enumerate(full)]
        torch.testing.assert_close(got.flatten(), torch.tensor(naive), atol=2e-3, rtol=1e-4)
        # under a memory budget the candidates go one per pass: the same scores
        monkeypatch.setattr(evaluate_module, "CONTINUATION_ELEMENTS", 1)
        batch_prompts = left_pad(prompts, encoder.pad_id, model.device)
        assert evaluate_module.candidates_per_pass(model, 2, batch_prompts.input_ids.shape[1], 8, 3) == 1
        one_by_one = llara_candidate_scores(model, encoder, batch_prompts, cands)
        torch.testing.assert_close(one_by_one, got, atol=1e-4, rtol=1e-5)
    else:
        assert "full_catalog" in result

    # save and reload: the trained rows are in the saved tables, the logits are the same
    model.save(tmp_path / "teacher")
    again = RecLM.load(tmp_path / "teacher").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, again(**batch).logits, atol=1e-5, rtol=1e-5)
    assert again.spec == model.spec


def test_a_truncated_student_trains_from_the_teachers_cache(pretrained, examples, tmp_path):
    alias, loaded = pretrained
    teacher = _as_format(loaded, "ids", "hybrid")
    teacher_dir = teacher.save(tmp_path / "teacher")
    cache = tmp_path / "cache"
    cache_teacher(teacher_dir, examples, cache, CacheTeacherSettings(splits=("train",), positions="answer",
                                                                     examples_per_shard=64, progress=False))
    spec = TeacherCache.open(cache).spec
    assert spec.vocab_size == teacher.vocab_size and spec.layers == tuple(late_layers(FAMILIES[alias][0]))
    keep = FAMILIES[alias][3]
    record = distill(cache, examples.root, tmp_path / "student",
                     DistillRecipe(student=alias, shrink=f"first:{keep}", item_head="hybrid", max_train=16, max_val=4,
                                   eval_batch_size=8),
                     {"max_steps": 2, "batch_size": 8, "progress": False})
    assert record["final_step"] == 2 and record["student"]["layers"] == keep
    student = RecLM.load(tmp_path / "student")
    ratio = teacher.non_embedding_parameters() / student.non_embedding_parameters()
    assert ratio >= 8, ratio
    assert student.tokenizer.get_vocab() == teacher.tokenizer.get_vocab()
