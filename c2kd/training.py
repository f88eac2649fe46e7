"""The one training loop of the project: teacher fine-tuning, the SFT student and distillation.

    source = ExampleBatches(examples, collate, batch_size=32, seed=0)
    result = train(model, loss_fn, source, evaluate_fn, "NDCG@10", TrainConfig(out_dir=..., batch_size=32, seed=0))

- `loss_fn(model, batch) -> {"loss": Tensor, other terms...}`: "loss" is optimised, every term is
  logged: its mean over the micro-batches, or its sum for a `count/` term (e.g. router choices). Call `model(...)` (the DDP wrapper under torchrun) for the forward pass.
- Data: a batch source (`BatchSource`) yields an epoch's micro-batches from any position, this
  rank's part of each; the trainer asks for (epoch, position) and never guesses. Both sources
  here and in stage two follow `epoch_batches`: a permutation drawn from (seed, epoch), cut into
  `batch_size` pieces, each rank taking a strided slice, so the data seen does not depend on the
  world size. `grad_accum` micro-batches make one optimizer step.
- AdamW (weight decay on matrices only) and linear warmup then cosine decay to 0.
- bf16 autocast when `bf16=True` and the device supports it (CPU autocast supports bf16).
- `on_device(model, device)` runs once the model is on its device (the LM recipes pass
  `hf.prepare_for_training`: the plain attention on CPU).
- Checkpoints every `checkpoint_every` optimizer steps in `out_dir/checkpoints/step-XXXXXX/`
  (trainable weights, optimizer, scheduler, data position, every rank's RNG states), written to a
  temp folder and renamed. `train()` resumes from the newest one by itself; a resumed run ends with
  the same weights, bit for bit on CPU, as one that never stopped.
- `evaluate_fn(model) -> dict` on validation data every `eval_every` steps (or each epoch) and at
  the end; the best state by `select_metric` (higher is better) goes to `out_dir/best/` and is
  loaded into the model at the end.
- `out_dir/log.jsonl`: one line per logged step ("kind": "train"), evaluation ("eval") and epoch.
- Under torchrun (WORLD_SIZE > 1): DDP (gloo on CPU, NCCL on CUDA); rank 0 evaluates, writes the
  checkpoints, the best state and the log; every rank reads the checkpoints from the same `out_dir`.
  Buffers are not broadcast each step (ours are constants, identical on every rank).
Frozen parameters are not checkpointed: resuming needs the same starting model, which is checked.
Bitwise resume holds on CPU; on GPUs non-deterministic kernels may make runs differ slightly.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn

from c2kd import distributed
from c2kd.atomic import TMP_PREFIX, staged_dir, write_bytes
from c2kd.errors import C2KDError

# Config fields that may change between a run and its resumption; all others must match.
_RESUMABLE_CHANGES = {"out_dir", "checkpoint_every", "keep_last", "log_every", "progress", "device"}
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
COUNT_PREFIX = "count/"  # a loss_fn term counted (summed) rather than averaged
MAX_SEED = 2**32 - 1  # torch and numpy take any seed in 0..2**32 - 1; larger ones overflow inside torch


@dataclass
class TrainConfig:
    out_dir: str | Path
    lr: float = 1e-3
    weight_decay: float = 1e-5  # the C2KD authors' value
    warmup_ratio: float = 0.05
    epochs: int = 3
    max_steps: int | None = None  # optimizer steps; overrides epochs when set
    batch_size: int = 32  # examples per micro-batch, over all ranks together
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    checkpoint_every: int = 200  # optimizer steps; a final checkpoint is always written
    eval_every: int | str = "epoch"  # optimizer steps, or "epoch"; also evaluated at the end
    log_every: int = 10
    seed: int = 0
    bf16: bool = False
    keep_last: int = 2
    device: str = "auto"  # "auto" = cuda:LOCAL_RANK when available, else cpu
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("lr", "weight_decay", "warmup_ratio", "max_grad_norm"):  # nan passes every comparison below
            if getattr(self, name) is not None and not math.isfinite(getattr(self, name)):
                raise C2KDError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(self, name)}")
        if not 0 <= self.seed <= MAX_SEED:
            raise C2KDError(f"--seed must be in 0..{MAX_SEED}, got {self.seed}")
        for name in ("batch_size", "grad_accum", "epochs", "log_every", "keep_last"):
            if getattr(self, name) < 1:
                raise C2KDError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.weight_decay < 0 or (self.max_grad_norm is not None and self.max_grad_norm <= 0) or self.checkpoint_every < 0:
            raise C2KDError(f"need weight_decay >= 0, max_grad_norm > 0 (or off) and checkpoint_every >= 0; got "
                            f"{self.weight_decay}, {self.max_grad_norm}, {self.checkpoint_every}")
        if self.max_steps is not None and self.max_steps < 1:
            raise C2KDError(f"max_steps must be >= 1, got {self.max_steps}")
        if not 0.0 <= self.warmup_ratio < 1.0 or self.lr <= 0:
            raise C2KDError(f"need lr > 0 and 0 <= warmup_ratio < 1 (got {self.lr}, {self.warmup_ratio})")
        if self.eval_every != "epoch" and not (isinstance(self.eval_every, int) and self.eval_every >= 1):
            raise C2KDError(f"eval_every must be 'epoch' or a number of steps >= 1, got {self.eval_every!r}")
        distributed.pick_device(self.device)  # refused here, before a run folder is created, not at the first step


@dataclass
class TrainResult:
    best_metric: float | None
    best_step: int | None
    best_metrics: dict[str, float]
    final_step: int
    out_dir: Path
    best_dir: Path | None
    log_path: Path
    elapsed_s: float  # this process
    total_train_s: float  # including the time before any resumption
    resumed_from: int | None


# ---------------------------------------------------------------- data order


def epoch_order(num_examples: int, seed: int, epoch: int, groups: np.ndarray | None = None, block: int = 0) -> np.ndarray:
    """A (seed, epoch) permutation of the examples.

    With `groups` (each example's group, e.g. its cache shard) and 0 < `block` < num_examples, a
    two-level shuffle instead: the groups in a random order, cut into blocks of whole groups holding
    at least `block` examples each, every block's examples shuffled. A batch then draws from one
    block's few groups, so a reader touches a few shards per batch however large the cache is (the
    block shuffle of MosaicML Streaming). Data no larger than one block gets the plain permutation."""
    rng = np.random.default_rng([seed, epoch])
    if groups is None or block <= 0 or num_examples <= block:
        return rng.permutation(num_examples)
    groups = np.asarray(groups)
    if len(groups) != num_examples:
        raise ValueError(f"groups has {len(groups)} entries for {num_examples} examples")
    _, label = np.unique(groups, return_inverse=True)
    by_group = np.argsort(label, kind="stable")
    members = np.split(by_group, np.cumsum(np.bincount(label))[:-1])  # each group's examples
    order, pending, held = [], [], 0
    for g in rng.permutation(len(members)):
        pending.append(members[g])
        held += len(members[g])
        if held >= block:
            order.append(rng.permutation(np.concatenate(pending)))
            pending, held = [], 0
    if pending:
        order.append(rng.permutation(np.concatenate(pending)))
    return np.concatenate(order)


def epoch_batches(num_examples: int, batch_size: int, seed: int, epoch: int, world_size: int = 1,
                  groups: np.ndarray | None = None, block: int = 0) -> list[np.ndarray]:
    """The micro-batches of one epoch: `epoch_order` cut into `batch_size` pieces. The order does
    not depend on the world size: each rank takes a strided slice of every piece.

    A last piece smaller than the world size is dropped (a rank would get nothing)."""
    perm = epoch_order(num_examples, seed, epoch, groups, block)
    batches = [perm[i : i + batch_size] for i in range(0, num_examples, batch_size)]
    if batches and len(batches[-1]) < world_size:
        batches.pop()
    return batches


class BatchSource(Protocol):
    """What the trainer draws micro-batches from."""

    num_examples: int

    def __len__(self) -> int:
        """Micro-batches per epoch (the same every epoch)."""

    def batches(self, epoch: int, start: int = 0) -> Iterator[Any]:
        """This rank's part of micro-batches start, start + 1, ... of `epoch`, ready for the loss."""


