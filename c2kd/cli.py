"""The `c2kd` command line."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

# Set before anything imports transformers: torchao (installed with the executorch extra, imported
# by transformers when present) warns about its CUDA-only kernels and enum registrations torch deprecates.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

from c2kd.atomic import check_destination, write_json
from c2kd.cli_util import finite_float, reporting_errors, within_64_bits
from c2kd.errors import C2KDError

# Where the options' defaults live: each option takes its default from the dataclass (or function)
# that uses it, so a default is written down once.
from c2kd.data.prepare import prepare as _prepare
from c2kd.demo import DemoSettings
from c2kd.deploy.export import export_ranker as _export_ranker
from c2kd.finetune.teacher import LoraSettings, TeacherRecipe
from c2kd.pipeline.cache_teacher import CacheTeacherSettings
from c2kd.recmodel.pretrained import WHEEL_MODELS
from c2kd.sasrec.train import SASRecTrainConfig, evaluate_sasrec as _evaluate_sasrec
from c2kd.student.distill import DEFAULT_RECIPES, PAPER_RECIPE, DistillRecipe, distill as _distill, recipe_preset
from c2kd.training import MAX_SEED, TrainConfig

app = typer.Typer(help="c2kd: distil an LLM recommender into a small on-device one (C2KD).", no_args_is_help=True)
cache_app = typer.Typer(help="Inspect, check and share teacher caches.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@app.callback()
def _main() -> None:
    """c2kd: distil an LLM recommender into a small on-device one (C2KD)."""

    from c2kd.recmodel.hf import quiet_transformers

    quiet_transformers()  # c2kd's own progress bars only
    # After a failed chunk read, zarr's other reads of that call are still pending when the process
    # exits with its one-line error; asyncio would print a "Task was destroyed" warning for each.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)

# Each section below holds the thin command wrappers of one module; the work lives in the module.


def _default(owner: object, name: str) -> object:
    """The default of field `name` of a dataclass, or of parameter `name` of a function."""
    if dataclasses.is_dataclass(owner):
        field = next(f for f in dataclasses.fields(owner) if f.name == name)
        return field.default_factory() if field.default is dataclasses.MISSING else field.default
    return inspect.signature(owner).parameters[name].default


def _numbers(kind: type | None, kw: dict) -> dict:
    """Floats refuse nan and inf; ints refuse what would overflow 64 bits (unless bounded already)."""
    if kind is float:
        kw.setdefault("parser", finite_float)
    elif kind is int and "max" not in kw:
        kw.setdefault("callback", within_64_bits)
    return kw


def _field(owner: object, name: str, flag: str, text: str, **kw) -> typer.models.OptionInfo:
    """An option whose default is the dataclass field's (or function parameter's) `name`."""
    default = _default(owner, name)
    if isinstance(default, tuple):
        default = ",".join(map(str, default))
    kind = None if isinstance(default, bool) else type(default) if isinstance(default, (int, float)) else None
    if owner is DistillRecipe and name in _PRESET_FIELDS:  # the dataclass's default is not what --recipe sets
        text, kw["show_default"] = f"{text} (default: set by --recipe; the paper's {PAPER_RECIPE.get(name, default)})", False
    return typer.Option(default, flag, help=text, **_numbers(kw.pop("kind", kind), kw))


_PRESET_FIELDS = set(PAPER_RECIPE).union(*DEFAULT_RECIPES.values())


def _opt(flag: str, text: str, cls: type | None = None, name: str | None = None, kind: type | None = None,
         **kw) -> typer.models.OptionInfo:
    """An option that is None unless given; its help shows the dataclass default it falls back to."""
    shown: bool | str = False
    if cls is not None:
        default = _default(cls, name or flag.lstrip("-").replace("-", "_"))
        shown = str(default)
        kind = kind or (type(default) if isinstance(default, (int, float)) and not isinstance(default, bool) else None)
    return typer.Option(flag, help=text, show_default=shown, **_numbers(kind, kw))


def _seed(owner: object, text: str) -> typer.models.OptionInfo:
    return _field(owner, "seed", "--seed", text, min=0, max=MAX_SEED)

# --- data: prepare ---


@app.command()
def prepare(
    source: str = typer.Argument(
        ...,
        help="'movielens-100k', a GroupLens folder or ml-100k.zip, a RecBole atomic folder, "
        "or a CSV/Parquet file with columns user,item,timestamp.",
    ),
    out: Path = typer.Option(..., "--out", help="Folder to write (train/validation/test/items Parquet + manifest)."),
    seed: int = _seed(_prepare, "Seed of the candidate sampling."),
    max_train_per_user: int | None = _field(_prepare, "max_train_per_user", "--max-train-per-user",
                                            "Keep only the K most recent train windows per user.", kind=int),
    items: Path | None = typer.Option(None, "--items", help="CSV/Parquet with item,title for a generic file."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing prepared folder."),
) -> None:
    """Turn interactions into leave-one-out examples, each with 20 stored candidates."""
    from rich.console import Console
    from rich.table import Table

    from c2kd.data.prepare import prepare as run_prepare

    console = Console()
    with reporting_errors(), console.status("preparing examples"):
        manifest = run_prepare(
            source, out, seed=seed, max_train_per_user=max_train_per_user, items=items, overwrite=overwrite
        )
    stats = manifest["stats"]
    table = Table(title=f"{source} → {out}", show_header=False)
    table.add_column("statistic")
    table.add_column("value", justify="right")
    rows = [
        ("users", "users"),
        ("items", "items"),
        ("interactions", "interactions"),
        ("dropped users (< 5 interactions)", "dropped_users"),
        ("duplicate interactions removed", "duplicates_removed"),
        ("train examples", "train"),
        ("validation examples", "validation"),
        ("test examples", "test"),
    ]
    for label, key in rows:
        table.add_row(label, f"{stats[key]:,}")
    console.print(table)
    console.print(f"fingerprint {manifest['fingerprint']}", soft_wrap=True)


# --- sasrec: train-sasrec ---


@app.command("train-sasrec")
def train_sasrec_cmd(
    data: Path = typer.Option(..., "--data", help="Prepared examples folder (from `c2kd prepare`)."),
    out: Path = typer.Option(..., "--out", help="Run folder to create."),
    seed: int = _seed(SASRecTrainConfig, "Seed for initialisation, dropout and batch order."),
    epochs: int = _field(SASRecTrainConfig, "epochs", "--epochs", "Maximum epochs (early stopping on validation)."),
    batch_size: int = _field(SASRecTrainConfig, "batch_size", "--batch-size", "Train examples per step."),
    lr: float = _field(SASRecTrainConfig, "lr", "--lr", "AdamW learning rate."),
    patience: int = _field(SASRecTrainConfig, "patience", "--patience",
                           "Stop after this many epochs without a better validation NDCG@10."),
    all_positions: bool = _field(SASRecTrainConfig, "all_positions", "--all-positions/--last-position",
                                 "Supervise every history position, or only the target."),
    threads: int | None = typer.Option(None, "--threads", min=1, max=4096,
                                       help="CPU threads for torch (default: torch's choice)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing run folder."),
) -> None:
    """Train the SASRec baseline; it also provides the item embeddings used in LM prompts."""
    import torch

    from c2kd.sasrec.train import train_sasrec

    with reporting_errors():
        config = SASRecTrainConfig(seed=seed, epochs=epochs, batch_size=batch_size, lr=lr, patience=patience,
                                   all_positions=all_positions)
        if threads is not None:
            torch.set_num_threads(threads)
        metrics = train_sasrec(data, out, config, overwrite=overwrite, progress=True)
    typer.echo(
        f"selected epoch {metrics['selected_epoch']} of {metrics['epochs_run']} "
        f"({metrics['train_seconds']:.1f} s); run folder: {out}"
    )
    _print_metrics({"validation": metrics["validation"], "test": metrics["test"]})


# --- evaluate ---


@app.command("evaluate")
def evaluate_cmd(
    model: Path = typer.Option(..., "--model", help="Run folder of a trained model (SASRec or recommender LM)."),
    data: Path = typer.Option(..., "--data", help="Prepared examples folder the model was trained on."),
    split: str = _field(_evaluate_sasrec, "split", "--split", "Split to evaluate: train, validation or test."),
    out: Path | None = typer.Option(
        None, "--out", help="Also write the metrics to this JSON file, and the per-example results beside it "
        "(metrics.json -> predictions.parquet, NAME.json -> NAME.predictions.parquet)."),
) -> None:
    """Evaluate a trained model on one split: ranking of the 20 candidates (and more per model)."""
    with reporting_errors():
        from c2kd.sasrec.train import read_run_config

        if out is not None:
            check_destination(out)
            if out.is_dir():
                raise C2KDError(f"--out {out}: is a folder; give the path of a JSON file to write")
        kind = read_run_config(model)["kind"]
        if kind == "sasrec":
            from c2kd.sasrec.train import evaluate_sasrec_with_predictions

            result, rows = evaluate_sasrec_with_predictions(model, data, split)
        elif kind == "reclm":
            result, rows = _evaluate_reclm(model, data, split)
        else:
            raise C2KDError(f"{model}/config.json: unknown model kind {kind!r}; expected 'sasrec' or 'reclm'")
        if out is not None:
            from c2kd.predictions import predictions_path, write_predictions

            write_json(out, result)
            write_predictions(predictions_path(out), rows)
    _print_metrics({split: result})
    if out is not None:
        typer.echo(f"metrics written to {out}, per-example results to {predictions_path(out)}")


def _evaluate_reclm(model: Path, data: Path, split: str) -> tuple[dict, object]:  # metrics, per-example rows
    # ranking of the candidates, and the generation protocol for llara
    from c2kd.evaluate import evaluate_reclm_with_predictions

    return evaluate_reclm_with_predictions(model, data, split)


def _print_metrics(results: dict[str, dict]) -> None:
    """One table: a row per metric (grouped, e.g. candidates / full_catalog), a column per split."""
    from rich.console import Console
    from rich.table import Table

    names = list(results)
    table = Table(title="metrics")
    table.add_column("group")
    table.add_column("metric")
    for name in names:
        table.add_column(f"{name} (n={results[name].get('examples', '?')})", justify="right")
    groups = [g for g, v in results[names[0]].items() if isinstance(v, dict)]
    for group in groups:
        for metric in results[names[0]][group]:
            values = [results[n].get(group, {}).get(metric) for n in names]
            table.add_row(group, metric, *(f"{v:.4f}" if isinstance(v, (int, float)) else "-" for v in values))
    Console().print(table)


# --- options shared by the training commands (defaults live in TrainConfig and the recipes) ---


Epochs = Annotated[Optional[int], _opt("--epochs", "Epochs over the train split.", TrainConfig)]
MaxSteps = Annotated[Optional[int], _opt("--max-steps", "Optimizer steps to run (overrides --epochs); distill caps both of its stages with it.", kind=int)]
BatchSize = Annotated[Optional[int], _opt("--batch-size", "Examples per micro-batch (over all processes).", TrainConfig)]
GradAccum = Annotated[Optional[int], _opt("--grad-accum", "Micro-batches per optimizer step.", TrainConfig)]
Lr = Annotated[Optional[float], _opt("--lr", "Peak AdamW learning rate (linear warmup, cosine decay).", TrainConfig)]
WeightDecay = Annotated[Optional[float], _opt("--weight-decay", "AdamW weight decay (matrices only).", TrainConfig)]
WarmupRatio = Annotated[Optional[float], _opt("--warmup-ratio", "Share of the steps spent warming up.", TrainConfig)]
MaxGradNorm = Annotated[Optional[float], _opt("--max-grad-norm", "Gradient clipping norm (0 = off).", TrainConfig)]
CheckpointEvery = Annotated[Optional[int], _opt("--checkpoint-every", "Optimizer steps between checkpoints "
                                                                     "(0: only the final one).", TrainConfig)]
EvalEvery = Annotated[Optional[str], _opt("--eval-every", "'epoch' or a number of optimizer steps between validations.", TrainConfig)]
Seed = Annotated[Optional[int], _opt("--seed", "Seed of the initialisation, dropout and data order.", TrainConfig,
                                     min=0, max=MAX_SEED)]
Bf16 = Annotated[bool, typer.Option("--bf16", help="bfloat16 autocast for training and its validation (both stages of "
                                                    "distill): CPUs with AMX or AVX512-BF16, bf16-capable GPUs.")]
Device = Annotated[Optional[str], _opt("--device", "auto (cuda:LOCAL_RANK if available, else cpu), cpu, cuda, cuda:1, ...", TrainConfig)]
MaxTrain = Annotated[Optional[int], _opt("--max-train", "Train on a fixed random subset of this many examples.", kind=int)]
MaxVal = Annotated[Optional[int], _opt("--max-val", "Select the best state on the first N validation examples.", kind=int)]
Shrink = Annotated[Optional[str], _opt("--shrink", "A student of a pretrained model with its tokenizer: first:K (its first K layers, "
                                                   "pretrained weights) or narrow:WIDTHxLAYERS (same family, random init).")]
ItemHelp = ("Score items with their token row (token) or with it plus the projected SASRec embedding (hybrid, ids "
            "only); auto: hybrid for ids.")
KeepCheckpoints = Annotated[bool, typer.Option("--keep-checkpoints", help="Keep OUT.partial/ (checkpoints) after finishing.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace an existing model folder.")]
ShowProgress = Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")]
BF16, PROGRESS = _default(TrainConfig, "bf16"), _default(TrainConfig, "progress")
KEEP, OVERWRITE = _default(_distill, "keep_checkpoints"), _default(_distill, "overwrite")  # as train_teacher's


def _train_config(**given: object) -> dict:
    """The TrainConfig fields the user gave (the rest keep the dataclass defaults)."""
    if given.get("eval_every") is not None:
        given["eval_every"] = _eval_every(str(given["eval_every"]))
    if given.get("max_grad_norm") == 0:
        given["max_grad_norm"] = None
        return {k: v for k, v in given.items() if v is not None or k == "max_grad_norm"}
    return {k: v for k, v in given.items() if v is not None}


def _eval_every(value: str) -> int | str:
    if value == "epoch":
        return value
    try:
        steps = int(value)
    except ValueError:
        raise C2KDError(f"--eval-every {value!r}: expected 'epoch' or a number of optimizer steps") from None
    if steps < 1:
        raise C2KDError(f"--eval-every must be >= 1, got {steps}")
    return steps


# --- recommender LM: train-teacher ---


@app.command("train-teacher")
def train_teacher_cmd(
    data: Path = typer.Option(..., "--data", help="Prepared examples folder (from `c2kd prepare`)."),
    sasrec: Path = typer.Option(..., "--sasrec", help="SASRec run folder (its item embeddings go into the prompts)."),
    out: Path = typer.Option(..., "--out", help="Model folder to create (work in progress lives in OUT.partial/)."),
    fmt: str = _field(TeacherRecipe, "fmt", "--format", "Prompt format: ids (one token per item) or llara (titles + slots)."),
    model: str = _field(TeacherRecipe, "model", "--model", "A preset (tiny-teacher, tiny-student, micro), a pretrained alias (smollm2-135m, gemma3-270m), a Hugging Face folder, a .gguf file or a saved model folder."),
    shrink: Shrink = None,
    item_head: str = _field(TeacherRecipe, "item_head", "--item-head", ItemHelp),
    lora_r: Optional[int] = typer.Option(None, "--lora-r", max=2**16, help="Train LoRA adapters of this rank (plus item-token rows and projector) instead of all weights."),
    lora_alpha: Annotated[Optional[float], _opt("--lora-alpha", "With --lora-r: LoRA alpha (default 2 x rank).", kind=float)] = None,
    lora_dropout: Annotated[Optional[float], _opt("--lora-dropout", "With --lora-r: dropout on the LoRA inputs.", LoraSettings, "dropout")] = None,
    history_loss: float = _field(TeacherRecipe, "history_loss", "--history-loss", "ids: also train every history item token to name the next history item (SASRec's every-position objective), with this weight."),
    sasrec_kd: float = _field(TeacherRecipe, "sasrec_kd", "--sasrec-kd", "ids: also distil the SASRec run's catalog distribution into the answer item's logits (KL, this weight): collaborative knowledge for a pretrained LM."),
    epochs: Epochs = None, max_steps: MaxSteps = None, batch_size: BatchSize = None, grad_accum: GradAccum = None,
    lr: Lr = None, weight_decay: WeightDecay = None, warmup_ratio: WarmupRatio = None, max_grad_norm: MaxGradNorm = None,
    checkpoint_every: CheckpointEvery = None, eval_every: EvalEvery = None, seed: Seed = None, bf16: Bf16 = BF16,
    device: Device = None, max_train: MaxTrain = None, max_val: MaxVal = None,
    keep_checkpoints: KeepCheckpoints = KEEP, overwrite: Overwrite = OVERWRITE, progress: ShowProgress = PROGRESS,
) -> None:
    """Fine-tune a recommender LM on the answer tokens (the teacher, or a student alone = SFT).

    Rerun the same command after an interruption to resume from the last checkpoint. Launch with
    `torchrun --nproc_per_node N -m c2kd.cli train-teacher ...` for data-parallel training."""
    from c2kd.distributed import is_main_process
    from c2kd.finetune.teacher import train_teacher

    with reporting_errors():
        if lora_r is None and (lora_alpha is not None or lora_dropout is not None):
            raise C2KDError("--lora-alpha and --lora-dropout set up LoRA adapters: give their rank with --lora-r")
        lora = {k: v for k, v in {"alpha": lora_alpha, "dropout": lora_dropout}.items() if v is not None}
        recipe = TeacherRecipe(
            fmt=fmt, model=model, shrink=shrink, item_head=item_head, max_train=max_train, max_val=max_val,
            lora=LoraSettings(r=lora_r, **lora) if lora_r is not None else None,
            history_loss=history_loss, sasrec_kd=sasrec_kd,
        )
        config = _train_config(epochs=epochs, max_steps=max_steps, batch_size=batch_size, grad_accum=grad_accum, lr=lr,
                               weight_decay=weight_decay, warmup_ratio=warmup_ratio, max_grad_norm=max_grad_norm,
                               checkpoint_every=checkpoint_every, eval_every=eval_every, seed=seed, bf16=bf16,
                               device=device, progress=progress)
        record = train_teacher(data, sasrec, out, recipe, config, overwrite=overwrite, keep_checkpoints=keep_checkpoints)
    if is_main_process():
        val = record["validation"]
        done = "already complete (same settings): " if record.get("already_complete") else ""
        typer.echo(
            f"{done}{record['model']['base']}: {record['final_step']} steps in {record['timings']['train_s']:.1f} s; "
            f"best validation {val['select_metric']} {val['best'].get(val['select_metric'], float('nan')):.4f} "
            f"at step {val['best_step']}; model folder: {out}"
        )


# --- stage one: cache-teacher ---


def _int_list(text: str | None, option: str) -> tuple[int, ...] | None:
    """Comma-separated integers; None when the option is not given (an empty value is refused, not
    taken for the default)."""
    if text is None:
        return None
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise C2KDError(f"{option} {text!r}: expected comma-separated integers, e.g. 24,26,28,30") from None
    if not values:
        raise C2KDError(f"{option} {text!r}: give at least one layer number, e.g. 24,26,28,30 (or leave the option out)")
    return values


CTS = CacheTeacherSettings


@app.command("cache-teacher")
def cache_teacher_cmd(
    teacher: Path = typer.Option(..., "--teacher", help="Trained teacher model folder (from `c2kd train-teacher`)."),
    data: Path = typer.Option(..., "--data", help="Prepared examples folder the teacher was trained on."),
    out: Path = typer.Option(..., "--out", help="Cache folder to write (rerun the same command to resume)."),
    splits: str = _field(CTS, "splits", "--splits", "Comma-separated splits to cache."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Comma-separated teacher layers (1-indexed); default: the late layers L-s..L-4s, s = max(1, L // 16)."),
    positions: str = _field(CTS, "positions", "--positions", "Hidden states at all tokens (all) or at answer positions only (answer)."),
    logits: str = _field(CTS, "logits", "--logits", "exact (recomputed from final hidden states + stored head), topk:K, or full."),
    dtype: str = _field(CTS, "dtype", "--dtype", "Stored float dtype: bfloat16, float16, float32, or float8 (hidden states as e4m3 with a scale per token and layer, about half the bytes of bfloat16; the final states exact logits come from stay bfloat16)."),
    compression: str = _field(CTS, "compression", "--compression", "zstd, zstd:LEVEL or none."),
    max_tokens_per_batch: int = _field(CTS, "max_tokens_per_batch", "--max-tokens-per-batch", "Padded tokens per teacher forward (length-bucketed batches)."),
    examples_per_shard: int = _field(CTS, "examples_per_shard", "--examples-per-shard", "Examples per shard (the unit of writing, resuming and reading)."),
    device: str = _field(CTS, "device", "--device", "auto (cuda:LOCAL_RANK if available, else cpu), cpu, cuda, cuda:1, ..."),
    writer: str = _field(CTS, "writer", "--writer", "Write shards from a background process (keeps the GIL off the forward) or a thread."),
    part: str = _field(CTS, "part", "--part", "i/n: write part i of n (one per machine), then `c2kd cache merge` the n parts. node: under `torchrun --nnodes N`, each node writes its own part to its own --out (no shared disk needed)."),
    max_examples: Optional[int] = _field(CTS, "max_examples", "--max-examples", "Cache only this many examples per split: the fixed subset `train-teacher --max-train N` trains on.", kind=int),
    backend: str = _field(CTS, "backend", "--backend", "What runs the teacher: transformers, or vllm (its own install; see the README)."),
    tensor_parallel: int = _field(CTS, "tensor_parallel", "--tensor-parallel", "vLLM: GPUs to split the teacher over."),
    vllm_states: str = _field(CTS, "vllm_states", "--vllm-states", "vLLM: how the layers come back: extract (vLLM's extract_hidden_states, compiled graphs), hooks (eager model), or auto (extract where the model and prompts allow it)."),
    vllm_memory: Optional[float] = _field(CTS, "vllm_memory", "--vllm-memory", "vLLM: share of the device's memory the engine may take (0 < share <= 1); default: sized from the machine (0.9 of a dedicated GPU, less what is in use; on the CPU a KV cache from the free memory).", kind=float),
    progress: bool = _field(CTS, "progress", "--progress/--no-progress", "Show a progress bar."),
) -> None:
    """Stage one: run the teacher once and write the teacher cache (sharded Zarr + Parquet index).

    Launch with `torchrun --nproc-per-node N -m c2kd.cli cache-teacher ...` to cache with N
    processes (each writes its own shards; rank 0 seals the manifest)."""
    from c2kd.pipeline.cache_teacher import cache_teacher

    with reporting_errors():
        settings = CTS(
            splits=tuple(s.strip() for s in splits.split(",") if s.strip()), layers=_int_list(layers, "--layers"),
            positions=positions, logits=logits, dtype=dtype, compression=compression,
            max_tokens_per_batch=max_tokens_per_batch, examples_per_shard=examples_per_shard, device=device,
            writer=writer, part=part, max_examples=max_examples, backend=backend, tensor_parallel=tensor_parallel,
            vllm_states=vllm_states, vllm_memory=vllm_memory, progress=progress,
        )
        summary = cache_teacher(teacher, data, out, settings)
    if summary["rank"] != 0:
        return
    if summary["already_complete"]:
        typer.echo(f"{out} is already a complete cache of this teacher and data; nothing to do")
        return
    rate = summary["examples"] / summary["loop_seconds"] if summary.get("loop_seconds") else 0.0
    vllm = f"; vLLM states: {summary['vllm_states']}" if summary.get("vllm_states") else ""
    typer.echo(
        f"cached {summary['examples']:,} examples ({summary['shards_written']} shards written, "
        f"{summary['shards_skipped']} already done) in {summary['seconds']:.1f} s ({rate:,.1f} examples/s on rank 0); "
        f"layers {summary['layers']}{vllm}; cache: {out}"
    )

# --- cache: info / verify ---


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


@cache_app.command("info")
def cache_info_cmd(
    cache: str = typer.Argument(..., help="Cache folder or URL (file://, https://, s3://)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON instead of a table."),
) -> None:
    """Summarise a teacher cache: teacher, layers, policies, examples, tokens, size on disk."""
    import json

    from rich.console import Console
    from rich.table import Table

    from c2kd.cache_schema import cache_info

    with reporting_errors():
        info = cache_info(cache)
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    table = Table(title=f"teacher cache {info['path']}", show_header=False)
    table.add_column("field")
    table.add_column("value", overflow="fold")  # whole identities and fingerprints, to copy
    status = "complete" if info["complete"] else f"INCOMPLETE ({info.get('shards_written', '?')} shards written so far)"
    splits = ", ".join(f"{k} {v:,}" for k, v in info["splits"].items()) or "-"
    rows = [
        ("status", status),
        ("content identity", str(info.get("content_id") or "- (not sealed)")),
        ("digest (of the manifest)", str(info["digest"] or "- (not sealed)")),
        ("schema version", str(info["schema_version"])),
        ("created by", f"{info['created_by']} at {info['created_at']}"),
        ("teacher", f"{info['teacher']} ({info['teacher_layers']} layers, width {info['hidden_size']}, vocab {info['vocab_size']:,})"),
        ("prompt format", str(info["prompt_format"])),
        ("layers", ", ".join(map(str, info["layers"] or []))),
        ("dtype", f"{info['dtype']} (stored as {info['storage_dtype']})"),
        ("positions", str(info["positions"])),
        ("logits", str(info["logits"])),
        ("compression", str(info["compression"])),
        ("shards", f"{info['shards']:,} ({info['examples_per_shard']} examples each)"),
        ("examples", f"{info['examples']:,} ({splits})"),
        ("tokens", f"{info['tokens']:,} ({info['answer_tokens']:,} answer positions)"),
        ("size on disk", f"{_human_bytes(info['bytes']['total'])} (shards {_human_bytes(info['bytes']['shards'])}, assets {_human_bytes(info['bytes']['assets'])}, index {_human_bytes(info['bytes']['index'])})"),
        ("bytes / token", f"{info['bytes_per_token']:,.1f}" if info["bytes_per_token"] else "-"),
        ("bytes / answer position", f"{info['bytes_per_answer_token']:,.1f}" if info["bytes_per_answer_token"] else "-"),
        ("teacher fingerprint", str(info["teacher_fingerprint"])),
        ("tokenizer fingerprint", str(info["tokenizer_fingerprint"])),
        ("data fingerprint", str(info["data_fingerprint"])),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


@cache_app.command("verify")
def cache_verify_cmd(
    cache: str = typer.Argument(..., help="Cache folder or URL (file://, https://, s3://)."),
) -> None:
    """Check schema, completeness, index consistency and every checksum (exit 1 naming bad shards)."""
    from rich.console import Console
    from rich.progress import Progress

    from c2kd.cache_schema import verify_cache

    with reporting_errors(), Progress(transient=True) as progress:
        task = progress.add_task("verifying shards", total=None)
        report = verify_cache(cache, progress=lambda done, total: progress.update(task, completed=done, total=total))
    console = Console()
    if report.ok:
        console.print(f"[green]ok[/green]: {report.shards_checked} shards, {_human_bytes(report.bytes_checked)} checked — "
                      f"{report.path}; content identity {report.content_id}", soft_wrap=True)
        return
    from c2kd.cli_util import one_line_error

    for problem in report.problems:  # one line per problem, each naming its file (and shard) or manifest field
        one_line_error(problem)
    raise typer.Exit(code=1)

def _transfer(label: str, run, where: str) -> None:
    """A push or pull with a progress bar (MB/s), then one line saying what moved."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with reporting_errors(), Progress(TextColumn(f"[bold]{label}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                      TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task(label, total=None)
        result = run(lambda done, total: bar.update(task, completed=done, total=total))
    if result["already_there"]:
        typer.echo(f"{where} already holds this cache (content identity {result['content_id']}, digest {result['digest']})")
        return
    moved = result.get("files_sent", result.get("files_fetched")), result.get("bytes_sent", result.get("bytes_fetched"))
    typer.echo(f"{label}: {moved[0]} files ({_human_bytes(moved[1])}) copied, {result['files_skipped']} already "
               f"there; content identity {result['content_id']}, digest {result['digest']}")


