"""Train, evaluate and export the SASRec baseline.

Recipe: cross-entropy over the whole catalog of the item that follows a history (the last
position predicts the example's target; optionally every earlier history position predicts the
next history item too, which only uses items that precede the train target, so nothing from the
validation or test targets leaks in). AdamW, the model of the epoch with the best validation
NDCG@10 over the 20 stored candidates is kept; the test split is read only after that choice.

Run folder written by `train_sasrec` (atomically: a temporary sibling folder renamed at the end):

    config.json                {"kind": "sasrec", "data_fingerprint", "spec", "train", ...}
    model.safetensors          the selected model's weights
    item_embeddings.safetensors  "item_embeddings": float32 [num_items + 1, hidden], row 0 = padding
    metrics.json               validation and test metrics of the selected model, training log
    predictions.parquet        the selected model's per-example results on validation and test
                               (c2kd.predictions)
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import polars as pl
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from c2kd.atomic import check_destination, staged_dir, write_json
from c2kd.errors import C2KDError
from c2kd.metrics import candidate_rank_metrics, candidate_ranks, full_catalog_rank_metrics, full_catalog_ranks
from c2kd.data.examples import MAX_HISTORY, ExampleSet, load_examples, target_indices
from c2kd.predictions import PREDICTIONS_FILE, prediction_rows, write_predictions
from c2kd.sasrec.model import SASRec, SASRecSpec

RUN_KIND = "sasrec"
RUN_VERSION = 1
SELECT_METRIC = "NDCG@10"  # over the 20 stored validation candidates
EMBEDDINGS_FILE = "item_embeddings.safetensors"
EMBEDDINGS_KEY = "item_embeddings"


@dataclass(frozen=True)
class SASRecTrainConfig:
    seed: int = 0
    epochs: int = 200
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.1
    patience: int = 10  # epochs without a better validation NDCG@10 before stopping
    all_positions: bool = True  # also supervise every history position (next history item)
    hidden: int = 64
    num_blocks: int = 2
    num_heads: int = 1
    dropout: float = 0.5  # ML-100k is small; 0.5 was at least as good as 0.2 on validation

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "patience", "hidden", "num_blocks", "num_heads"):
            if getattr(self, name) < 1:
                raise C2KDError(f"SASRec {name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or self.weight_decay < 0 or not 0 <= self.dropout < 1:
            raise C2KDError(
                f"SASRec needs lr > 0, weight_decay >= 0, 0 <= dropout < 1; got {self.lr}, {self.weight_decay}, {self.dropout}"
            )

    def spec(self, num_items: int) -> SASRecSpec:
        return SASRecSpec(
            num_items=num_items, hidden=self.hidden, num_blocks=self.num_blocks,
            num_heads=self.num_heads, max_len=MAX_HISTORY, dropout=self.dropout,
        )


@dataclass(frozen=True)
class SplitTensors:
    """One split as tensors: left-padded histories, targets and the stored candidates."""

    seq: torch.Tensor  # [B, MAX_HISTORY] long, left padded with 0
    target: torch.Tensor  # [B] long
    candidates: torch.Tensor  # [B, C] long
    target_index: torch.Tensor  # [B] long, position of the target in `candidates`

    @staticmethod
    def from_frame(frame: pl.DataFrame) -> "SplitTensors":
        histories = frame["history"].to_list()
        seq = np.zeros((len(histories), MAX_HISTORY), dtype=np.int64)
        for row, hist in enumerate(histories):
            if len(hist) > MAX_HISTORY:
                raise C2KDError(f"example {frame['example_id'][row]}: history of {len(hist)} items, at most {MAX_HISTORY} expected")
            if hist:
                seq[row, MAX_HISTORY - len(hist):] = hist
        return SplitTensors(
            seq=torch.from_numpy(seq),
            target=torch.from_numpy(frame["target"].to_numpy().astype(np.int64)),
            candidates=torch.from_numpy(np.asarray(frame["candidates"].to_list(), dtype=np.int64).reshape(len(frame), -1)),
            target_index=torch.from_numpy(target_indices(frame).astype(np.int64)),
        )

    def __len__(self) -> int:
        return int(self.target.shape[0])


@dataclass
class FitResult:
    model: SASRec
    best_epoch: int
    best_validation: dict
    log: list[dict] = field(default_factory=list)
    seconds: float = 0.0


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def catalog_scores(model: SASRec, seq: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
    """Scores of every item after each history: [B, num_items + 1] (column 0 = -inf)."""
    was_training = model.training
    model.eval()
    out = torch.cat([model.last_scores(seq[i : i + batch_size]) for i in range(0, len(seq), batch_size)])
    model.train(was_training)
    return out


def split_ranks(model: SASRec, data: SplitTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's rank [B] among the 20 stored candidates and among the full catalog."""
    if len(data) == 0:
        raise C2KDError("no examples to evaluate (empty split)")
    scores = catalog_scores(model, data.seq)
    return candidate_ranks(scores.gather(1, data.candidates), data.target_index), full_catalog_ranks(scores, data.target, data.seq)


