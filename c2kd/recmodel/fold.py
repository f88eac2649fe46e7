"""A recommender LM as a plain Hugging Face model that any serving engine can run (vLLM).

In `ids` prompts every item token carries its item: its input is `scale · E[token] + P(s_item)`
(P the projector, s the SASRec embedding, scale the model's embedding multiplier, 1 but for
Gemma). That is a constant per token, so it folds into the token's row of the input table:
the folded model takes plain token ids. The output side folds too: the head becomes the
recommender's effective head (trained item rows, plus P(s_i) with the hybrid head), saved as its
own, untied matrix. LoRA adapters are merged. The folded model computes the recommender's hidden
states and logits exactly (up to float rounding) for `ids` prompts; for `llara` prompts only the
output side folds, and the slot embeddings are passed as prompt embeddings.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from c2kd.atomic import staged_dir
from c2kd.recmodel import hf
from c2kd.recmodel.model import RecLM

FOLD_FILE = "c2kd-folded.json"


@torch.no_grad()
def folded_lm(model: RecLM):
    """A plain Hugging Face model equal to `model` on token ids (see the module docstring)."""
    if model.added is not None:
        model.added.write_into(model.lm)
    lm = hf.plain_copy(model.lm)
    embedding = lm.get_input_embeddings()
    if model.spec.format == "ids":
        scale = hf.embed_scale(embedding)
        rows = model.item_token_ids[1:]
        embedding.weight[rows] += (model.projected_items()[1:] / scale).to(embedding.weight.dtype)
    head = model.effective_head_weight()
    config = lm.config
    text = config.get_text_config()
    config.tie_word_embeddings = False
    text.tie_word_embeddings = False
    out = torch.nn.Linear(head.shape[1], head.shape[0], bias=False, dtype=head.dtype)
    out.weight.copy_(head)
    lm.set_output_embeddings(out)
    return lm


def save_folded(model: RecLM, out: str | os.PathLike) -> Path:
    """Write the folded model (weights, config, tokenizer) as a Hugging Face folder."""
    out = Path(out)
    lm = folded_lm(model)
    with staged_dir(out, replace=True) as tmp:
        lm.save_pretrained(tmp, safe_serialization=True)
        model.tokenizer.save_pretrained(tmp)
        (tmp / FOLD_FILE).write_text(json.dumps({"format": model.spec.format, "item_head": model.spec.item_head,
                                                  "base": model.spec.base}, indent=1))
    return out