@cache_app.command("push")
def cache_push_cmd(
    cache: Path = typer.Argument(..., help="A complete local cache folder."),
    url: str = typer.Argument(..., help="Where to put it: s3://bucket/path, gs://..., hf://... (fsspec), or a folder: file:///shared/caches/x or a path."),
) -> None:
    """Copy a cache to object storage, file by file, manifest last; rerun to resume."""
    from c2kd.cache_schema.transfer import push

    _transfer("push", lambda progress: push(cache, url, progress=progress), url)


@cache_app.command("pull")
def cache_pull_cmd(
    url: str = typer.Argument(..., help="The cache's URL (s3://, gs://, hf://, https://, file://) or folder."),
    out: Path = typer.Argument(..., help="An empty or new local folder (or a cut pull of the same cache, resumed)."),
    expect: Optional[str] = typer.Option(None, "--expect", help="The cache you expect: 8 to 64 hex digits of its content identity or its digest (`c2kd cache info`); anything else is refused."),
) -> None:
    """Copy a cache from a URL, every file checked against the manifest on arrival; rerun to resume."""
    from c2kd.cache_schema.transfer import pull

    _transfer("pull", lambda progress: pull(url, out, expect=expect, progress=progress), str(out))


@cache_app.command("merge")
def cache_merge_cmd(
    parts: list[Path] = typer.Argument(..., help="The part caches 1/n .. n/n (written with cache-teacher --part)."),
    out: Path = typer.Option(..., "--out", help="The merged cache folder to write (rerun to resume)."),
) -> None:
    """Merge part caches written on several machines into the one cache a single run writes."""
    from c2kd.cache_schema.merge import merge_caches

    with reporting_errors():
        manifest = merge_caches(parts, out)
    from c2kd.cache_schema.identity import content_identity

    typer.echo(f"merged {len(parts)} parts into {out}: {len(manifest['shards'])} shards, "
               f"{manifest['totals']['examples']:,} examples; content identity {content_identity(manifest)}")


