"""The two prompt formats of the recommender LM, encoded straight to token ids.

`ids`   <bos> history : <item_a> ... candidates : <item_c1> ... <item_c20> next :  ||  <item_t> <eos>
        Every item token (history, candidates, answer) carries its item id in `slot_items` (the
        model ADDS the projected SASRec embedding to the token embedding).
`llara` <bos> This user has watched <title> <slot> , ... . Choose the next movie from :
        <title> <slot> , ... . Answer :  ||  <title_t> <eos>
        Each `<slot>` carries its item id (the model REPLACES the slot's embedding by the projected
        SASRec embedding); the answer is the target's title text.

Everything after `||` is the answer: those positions get labels (their own token id; Hugging Face
models shift), all others -100. A prompt is built from pieces encoded once and cached, so encoding
a split is list concatenation, not tokenizer calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl
import torch
from transformers import PreTrainedTokenizerBase

from c2kd.errors import C2KDError, DataError
from c2kd.recmodel.templates import (
    IDS_CANDIDATES,
    IDS_HISTORY,
    IDS_NEXT,
    LLARA_ANSWER,
    LLARA_CHOOSE,
    LLARA_END,
    LLARA_HISTORY,
    LLARA_SEP,
    template_texts,
)
from c2kd.recmodel.tokenizer import item_token_ids, slot_token_id

FORMATS = ("ids", "llara")
IGNORE = -100


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise C2KDError(f"unknown prompt format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return fmt


@dataclass(frozen=True)
class EncodedExample:
    """One prompt (+ answer when the target is known); all lists have the same length."""

    example_id: int
    input_ids: list[int]
    slot_items: list[int]
    labels: list[int]
    prompt_length: int

    def __len__(self) -> int:
        return len(self.input_ids)


class PromptEncoder:
    """Turns (history, candidates, target) into token ids for one tokenizer and format."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, fmt: str, titles: Sequence[str]):
        self.tokenizer = tokenizer
        self.fmt = check_format(fmt)
        self.num_items = len(titles) - 1  # titles[0] is the padding item
        self.item_token_ids = item_token_ids(tokenizer, self.num_items)
        self.slot_id = slot_token_id(tokenizer)
        if tokenizer.eos_token_id is None:
            raise C2KDError("the tokenizer has no eos token; the answer needs a terminator")
        self.eos_id = int(tokenizer.eos_token_id)
        self.bos = [int(tokenizer.bos_token_id)] if tokenizer.bos_token_id is not None else []
        self.pad_id = int(tokenizer.pad_token_id)
        pieces = template_texts()
        encoded = tokenizer(pieces, add_special_tokens=False)["input_ids"]
        self._piece = dict(zip(pieces, encoded, strict=True))
        # Titles are encoded once, as words in running text (leading space).
        if self.num_items < 1:
            raise DataError("the catalog is empty: titles must hold the padding entry and at least one item")
        encoded_titles = tokenizer([" " + t for t in titles[1:]], add_special_tokens=False)["input_ids"]
        self.title_ids: list[list[int]] = [[], *encoded_titles]
        empty = [i for i in range(1, self.num_items + 1) if not self.title_ids[i]]
        if self.fmt == "llara" and empty:
            raise DataError(f"items {empty[:5]} have empty titles; the llara format needs a title for every item")

    # -- answers -----------------------------------------------------------------------------
    def answer_ids(self, item: int) -> list[int]:
        """The answer tokens naming `item` (what the model is trained to produce)."""
        self._check_item(item)
        if self.fmt == "ids":
            return [self.item_token_ids[item], self.eos_id]
        return [*self.title_ids[item], self.eos_id]

    def title_text(self, item: int) -> str:
        """The item's title as the tokenizer round-trips it (what a generated answer looks like)."""
        return self.tokenizer.decode(self.title_ids[item], skip_special_tokens=True).strip()

    # -- prompts -----------------------------------------------------------------------------
    def prompt(self, history: Sequence[int], candidates: Sequence[int]) -> tuple[list[int], list[int]]:
        """Prompt token ids and slot items (0 where no SASRec embedding goes)."""
        for item in (*history, *candidates):
            self._check_item(item)
        ids: list[int] = list(self.bos)
        slots: list[int] = [0] * len(ids)

        def text(piece: str) -> None:
            toks = self._piece[piece]
            ids.extend(toks)
            slots.extend([0] * len(toks))

        if self.fmt == "ids":
            def items(seq: Sequence[int]) -> None:
                ids.extend(self.item_token_ids[i] for i in seq)
                slots.extend(int(i) for i in seq)

            text(IDS_HISTORY)
            items(history)
            text(IDS_CANDIDATES)
            items(candidates)
            text(IDS_NEXT)
        else:
            def titled(seq: Sequence[int]) -> None:
                for n, item in enumerate(seq):
                    if n:
                        text(LLARA_SEP)
                    toks = self.title_ids[item]
                    ids.extend(toks)
                    slots.extend([0] * len(toks))
                    ids.append(self.slot_id)
                    slots.append(int(item))
                text(LLARA_END)

            text(LLARA_HISTORY)
            titled(history)
            text(LLARA_CHOOSE)
            titled(candidates)
            text(LLARA_ANSWER)
        return ids, slots

    def encode(
        self, example_id: int, history: Sequence[int], candidates: Sequence[int], target: int | None = None
    ) -> EncodedExample:
        ids, slots = self.prompt(history, candidates)
        prompt_length = len(ids)
        labels = [IGNORE] * prompt_length
        if target is not None:
            answer = self.answer_ids(int(target))
            ids = ids + answer
            answer_slots = [0] * len(answer)
            if self.fmt == "ids":
                answer_slots[0] = int(target)  # the answer's item token carries its item like every item token
            slots = slots + answer_slots
            labels = labels + answer
        return EncodedExample(int(example_id), ids, slots, labels, prompt_length)

    def _check_item(self, item: int) -> None:
        if not 1 <= item <= self.num_items:
            raise DataError(f"item id {item} outside 1..{self.num_items} (the catalog the tokenizer was built for)")