class ExampleBatches:
    """A batch source over examples held in memory: `collate` turns a list of them into a batch."""

    def __init__(self, examples: Sequence, collate: Callable[[list], Any], batch_size: int, seed: int):
        self.examples, self.collate, self.batch_size, self.seed = examples, collate, batch_size, seed
        self.num_examples = len(examples)
        self.rank, self.world = distributed.dist_env()[:2]

    def __len__(self) -> int:
        return len(epoch_batches(self.num_examples, self.batch_size, self.seed, 0, self.world))

    def batches(self, epoch: int, start: int = 0) -> Iterator[Any]:
        for idx in epoch_batches(self.num_examples, self.batch_size, self.seed, epoch, self.world)[start:]:
            yield self.collate([self.examples[int(i)] for i in idx[self.rank :: self.world]])


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor) or callable(getattr(batch, "to", None)):  # tensors, CachedBatch
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _batch_size_and_tokens(batch: Any) -> tuple[int, int]:
    """Examples in a batch (rows of its first tensor), and real tokens when it carries an
    `attention_mask` (else 0)."""
    mask = batch.get("attention_mask") if isinstance(batch, dict) else getattr(batch, "attention_mask", None)
    if isinstance(mask, torch.Tensor):
        return int(mask.shape[0]), int(mask.sum())
    stack = [batch]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            return (int(item.shape[0]) if item.ndim else 1), 0
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return 0, 0