# --- stage two: distill ---


DR = DistillRecipe


def _check_read_cache(read_cache: Path, cache: str) -> None:
    """--read-cache keeps the files of a cache at a URL: refused for a local cache, and where no folder can be."""
    from c2kd.cache_schema.storage import CacheLocation

    if CacheLocation(cache).is_local:
        raise C2KDError(f"--read-cache keeps the files of a cache read from a URL; --cache {cache} is a local folder "
                        "(leave --read-cache out)")
    if read_cache.exists() and not read_cache.is_dir():
        raise C2KDError(f"--read-cache {read_cache}: a file, not a folder")
    check_destination(read_cache / "x")


def _with_preset(ctx: typer.Context, recipe: DistillRecipe, name: str) -> DistillRecipe:
    """`recipe` with the preset `name`'s fields for its method (student.distill.recipe_preset), less
    those given on the command line."""
    given = lambda k: getattr(ctx.get_parameter_source(k), "name", None) == "COMMANDLINE"  # noqa: E731 (typer's click)
    preset = recipe_preset(name, recipe.method, recipe.cross_head)
    return dataclasses.replace(recipe, **{k: v for k, v in preset.items() if not given(k)})


@app.command("distill")
def distill_cmd(
    ctx: typer.Context,
    cache: str = typer.Option(..., "--cache", help="Teacher cache (a folder or an https:// / s3:// URL); the only teacher input."),
    recipe_name: str = typer.Option("default", "--recipe", help="default (chosen on validation, docs/DESIGN.md §7) or paper (the paper's C2KD at its authors' settings); options given beside it still apply."),
    student: str = _field(DR, "student", "--student", "A preset (tiny-student, micro, ...) built with the cache's tokenizer, a pretrained alias or folder with --shrink, or a saved model folder."),
    shrink: Shrink = None,
    item_head: str = _field(DR, "item_head", "--item-head", ItemHelp),
    out: Path = typer.Option(..., "--out", help="Student model folder to create (work in progress lives in OUT.partial/)."),
    data: Path = typer.Option(..., "--data", help="Prepared examples folder the cache was built from (validation and test)."),
    method: str = _field(DR, "method", "--method", "c2kd | sft | logit-kd | feature-kd."),
    router: str = _field(DR, "router", "--router", "C2KD router: top1 (paper), soft or soft:T (softmax of the scores / T), probe (per example, the layer whose stage-1 probe predicts the answer best), or fixed:L (teacher layer L)."),
    student_layer: str = _field(DR, "student_layer", "--student-layer", "C2KD's student layer n: penultimate (the paper) or last (its final-normed state, the one its own head ranks from)."),
    filter_init: str = _field(DR, "filter_init", "--filter-init", "Stage-1 filters start random (the paper), as lens: identity filters with the teacher's head as the probe head (needs the student's width = the teacher's), or auto: lens where the widths allow, else random."),
    router_layers: Optional[str] = typer.Option(None, "--router-layers", help="Comma-separated cached teacher layers the C2KD router chooses among [default: every cached layer]; for a cache that also holds early layers for feature KD."),
    cross_head: bool = _field(DR, "cross_head", "--cross-head/--no-cross-head", "Score student features with the teacher's head (off: the student's own head)."),
    orth: bool = _field(DR, "orth", "--orth/--no-orth", "Orthogonality loss on the cross-head projection."),
    w_feat: float = _field(DR, "w_feat", "--w-feat", "Weight of the feature loss."),
    w_logit: float = _field(DR, "w_logit", "--w-logit", "Weight of the logit loss."),
    w_orth: float = _field(DR, "w_orth", "--w-orth", "Weight of the orthogonality loss."),
    tau: float = _field(DR, "tau", "--tau", "Softmax temperature of the logit losses."),
    w_own_logit: float = _field(DR, "w_own_logit", "--w-own-logit", "c2kd: weight of a vanilla logit-KD term on the student's own head, added to the cross-head loss (0: the paper's C2KD)."),
    kd_over: str = _field(DR, "kd_over", "--kd-over", "Support of the logit losses: vocab (the paper), items (the item tokens at the item-predicting answer, ids only) or candidates (as items, narrowed to the example's candidates: the ranking the metrics measure)."),
    stage1_epochs: int = _field(DR, "stage1_epochs", "--stage1-epochs", "Epochs of stage 1 (layer filters on cached teacher states; c2kd only)."),
    stage1_lr: float = _field(DR, "stage1_lr", "--stage1-lr", "Learning rate of stage 1."),
    stage1_select: str = _field(DR, "stage1_select", "--stage1-select", "What picks stage 1's best epoch on held-out examples: ce (the probes' cross-entropy) or hr1 (their mean HR@1 over each example's candidates)."),
    stage1_holdout: float = _field(DR, "stage1_holdout", "--stage1-holdout", "For a cache without a validation split: the share of its train examples stage 1 holds out to judge its probes and pick its best epoch."),
    select_metric: str = _field(DR, "select_metric", "--select-metric", "Validation metric that picks the best state."),
    shuffle_block: int = _field(DR, "shuffle_block", "--shuffle-block", "Each epoch shuffles the cache's shards, then the examples within blocks of at least this many, so reads touch few shards at any cache size (0: one full shuffle; data no larger than a block is fully shuffled).", min=0),
    read_cache: Optional[Path] = typer.Option(None, "--read-cache", help="For a cache at a URL: a local folder keeping each fetched file, so it is fetched once [default: $C2KD_HOME/remote-caches]."),
    epochs: Epochs = None, max_steps: MaxSteps = None, batch_size: BatchSize = None, grad_accum: GradAccum = None,
    lr: Lr = None, weight_decay: WeightDecay = None, warmup_ratio: WarmupRatio = None, max_grad_norm: MaxGradNorm = None,
    checkpoint_every: CheckpointEvery = None, eval_every: EvalEvery = None, seed: Seed = None, bf16: Bf16 = BF16,
    device: Device = None, max_train: MaxTrain = None, max_val: MaxVal = None,
    keep_checkpoints: KeepCheckpoints = KEEP, overwrite: Overwrite = OVERWRITE, progress: ShowProgress = PROGRESS,
) -> None:
    """Distil a student from a teacher cache (no teacher weights are loaded).

    Rerun the same command after an interruption to resume. Launch with
    `torchrun --nproc_per_node N -m c2kd.cli distill ...` for data-parallel training."""
    from c2kd.distributed import is_main_process
    from c2kd.student.distill import distill

    with reporting_errors():
        if read_cache is not None:
            _check_read_cache(read_cache, cache)
        recipe = DR(
            method=method, student=student, shrink=shrink, item_head=item_head, router=router,
            router_layers=_int_list(router_layers, "--router-layers"), cross_head=cross_head,
            orth=orth, w_feat=w_feat, w_logit=w_logit, w_orth=w_orth, tau=tau, w_own_logit=w_own_logit, kd_over=kd_over,
            stage1_epochs=stage1_epochs, stage1_lr=stage1_lr, max_train=max_train, max_val=max_val, select_metric=select_metric,
            student_layer=student_layer, filter_init=filter_init, stage1_holdout=stage1_holdout, stage1_select=stage1_select,
            shuffle_block=shuffle_block,
        )
        recipe = _with_preset(ctx, recipe, recipe_name)
        config = _train_config(epochs=epochs, max_steps=max_steps, batch_size=batch_size, grad_accum=grad_accum, lr=lr,
                               weight_decay=weight_decay, warmup_ratio=warmup_ratio, max_grad_norm=max_grad_norm,
                               checkpoint_every=checkpoint_every, eval_every=eval_every, seed=seed, bf16=bf16,
                               device=device, progress=progress)
        record = distill(cache, data, out, recipe, config, overwrite=overwrite, keep_checkpoints=keep_checkpoints,
                         read_cache=read_cache)
    if is_main_process():
        test = record["metrics"]["test"]
        summary = ", ".join(f"{k} {v:.4f}" for k, v in test["candidates"].items() if k in ("HR@1", "NDCG@10", "MRR"))
        done = "already complete (same settings): " if record.get("already_complete") else ""
        typer.echo(
            f"{done}{record['recipe']['method']}: {record['final_step']} steps in {record['timings']['train_s']:.1f} s; "
            f"test {summary}; model folder: {out}"
        )
        if record.get("diagnostics"):
            from c2kd.student.report import diagnostics_line

            typer.echo(diagnostics_line(record))

