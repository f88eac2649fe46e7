"""`c2kd export`: a recommender LM (`ids` format) as one ONNX graph that ranks items on a device.

    prompt token ids [B, T] (left-padded) + attention mask [B, T]  ->  scores of every item [B, N + 1]

What the graph holds, baked in: the projected SASRec embeddings folded into the item tokens' input
rows (in `ids` every item token carries its item, so the projector is a constant per token), the
transformer, the final norm, and the item rows that score the items (with the hybrid head, the
projected embeddings are folded into them too). The vocabulary is cut to the tokens an `ids`
prompt can hold — the specials, the template words, the item tokens — so a 50k–262k-row table
becomes about 1,700 rows: the file holds the model, not its tokenizer. `ranker.json` says how to
build a prompt from item ids in that small vocabulary, so the runtime needs no tokenizer and no
PyTorch (`c2kd.deploy.runtime`). `--quantize int8` quantises the weights (onnxruntime dynamic
quantisation; activations stay float). `--format executorch` writes the same graph as an
ExecuTorch program (`model.pte`, lowered to the XNNPACK backend; needs the `executorch` package,
the `executorch` extra), for phones and embedded devices.

`llara` models rank by scoring each candidate title token by token through the whole vocabulary;
they are not exported (the graph would need the full vocabulary and a decoding loop).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from c2kd.atomic import check_destination, staged_dir
from c2kd.deploy.runtime import RANKER_FILE, RANKER_KIND  # the format's names, defined by its reader
from c2kd.errors import C2KDError
from c2kd.recmodel import hf
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.prompts import PromptEncoder
from c2kd.recmodel.templates import IDS_CANDIDATES, IDS_HISTORY, IDS_NEXT

RANKER_VERSION = 1
MODEL_FILES = {"onnx": "model.onnx", "executorch": "model.pte"}
QUANTIZE = ("none", "int8")
# An ExecuTorch program plans its memory for the largest shapes it accepts: one prompt of up to
# 512 tokens (a device serves one user at a time; the runtime runs a batch prompt by prompt).
MAX_PROMPT, MAX_BATCH = 512, 1


class FoldedRanker(nn.Module):
    """The exported computation: embeddings from one folded table, the body, item scores."""

    def __init__(self, model: RecLM, keep: Tensor):
        super().__init__()
        with torch.no_grad():
            base = model.base_lm()
            embedding = base.get_input_embeddings()
            table = embedding.weight.detach().clone()
            if model.added is not None:
                table[model.added.token_ids] = model.added.input_rows.detach().to(table.dtype)
            table = table * hf.embed_scale(embedding)
            items = model.item_token_ids[1:]
            table[items] += model.projected_items()[1:].to(table.dtype)  # every ids item token carries its item
            self.register_buffer("table", table[keep].contiguous())
            self.register_buffer("item_rows", model.item_rows().detach().clone())
        self.decoder = hf.decoder(model.lm)
        self.softcap = hf.logit_softcap(model.lm)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        h = self.decoder(inputs_embeds=torch.nn.functional.embedding(input_ids, self.table),
                         attention_mask=attention_mask, position_ids=position_ids).last_hidden_state[:, -1]
        scores = h @ self.item_rows.T
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        return scores


def ranker_spec(model: RecLM, titles: list[str]) -> tuple[dict, Tensor]:
    """ranker.json for `model`, and the original token ids kept (in their new order)."""
    encoder = PromptEncoder(model.tokenizer, "ids", titles)
    pieces = {"bos": encoder.bos, "history": encoder._piece[IDS_HISTORY], "candidates": encoder._piece[IDS_CANDIDATES],
              "next": encoder._piece[IDS_NEXT]}
    words = sorted({t for ids in pieces.values() for t in ids} | {encoder.pad_id, encoder.eos_id})
    keep = [*words, *model.item_token_ids[1:].tolist()]
    new = {old: i for i, old in enumerate(keep)}
    spec = {
        "kind": RANKER_KIND, "version": RANKER_VERSION, "format": "ids",
        "num_items": model.spec.num_items,
        "vocabulary": len(keep),
        "item_token_offset": len(words),  # item i is token item_token_offset + i - 1
        "pad_id": new[encoder.pad_id],
        "pieces": {name: [new[t] for t in ids] for name, ids in pieces.items()},
        "data_fingerprint": model.spec.data_fingerprint,
        "base": model.spec.base,
        "item_head": model.spec.item_head,
        "non_embedding_parameters": model.non_embedding_parameters(),
        "titles": titles,
    }
    return spec, torch.tensor(keep, dtype=torch.long)


def export_ranker(model_dir: str | os.PathLike, out: str | os.PathLike, titles: list[str], quantize: str = "none",
                  overwrite: bool = False, fmt: str = "onnx", data_fingerprint: str | None = None) -> Path:
    """Export a saved `ids` recommender (teacher or student) as a ranker folder at `out`; with
    `data_fingerprint` (the prepared data the titles come from), a model of other data is refused."""
    if fmt not in MODEL_FILES:
        raise C2KDError(f"--format {fmt!r}: expected one of {', '.join(MODEL_FILES)}")
    if quantize not in QUANTIZE or (quantize != "none" and fmt != "onnx"):
        raise C2KDError(f"--quantize {quantize!r}: expected one of {', '.join(QUANTIZE)} (int8 for onnx only)")
    if fmt == "executorch" and importlib.util.find_spec("executorch") is None:
        raise C2KDError("--format executorch needs the executorch package: pip install 'c2kd[executorch]'")
    out = Path(out)
    if out.exists() and not overwrite:
        raise C2KDError(f"{out} already exists; choose another --out or pass --overwrite")
    check_destination(out)
    model = RecLM.load(model_dir).eval()
    if data_fingerprint and model.spec.data_fingerprint and model.spec.data_fingerprint != data_fingerprint:
        raise C2KDError(f"{model_dir} was trained on other data (fingerprint {model.spec.data_fingerprint[:12]}…) than "
                        f"--data ({data_fingerprint[:12]}…); its item ids would not match the titles")
    if model.spec.format != "ids":
        raise C2KDError(f"{model_dir}: a {model.spec.format} model; only ids models are exported (llara ranks "
                        "candidates by decoding titles through the whole vocabulary)")
    if len(titles) != model.spec.num_items + 1:
        raise C2KDError(f"{model_dir} knows {model.spec.num_items} items, the data {len(titles) - 1}")
    spec, keep = ranker_spec(model, titles)
    ranker = FoldedRanker(model, keep).eval()
    example = torch.tensor([spec["pieces"]["bos"] + spec["pieces"]["history"] + [spec["item_token_offset"]] * 3
                            + spec["pieces"]["next"]], dtype=torch.long)
    with staged_dir(out, replace=overwrite) as tmp:
        if fmt == "executorch":
            _write_pte(ranker, example, tmp / MODEL_FILES[fmt])
            spec.update(max_prompt=MAX_PROMPT, max_batch=MAX_BATCH)
        else:
            _write_onnx(ranker, example, tmp / MODEL_FILES[fmt], quantize)
        spec.update(quantize=quantize, source=str(Path(model_dir).resolve()), model_file=MODEL_FILES[fmt])
        (tmp / RANKER_FILE).write_text(json.dumps(spec, indent=1))
    return out


def _write_onnx(ranker: FoldedRanker, example: Tensor, path: Path, quantize: str) -> None:
    """The ranker as one ONNX graph (batch and prompt length dynamic); int8: weights quantised."""
    with torch.no_grad():
        torch.onnx.export(
            ranker, (example, torch.ones_like(example)), str(path), input_names=["input_ids", "attention_mask"],
            output_names=["scores"], dynamic_axes={"input_ids": {0: "batch", 1: "tokens"},
                                                   "attention_mask": {0: "batch", 1: "tokens"},
                                                   "scores": {0: "batch"}},
            opset_version=18, dynamo=False,
        )
    if quantize == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantized = path.with_name("model.int8.onnx")
        logging.disable(logging.WARNING)  # its advice to pre-process image models, on the root logger
        try:
            quantize_dynamic(str(path), str(quantized), weight_type=QuantType.QInt8)
        finally:
            logging.disable(logging.NOTSET)
        os.replace(quantized, path)


def _write_pte(ranker: FoldedRanker, example: Tensor, path: Path) -> None:
    """The ranker as an ExecuTorch program for the XNNPACK backend: one prompt of 2..MAX_PROMPT tokens."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torch.export import Dim, export

    tokens = Dim("tokens", min=2, max=MAX_PROMPT)
    with torch.no_grad():
        program = export(ranker, (example, torch.ones_like(example)), strict=False,
                         dynamic_shapes={"input_ids": {1: tokens}, "attention_mask": {1: tokens}})
    path.write_bytes(to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)