def evaluate_split(model: SASRec, data: SplitTensors) -> dict:
    """Ranking metrics over the 20 stored candidates and over the full catalog."""
    ranks, catalog = split_ranks(model, data)
    return {
        "examples": len(data),
        "candidates": candidate_rank_metrics(ranks),
        "full_catalog": full_catalog_rank_metrics(catalog),
    }


def evaluate_frame(model: SASRec, frame: pl.DataFrame, split: str) -> tuple[dict, pl.DataFrame]:
    """`evaluate_split` of a split's examples and the per-example rows it is the mean of."""
    ranks, catalog = split_ranks(model, SplitTensors.from_frame(frame))
    metrics = {"examples": frame.height, "candidates": candidate_rank_metrics(ranks),
               "full_catalog": full_catalog_rank_metrics(catalog)}
    return metrics, prediction_rows(frame, split, ranks, catalog)


# --------------------------------------------------------------------------- training


def _loss(model: SASRec, seq: torch.Tensor, target: torch.Tensor, all_positions: bool) -> torch.Tensor:
    if not all_positions:
        return F.cross_entropy(model.last_scores(seq), target)
    # Position p predicts the item at p + 1; the last position predicts the target.
    labels = torch.cat([seq[:, 1:], target[:, None]], dim=1)
    real = seq != 0
    hidden = model(seq)[real]
    return F.cross_entropy(model.item_scores(hidden), labels[real])


def _train_epoch(
    model: SASRec, optimizer: torch.optim.Optimizer, data: SplitTensors, order: torch.Tensor, config: SASRecTrainConfig
) -> float:
    """One pass over `data` in `order`; returns the mean batch loss.

    The padding row of the item table stays exactly zero: its gradient is zero (padding_idx),
    and AdamW's decay and update of a zero row with zero gradient are zero.
    """
    model.train()
    total, batches = 0.0, 0
    for i in range(0, len(order), config.batch_size):
        idx = order[i : i + config.batch_size]
        loss = _loss(model, data.seq[idx], data.target[idx], config.all_positions)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total += loss.item()
        batches += 1
    return total / batches