@app.command("tune")
def tune_cmd(
    ctx: typer.Context,
    cache: str = typer.Option(..., "--cache", help="Teacher cache (a folder or a URL) every trial's student learns from."),
    data: Path = typer.Option(..., "--data", help="Prepared examples folder the cache was built from."),
    out: Path = typer.Option(..., "--out", help="Search folder: the Optuna study, every trial's student, tune.json and tune.md."),
    method: str = _field(DR, "method", "--method", "The method whose recipe is searched: c2kd | logit-kd | feature-kd (sft has nothing to tune)."),
    student: str = _field(DR, "student", "--student", "The student, as for distill."),
    shrink: Shrink = None,
    kd_over: str = _field(DR, "kd_over", "--kd-over", "Support of the logit losses, as for distill (fixed during the search unless the space names it)."),
    filter_init: str = _field(DR, "filter_init", "--filter-init", "Stage-1 filter start, as for distill."),
    stage1_epochs: int = _field(DR, "stage1_epochs", "--stage1-epochs", "Epochs of stage 1, as for distill."),
    stage1_lr: float = _field(DR, "stage1_lr", "--stage1-lr", "Learning rate of stage 1."),
    recipe_name: str = typer.Option("default", "--recipe", help="The recipe the search starts from (its first trial) and keeps where the space does not search: default or paper, as for distill."),
    trials: int = typer.Option(20, "--trials", help="Trials in all (a resumed search runs the ones still missing)."),
    space: Optional[Path] = typer.Option(None, "--space", help='JSON object of DistillRecipe fields to search, e.g. {"w_logit": {"low": 0.25, "high": 16, "log": true}, "router": {"choices": ["top1", "probe"]}} [default: the method\'s space in c2kd/student/tune.py].'),
    objective: str = typer.Option("HR@1", "--objective", help="Validation metric (over the 20 candidates) the search maximises."),
    read_cache: Optional[Path] = typer.Option(None, "--read-cache", help="For a cache at a URL: a local folder keeping each fetched file."),
    epochs: Epochs = None, batch_size: BatchSize = None, lr: Lr = None, seed: Seed = None, bf16: Bf16 = False,
    max_train: MaxTrain = None, max_val: MaxVal = None, progress: ShowProgress = True,
) -> None:
    """Search a distillation recipe on validation from one cache, then test the chosen one once.

    Every trial is a `distill` run scored on the validation split only; the best trial's student is
    the only one evaluated on test. Rerun the same command to resume an interrupted search; several
    processes sharing --out run trials of one study."""
    from c2kd.student.tune import read_space, tune

    with reporting_errors():
        base = DR(method=method, student=student, shrink=shrink, kd_over=kd_over, filter_init=filter_init,
                  stage1_epochs=stage1_epochs, stage1_lr=stage1_lr, max_train=max_train, max_val=max_val)
        base = _with_preset(ctx, base, recipe_name)
        dims = read_space(space, method)
        config = _train_config(epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, bf16=bf16)
        record = tune(cache, data, out, base, dims, trials, config, objective=objective,
                      seed=seed or 0, read_cache=read_cache, progress=progress)
    chosen = record["chosen"]
    typer.echo(f"{len(record['trials'])} trials; chosen trial {chosen['number']} {chosen['params']}: validation "
               f"{objective} {chosen[f'validation_{objective}']:.4f}, test {objective} "
               f"{chosen['test']['candidates'][objective]:.4f}; table: {out / 'tune.md'}")