# ---------------------------------------------------------------- state on disk


def _rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "python": random.getstate(),
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def _trainable_state(module: nn.Module, frozen: set[str]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if k not in frozen}


def _load_trainable_state(module: nn.Module, state: dict, frozen: set[str], where: Path) -> None:
    missing, unexpected = module.load_state_dict(state, strict=False)
    if unexpected or set(missing) - frozen:
        raise C2KDError(
            f"{where}: saved weights do not fit this model (unexpected: {sorted(unexpected)[:5]}, "
            f"missing: {sorted(set(missing) - frozen)[:5]}); was it trained with another model or trainable set?"
        )


def _frozen_checksum(module: nn.Module, frozen_params: list[torch.Tensor]) -> list[float]:
    with torch.no_grad():
        return [float(sum(p.double().sum() for p in frozen_params) if frozen_params else 0.0),
                float(sum(p.numel() for p in frozen_params))]


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder under `out_dir/checkpoints`, or None."""
    root = Path(out_dir) / "checkpoints"
    steps = [(int(m.group(1)), p) for p in root.glob("step-*") if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return max(steps)[1] if steps else None


def comparable_config(config: TrainConfig) -> dict:
    """The settings a resumed (or repeated) run must share with the first one."""
    return {k: v for k, v in asdict(config).items() if k not in _RESUMABLE_CHANGES}


# ---------------------------------------------------------------- the loop


def cosine_with_warmup(step: int, warmup: int, total: int) -> float:
    """LR multiplier: linear warmup to 1 over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def train(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], dict[str, torch.Tensor]],
    source: BatchSource,
    evaluate_fn: Callable[[nn.Module], dict[str, float]] | None,
    select_metric: str | None,
    config: TrainConfig,
    trainable_parameters: list[nn.Parameter] | None = None,
    on_epoch_end: Callable[[int, dict], dict | None] | None = None,
    on_device: Callable[[nn.Module, torch.device], None] | None = None,
) -> TrainResult:
    """Train `model` in place (ending with its best validation weights) and return where things went.

    `trainable_parameters`: the parameters to optimise (default: those with requires_grad); all the
    others are frozen. `on_epoch_end(epoch, stats)` runs on every rank after each epoch (and after a
    last partial one); a dict it returns is added to the epoch line of the log."""
    started = time.perf_counter()
    # Bit-reproducible runs with more than one CPU thread: without it, two runs of the same teacher
    # command ended with different weights (and so different caches and distilled students).
    # warn_only: an op with no deterministic kernel warns instead of stopping the run.
    torch.use_deterministic_algorithms(True, warn_only=True)
    rank, world, _ = distributed.dist_env()
    device = distributed.pick_device(config.device)
    distributed.init(device)
    if source.num_examples == 0:
        raise C2KDError("no training examples")
    if evaluate_fn is not None and not select_metric:
        raise C2KDError("select_metric is needed to choose the best state on validation")
    out = Path(config.out_dir)
    ckpt_root, best_dir, log_path = out / "checkpoints", out / "best", out / "log.jsonl"
    main = rank == 0

    # Trainable set, and the names of what stays frozen (not checkpointed).
    if trainable_parameters is not None:
        chosen = {id(p) for p in trainable_parameters}
        for p in model.parameters():
            p.requires_grad_(id(p) in chosen)
    names = list(model.named_parameters(remove_duplicate=False))
    frozen = {n for n, p in names if not p.requires_grad}
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise C2KDError("the model has no trainable parameters")
    frozen_sum = _frozen_checksum(model, [p for _, p in model.named_parameters() if not p.requires_grad])
    model.to(device)
    if on_device is not None:
        on_device(model, device)

    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr)
    micro_per_epoch = len(source)
    if micro_per_epoch == 0:
        raise C2KDError(f"no batch of at least {world} examples (one per process) in an epoch")
    steps_per_epoch = math.ceil(micro_per_epoch / config.grad_accum)
    total = config.max_steps if config.max_steps else config.epochs * steps_per_epoch
    warmup = round(config.warmup_ratio * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cosine_with_warmup(s, warmup, total))

    # Fresh start or resumption from the newest checkpoint.
    step, epoch, batch_pos, prior_s, resumed_from = 0, 0, 0, 0.0, None
    best: dict = {"metric": None, "step": None, "metrics": {}}
    epoch_acc: dict = {}
    ckpt = latest_checkpoint(out)
    if ckpt is not None:
        state = torch.load(ckpt / "trainer.pt", weights_only=True)
        if state["config"] != comparable_config(config) or state["num_examples"] != source.num_examples:
            raise C2KDError(f"{ckpt}: checkpoint of a different run (settings or data differ); use another out_dir")
        if state["frozen_checksum"] != frozen_sum:
            raise C2KDError(f"{ckpt}: the frozen weights differ from the model this run started from")
        _load_trainable_state(model, torch.load(ckpt / "model.pt", weights_only=True), frozen, ckpt)
        optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
        scheduler.load_state_dict(state["scheduler"])
        step, epoch, batch_pos, prior_s = state["step"], state["epoch"], state["batch_pos"], state["train_s"]
        best, resumed_from = state["best"], step
        if rank == 0:
            Console(stderr=True).print(f"resuming from step {step} of {config.max_steps or '?'}" if config.max_steps
                                       else f"resuming from step {step} ({ckpt})", highlight=False)
        ranks = state["ranks"]
        mine = ranks[rank] if len(ranks) == world else None
        if mine is None:  # another world size: data order is kept, dropout streams are new
            if rank == 0:
                Console(stderr=True).print(f"resumed under {world} process(es), stopped under {len(ranks)}: the same "
                                           "global sample order continues; dropout is reseeded", highlight=False)
            torch.manual_seed(config.seed + 1000 * step + rank)
        else:
            _set_rng_state(mine["rng"])
            epoch_acc = mine["epoch_acc"]
    else:
        torch.manual_seed(config.seed + rank)
        np.random.seed(config.seed + rank)
        random.seed(config.seed + rank)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        for stale in list(ckpt_root.glob(f"{TMP_PREFIX}*")) + list(out.glob(f"{TMP_PREFIX}*")):
            shutil.rmtree(stale, ignore_errors=True)
        _rewrite_log(log_path, keep_until=step if ckpt is not None else -1)
        if ckpt is None:
            shutil.rmtree(best_dir, ignore_errors=True)
    distributed.barrier()

    ddp = world > 1
    net: nn.Module = model
    if ddp:
        net = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            broadcast_buffers=False,  # buffers here are constants (item embeddings, teacher heads): no per-step copy
        )
    use_bf16 = config.bf16 and (device.type == "cpu" or torch.cuda.is_bf16_supported())
    if config.bf16 and not use_bf16:
        warnings.warn(f"bf16 autocast is not supported on {device}; training in float32")
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 else nullcontext

    def log(record: dict) -> None:
        if main:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def evaluate() -> None:
        metrics = None
        if main:
            model.eval()
            with torch.no_grad(), autocast():
                metrics = {k: float(v) for k, v in evaluate_fn(model).items()}
            model.train()
            if select_metric not in metrics:
                raise C2KDError(f"evaluation returned {sorted(metrics)}, not the selection metric {select_metric!r}")
        metrics = distributed.broadcast(metrics)
        improved = best["metric"] is None or metrics[select_metric] > best["metric"]
        if improved:
            best.update(metric=metrics[select_metric], step=step, metrics=metrics)
            if main:
                with staged_dir(best_dir, replace=True) as d:
                    torch.save(_trainable_state(model, frozen), d / "model.pt")
                    (d / "best.json").write_text(json.dumps(best, indent=1))
        log({"kind": "eval", "step": step, "epoch": epoch, **metrics, "best": improved})

    def checkpoint() -> None:
        per_rank = distributed.gather({"rng": _rng_state(), "epoch_acc": {k: float(v) for k, v in epoch_acc.items()}})
        if main:
            state = {"step": step, "epoch": epoch, "batch_pos": batch_pos, "scheduler": scheduler.state_dict(),
                     "best": best, "ranks": per_rank, "config": comparable_config(config), "num_examples": source.num_examples,
                     "frozen_checksum": frozen_sum, "train_s": prior_s + time.perf_counter() - started}

            with staged_dir(ckpt_root / f"step-{step:06d}", replace=True) as d:
                torch.save(_trainable_state(model, frozen), d / "model.pt")
                torch.save(optimizer.state_dict(), d / "optimizer.pt")
                torch.save(state, d / "trainer.pt")
            done = sorted(p for p in ckpt_root.glob("step-*") if _STEP_DIR.match(p.name))
            for old in done[: max(0, len(done) - max(1, config.keep_last))]:
                shutil.rmtree(old, ignore_errors=True)
        distributed.barrier()

    def end_epoch(ep: int) -> None:
        stats = _reduce_means(epoch_acc)
        stats.update(epoch=ep, step=step)
        extra = on_epoch_end(ep, stats) if on_epoch_end is not None else None
        log({"kind": "epoch", **stats, **(extra or {})})
        epoch_acc.clear()

    def optimizer_step(group: list) -> None:
        """Forward/backward of `grad_accum` micro-batches, one optimizer step, and the log line."""
        nonlocal step, t_interval
        for j, batch in enumerate(group):
            batch = _to_device(batch, device)
            n_ex, n_tok = _batch_size_and_tokens(batch)
            with (net.no_sync() if ddp and j < len(group) - 1 else nullcontext()):
                with autocast():
                    terms = loss_fn(net, batch)
                (terms["loss"] / len(group)).backward()
            for acc in (interval, epoch_acc):
                _accumulate(acc, terms, n_ex, n_tok)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm or float("inf"))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        progress.update(task, completed=step)
        if step % config.log_every == 0 or step == total:
            stats = _reduce_means(interval, keep_counts=True)
            dt = max(time.perf_counter() - t_interval, 1e-9)
            n_ex, n_tok = stats.pop("examples"), stats.pop("tokens")
            rate = {"examples_per_s": n_ex / dt, **({"tokens_per_s": n_tok / dt} if n_tok else {})}
            log({"kind": "train", "step": step, "epoch": epoch, "lr": lr, **stats, "grad_norm": float(grad_norm), **rate})
            speed = f"{rate['tokens_per_s']:.0f} tok/s" if n_tok else f"{rate['examples_per_s']:.0f} ex/s"
            progress.update(task, info=f"loss {stats.get('loss', float('nan')):.4f}  {speed}")
            interval.clear()
            t_interval = time.perf_counter()

    model.train()
    interval: dict = {}
    t_interval = time.perf_counter()
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                        TimeRemainingColumn(), disable=not (main and config.progress))
    with progress:
        task = progress.add_task("train", total=total, completed=step, info="")
        while step < total:
            with closing(source.batches(epoch, batch_pos)) as batches:  # closing stops any read-ahead
                while batch_pos < micro_per_epoch and step < total:
                    group = [next(batches) for _ in range(min(config.grad_accum, micro_per_epoch - batch_pos))]
                    optimizer_step(group)
                    batch_pos += len(group)
                    epoch_done = batch_pos >= micro_per_epoch
                    if epoch_done or step == total:
                        end_epoch(epoch)
                    if epoch_done:
                        epoch, batch_pos = epoch + 1, 0
                    if evaluate_fn is not None and (
                        step == total or (config.eval_every == "epoch" and epoch_done)
                        or (isinstance(config.eval_every, int) and step % config.eval_every == 0)
                    ):
                        evaluate()
                    if step == total or (config.checkpoint_every > 0 and step % config.checkpoint_every == 0):
                        checkpoint()
                    if epoch_done:
                        break  # next epoch: a new permutation

    if evaluate_fn is not None and best["step"] is not None and best_dir.is_dir():
        _load_trainable_state(model, torch.load(best_dir / "model.pt", weights_only=True), frozen, best_dir)
    distributed.barrier()
    elapsed = time.perf_counter() - started
    return TrainResult(
        best_metric=best["metric"], best_step=best["step"], best_metrics=dict(best["metrics"]), final_step=step,
        out_dir=out, best_dir=best_dir if best["step"] is not None else None, log_path=log_path,
        elapsed_s=elapsed, total_train_s=prior_s + elapsed,
        resumed_from=resumed_from,
    )


