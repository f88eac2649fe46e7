"""One way to name the recommender LM to build, for teachers and students alike.

    --model / --student SOURCE [--shrink first:K | narrow:WIDTHxLAYERS]

SOURCE is a preset (random weights: tiny-teacher, tiny-student, micro), a pretrained alias
(smollm2-135m, gemma3-270m), a Hugging Face folder, a .gguf file, or a saved recommender folder.
`--shrink` makes a student of a pretrained SOURCE that shares its tokenizer: `first:K` keeps its
first K layers with the final norm and head, pretrained weights kept (as SLMRec does);
`narrow:WIDTHxLAYERS` is a random-initialised model of the same family, WIDTH wide and LAYERS deep.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from c2kd.errors import C2KDError
from c2kd.recmodel.model import ITEM_HEADS, SPEC_FILE, RecLM
from c2kd.recmodel.presets import PRESETS
from c2kd.recmodel.pretrained import WHEEL_MODELS


@dataclass(frozen=True)
class Shrink:
    kind: str  # first | narrow
    layers: int
    width: int = 0

    @staticmethod
    def parse(text: str | None) -> Shrink | None:
        if not text:
            return None
        m = re.fullmatch(r"first:(\d+)", text.strip())
        if m and int(m.group(1)) >= 1:
            return Shrink("first", int(m.group(1)))
        m = re.fullmatch(r"narrow:(\d+)x(\d+)", text.strip())
        if m and int(m.group(1)) >= 1 and int(m.group(2)) >= 1:
            return Shrink("narrow", int(m.group(2)), int(m.group(1)))
        raise C2KDError(f"--shrink {text!r}: expected first:K (keep the first K layers) or narrow:WIDTHxLAYERS "
                        "(e.g. narrow:192x4), with positive numbers")

    def __str__(self) -> str:
        return f"first:{self.layers}" if self.kind == "first" else f"narrow:{self.width}x{self.layers}"

    def apply(self, model: RecLM, seed: int) -> RecLM:
        if self.kind == "first":
            return model.truncated(self.layers)
        return model.narrowed(self.width, self.layers, seed=seed)


def resolve_item_head(item_head: str, fmt: str) -> str:
    """`auto`: the hybrid head for `ids` (it made the fine-tuned SmolLM2 teacher twice as good on
    validation HR@1), the token head for `llara` (its answers are titles, not item tokens)."""
    if item_head == "auto":
        return "hybrid" if fmt == "ids" else "token"
    if item_head not in ITEM_HEADS:
        raise C2KDError(f"--item-head {item_head!r}: expected auto or one of {', '.join(ITEM_HEADS)}")
    if item_head == "hybrid" and fmt != "ids":
        raise C2KDError("--item-head hybrid scores item tokens: it needs the ids prompt format")
    return item_head


def check_source(source: str, shrink: str | None = None, item_head: str = "auto", fmt: str = "ids") -> None:
    """Refuse a model name that names nothing, before anything is built or written."""
    resolve_item_head(item_head, fmt)
    parsed = Shrink.parse(shrink)
    if source in PRESETS:
        if parsed is not None:
            raise C2KDError(f"--shrink needs a pretrained model; {source!r} is a preset (pick a smaller preset instead)")
        return
    if source in WHEEL_MODELS:
        return
    path = Path(source)
    if not path.exists():
        raise C2KDError(f"model {source!r}: neither a preset ({', '.join(PRESETS)}), a pretrained alias "
                        f"({', '.join(WHEEL_MODELS)}) nor an existing path")
    if path.is_dir() and not ((path / "config.json").is_file() or (path / SPEC_FILE).is_file()):
        raise C2KDError(f"{path}: not a model folder (no config.json)")
    if path.is_file() and path.suffix != ".gguf":
        raise C2KDError(f"{path}: a model file must be a .gguf file")


def build_model(
    source: str,
    *,
    fmt: str,
    item_embeddings: torch.Tensor,
    data_fingerprint: str,
    seed: int,
    preset_tokenizer: Callable[[], PreTrainedTokenizerBase],
    item_head: str = "auto",
    shrink: str | None = None,
) -> RecLM:
    """The RecLM that SOURCE (+ shrink) names, over this catalog (see the module docstring).

    `preset_tokenizer()` gives the tokenizer of a preset (a word-level one over the catalog, or a
    teacher cache's); pretrained models bring their own."""
    check_source(source, shrink, item_head, fmt)
    item_head = resolve_item_head(item_head, fmt)
    if source in PRESETS:
        return RecLM.from_preset(source, preset_tokenizer(), item_embeddings, fmt, seed=seed,
                                 data_fingerprint=data_fingerprint, item_head=item_head)
    model = RecLM.from_pretrained(source, item_embeddings, fmt, data_fingerprint=data_fingerprint, seed=seed,
                                  item_head=item_head)
    if model.spec.data_fingerprint and model.spec.data_fingerprint != data_fingerprint:
        raise C2KDError(f"{source} was trained on other data (fingerprint {model.spec.data_fingerprint[:12]}…, "
                        f"expected {data_fingerprint[:12]}…)")
    parsed = Shrink.parse(shrink)
    return parsed.apply(model, seed) if parsed is not None else model