# --- deployment: export / recommend ---


@app.command("export")
def export_cmd(
    model: Path = typer.Option(..., "--model", help="A saved recommender folder (teacher or student, ids format)."),
    data: Path = typer.Option(..., "--data", help="Prepared examples folder it was trained on (its item titles go along)."),
    out: Path = typer.Option(..., "--out", help="Folder to write: model.onnx (or model.pte) + ranker.json."),
    fmt: str = _field(_export_ranker, "fmt", "--format", "onnx, or executorch (a .pte for the XNNPACK backend; the executorch extra)."),
    quantize: str = _field(_export_ranker, "quantize", "--quantize", "none or int8 (dynamic quantisation of the weights)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing folder."),
) -> None:
    """Export a recommender as one graph that ranks items: ONNX (onnxruntime alone, no PyTorch) or ExecuTorch."""
    import warnings

    from c2kd.deploy.export import export_ranker
    from c2kd.data.examples import load_examples

    with reporting_errors():
        examples = load_examples(data)
        with warnings.catch_warnings():  # the tracer's notes about Python control flow in the model
            warnings.simplefilter("ignore")
            folder = export_ranker(model, out, examples.titles(), quantize=quantize, overwrite=overwrite, fmt=fmt,
                                   data_fingerprint=examples.fingerprint)
    size = sum(p.stat().st_size for p in folder.iterdir())
    kind = {"onnx": "ONNX", "executorch": "ExecuTorch (XNNPACK)"}[fmt]
    typer.echo(f"exported {model} to {folder}: {kind}, {_human_bytes(size)}, "
               f"{'int8' if quantize == 'int8' else 'float32'} weights")