def encode_frame(encoder: PromptEncoder, frame: pl.DataFrame, with_target: bool = True) -> list[EncodedExample]:
    """Encode every row of a split frame (columns example_id, history, candidates, target)."""
    missing = {"example_id", "history", "candidates", "target"} - set(frame.columns)
    if missing:
        raise DataError(f"split frame lacks columns {sorted(missing)}")
    cols = [frame[c].to_list() for c in ("example_id", "history", "candidates", "target")]
    return [
        encoder.encode(eid, hist, cands, target if with_target else None)
        for eid, hist, cands, target in zip(*cols, strict=True)
    ]


def collate(examples: Sequence[EncodedExample], pad_id: int, with_example_ids: bool = False) -> dict[str, torch.Tensor]:
    """Right-pad a list of examples into LongTensors input_ids, attention_mask, slot_items, labels
    [B, T] (+ example_ids [B] when asked)."""
    if not examples:
        raise C2KDError("cannot collate an empty batch")
    width = max(len(e) for e in examples)
    shape = (len(examples), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    slot_items = torch.zeros(shape, dtype=torch.long)
    labels = torch.full(shape, IGNORE, dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e)
        input_ids[row, :n] = torch.tensor(e.input_ids)
        attention_mask[row, :n] = 1
        slot_items[row, :n] = torch.tensor(e.slot_items)
        labels[row, :n] = torch.tensor(e.labels)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "slot_items": slot_items, "labels": labels}
    if with_example_ids:
        batch["example_ids"] = torch.tensor([e.example_id for e in examples], dtype=torch.long)
    return batch


def next_history_items(slot_items: torch.Tensor) -> torch.Tensor:
    """`ids` prompts: [B, T] the history item that follows each history item token, 0 elsewhere.

    Training position p (history item k) to name item k + 1 is SASRec's every-position objective;
    causal attention keeps it from seeing anything after item k. The history is the first run of
    item tokens (the `candidates :` text ends it)."""
    is_item = slot_items > 0
    starts = is_item.clone()
    starts[:, 1:] &= ~is_item[:, :-1]
    in_history = (torch.cumsum(starts.long(), 1) == 1) & is_item
    out = torch.zeros_like(slot_items)
    out[:, :-1] = slot_items[:, 1:] * (in_history[:, :-1] & in_history[:, 1:])
    return out


def answer_mask(labels: torch.Tensor) -> torch.Tensor:
    """Bool [B, T]: positions whose logits predict an answer token (labels[p+1] != -100)."""
    out = torch.zeros_like(labels, dtype=torch.bool)
    out[:, :-1] = labels[:, 1:] != IGNORE
    return out


def answer_index(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded answer positions [B, A] (ascending per row) and the mask of the real ones [B, A]."""
    is_answer = answer_mask(labels)
    counts = is_answer.sum(1)
    width = int(counts.max()) if len(counts) else 0
    # a stable sort puts the answer positions first, in order
    order = torch.sort((~is_answer).to(torch.int8), dim=1, stable=True).indices[:, :width]
    mask = torch.arange(width, device=labels.device).unsqueeze(0) < counts.unsqueeze(1)
    return torch.where(mask, order, torch.zeros_like(order)), mask


def first_answer_rows(labels: torch.Tensor) -> torch.Tensor:
    """[B]: the row of each example's first answer position in the answer-only logits that
    `RecLM.forward(labels=...)` returns (its rows are the answer positions, example by example)."""
    counts = answer_mask(labels).sum(1)
    return torch.cumsum(counts, 0) - counts


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[b, index[b, a]] for a per-token tensor x [B, T, ...] and positions index [B, A]: [B, A, ...]."""
    index = index.to(x.device)
    return torch.gather(x, 1, index.view(*index.shape, *([1] * (x.ndim - 2))).expand(*index.shape, *x.shape[2:]))
