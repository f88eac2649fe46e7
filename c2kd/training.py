"""The one training loop of the project: teacher fine-tuning, the SFT student and distillation.

    result = train(model, loss_fn, train_data, collate_fn, evaluate_fn, "NDCG@10", TrainConfig(out_dir=...))

- `loss_fn(model, batch) -> {"loss": Tensor, other terms...}`: "loss" is optimised, every term is
  logged. Call `model(...)` (the DDP wrapper under torchrun) for the forward pass.
- Data order: a permutation of `train_data` drawn from (seed, epoch); micro-batches of
  `batch_size` examples, `grad_accum` micro-batches per optimizer step. Under torchrun each rank
  takes a strided slice of every micro-batch, so the data seen does not depend on the world size.
- AdamW (weight decay on matrices only) and linear warmup then cosine decay to 0.
- bf16 autocast when `bf16=True` and the device supports it (CPU autocast supports bf16).
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
import os
import random
import re
import shutil
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn

from c2kd.errors import C2KDError

# Config fields that may change between a run and its resumption; all others must match.
_RESUMABLE_CHANGES = {"out_dir", "checkpoint_every", "keep_last", "log_every", "progress", "device"}
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


@dataclass
class TrainConfig:
    out_dir: str | Path
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.05
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; overrides epochs when set
    batch_size: int = 32  # examples per micro-batch, over all ranks together
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    checkpoint_every: int = 100  # optimizer steps; a final checkpoint is always written
    eval_every: int | str = "epoch"  # optimizer steps, or "epoch"; also evaluated at the end
    log_every: int = 10
    seed: int = 0
    bf16: bool = False
    keep_last: int = 2
    device: str = "auto"  # "auto" = cuda:LOCAL_RANK when available, else cpu
    find_unused_parameters: bool = False  # DDP option for models whose steps skip some parameters
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum", "epochs", "log_every", "keep_last"):
            if getattr(self, name) < 1:
                raise C2KDError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise C2KDError(f"max_steps must be >= 1, got {self.max_steps}")
        if not 0.0 <= self.warmup_ratio < 1.0 or self.lr <= 0:
            raise C2KDError(f"need lr > 0 and 0 <= warmup_ratio < 1 (got {self.lr}, {self.warmup_ratio})")
        if self.eval_every != "epoch" and not (isinstance(self.eval_every, int) and self.eval_every >= 1):
            raise C2KDError(f"eval_every must be 'epoch' or a number of steps >= 1, got {self.eval_every!r}")


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


# ---------------------------------------------------------------- distributed helpers


def distributed_info() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun environment (0, 1, 0 when not launched by it)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def is_main_process() -> bool:
    return distributed_info()[0] == 0


def _init_distributed(device: torch.device) -> None:
    if distributed_info()[1] > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast(obj: Any) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------- data order


def epoch_batches(num_examples: int, batch_size: int, seed: int, epoch: int, world_size: int = 1) -> list[np.ndarray]:
    """The micro-batches of one epoch: a (seed, epoch) permutation cut into `batch_size` pieces.

    A last piece smaller than the world size is dropped (a rank would get nothing)."""
    perm = np.random.default_rng([seed, epoch]).permutation(num_examples)
    batches = [perm[i : i + batch_size] for i in range(0, num_examples, batch_size)]
    if batches and len(batches[-1]) < world_size:
        batches.pop()
    return batches


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _batch_size_and_tokens(batch: Any) -> tuple[int, int]:
    """Examples in a batch (rows of its first tensor), and real tokens when it carries an
    `attention_mask` (else 0)."""
    if isinstance(batch, dict) and isinstance(batch.get("attention_mask"), torch.Tensor):
        mask = batch["attention_mask"]
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


def _atomic_dir(final: Path, write: Callable[[Path], None]) -> None:
    """Write a folder under a temp name, then rename it into place (replacing an older one)."""
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    old = final.parent / f".old-{final.name}"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder under `out_dir/checkpoints`, or None."""
    root = Path(out_dir) / "checkpoints"
    steps = [(int(m.group(1)), p) for p in root.glob("step-*") if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return max(steps)[1] if steps else None


def _comparable(config: TrainConfig) -> dict:
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
    train_data: Sequence,
    collate_fn: Callable[[list], Any],
    evaluate_fn: Callable[[nn.Module], dict[str, float]] | None,
    select_metric: str | None,
    config: TrainConfig,
    trainable_parameters: list[nn.Parameter] | None = None,
    on_epoch_end: Callable[[int, dict], dict | None] | None = None,
    batch_order: Callable[[int], Sequence[Sequence[int]]] | None = None,
) -> TrainResult:
    """Train `model` in place (ending with its best validation weights) and return where things went.

    `trainable_parameters`: the parameters to optimise (default: those with requires_grad); all the
    others are frozen. `on_epoch_end(epoch, stats)` runs on every rank after each epoch (and after a
    last partial one); a dict it returns is added to the epoch line of the log.
    `batch_order(epoch)`: the epoch's micro-batches as lists of indices into `train_data` (e.g. a
    shard-local order); it must be deterministic and give the same number of batches each epoch.
    Default: `epoch_batches` (a (seed, epoch) permutation cut into `batch_size` pieces)."""
    started = time.perf_counter()
    rank, world, local_rank = distributed_info()
    if config.device == "auto":
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
    _init_distributed(device)
    if len(train_data) == 0:
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

    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr)
    def batches_of(ep: int) -> list:
        if batch_order is None:
            return epoch_batches(len(train_data), config.batch_size, config.seed, ep, world)
        return [np.asarray(b) for b in batch_order(ep) if len(b) >= world]

    micro_per_epoch = len(batches_of(0))
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
        if state["config"] != _comparable(config) or state["num_examples"] != len(train_data):
            raise C2KDError(f"{ckpt}: checkpoint of a different run (settings or data differ); use another out_dir")
        if state["frozen_checksum"] != frozen_sum:
            raise C2KDError(f"{ckpt}: the frozen weights differ from the model this run started from")
        _load_trainable_state(model, torch.load(ckpt / "model.pt", weights_only=True), frozen, ckpt)
        optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
        scheduler.load_state_dict(state["scheduler"])
        step, epoch, batch_pos, prior_s = state["step"], state["epoch"], state["batch_pos"], state["train_s"]
        best, resumed_from = state["best"], step
        ranks = state["ranks"]
        mine = ranks[rank] if len(ranks) == world else None
        if mine is None:  # another world size: data order is kept, dropout streams are new
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
        for stale in list(ckpt_root.glob(".tmp-*")) + list(out.glob(".tmp-*")):
            shutil.rmtree(stale, ignore_errors=True)
        _rewrite_log(log_path, keep_until=step if ckpt is not None else -1)
        if ckpt is None:
            shutil.rmtree(best_dir, ignore_errors=True)
    _barrier()

    ddp = world > 1
    net: nn.Module = model
    if ddp:
        net = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=config.find_unused_parameters,
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
        metrics = _broadcast(metrics)
        improved = best["metric"] is None or metrics[select_metric] > best["metric"]
        if improved:
            best.update(metric=metrics[select_metric], step=step, metrics=metrics)
            if main:
                weights = _trainable_state(model, frozen)
                _atomic_dir(best_dir, lambda d: (torch.save(weights, d / "model.pt"),
                                                 (d / "best.json").write_text(json.dumps(best, indent=1))))
        log({"kind": "eval", "step": step, "epoch": epoch, **metrics, "best": improved})

    def checkpoint() -> None:
        per_rank = _gather({"rng": _rng_state(), "epoch_acc": {k: float(v) for k, v in epoch_acc.items()}})
        if main:
            state = {"step": step, "epoch": epoch, "batch_pos": batch_pos, "scheduler": scheduler.state_dict(),
                     "best": best, "ranks": per_rank, "config": _comparable(config), "num_examples": len(train_data),
                     "frozen_checksum": frozen_sum, "train_s": prior_s + time.perf_counter() - started}

            def write(d: Path) -> None:
                torch.save(_trainable_state(model, frozen), d / "model.pt")
                torch.save(optimizer.state_dict(), d / "optimizer.pt")
                torch.save(state, d / "trainer.pt")

            ckpt_root.mkdir(parents=True, exist_ok=True)
            _atomic_dir(ckpt_root / f"step-{step:06d}", write)
            done = sorted(p for p in ckpt_root.glob("step-*") if _STEP_DIR.match(p.name))
            for old in done[: max(0, len(done) - max(1, config.keep_last))]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()

    def end_epoch(ep: int) -> None:
        stats = _reduce_means(epoch_acc)
        stats.update(epoch=ep, step=step)
        extra = on_epoch_end(ep, stats) if on_epoch_end is not None else None
        log({"kind": "epoch", **stats, **(extra or {})})
        epoch_acc.clear()

    model.train()
    interval: dict = {}
    t_interval = time.perf_counter()
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                        TimeRemainingColumn(), disable=not (main and config.progress))
    with progress:
        task = progress.add_task("train", total=total, completed=step, info="")
        while step < total:
            batches = batches_of(epoch)
            while batch_pos < len(batches) and step < total:
                group = batches[batch_pos : batch_pos + config.grad_accum]
                for j, idx in enumerate(group):
                    batch = _to_device(collate_fn([train_data[int(i)] for i in idx[rank::world]]), device)
                    n_ex, n_tok = _batch_size_and_tokens(batch)
                    last = j == len(group) - 1
                    with (net.no_sync() if ddp and not last else nullcontext()):
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
                batch_pos += len(group)
                progress.update(task, completed=step)

                if step % config.log_every == 0 or step == total:
                    stats = _reduce_means(interval, keep_counts=True)
                    dt = max(time.perf_counter() - t_interval, 1e-9)
                    n_ex, n_tok = stats.pop("examples"), stats.pop("tokens")
                    rate = {"examples_per_s": n_ex / dt, **({"tokens_per_s": n_tok / dt} if n_tok else {})}
                    log({"kind": "train", "step": step, "epoch": epoch, "lr": lr, **stats,
                         "grad_norm": float(grad_norm), **rate})
                    progress.update(task, info=f"loss {stats.get('loss', float('nan')):.4f}  "
                                               + (f"{rate['tokens_per_s']:.0f} tok/s" if n_tok else f"{rate['examples_per_s']:.0f} ex/s"))
                    interval.clear()
                    t_interval = time.perf_counter()
                epoch_done = batch_pos >= len(batches)
                if epoch_done or step == total:
                    end_epoch(epoch)
                if epoch_done:
                    epoch, batch_pos = epoch + 1, 0
                if evaluate_fn is not None and (
                    step == total or (config.eval_every == "epoch" and epoch_done)
                    or (isinstance(config.eval_every, int) and config.eval_every > 0 and step % config.eval_every == 0)
                ):
                    evaluate()
                if step == total or (config.checkpoint_every > 0 and step % config.checkpoint_every == 0):
                    checkpoint()
                if epoch_done:
                    break  # next epoch: new permutation

    if evaluate_fn is not None and best["step"] is not None and best_dir.is_dir():
        _load_trainable_state(model, torch.load(best_dir / "model.pt", weights_only=True), frozen, best_dir)
    _barrier()
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
    """Mean of each term over micro-batches (and ranks); with keep_counts, summed examples/tokens."""
    keys = sorted(k for k in acc if k not in ("_count", "examples", "tokens"))
    keys = _broadcast(keys)  # same order on every rank
    values = torch.tensor([float(acc.get(k, 0.0)) for k in keys] + [acc.get("_count", 0), acc.get("examples", 0),
                                                                    acc.get("tokens", 0)], dtype=torch.float64)
    if dist.is_initialized():
        on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else values.device
        values = values.to(on)
        dist.all_reduce(values)
        values = values.cpu()
    count = max(values[-3].item(), 1.0)
    out = {k: values[i].item() / count for i, k in enumerate(keys)}
    if keep_counts:
        out.update(examples=int(values[-2].item()), tokens=int(values[-1].item()))
    return out


def _rewrite_log(path: Path, keep_until: int) -> None:
    """Drop log lines past the resumed step (they will be written again); -1 drops all."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept = [ln for ln in lines if keep_until >= 0 and json.loads(ln).get("step", 0) <= keep_until]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(ln + "\n" for ln in kept))
    os.replace(tmp, path)


def read_log(out_dir: str | Path, kind: str | None = None) -> list[dict]:
    """The records of `out_dir/log.jsonl`, optionally only one kind ("train", "eval", "epoch")."""
    path = Path(out_dir) / "log.jsonl"
    records = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    return [r for r in records if kind is None or r.get("kind") == kind]