@app.command("recommend")
def recommend_cmd(
    model: Path = typer.Option(..., "--model", help="A saved recommender folder, or an exported ranker folder."),
    data: Path = typer.Option(..., "--data", help="Prepared examples folder (users, titles)."),
    user: Optional[int] = typer.Option(None, "--user", callback=within_64_bits, help="A user of the data (internal id 0..U-1): ranks their test candidates."),
    history: Optional[str] = typer.Option(None, "--history", help="A made-up user: watched titles, 'Title A; Title B; ...'."),
    candidates: Optional[str] = typer.Option(None, "--candidates", help="With --history: titles to choose from, none of them watched (default: the 20 most watched the user has not)."),
    top: int = typer.Option(10, "--top", callback=within_64_bits, help="How many recommendations to show."),
) -> None:
    """Show a user's recent history and what the model recommends next, with titles and scores."""
    from rich.console import Console
    from rich.table import Table

    from c2kd.deploy.recommend import made_up_request, rank, user_request
    from c2kd.data.examples import load_examples

    with reporting_errors():
        if (user is None) == (history is None):
            raise C2KDError("give either --user U (a user of the data) or --history 'Title A; Title B'")
        if top < 1:
            raise C2KDError(f"--top must be >= 1, got {top}")
        if candidates is not None and history is None:
            raise C2KDError("--candidates goes with --history; a user of the data (--user) is ranked on their own "
                            "test candidates")
        examples = load_examples(data)
        request = user_request(examples, user) if user is not None else made_up_request(examples, history, candidates)
        ranked = rank(model, request, examples, top)
    titles = examples.titles()
    console = Console()
    who = f"user {user}" if user is not None else "a made-up user"
    console.print(f"[bold]{who}[/] watched (oldest first): " + "; ".join(titles[i] for i in request.history[-10:]))
    table = Table(title=f"top {len(ranked)} of {len(request.candidates)} candidates — {model}")
    for col in ("rank", "title", "score"):
        table.add_column(col, justify="left" if col == "title" else "right")
    for k, (item, score) in enumerate(ranked, 1):
        mark = "  ← watched next (held out)" if item == request.target else ""
        table.add_row(str(k), titles[item] + mark, f"{score:.3f}")
    console.print(table)