def fit(
    num_items: int,
    train: pl.DataFrame,
    validation: pl.DataFrame,
    config: SASRecTrainConfig,
    on_epoch: Callable[[dict], None] | None = None,
) -> FitResult:
    """Train SASRec on `train`, selecting the epoch by validation NDCG@10 over the candidates.

    Only the train and validation splits are given to this function, so the test split cannot
    influence training or model selection.
    """
    if len(train) == 0 or len(validation) == 0:
        raise C2KDError("SASRec needs non-empty train and validation splits")
    train_t, val_t = SplitTensors.from_frame(train), SplitTensors.from_frame(validation)
    start = time.perf_counter()
    # fork_rng: seeding here must not change the random state of the caller.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = SASRec(config.spec(num_items))
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=(0.9, 0.98), weight_decay=config.weight_decay
        )
        order_rng = torch.Generator().manual_seed(config.seed)
        best_score, best_epoch, best_state, best_val = -math.inf, 0, None, {}
        log: list[dict] = []
        for epoch in range(1, config.epochs + 1):
            order = torch.randperm(len(train_t), generator=order_rng)
            train_loss = _train_epoch(model, optimizer, train_t, order, config)
            val = evaluate_split(model, val_t)
            score = val["candidates"][SELECT_METRIC]
            entry = {"epoch": epoch, "train_loss": train_loss, f"validation_{SELECT_METRIC}": score}
            log.append(entry)
            if score > best_score:
                best_score, best_epoch, best_val = score, epoch, val
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if on_epoch is not None:
                on_epoch({**entry, "best_epoch": best_epoch, f"best_{SELECT_METRIC}": best_score})
            if epoch - best_epoch >= config.patience:
                break
        model.load_state_dict(best_state)
        model.eval()
    return FitResult(model, best_epoch, best_val, log, time.perf_counter() - start)


# --------------------------------------------------------------------------- run folder


def train_sasrec(
    data: str | Path | ExampleSet,
    out: str | Path,
    config: SASRecTrainConfig = SASRecTrainConfig(),
    overwrite: bool = False,
    progress: bool = False,
) -> dict:
    """Train on a prepared folder, write the run folder, return its metrics.json content."""
    examples = data if isinstance(data, ExampleSet) else load_examples(data, verify=True)
    out = Path(out)
    check_destination(out)
    if out.exists() and not overwrite:
        raise C2KDError(f"{out} already exists; choose another --out or pass --overwrite")

    with _progress(progress, config.epochs) as on_epoch:
        result = fit(examples.num_items, examples.split("train"), examples.split("validation"), config, on_epoch)
    # The model is chosen; only now is the test split read.
    test, test_rows = evaluate_frame(result.model, examples.split("test"), "test")
    # the selected model again on validation: the per-example rows of the metrics recorded during fit
    _, validation_rows = evaluate_frame(result.model, examples.split("validation"), "validation")

    metrics = {
        "kind": RUN_KIND,
        "selected_epoch": result.best_epoch,
        "selected_by": f"validation candidates {SELECT_METRIC}",
        "epochs_run": len(result.log),
        "train_seconds": round(result.seconds, 2),
        "validation": {"split": "validation", **result.best_validation},
        "test": {"split": "test", **test},
        "log": result.log,
    }
    run_config = {
        "kind": RUN_KIND,
        "version": RUN_VERSION,
        "data_fingerprint": examples.fingerprint,
        "data_dir": str(Path(examples.root).resolve()),
        "num_items": examples.num_items,
        "spec": result.model.spec.to_dict(),
        "train": asdict(config),
        "selected_epoch": result.best_epoch,
    }
    with staged_dir(out, replace=overwrite) as tmp:
        state = {k: v.contiguous() for k, v in result.model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"))
        emb = result.model.item_emb.weight.detach().to(torch.float32).contiguous().clone()
        save_file({EMBEDDINGS_KEY: emb}, str(tmp / EMBEDDINGS_FILE))
        write_json(tmp / "metrics.json", metrics)
        write_predictions(tmp / PREDICTIONS_FILE, [validation_rows, test_rows])
        write_json(tmp / "config.json", run_config)
    return metrics


@contextmanager
def _progress(enabled: bool, epochs: int) -> Iterator[Callable[[dict], None] | None]:
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("[bold]SASRec"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.description}"),
    ) as bar:
        task = bar.add_task("", total=epochs)

        def on_epoch(entry: dict) -> None:
            bar.update(
                task, completed=entry["epoch"],
                description=(
                    f"loss {entry['train_loss']:.3f}  val {SELECT_METRIC} {entry[f'validation_{SELECT_METRIC}']:.4f}"
                    f"  best {entry[f'best_{SELECT_METRIC}']:.4f} @ {entry['best_epoch']}"
                ),
            )

        yield on_epoch


