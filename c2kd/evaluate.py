"""Evaluation of a recommender LM (teacher or student) on a prepared split.

- Ranking of the 20 stored candidates by the model's own scores: for `ids` the item-token logit
  at the answer position (one forward pass; the head runs on the item tokens' rows only, and the
  same scores rank the full catalog too; that prompt lists the 20 candidates, target included,
  so a model can rank the catalog by copying from it: SASRec's full-catalog metrics see no
  candidates), for
  `llara` the log-likelihood of each candidate's answer tokens (title + eos) given the prompt.
  The prompt runs once per example; its KV cache is repeated for the continuations, as many
  candidates at a time as a memory budget allows.
- The paper's generation protocol (`llara`): greedy decoding, first line of the answer,
  ValidRatio and HR@1 (over valid answers and over all examples).

Prompts are LEFT-padded here (unlike training batches) so that the last column is every row's
last prompt token and continuations line up after it.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from c2kd.errors import C2KDError
from c2kd.metrics import (candidate_rank_metrics, candidate_ranks, first_line, full_catalog_rank_metrics,
                          full_catalog_ranks, generation_metrics)
from c2kd.data.examples import ExampleSet, load_examples, target_indices
from c2kd.predictions import prediction_rows
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.prompts import EncodedExample, PromptEncoder

DEFAULT_BATCH_SIZE = 16


@dataclass
class PromptBatch:
    """Left-padded prompts: every row's last prompt token sits in the last column."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    slot_items: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T]
    lengths: torch.Tensor  # [B]


