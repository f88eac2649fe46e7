"""The recommender LM: tokenizer, prompts, hybrid embeddings, loss, save/load, truncation."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from c2kd.errors import C2KDError, DataError
from c2kd.recmodel.layers import late_layers
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.presets import PRESETS, get_preset
from c2kd.recmodel.prompts import IGNORE, PromptEncoder, answer_mask, collate, encode_frame, next_history_items
from c2kd.recmodel.tokenizer import SLOT, add_item_tokens, build_word_tokenizer, item_token

TITLES = ["", "Toy Story", "GoldenEye", "Four Rooms", "Schindler's List", "Star Wars", "Usual Suspects"] + [
    f"Movie Number {i}" for i in range(7, 31)
]
N = len(TITLES) - 1


@pytest.fixture(scope="module")
def tokenizer():
    return build_word_tokenizer(TITLES[1:], N)


@pytest.fixture(scope="module")
def item_embeddings():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(N + 1, 64, generator=g)
    emb[0] = 0
    return emb


def _batch(encoder: PromptEncoder, with_target: bool = True):
    examples = [
        encoder.encode(1, [1, 2, 3], list(range(4, 24)), 5 if with_target else None),
        encoder.encode(2, [4, 5, 6, 7, 8], list(range(11, 31)), 30 if with_target else None),
    ]
    return examples, collate(examples, encoder.pad_id)


# -- layers and presets ------------------------------------------------------------------------
def test_late_layers_rule():
    assert late_layers(32) == [24, 26, 28, 30]
    assert late_layers(8) == [4, 5, 6, 7]
    assert late_layers(6) == [2, 3, 4, 5]
    assert late_layers(30) == [26, 27, 28, 29]
    assert late_layers(2) == [1]
    with pytest.raises(C2KDError):
        late_layers(0)


def test_student_preset_is_eight_times_smaller(tokenizer, item_embeddings):
    teacher = RecLM.from_preset("tiny-teacher", tokenizer, item_embeddings, "ids")
    student = RecLM.from_preset("tiny-student", tokenizer, item_embeddings, "ids")
    assert teacher.non_embedding_parameters() >= 8 * student.non_embedding_parameters()
    assert (teacher.num_layers, teacher.hidden_size) == (6, 128)
    assert (student.num_layers, student.hidden_size) == (2, 64)
    assert set(PRESETS) >= {"tiny-teacher", "tiny-student", "micro"}
    with pytest.raises(C2KDError, match="unknown model preset"):
        get_preset("huge")


# -- tokenizer ---------------------------------------------------------------------------------
def test_word_tokenizer_vocab_and_round_trip(tokenizer, tmp_path):
    ids = tokenizer.encode("Schindler's List <slot> <item_3>", add_special_tokens=False)
    assert tokenizer.unk_token_id not in ids
    assert ids[-2:] == [tokenizer.convert_tokens_to_ids(SLOT), tokenizer.convert_tokens_to_ids(item_token(3))]
    assert tokenizer.decode(ids[:-2]) == "schindler ' s list"  # lowercased words
    # every template word is in the vocabulary
    prompt_words = "this user has watched . choose the next movie from : answer history candidates next ,"
    assert tokenizer.unk_token_id not in tokenizer.encode(prompt_words, add_special_tokens=False)
    assert len({tokenizer.convert_tokens_to_ids(item_token(i)) for i in range(1, N + 1)}) == N
    tokenizer.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.encode("Star Wars <item_7> <slot>", add_special_tokens=False) == tokenizer.encode(
        "Star Wars <item_7> <slot>", add_special_tokens=False
    )
    assert (again.pad_token, again.bos_token, again.eos_token, again.unk_token) == ("<pad>", "<bos>", "<eos>", "<unk>")


def test_add_item_tokens_to_a_pretrained_tokenizer(tokenizer):
    base = build_word_tokenizer(["alpha beta"], 1)  # a tokenizer that knows only item 1
    size = len(base)
    add_item_tokens(base, 5)
    assert len(base) == size + 4
    assert base.convert_tokens_to_ids(item_token(5)) == size + 3
    add_item_tokens(base, 5)  # idempotent
    assert len(base) == size + 4


# -- prompts -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["ids", "llara"])
def test_encoding_lines_up(tokenizer, fmt):
    enc = PromptEncoder(tokenizer, fmt, TITLES)
    history, candidates, target = [1, 2, 3], list(range(4, 24)), 5
    e = enc.encode(9, history, candidates, target)
    assert len(e.input_ids) == len(e.slot_items) == len(e.labels)
    answer = enc.answer_ids(target)
    assert len(e) == e.prompt_length + len(answer)
    assert e.labels[: e.prompt_length] == [IGNORE] * e.prompt_length
    assert e.labels[e.prompt_length :] == answer == e.input_ids[e.prompt_length :]
    assert answer[-1] == tokenizer.eos_token_id
    assert e.input_ids[0] == tokenizer.bos_token_id
    slotted = [(p, item) for p, item in enumerate(e.slot_items) if item]
    # in prompt order; in ids every item token carries its item, the answer's too
    assert [item for _, item in slotted] == history + candidates + ([target] if fmt == "ids" else [])
    slot_id = tokenizer.convert_tokens_to_ids(SLOT)
    for p, item in slotted:
        expected = tokenizer.convert_tokens_to_ids(item_token(item)) if fmt == "ids" else slot_id
        assert e.input_ids[p] == expected
        assert p < e.prompt_length or (fmt == "ids" and p == e.prompt_length)
    if fmt == "ids":
        assert answer == [tokenizer.convert_tokens_to_ids(item_token(5)), tokenizer.eos_token_id]
        assert tokenizer.decode(e.input_ids[: e.prompt_length]).endswith("next :")
    else:
        assert tokenizer.decode(answer[:-1]) == "star wars" == enc.title_text(5)
        # each title is followed by its slot
        p = slotted[0][0]
        assert tokenizer.decode(e.input_ids[p - 2 : p]) == "toy story"
    no_target = enc.encode(9, history, candidates)
    assert no_target.input_ids == e.input_ids[: e.prompt_length]
    assert no_target.labels == [IGNORE] * no_target.prompt_length


def test_encoder_rejects_unknown_items(tokenizer):
    enc = PromptEncoder(tokenizer, "ids", TITLES)
    with pytest.raises(DataError, match="outside 1..30"):
        enc.encode(1, [1, 2, 31], list(range(1, 21)), 1)
    with pytest.raises(C2KDError, match="unknown prompt format"):
        PromptEncoder(tokenizer, "text", TITLES)


def test_collate_right_pads_and_answer_positions(tokenizer):
    enc = PromptEncoder(tokenizer, "llara", TITLES)
    examples, batch = _batch(enc)
    lengths = [len(e) for e in examples]
    assert batch["input_ids"].shape == (2, max(lengths))
    for row, e in enumerate(examples):
        n = len(e)
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (max(lengths) - n)
        assert batch["input_ids"][row, :n].tolist() == e.input_ids
        assert (batch["input_ids"][row, n:] == enc.pad_id).all()
        assert (batch["labels"][row, n:] == IGNORE).all() and (batch["slot_items"][row, n:] == 0).all()
        pos = answer_mask(batch["labels"])[row].nonzero().flatten().tolist()
        # the last prompt token predicts the first answer token, ..., the last answer token predicts nothing
        assert pos == list(range(e.prompt_length - 1, n - 1))


def test_encode_frame(tokenizer):
    import polars as pl

    frame = pl.DataFrame(
        {
            "example_id": [3, 4],
            "user": [1, 2],
            "history": [[1, 2, 3], [2, 3, 4, 5]],
            "target": [7, 8],
            "candidates": [list(range(5, 25)), list(range(8, 28))],
        }
    )
    enc = PromptEncoder(tokenizer, "ids", TITLES)
    out = encode_frame(enc, frame)
    assert [e.example_id for e in out] == [3, 4]
    assert out[1] == enc.encode(4, [2, 3, 4, 5], list(range(8, 28)), 8)
    assert encode_frame(enc, frame, with_target=False)[0] == enc.encode(3, [1, 2, 3], list(range(5, 25)))


# -- the model ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["ids", "llara"])
def test_slot_embeddings_added_or_replaced(tokenizer, item_embeddings, fmt):
    model = RecLM.from_preset("micro", tokenizer, item_embeddings, fmt, seed=1)
    enc = PromptEncoder(tokenizer, fmt, TITLES)
    _, batch = _batch(enc)
    with torch.no_grad():
        got = model.embed_inputs(batch["input_ids"], batch["slot_items"])
        tokens = model.lm.get_input_embeddings()(batch["input_ids"])
        for b, p in (batch["slot_items"] > 0).nonzero().tolist():
            item = batch["slot_items"][b, p]
            projected = model.projector(item_embeddings[item])
            expected = tokens[b, p] + projected if fmt == "ids" else projected
            torch.testing.assert_close(got[b, p], expected)
        plain = batch["slot_items"] == 0
        torch.testing.assert_close(got[plain], tokens[plain])
    # the projector gets gradients through the slots
    model(**batch).loss.backward()
    assert model.projector[0].weight.grad.abs().sum() > 0


@pytest.mark.parametrize("fmt", ["ids", "llara"])
def test_loss_counts_answer_tokens_only(tokenizer, item_embeddings, fmt):
    model = RecLM.from_preset("micro", tokenizer, item_embeddings, fmt, seed=2)
    enc = PromptEncoder(tokenizer, fmt, TITLES)
    _, batch = _batch(enc)
    out = model(**batch)
    mask = answer_mask(batch["labels"])
    next_tokens = batch["input_ids"][:, 1:][mask[:, :-1]]
    # the head ran at the answer positions only, and gives what the head everywhere gives there
    with torch.no_grad():
        everywhere = model(batch["input_ids"], batch["attention_mask"], batch["slot_items"]).logits
    assert out.logits.shape == (int(mask.sum()), len(tokenizer))
    torch.testing.assert_close(out.logits, everywhere[mask])
    manual = F.cross_entropy(everywhere[mask], next_tokens)
    torch.testing.assert_close(out.loss, manual)
    # the prompt tokens do not matter to the loss once they are labelled -100 ...
    assert mask.sum() == sum(len(enc.answer_ids(t)) for t in (5, 30))


def test_next_history_items_name_the_following_history_item(tokenizer):
    enc = PromptEncoder(tokenizer, "ids", TITLES)
    examples, batch = _batch(enc)
    targets = next_history_items(batch["slot_items"])
    for row, (history, candidates) in enumerate([([1, 2, 3], range(4, 24)), ([4, 5, 6, 7, 8], range(11, 31))]):
        at = targets[row] > 0
        # the history's item tokens but its last, each naming the item after it; nothing in the candidates
        assert targets[row][at].tolist() == history[1:]
        assert batch["slot_items"][row][at].tolist() == history[:-1]
        assert batch["input_ids"][row][at].tolist() == [enc.item_token_ids[i] for i in history[:-1]]


def test_item_loss_is_catalog_cross_entropy_at_the_labelled_positions(tokenizer, item_embeddings):
    model = RecLM.from_preset("micro", tokenizer, item_embeddings, "ids", seed=3, item_head="hybrid")
    _, batch = _batch(PromptEncoder(tokenizer, "ids", TITLES))
    item_labels = next_history_items(batch["slot_items"])
    out = model(**batch, item_labels=item_labels)
    with torch.no_grad():
        h = model.decode(batch["input_ids"], batch["attention_mask"], batch["slot_items"]).last_hidden_state
        at = item_labels > 0
        manual = F.cross_entropy(model.item_scores(h[at]), item_labels[at])
    torch.testing.assert_close(out.item_loss, manual)
    torch.testing.assert_close(out.loss, model(**batch).loss)  # the answer loss is unchanged
    # causal: a history position's loss does not see the items after it
    changed = dict(batch, input_ids=batch["input_ids"].clone(), slot_items=batch["slot_items"].clone())
    last = int(at[0].nonzero().max()) + 1  # the last history item of row 0: no label reads beyond it
    changed["slot_items"][0, last + 3] = 9
    changed["input_ids"][0, last + 3] = PromptEncoder(tokenizer, "ids", TITLES).item_token_ids[9]
    with torch.no_grad():
        h2 = model.decode(changed["input_ids"], changed["attention_mask"], changed["slot_items"]).last_hidden_state
    torch.testing.assert_close(h2[0, : last + 1], h[0, : last + 1])
    llara = RecLM.from_preset("micro", tokenizer, item_embeddings, "llara")
    with pytest.raises(C2KDError, match="ids"):
        llara(**collate(_batch(PromptEncoder(tokenizer, "llara", TITLES))[0], 0), item_labels=item_labels)


def test_hidden_states_layout(tokenizer, item_embeddings):
    model = RecLM.from_preset("micro", tokenizer, item_embeddings, "ids")
    _, batch = _batch(PromptEncoder(tokenizer, "ids", TITLES))
    out = model(batch["input_ids"], batch["attention_mask"], batch["slot_items"], output_hidden_states=True)
    assert len(out.hidden_states) == model.num_layers + 1
    # index L is final-normed; the LM head applied to it gives the logits
    torch.testing.assert_close(out.hidden_states[-1] @ model.effective_head_weight().T, out.logits)
    assert model.item_token_ids.tolist()[1:] == [tokenizer.convert_tokens_to_ids(item_token(i)) for i in range(1, N + 1)]
    assert model.effective_head_weight().shape == (len(tokenizer), model.hidden_size) and model.vocab_size == len(tokenizer)
    assert isinstance(model.final_norm, torch.nn.Module)


@pytest.mark.parametrize("fmt", ["ids", "llara"])
def test_save_load_round_trip(tokenizer, item_embeddings, fmt, tmp_path):
    model = RecLM.from_preset("micro", tokenizer, item_embeddings, fmt, seed=3, data_fingerprint="abc123")
    with torch.no_grad():  # make sure the projector is not at its init when saved
        model.projector[2].bias.add_(0.5)
    _, batch = _batch(PromptEncoder(tokenizer, fmt, TITLES))
    model.eval()
    out = model.save(tmp_path / "m")
    spec = json.loads((out / "reclm.json").read_text())
    assert spec["kind"] == "reclm" and spec["format"] == fmt and spec["num_items"] == N
    assert spec["data_fingerprint"] == "abc123" and spec["preset"] == "micro"
    assert {"model.safetensors", "projector.safetensors", "item_embeddings.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    again = RecLM.load(out).eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, again(**batch).logits)
    assert torch.equal(again.item_embeddings, item_embeddings)
    assert again.spec == model.spec
    # saving over an existing folder replaces it whole, leaving no temp folders behind
    model.save(tmp_path / "m")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_load_refuses_other_folders(tmp_path):
    with pytest.raises(C2KDError, match="not a saved recommender"):
        RecLM.load(tmp_path)
    (tmp_path / "reclm.json").write_text(json.dumps({"kind": "sasrec", "version": 1}))
    with pytest.raises(C2KDError, match="expected 'reclm'"):
        RecLM.load(tmp_path)


def _four_layer_model(tokenizer, item_embeddings, fmt="ids") -> RecLM:
    config = get_preset("micro").llama_config(len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    config.num_hidden_layers = 4
    torch.manual_seed(4)
    return RecLM(LlamaForCausalLM(config), tokenizer, item_embeddings, fmt, base="four-layer test model")


def test_truncated_keeps_the_first_layers(tokenizer, item_embeddings):
    teacher = _four_layer_model(tokenizer, item_embeddings).eval()
    student = teacher.truncated(2).eval()
    assert student.num_layers == 2 and teacher.num_layers == 4
    t_state, s_state = teacher.lm.state_dict(), student.lm.state_dict()
    assert not any(".layers.2." in k or ".layers.3." in k for k in s_state)
    for key, value in s_state.items():
        assert torch.equal(value, t_state[key]), key
    assert torch.equal(student.projector[0].weight, teacher.projector[0].weight)
    _, batch = _batch(PromptEncoder(tokenizer, "ids", TITLES))
    with torch.no_grad():
        t_out = teacher(**batch, output_hidden_states=True)
        s_out = student(**batch, output_hidden_states=True)
    torch.testing.assert_close(s_out.hidden_states[1], t_out.hidden_states[1])
    # the student's weights are copies: training it leaves the teacher alone
    with torch.no_grad():
        student.lm.model.layers[0].mlp.down_proj.weight.add_(1.0)
    assert not torch.equal(student.lm.model.layers[0].mlp.down_proj.weight, teacher.lm.model.layers[0].mlp.down_proj.weight)
    with pytest.raises(C2KDError):
        teacher.truncated(5)


def test_lora_wrapped_model_saves_merged(tokenizer, item_embeddings, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = RecLM.from_preset("micro", tokenizer, item_embeddings, "llara", seed=5)
    size = model.non_embedding_parameters()
    new_tokens = sorted({*model.spec.item_token_ids[1:], model.spec.slot_token_id})
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
        trainable_token_indices={"embed_tokens": new_tokens}, task_type="CAUSAL_LM",
    )
    model.lm = get_peft_model(model.lm, config)
    with torch.no_grad():  # move the trainable token rows away from their initial values
        for name, p in model.lm.named_parameters():
            if "trainable_tokens_delta" in name:
                p.add_(torch.randn_like(p))
    model.eval()
    assert model.non_embedding_parameters() == size  # adapters are not counted
    assert model.num_layers == 2 and model.final_norm is model.base_lm().model.norm
    _, batch = _batch(PromptEncoder(tokenizer, "llara", TITLES))
    with torch.no_grad():
        wrapped = model(**batch).logits
        model.save(tmp_path / "m")
        again = RecLM.load(tmp_path / "m").eval()
        torch.testing.assert_close(again(**batch).logits, wrapped, atol=1e-5, rtol=1e-5)
        # saving did not merge the adapters into the model being trained
        torch.testing.assert_close(model(**batch).logits, wrapped, atol=0, rtol=0)
    assert any("lora_" in name for name, _ in model.lm.named_parameters())


def test_from_pretrained_local_folder_adds_item_tokens(item_embeddings, tmp_path):
    base_tok = build_word_tokenizer(TITLES[1:], 1)  # a "pretrained" tokenizer knowing only <item_1>
    config = get_preset("micro").llama_config(len(base_tok), base_tok.pad_token_id, base_tok.bos_token_id, base_tok.eos_token_id)
    torch.manual_seed(6)
    lm = LlamaForCausalLM(config)
    lm.save_pretrained(tmp_path / "base")
    base_tok.save_pretrained(tmp_path / "base")
    model = RecLM.from_pretrained(tmp_path / "base", item_embeddings, "ids", data_fingerprint="fp")
    assert len(model.tokenizer) == len(base_tok) + N - 1
    emb = model.lm.get_input_embeddings().weight
    assert emb.shape[0] >= len(model.tokenizer)
    assert torch.equal(emb[: len(base_tok)], lm.get_input_embeddings().weight)
    assert model.item_token_ids[N].item() == model.tokenizer.convert_tokens_to_ids(item_token(N))
    enc = PromptEncoder(model.tokenizer, "ids", TITLES)
    _, batch = _batch(enc)
    assert torch.isfinite(model(**batch).loss)
    with pytest.raises(C2KDError, match="expected a Hugging Face model folder"):
        RecLM.from_pretrained(tmp_path / "nothing", item_embeddings, "ids")


@pytest.mark.parametrize("item_head,frozen", [("token", False), ("hybrid", True)])
def test_folded_model_takes_plain_token_ids(tokenizer, item_embeddings, tmp_path, item_head, frozen):
    from c2kd.recmodel.fold import save_folded

    model = RecLM.from_preset("micro", tokenizer, item_embeddings, "ids", seed=7, item_head=item_head)
    if frozen:
        model.freeze_vocabulary()
        with torch.no_grad():
            model.added.input_rows.add_(torch.randn_like(model.added.input_rows))
    model.eval()
    folded = AutoModelForCausalLM.from_pretrained(save_folded(model, tmp_path / "folded")).eval()
    _, batch = _batch(PromptEncoder(tokenizer, "ids", TITLES))
    with torch.no_grad():
        ours = model(batch["input_ids"], batch["attention_mask"], batch["slot_items"], output_hidden_states=True)
        theirs = folded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    mask = batch["attention_mask"].bool()
    for layer in range(model.num_layers + 1):
        torch.testing.assert_close(theirs.hidden_states[layer][mask], ours.hidden_states[layer][mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(theirs.logits[mask], ours.logits[mask], atol=1e-4, rtol=1e-4)
    assert not folded.config.tie_word_embeddings


def test_frozen_head_under_autocast_is_cast_once_and_equals_the_linear(tokenizer, item_embeddings):
    model = RecLM.from_preset("micro", tokenizer, item_embeddings, "ids", seed=3, item_head="hybrid")
    model.freeze_vocabulary()
    head = model.base_lm().get_output_embeddings()
    h = torch.randn(5, model.hidden_size, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = head(h)
        got = model.added.frozen_logits(head, h)
        cast = model.added._cast_head[1]
        again = model.added.frozen_logits(head, h)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected) and torch.equal(again, expected)
    assert model.added._cast_head[1] is cast  # reused, not cast again
    (g_expected,) = torch.autograd.grad(expected.float().sum(), h)
    (g_got,) = torch.autograd.grad(got.float().sum(), h)
    assert torch.equal(g_got, g_expected)
    with torch.no_grad():  # an in-place change of the frozen table (what write_into does) is seen
        head.weight.mul_(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model.added.frozen_logits(head, h), head(h))
    assert model.added._cast_head[1] is not cast
    assert torch.equal(model.added.frozen_logits(head, h), head(h))  # no autocast: the plain linear


def test_training_on_cpu_uses_the_plain_attention_and_does_not_save_it(tokenizer, item_embeddings, tmp_path):
    import copy

    from c2kd.recmodel.hf import plain_attention_for_training, prepare_for_training
    from c2kd.training import ExampleBatches, TrainConfig, train

    model = RecLM.from_preset("micro", tokenizer, item_embeddings, "ids", seed=4)
    encoder = PromptEncoder(tokenizer, "ids", TITLES)
    examples, batch = _batch(encoder)
    plain = copy.deepcopy(model)
    plain_attention_for_training(plain)
    assert model.base_lm().config._attn_implementation == "sdpa"
    assert plain.base_lm().config._attn_implementation == "eager"
    with torch.no_grad():  # the same attention computed two ways
        torch.testing.assert_close(plain(**batch).loss, model(**batch).loss, atol=1e-5, rtol=1e-5)
    train(model, lambda m, b: {"loss": m(**b).loss}, ExampleBatches(examples, lambda e: collate(e, encoder.pad_id), 2, 0),
          None, None, TrainConfig(out_dir=str(tmp_path / "run"), epochs=1, batch_size=2, progress=False),
          on_device=prepare_for_training)
    assert model.base_lm().config._attn_implementation == "eager"
    saved = RecLM.load(model.save(tmp_path / "saved"))
    assert saved.base_lm().config._attn_implementation == "sdpa"