def read_run_config(run_dir: str | Path) -> dict:
    """config.json of a run folder (any kind), with a clear error when it is missing or broken."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise C2KDError(f"{run_dir}: not a model run folder (no config.json)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise C2KDError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict) or "kind" not in config:
        raise C2KDError(f"{path}: no \"kind\" field; expected e.g. {{\"kind\": \"sasrec\", ...}}")
    return config


def _sasrec_config(run_dir: Path) -> dict:
    config = read_run_config(run_dir)
    if config["kind"] != RUN_KIND:
        raise C2KDError(f"{run_dir}: a {config['kind']!r} run, expected a {RUN_KIND!r} run")
    if config.get("version") != RUN_VERSION:
        raise C2KDError(f"{run_dir}/config.json: version {config.get('version')!r}, expected {RUN_VERSION}")
    return config


def check_fingerprint(run_config: dict, examples: ExampleSet, run_dir: str | Path) -> None:
    """Refuse to use a model on data other than the data it was trained on."""
    if run_config.get("data_fingerprint") != examples.fingerprint:
        raise C2KDError(
            f"{run_dir} was trained on data with fingerprint {run_config.get('data_fingerprint')!r} "
            f"but {examples.root} has fingerprint {examples.fingerprint!r}; "
            "evaluate on the prepared folder the model was trained on (or retrain)"
        )


def load_sasrec(run_dir: str | Path) -> tuple[SASRec, dict]:
    """The selected model of a SASRec run folder (eval mode) and its config.json."""
    run_dir = Path(run_dir)
    config = _sasrec_config(run_dir)
    spec_fields = {f.name for f in fields(SASRecSpec)}
    spec = SASRecSpec(**{k: v for k, v in config["spec"].items() if k in spec_fields})
    model = SASRec(spec)
    try:
        model.load_state_dict(load_file(str(run_dir / "model.safetensors")))
    except (OSError, RuntimeError) as err:
        raise C2KDError(f"{run_dir}/model.safetensors: cannot load the SASRec weights ({err})") from None
    model.eval()
    return model, config


def load_item_embeddings(run_dir: str | Path) -> torch.Tensor:
    """The trained item embeddings, float32 [num_items + 1, hidden], row 0 = padding (zeros)."""
    run_dir = Path(run_dir)
    config = _sasrec_config(run_dir)
    path = run_dir / EMBEDDINGS_FILE
    try:
        tensors = load_file(str(path))
    except (OSError, RuntimeError) as err:
        raise C2KDError(f"{path}: cannot read ({err})") from None
    if EMBEDDINGS_KEY not in tensors:
        raise C2KDError(f"{path}: no tensor {EMBEDDINGS_KEY!r} (found {sorted(tensors)})")
    emb = tensors[EMBEDDINGS_KEY]
    expected = (int(config["num_items"]) + 1, int(config["spec"]["hidden"]))
    if tuple(emb.shape) != expected or emb.dtype != torch.float32:
        raise C2KDError(
            f"{path}: {EMBEDDINGS_KEY!r} is {emb.dtype} {tuple(emb.shape)}, expected torch.float32 {expected}"
        )
    return emb


def evaluate_sasrec(run_dir: str | Path, data: str | Path | ExampleSet, split: str = "test") -> dict:
    """Metrics of a trained SASRec run on one split of its prepared folder."""
    return evaluate_sasrec_with_predictions(run_dir, data, split)[0]


def evaluate_sasrec_with_predictions(
    run_dir: str | Path, data: str | Path | ExampleSet, split: str = "test"
) -> tuple[dict, pl.DataFrame]:
    """`evaluate_sasrec`'s metrics and the per-example rows they are the means of (`c2kd.predictions`)."""
    examples = data if isinstance(data, ExampleSet) else load_examples(data, verify=True)
    check_fingerprint(_sasrec_config(Path(run_dir)), examples, run_dir)  # before loading any weights
    model, _ = load_sasrec(run_dir)
    metrics, rows = evaluate_frame(model, examples.split(split), split)
    return {"kind": RUN_KIND, "split": split, **metrics}, rows
