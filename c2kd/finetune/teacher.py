"""The `train-teacher` recipe: supervised fine-tuning of a recommender LM on its answer tokens.

The same recipe trains a student alone (the SFT baseline): a smaller preset, or a pretrained
model shrunk with `--shrink` (see `c2kd.recmodel.build`).

    data (prepared examples) + SASRec run (item embeddings) + model (preset | alias | HF folder | GGUF)
      -> RecLM -> PromptEncoder(train split) -> c2kd.training.train(loss = CE on answer tokens
         [+ the next-history-item CE, --history-loss] [+ KL(SASRec || model) at the answer item,
         --sasrec-kd], best state by validation candidate-ranking NDCG@10) -> saved RecLM + train.json

While it runs, everything lives in `<out>.partial/` (the trainer's checkpoints, best state and
log.jsonl, plus recipe.json); running the same command again resumes there. At the end the best
weights are saved with `RecLM.save` together with `train.json` and `log.jsonl`, and the folder
is renamed to `<out>`: a folder at `<out>` is always a whole model. The selected model is evaluated
once more on the examples that selected it: `metrics.json` ({"validation": ...}) and the per-example
rows, `predictions.parquet` (c2kd.predictions).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import polars as pl
import torch
import torch.nn.functional as F
from torch import nn

from c2kd.atomic import write_json
from c2kd.distributed import dist_env
from c2kd.errors import C2KDError
from c2kd.evaluate import RecLMEvaluator
from c2kd.metrics import DEFAULT_SELECT_METRIC
from c2kd.predictions import PREDICTIONS_FILE, write_predictions
from c2kd.data.examples import ExampleSet, fixed_subset, load_examples
from c2kd.sasrec.train import (SplitTensors, catalog_scores, check_fingerprint, load_item_embeddings, load_sasrec,
                                  read_run_config)
from c2kd.recmodel.build import build_model as build_reclm
from c2kd.recmodel.build import check_source
from c2kd.recmodel.hf import prepare_for_training
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.prompts import (EncodedExample, PromptEncoder, check_format, collate, encode_frame, first_answer_rows,
                                   next_history_items)
from c2kd.recmodel.tokenizer import build_word_tokenizer
from c2kd.run_folder import check_or_write_recipe, claim, finished_run, leaves_nothing_when_refused, publish
from c2kd.training import ExampleBatches, TrainConfig, TrainResult, comparable_config, train

TRAIN_KIND = "c2kd-train"
TRAIN_VERSION = 1
RECIPE = "train-teacher"
# Projection layers LoRA adapts in Llama-style models (Llama, Qwen2, Mistral, SmolLM2, ...).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Settings added after train-teacher runs were first recorded, with the value those runs used: a
# finished or interrupted run recorded without one is still the same run (run_folder.finished_run).
SETTINGS_ADDED = {"sasrec_kd": 0.0}


@dataclass(frozen=True)
class LoraSettings:
    r: int = 8
    alpha: float | None = None  # default 2 * r
    dropout: float = 0.05

    def __post_init__(self) -> None:
        if self.r < 1:
            raise C2KDError(f"--lora-r must be >= 1, got {self.r}")
        if self.alpha is not None and self.alpha <= 0:
            raise C2KDError(f"--lora-alpha must be positive, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise C2KDError(f"--lora-dropout must be in [0, 1), got {self.dropout}")


@dataclass(frozen=True)
class TeacherRecipe:
    """What to train; `TrainConfig` (minus out_dir) says how."""

    fmt: str = "ids"
    model: str = "tiny-teacher"  # a preset, a pretrained alias, a Hugging Face folder, a .gguf file or a saved RecLM
    shrink: str | None = None  # first:K | narrow:WIDTHxLAYERS (students of a pretrained model)
    item_head: str = "auto"  # token | hybrid (ids: item rows + projected SASRec embeddings) | auto
    lora: LoraSettings | None = None
    max_train: int | None = None  # a seeded subset of the train split (CPU runs)
    max_val: int | None = None  # the first N validation examples for model selection
    select_metric: str = DEFAULT_SELECT_METRIC
    eval_batch_size: int = 32
    history_loss: float = 0.0  # weight of the next-history-item loss (ids), SASRec's every-position objective
    sasrec_kd: float = 0.0  # weight of KL(SASRec's catalog distribution || the model's) at the answer item (ids)

    def __post_init__(self) -> None:
        check_format(self.fmt)
        if self.history_loss < 0:
            raise C2KDError(f"--history-loss must be >= 0, got {self.history_loss}")
        if self.history_loss and self.fmt != "ids":
            raise C2KDError("--history-loss trains item tokens to name the next history item: it needs --format ids")
        if self.sasrec_kd < 0:
            raise C2KDError(f"--sasrec-kd must be >= 0, got {self.sasrec_kd}")
        if self.sasrec_kd and self.fmt != "ids":
            raise C2KDError("--sasrec-kd distils SASRec's scores into the item tokens' logits: it needs --format ids")
        check_source(self.model, self.shrink, self.item_head, self.fmt)
        for name in ("max_train", "max_val"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise C2KDError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


def build_model(recipe: TeacherRecipe, examples: ExampleSet, item_embeddings: torch.Tensor, seed: int) -> RecLM:
    """The RecLM to train (see `c2kd.recmodel.build`; presets get a word-level tokenizer over this
    catalog); LoRA adapters when asked."""
    model = build_reclm(recipe.model, fmt=recipe.fmt, item_embeddings=item_embeddings,
                        data_fingerprint=examples.fingerprint, seed=seed, item_head=recipe.item_head,
                        shrink=recipe.shrink,
                        preset_tokenizer=lambda: build_word_tokenizer(examples.titles()[1:], examples.num_items))
    if recipe.lora is not None:
        add_lora(model, recipe.lora, seed)
    return model


def add_lora(model: RecLM, lora: LoraSettings, seed: int) -> None:
    """Wrap `model.lm` with peft LoRA on its projections. The vocabulary is frozen but for the
    item and slot tokens' rows (`RecLM.freeze_vocabulary`), and the projector, which lives outside
    the LM, keeps training in full."""
    from peft import LoraConfig, get_peft_model

    model.freeze_vocabulary()
    lm = model.lm
    names = {name.rsplit(".", 1)[-1] for name, module in lm.named_modules() if isinstance(module, nn.Linear)}
    targets: Any = [t for t in LORA_TARGETS if t in names] or "all-linear"
    config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha if lora.alpha is not None else 2 * lora.r, lora_dropout=lora.dropout,
        target_modules=targets, task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # LoRA A matrices: the same on every rank and on resumption
        model.lm = get_peft_model(lm, config)


def answer_loss(model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    """Cross-entropy on the answer tokens (the labels of `collate`)."""
    return {"loss": model(**batch).loss}


def teacher_loss(history: float, sasrec_kd: float, item_token_ids: torch.Tensor) -> Callable[[nn.Module, dict], dict[str, torch.Tensor]]:
    """The answer loss + `history` x the cross-entropy of every history item token naming the next
    history item over the catalog (`next_history_items`) + `sasrec_kd` x KL(SASRec ‖ model) over
    the catalog at the answer item (the batch's `sasrec_logits`, see `with_sasrec_logits`)."""
    item_columns = item_token_ids[1:]

    def loss_fn(model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        inputs = {k: v for k, v in batch.items() if k != "sasrec_logits"}
        labels = next_history_items(batch["slot_items"]) if history else None
        out = model(**inputs, item_labels=labels)
        terms = {"answer": out.loss}
        if history:
            terms["history"] = out.item_loss
        if sasrec_kd:
            items = out.logits[first_answer_rows(batch["labels"]).to(out.logits.device)][:, item_columns.to(out.logits.device)]
            sasrec = F.log_softmax(batch["sasrec_logits"][:, 1:].float(), -1)
            terms["sasrec_kd"] = F.kl_div(F.log_softmax(items.float(), -1), sasrec, log_target=True, reduction="batchmean")
        loss = out.loss + history * terms.get("history", 0.0) + sasrec_kd * terms.get("sasrec_kd", 0.0)
        return {"loss": loss, **terms}
    return loss_fn


def with_sasrec_logits(collate_fn: Callable[[list], dict], sasrec: str | Path, frame: pl.DataFrame) -> Callable[[list], dict]:
    """`collate_fn` that also hands over SASRec's catalog scores after each example's history
    (`sasrec_logits` [B, N + 1]), computed once here for every example of `frame`."""
    model, _ = load_sasrec(sasrec)
    scores = catalog_scores(model, SplitTensors.from_frame(frame).seq)
    row_of = {int(eid): row for row, eid in enumerate(frame["example_id"].to_list())}

    def collate_with_scores(batch: list[EncodedExample]) -> dict:
        out = collate_fn(batch)
        out["sasrec_logits"] = scores[[row_of[e.example_id] for e in batch]]
        return out
    return collate_with_scores


@leaves_nothing_when_refused
def train_teacher(
    data: str | Path | ExampleSet,
    sasrec: str | Path,
    out: str | Path,
    recipe: TeacherRecipe,
    train_config: dict | None = None,
    overwrite: bool = False,
    keep_checkpoints: bool = False,
) -> dict:
    """Train a recommender LM and save it at `out`; returns the content of `out/train.json`.

    `train_config`: TrainConfig fields (all but out_dir). Re-running after an interruption with
    the same arguments resumes from the last checkpoint."""
    wall = time.perf_counter()
    out, work = claim(out)
    examples = data if isinstance(data, ExampleSet) else load_examples(data)
    check_fingerprint(read_run_config(sasrec), examples, sasrec)
    item_embeddings = load_item_embeddings(sasrec)
    config = TrainConfig(out_dir=work, **(train_config or {}))
    rank = dist_env()[0]
    recipe_record = {"recipe": RECIPE, **asdict(recipe), "train": comparable_config(config),
                     "data_fingerprint": examples.fingerprint, "sasrec": str(Path(sasrec).resolve())}
    finished = finished_run(out, recipe_record, "train.json", overwrite, SETTINGS_ADDED)
    if finished is not None:
        return {**finished, "already_complete": True}

    model = build_model(replace(recipe, lora=None), examples, item_embeddings, seed=config.seed)
    check_or_write_recipe(work, recipe_record, rank, SETTINGS_ADDED)  # only once everything could be built
    non_embedding = model.non_embedding_parameters()  # of the LM itself, before any adapters
    if recipe.lora is not None:
        add_lora(model, recipe.lora, config.seed)
    encoder = PromptEncoder(model.tokenizer, recipe.fmt, examples.titles())
    train_frame = examples.split("train")
    train_frame = train_frame[fixed_subset(train_frame.height, recipe.max_train)]
    train_data: list[EncodedExample] = encode_frame(encoder, train_frame)
    pad_id = encoder.pad_id
    evaluator = RecLMEvaluator(examples, "validation", limit=recipe.max_val, batch_size=recipe.eval_batch_size,
                               generation=False, full_catalog=False, progress=False)
    batch_of: Callable[[list], dict] = lambda batch: collate(batch, pad_id)
    if recipe.sasrec_kd:
        batch_of = with_sasrec_logits(batch_of, sasrec, train_frame)
    source = ExampleBatches(train_data, batch_of, config.batch_size, config.seed)
    extra_terms = recipe.history_loss or recipe.sasrec_kd
    loss_fn = (teacher_loss(recipe.history_loss, recipe.sasrec_kd, model.item_token_ids) if extra_terms
               else answer_loss)
    result: TrainResult = train(model, loss_fn, source, evaluator, recipe.select_metric, config,
                                on_device=prepare_for_training)
    record = {
        "kind": TRAIN_KIND, "version": TRAIN_VERSION, "recipe": RECIPE,
        "format": recipe.fmt,
        "model": {"source": recipe.model, "base": model.spec.base, "preset": model.spec.preset,
                  "layers": model.num_layers, "hidden_size": model.hidden_size,
                  "non_embedding_parameters": non_embedding,
                  "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
                  "lora": asdict(recipe.lora) if recipe.lora is not None else None},
        "data": {"dir": str(examples.root), "fingerprint": examples.fingerprint,
                 "train_examples": len(train_data), "train_split_examples": examples.split("train").height,
                 "validation_examples": evaluator.frame.height},
        "sasrec": {"run": str(sasrec), "dim": int(item_embeddings.shape[1])},
        "train": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items() if k != "out_dir"},
        "validation": {"select_metric": recipe.select_metric, "best_step": result.best_step,
                       "best": result.best_metrics},
        "final_step": result.final_step,
        "timings": {"train_s": round(result.total_train_s, 3), "this_run_s": round(time.perf_counter() - wall, 3),
                    "resumed_from_step": result.resumed_from},
    }
    if rank == 0:
        _finish(model, work, out, record, overwrite, keep_checkpoints, evaluator)
    return record


def _finish(model: RecLM, work: Path, out: Path, record: dict, overwrite: bool, keep_checkpoints: bool,
            evaluator: RecLMEvaluator) -> None:
    """Save the (best) model with train.json, log.jsonl, its validation metrics and per-example rows,
    then rename it into place at `out`."""
    metrics, rows = evaluator.evaluate_with_predictions(model)
    staged = model.save(work / "model")
    shutil.copyfile(work / "log.jsonl", staged / "log.jsonl")
    write_json(staged / "train.json", record)
    write_json(staged / "metrics.json", {"validation": metrics})
    write_predictions(staged / PREDICTIONS_FILE, rows)
    publish(staged, out, work, overwrite, keep_work=keep_checkpoints)


def read_train_record(model_dir: str | Path) -> dict:
    """`train.json` of a model folder written by train-teacher."""
    path = Path(model_dir) / "train.json"
    if not path.is_file():
        raise C2KDError(f"{model_dir}: no train.json (not written by `c2kd train-teacher`)")
    return json.loads(path.read_text())