def left_pad(prompts: Sequence[EncodedExample], pad_id: int, device: torch.device) -> PromptBatch:
    width = max(e.prompt_length for e in prompts)
    shape = (len(prompts), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    slot_items = torch.zeros(shape, dtype=torch.long)
    for row, e in enumerate(prompts):
        n = e.prompt_length
        input_ids[row, width - n :] = torch.tensor(e.input_ids[:n])
        slot_items[row, width - n :] = torch.tensor(e.slot_items[:n])
        attention_mask[row, width - n :] = 1
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    lengths = attention_mask.sum(1)
    return PromptBatch(*(t.to(device) for t in (input_ids, attention_mask, slot_items, position_ids, lengths)))


@dataclass
class PromptState:
    """The result of running a batch of prompts once: next-token logits and the KV cache."""

    last_logits: torch.Tensor  # [B, V] float32, at every row's last prompt token
    cache: object | None  # a transformers Cache, consumed (extended) by whoever uses it

    def copy(self) -> PromptState:
        return PromptState(self.last_logits, copy.deepcopy(self.cache))


@torch.no_grad()
def run_prompts(model: RecLM, prompts: PromptBatch, use_cache: bool = True) -> PromptState:
    """The prompts' forward pass: next-token logits at the last position (and the KV cache)."""
    out = model(
        input_ids=prompts.input_ids,
        attention_mask=prompts.attention_mask,
        slot_items=prompts.slot_items,
        position_ids=prompts.position_ids,
        use_cache=use_cache,
        logits_to_keep=1,
    )
    return PromptState(out.logits[:, -1].float(), out.cache if use_cache else None)


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    # gather - logsumexp instead of a full log_softmax: half the memory for large vocabularies
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def ids_scores(model: RecLM, prompts: PromptBatch) -> torch.Tensor:
    """`ids` format: logit of every item token at the answer position, [B, N+1] (column 0 = -inf).
    The head runs on the item tokens' rows only (1,683 rows, not a 50k–262k vocabulary)."""
    h = model.decode(prompts.input_ids, prompts.attention_mask, prompts.slot_items,
                     position_ids=prompts.position_ids).last_hidden_state
    return model.item_scores(h[:, -1]).float()


# Elements one pass of candidate continuations may hold in its repeated KV cache, or in its logits
# (about 1 GiB in float32). All 20 candidates of 32 prompts at once would need ~23 GiB for
# SmolLM2-135M with `llara` prompts (30 layers, 260 tokens), so the candidates go in groups.
CONTINUATION_ELEMENTS = 2**28


def candidates_per_pass(model: RecLM, batch: int, prompt_width: int, answer_width: int, num_cands: int) -> int:
    """How many candidates per prompt one continuation pass scores within CONTINUATION_ELEMENTS
    (an upper bound: keys and values at full width in every layer; at least one)."""
    per_row = max(2 * model.num_layers * prompt_width * model.hidden_size, answer_width * model.vocab_size)
    return max(1, min(num_cands, CONTINUATION_ELEMENTS // (per_row * batch)))


@torch.no_grad()
def llara_candidate_scores(
    model: RecLM,
    encoder: PromptEncoder,
    prompts: PromptBatch,
    candidates: torch.Tensor,
    state: PromptState | None = None,
) -> torch.Tensor:
    """`llara` format: sum of log-probs of each candidate's answer tokens given the prompt, [B, C].

    The prompt runs once (or `state` is reused; its cache may be consumed); its KV cache is
    repeated for a group of candidates at a time (`candidates_per_pass`) and each group's B*G
    continuations run in one right-padded batch."""
    batch, num_cands = candidates.shape
    state = state if state is not None else run_prompts(model, prompts)
    answers = [[encoder.answer_ids(int(c)) for c in row] for row in candidates.tolist()]
    width = max(len(a) for row in answers for a in row)
    group = candidates_per_pass(model, batch, prompts.input_ids.shape[1], width, num_cands)
    scores = []
    for first in range(0, num_cands, group):
        last = first + group >= num_cands  # the last group may consume the prompts' cache itself
        cache = state.cache if last else copy.deepcopy(state.cache)
        cols = [row[first : first + group] for row in answers]
        scores.append(_continuation_logprobs(model, prompts, state.last_logits, cache, cols, encoder.pad_id))
    return torch.cat(scores, dim=1)


def _continuation_logprobs(
    model: RecLM, prompts: PromptBatch, last_logits: torch.Tensor, cache: object, answers: list[list[list[int]]],
    pad_id: int,
) -> torch.Tensor:
    """Log-likelihood of answers[b][g] after prompt b, [B, G]; `cache` (the prompts') is consumed."""
    batch, group = len(answers), len(answers[0])
    flat = [a for row in answers for a in row]
    width = max(len(a) for a in flat)
    device = prompts.input_ids.device
    tokens = torch.full((batch * group, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch * group, width), dtype=torch.long)
    for row, a in enumerate(flat):
        tokens[row, : len(a)] = torch.tensor(a)
        mask[row, : len(a)] = 1
    tokens, mask = tokens.to(device), mask.to(device)
    cache.batch_repeat_interleave(group)
    # Token j is predicted by the prompt's last position (j = 0) or by token j-1, so the last
    # answer token never needs to be fed.
    fed = tokens[:, :-1]
    attention = torch.cat([prompts.attention_mask.repeat_interleave(group, 0), mask[:, :-1]], dim=1)
    positions = prompts.lengths.repeat_interleave(group).unsqueeze(1) + torch.arange(width - 1, device=device)
    out = model(
        input_ids=fed, attention_mask=attention, slot_items=torch.zeros_like(fed),
        position_ids=positions, cache=cache, use_cache=True,
    )
    logits = torch.cat([last_logits.repeat_interleave(group, 0).unsqueeze(1), out.logits.float()], dim=1)
    logprobs = _token_logprobs(logits, tokens) * mask
    return logprobs.sum(1).view(batch, group)


@torch.no_grad()
def generate_answers(
    model: RecLM, prompts: PromptBatch, max_new_tokens: int, state: PromptState | None = None
) -> list[list[int]]:
    """Greedy decoding until eos (or `max_new_tokens`); the generated ids per row, eos excluded.
    `state` (from `run_prompts`, consumed) saves running the prompts again."""
    eos = model.tokenizer.eos_token_id
    state = state if state is not None else run_prompts(model, prompts)
    cache, attention, positions = state.cache, prompts.attention_mask, prompts.lengths.clone()
    finished = torch.zeros(len(state.last_logits), dtype=torch.bool, device=state.last_logits.device)
    steps: list[torch.Tensor] = []
    next_token = state.last_logits.argmax(-1)
    for step in range(max_new_tokens):
        next_token = torch.where(finished, torch.full_like(next_token, eos), next_token)
        steps.append(next_token)
        finished |= next_token == eos
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        out = model(
            input_ids=next_token.unsqueeze(1), attention_mask=attention,
            slot_items=torch.zeros_like(next_token).unsqueeze(1), position_ids=positions.unsqueeze(1),
            cache=cache, use_cache=True,
        )
        positions = positions + 1
        next_token = out.logits[:, -1].argmax(-1)
    generated = torch.stack(steps, dim=1).tolist()
    return [row[: row.index(eos)] if eos in row else row for row in generated]


@dataclass
class RankScores:
    candidates: torch.Tensor  # [B, C]
    full_catalog: torch.Tensor | None  # [B, N+1] (ids only)


def rank_scores(model: RecLM, encoder: PromptEncoder, prompts: Sequence[EncodedExample], candidates: torch.Tensor) -> RankScores:
    """The model's own score of each candidate (and of every item for `ids`), one batch."""
    batch = left_pad(prompts, encoder.pad_id, model.device)
    if model.spec.format == "ids":
        full = ids_scores(model, batch)
        return RankScores(full.gather(1, candidates.to(full.device)).cpu(), full.cpu())
    return RankScores(llara_candidate_scores(model, encoder, batch, candidates.to(model.device)).cpu(), None)


@contextmanager
def _eval_mode(model: torch.nn.Module):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        disable=not enabled, transient=True,
    )


class RecLMEvaluator:
    """Encodes a split once and evaluates any model with the matching tokenizer and format.

    Calling it returns a flat dict (candidate metrics under their own names, e.g. "NDCG@10";
    "full_catalog/..." and "generation/..." for the others), as the trainer's `evaluate_fn` wants.
    `evaluate_with_predictions` also returns one row per example (`c2kd.predictions`).
    """

    def __init__(
        self,
        examples: ExampleSet,
        split: str,
        limit: int | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        generation: bool = True,
        full_catalog: bool = True,
        max_new_tokens: int | None = None,
        progress: bool = True,
        keep_answers: bool = False,
    ):
        frame = examples.split(split)
        if limit is not None:
            frame = frame.head(limit)
        if frame.height == 0:
            raise C2KDError(f"{examples.root}: split {split!r} has no examples to evaluate")
        self.examples, self.split, self.frame = examples, split, frame
        self.batch_size, self.generation, self.full_catalog = batch_size, generation, full_catalog
        self.max_new_tokens, self.progress, self.keep_answers = max_new_tokens, progress, keep_answers
        self.candidates = torch.tensor(frame["candidates"].to_list(), dtype=torch.long)
        self.targets = torch.tensor(frame["target"].to_list(), dtype=torch.long)
        self.target_index = torch.as_tensor(target_indices(frame), dtype=torch.long)
        self._encoded: tuple[int, str, PromptEncoder, list[EncodedExample]] | None = None

    def _prompts(self, model: RecLM) -> tuple[PromptEncoder, list[EncodedExample]]:
        key = (id(model.tokenizer), model.spec.format)
        if self._encoded is None or self._encoded[:2] != key:
            encoder = PromptEncoder(model.tokenizer, model.spec.format, self.examples.titles())
            cols = (self.frame[c].to_list() for c in ("example_id", "history", "candidates"))
            prompts = [encoder.encode(eid, h, c) for eid, h, c in zip(*cols, strict=True)]
            self._encoded = (*key, encoder, prompts)
        return self._encoded[2], self._encoded[3]

    def evaluate(self, model: RecLM) -> dict:
        """Nested result: {"candidates": {...}, "full_catalog": {...} (ids), "generation": {...} (llara)}."""
        return self.evaluate_with_predictions(model)[0]

    def evaluate_with_predictions(self, model: RecLM) -> tuple[dict, pl.DataFrame]:
        """`evaluate`'s result and the per-example rows it is the mean of (`c2kd.predictions.COLUMNS`)."""
        _check_model_fits(model, self.examples)
        encoder, prompts = self._prompts(model)
        fmt = model.spec.format
        generate = self.generation and fmt == "llara"
        cand_scores, full_scores, answers = [], [], []
        max_new = self.max_new_tokens or max(len(encoder.answer_ids(i)) for i in range(1, encoder.num_items + 1)) + 2
        with _eval_mode(model), torch.no_grad(), _progress(self.progress) as bar:
            task = bar.add_task(f"evaluate {fmt} on {self.split}", total=len(prompts))
            for start in range(0, len(prompts), self.batch_size):
                chunk = prompts[start : start + self.batch_size]
                candidates = self.candidates[start : start + len(chunk)]
                if fmt == "ids":
                    scores = rank_scores(model, encoder, chunk, candidates)
                    cand_scores.append(scores.candidates)
                    if self.full_catalog:
                        full_scores.append(scores.full_catalog)
                else:
                    # one prompt pass serves both the ranking and the generation
                    batch = left_pad(chunk, encoder.pad_id, model.device)
                    state = run_prompts(model, batch)
                    if generate:
                        for ids in generate_answers(model, batch, max_new, state.copy()):
                            answers.append(first_line(model.tokenizer.decode(ids, skip_special_tokens=True)))
                    cand_scores.append(llara_candidate_scores(model, encoder, batch, candidates.to(model.device), state).cpu())
                bar.advance(task, len(chunk))
        result: dict = {
            "kind": "reclm",
            "format": fmt,
            "split": self.split,
            "examples": len(prompts),
        }
        ranks = candidate_ranks(torch.cat(cand_scores), self.target_index)
        result["candidates"] = candidate_rank_metrics(ranks)
        catalog_ranks = None
        if full_scores:
            histories = self.frame["history"].to_list()
            catalog_ranks = full_catalog_ranks(torch.cat(full_scores), self.targets, histories)
            result["full_catalog"] = full_catalog_rank_metrics(catalog_ranks)
        if generate:
            titles = [[encoder.title_text(int(c)) for c in row] for row in self.candidates.tolist()]
            target_titles = [encoder.title_text(int(t)) for t in self.targets.tolist()]
            result["generation"] = generation_metrics(answers, titles, target_titles)
            if self.keep_answers:
                result["answers"] = answers
        return result, prediction_rows(self.frame, self.split, ranks, catalog_ranks)

    def __call__(self, model: RecLM) -> dict[str, float]:
        return flatten_metrics(self.evaluate(model))


def flatten_metrics(result: dict) -> dict[str, float]:
    """{"HR@1": ..., "full_catalog/NDCG@10": ..., "generation/ValidRatio": ...}."""
    flat = {k: float(v) for k, v in result["candidates"].items()}
    for group in ("full_catalog", "generation"):
        for k, v in result.get(group, {}).items():
            flat[f"{group}/{k}"] = float(v)
    return flat


def _check_model_fits(model: RecLM, examples: ExampleSet) -> None:
    if model.spec.num_items != examples.num_items:
        raise C2KDError(f"the model knows {model.spec.num_items} items but {examples.root} has {examples.num_items}")
    fp = model.spec.data_fingerprint
    if fp and fp != examples.fingerprint:
        raise C2KDError(
            f"the model was trained on data with fingerprint {fp!r} but {examples.root} has "
            f"{examples.fingerprint!r}; evaluate on the prepared folder the model was trained on"
        )


def evaluate_reclm(
    model: RecLM | str | os.PathLike,
    examples: ExampleSet | str | os.PathLike,
    split: str = "test",
    limit: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    generation: bool = True,
    device: str | torch.device | None = None,
    progress: bool = True,
    keep_answers: bool = False,
) -> dict:
    """Metrics of a recommender LM (a model or a saved folder) on one split of a prepared folder."""
    return evaluate_reclm_with_predictions(model, examples, split, limit, batch_size, generation, device, progress,
                                           keep_answers)[0]


def evaluate_reclm_with_predictions(
    model: RecLM | str | os.PathLike,
    examples: ExampleSet | str | os.PathLike,
    split: str = "test",
    limit: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    generation: bool = True,
    device: str | torch.device | None = None,
    progress: bool = True,
    keep_answers: bool = False,
) -> tuple[dict, pl.DataFrame]:
    """`evaluate_reclm`'s metrics and the per-example rows they are the means of."""
    data = examples if isinstance(examples, ExampleSet) else load_examples(examples)
    if not isinstance(model, RecLM):
        model = RecLM.load(Path(model), device=device)
    elif device is not None:
        model.to(device)
    evaluator = RecLMEvaluator(
        data, split, limit=limit, batch_size=batch_size, generation=generation, progress=progress, keep_answers=keep_answers
    )
    return evaluator.evaluate_with_predictions(model)