# --- demo ---


@app.command("demo")
def demo_command(
    out: Optional[Path] = typer.Option(None, "--out", help="Run folder (default: runs/demo-<date-time>)."),
    seed: int = _seed(DemoSettings, "Seed of every stage."),
    teacher_epochs: int = _field(DemoSettings, "teacher_epochs", "--teacher-epochs", "Epochs of the teacher.", min=1),
    student_epochs: int = _field(DemoSettings, "student_epochs", "--student-epochs", "Epochs of each student.", min=1),
    max_train_per_user: int = _field(DemoSettings, "max_train_per_user", "--max-train-per-user", "Train windows per user (the most recent ones).", min=1),
    family: str = _field(DemoSettings, "teacher", "--family", "Pretrained family of the teacher and the students: "
                         "smollm2-135m or gemma3-270m (the students are its first 2 layers)."),
    bf16: Optional[bool] = typer.Option(None, "--bf16/--no-bf16", help="bfloat16 autocast for training and its "
                                        "validation (the table's test metrics stay float32). Default: on where the CPU "
                                        "has native bf16 (AMX or AVX512-BF16)."),
) -> None:
    """The whole pipeline on MovieLens-100k with small presets (minutes on a CPU), ending in a comparison table."""
    from c2kd.demo import run_demo

    with reporting_errors():
        if family not in WHEEL_MODELS:
            raise C2KDError(f"--family {family!r}: expected one of {', '.join(WHEEL_MODELS)}")
        if out is not None:
            if out.exists() and (not out.is_dir() or any(out.iterdir())):
                raise C2KDError(f"--out {out}: exists and is not an empty folder; choose another --out")
            check_destination(out)
        run_demo(out, DemoSettings(seed=seed, teacher_epochs=teacher_epochs, student_epochs=student_epochs,
                                   max_train_per_user=max_train_per_user, teacher=family, student=family, bf16=bf16))


def main(argv: list[str] | None = None) -> int:
    """The `c2kd` entry point: the exit code of the command. A usage mistake (unknown option,
    missing value) is one line on stderr and exit code 2, like every other refusal (exit code 1)."""
    from c2kd.cli_util import ClickException, NoArgsIsHelpError, one_line_error

    try:
        code = app(args=argv, prog_name="c2kd", standalone_mode=False)  # typer.Exit comes back as its code
        return code if isinstance(code, int) else 0
    except typer.Exit as done:
        return done.exit_code
    except NoArgsIsHelpError:  # typer has printed the help already
        return 0
    except ClickException as mistake:
        ctx = getattr(mistake, "ctx", None)
        message = mistake.format_message().replace("Value error, ", "")  # a parser's ValueError, as typer words it
        one_line_error(f"{message} (see `{ctx.command_path if ctx else 'c2kd'} --help`)")
        return mistake.exit_code
    except typer.Abort:
        one_line_error("interrupted")
        return 130


def _console_script() -> None:
    sys.exit(main())


if __name__ == "__main__":
    _console_script()