def _accumulate(acc: dict, terms: dict[str, torch.Tensor], n_examples: int, n_tokens: int) -> None:
    for k, v in terms.items():  # tensors stay on the device: no sync per micro-batch
        acc[k] = acc.get(k, 0.0) + (v.detach().float() if isinstance(v, torch.Tensor) else float(v))
    acc["_count"] = acc.get("_count", 0) + 1
    acc["examples"] = acc.get("examples", 0) + n_examples
    acc["tokens"] = acc.get("tokens", 0) + n_tokens


def _reduce_means(acc: dict, keep_counts: bool = False) -> dict:
    """Mean of each term over micro-batches (and ranks), the sum of a `count/` term; with keep_counts,
    summed examples/tokens."""
    keys = sorted(k for k in acc if k not in ("_count", "examples", "tokens"))
    keys = distributed.broadcast(keys)  # same order on every rank
    values = torch.tensor([float(acc.get(k, 0.0)) for k in keys] + [acc.get("_count", 0), acc.get("examples", 0),
                                                                    acc.get("tokens", 0)], dtype=torch.float64)
    values = distributed.all_reduce_sum(values)
    count = max(values[-3].item(), 1.0)
    out = {k: values[i].item() / (1.0 if k.startswith(COUNT_PREFIX) else count) for i, k in enumerate(keys)}
    if keep_counts:
        out.update(examples=int(values[-2].item()), tokens=int(values[-1].item()))
    return out


def _rewrite_log(path: Path, keep_until: int) -> None:
    """Drop log lines past the resumed step (they will be written again); -1 drops all."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept = [ln for ln in lines if keep_until >= 0 and json.loads(ln).get("step", 0) <= keep_until]
    write_bytes(path, "".join(ln + "\n" for ln in kept).encode())


def read_log(out_dir: str | Path, kind: str | None = None) -> list[dict]:
    """The records of `out_dir/log.jsonl`, optionally only one kind ("train", "eval", "epoch")."""
    path = Path(out_dir) / "log.jsonl"
    records = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    return [r for r in records if kind is None or r.get("kind") == kind]
