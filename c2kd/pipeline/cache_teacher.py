"""Stage one, `c2kd cache-teacher`: run the teacher once over the examples and write a teacher cache.

    teacher (RecLM.load) + examples --PromptEncoder--> shard plan (cache_schema.plan_shards)
      for each shard this rank owns (shard_id % world_size == rank), not yet done:
        length-bucketed batches -> teacher forward (eval, no grad, hidden states)
          -> late layers at all/answer positions, final-normed states at answer positions,
             optional top-k / full logits, cast to the cache dtype
        -> bounded queue -> writer process (CacheWriter.write_shard: atomic + journaled)
      barrier; rank 0 seals (index + manifest, complete = true)

The forward never waits on disk unless the queue is full. Rerunning the same command after an
interruption (kill -9 included) continues where it stopped; under `torchrun --nproc-per-node N`
each rank writes its own shards. The layout on disk is cache_schema's business only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from c2kd import distributed
from c2kd.cache_schema import CacheSpec, CacheWriter, fingerprint_files, fingerprint_tokenizer, plan_shards
from c2kd.cache_schema import schema as S
from c2kd.cache_schema.dtypes import TORCH_DTYPES
from c2kd.cache_schema.merge import part_plan
from c2kd.cache_schema.plan import ShardPlan
from c2kd.cache_schema.records import answer_positions
from c2kd.cache_schema.schema import CACHE_DTYPES, FLOAT8, FLOAT8_FULL_LOGITS, POSITIONS, Compression, LogitsPolicy, parse_part
from c2kd.errors import C2KDError, CacheError
from c2kd.data.examples import SPLITS, ExampleSet, fixed_subset, load_examples
from c2kd.pipeline.shard_writers import WRITERS, BatchOutputs, ShardJob, ShardWriter, start_shard_writer
from c2kd.pipeline.vllm_backend import MECHANISMS, check_vllm
from c2kd.recmodel import hf
from c2kd.recmodel.layers import late_layers
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.prompts import EncodedExample, PromptEncoder, collate


BACKENDS = ("transformers", "vllm")

NODE_PART = "node"  # --part node: one part per torchrun node (distributed.node_env)


@dataclass(frozen=True)
class CacheTeacherSettings:
    splits: tuple[str, ...] = SPLITS
    layers: tuple[int, ...] | None = None  # None: late_layers(num_layers)
    positions: str = "all"  # hidden states at all tokens, or at answer positions only
    logits: LogitsPolicy = LogitsPolicy("exact")  # exact (head(final_hidden)), topk:K, full; text is parsed here
    dtype: str = "bfloat16"
    compression: str = "zstd"
    max_tokens_per_batch: int = 8192  # padded tokens (batch x longest prompt) per forward
    examples_per_shard: int = 256
    queue_shards: int = 2  # finished shards waiting for the writer
    writer: str = "process"  # where shards are written: a background process, or a thread
    # "i/n": write part i of n of the cache (on n machines), for `c2kd cache merge`; "node": under
    # torchrun on several nodes, each node writes its own part (node k of n: part k+1/n) to its own --out
    part: str = ""
    max_examples: int | None = None  # per split, the fixed subset `train-teacher --max-train` trains on
    backend: str = "transformers"  # transformers | vllm
    tensor_parallel: int = 1  # vLLM: GPUs the teacher is split over
    vllm_states: str = "auto"  # vLLM: how the layers come back (auto | extract | hooks; see vllm_backend)
    vllm_memory: float | None = None  # vLLM: share of the device's memory; None: sized from the machine (engine_memory)
    device: str = "auto"  # auto: cuda:LOCAL_RANK when available, else cpu
    progress: bool = True

    def __post_init__(self) -> None:
        """Every setting checked before anything is loaded or written."""
        if not self.splits or len(set(self.splits)) != len(self.splits) or set(self.splits) - set(SPLITS):
            raise C2KDError(f"--splits {','.join(self.splits)!r}: expected distinct names among {', '.join(SPLITS)}")
        if self.layers is not None:
            if not self.layers:
                raise C2KDError("--layers: give at least one layer number, e.g. 24,26,28,30 (or leave it out)")
            if len(set(self.layers)) != len(self.layers) or min(self.layers) < 1:
                raise C2KDError(f"--layers {','.join(map(str, self.layers))}: expected distinct layer numbers >= 1")
        if self.positions not in POSITIONS:
            raise C2KDError(f"--positions {self.positions!r}: expected one of {', '.join(POSITIONS)}")
        if self.dtype not in CACHE_DTYPES:
            raise C2KDError(f"--dtype {self.dtype!r}: expected one of {', '.join(CACHE_DTYPES)}")
        if not isinstance(self.logits, LogitsPolicy):  # `--logits` text: parsed once, here
            object.__setattr__(self, "logits", LogitsPolicy.parse(self.logits))
        if self.dtype == FLOAT8 and self.logits.kind == "full":
            raise C2KDError(FLOAT8_FULL_LOGITS)
        Compression.parse(self.compression)
        if self.max_examples is not None and self.max_examples < 1:
            raise C2KDError(f"--max-examples must be >= 1, got {self.max_examples}")
        for name in ("max_tokens_per_batch", "examples_per_shard", "queue_shards"):
            if getattr(self, name) < 1:
                raise C2KDError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.writer not in WRITERS:
            raise C2KDError(f"--writer {self.writer!r}: expected one of {', '.join(WRITERS)}")
        if self.part != NODE_PART:
            parse_part(self.part)
        if self.backend not in BACKENDS:
            raise C2KDError(f"--backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.backend == "vllm":
            check_vllm()
        if self.vllm_states not in ("auto", *MECHANISMS) or (self.vllm_states != "auto" and self.backend != "vllm"):
            raise C2KDError(f"--vllm-states {self.vllm_states!r}: expected auto, {' or '.join(MECHANISMS)}, "
                            "other than auto with --backend vllm only")
        if self.vllm_memory is not None and (self.backend != "vllm" or not 0 < self.vllm_memory <= 1):
            raise C2KDError(f"--vllm-memory {self.vllm_memory}: a share of the device's memory, 0 < share <= 1, "
                            "with --backend vllm only")
        if self.tensor_parallel < 1 or (self.tensor_parallel > 1 and self.backend != "vllm"):
            raise C2KDError(f"--tensor-parallel {self.tensor_parallel}: a number >= 1, above 1 with --backend vllm only")
        distributed.pick_device(self.device)


# ---------------------------------------------------------------- the teacher side


def length_buckets(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped into batches of similar length with batch x longest <= max_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


class TransformersStates:
    """The transformers backend: the teacher's states with its own Hugging Face forward."""

    def __init__(self, model: RecLM, pad_id: int, device: torch.device):
        self.model, self.pad_id, self.device = model, pad_id, device

    @torch.inference_mode()
    def __call__(self, examples: Sequence[EncodedExample], layers: Sequence[int]) -> tuple[torch.Tensor, dict]:
        """Right-padded [B, T, d] final (post-norm) states, and {layer: [B, T, d]} (HF hidden_states[l])."""
        t = collate(examples, self.pad_id)
        out = self.model.decode(t["input_ids"].to(self.device), t["attention_mask"].to(self.device),
                                t["slot_items"].to(self.device), output_hidden_states=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out.last_hidden_state, {layer: out.hidden_states[layer] for layer in layers}


class TeacherRunner:
    """Turns the examples of one shard into cache records with one teacher forward per batch.

    `states` runs the teacher (TransformersStates by default; the vLLM backend gives the same
    states from vLLM); everything the cache keeps is derived from them here, identically."""

    def __init__(self, model: RecLM, encoder: PromptEncoder, spec: CacheSpec, device: torch.device, max_tokens: int,
                 states=None):
        self.model, self.encoder, self.spec, self.device = model, encoder, spec, device
        self.max_tokens = max_tokens
        self.states = states or TransformersStates(model, encoder.pad_id, device)
        if hf.logit_softcap(model.lm):
            raise CacheError("the teacher soft-caps its logits; the cache's head(final state) cannot represent that")
        if getattr(model.base_lm().get_output_embeddings(), "bias", None) is not None:
            raise CacheError("the teacher's LM head has a bias; the cache stores the head weight only")
        # what each output is cast to before it leaves the device: the cache's float dtype (float8 hidden
        # states leave in the other floats' bfloat16: the writer quantises them off the forward's path), or int32
        self._storage = {a.name: TORCH_DTYPES[spec.float_dtype] if a.is_float or a.is_quantized else getattr(torch, a.dtype)
                         for a in S.output_defs(spec)}
        self.forward_seconds = 0.0

    def encode(self, rows: Sequence[dict]) -> list[EncodedExample]:
        return [self.encoder.encode(r["example_id"], r["history"], r["candidates"], r["target"]) for r in rows]

    def batches(self, encoded: Sequence[EncodedExample]) -> list[list[int]]:
        return length_buckets([len(e) for e in encoded], self.max_tokens)

    def forward(self, examples: Sequence[EncodedExample]) -> tuple[torch.Tensor, dict]:
        """The bare teacher forward of one batch: final states and the cached layers, no LM head."""
        start = time.perf_counter()
        out = self.states(examples, self.spec.layers)
        self.forward_seconds += time.perf_counter() - start
        return out

    @torch.inference_mode()
    def run_batch(self, examples: Sequence[EncodedExample], indices: Sequence[int]) -> BatchOutputs:
        """Teacher forward of one batch: every output the cache keeps (`schema.output_defs`), by
        array name, in its storage dtype, on the CPU. The final state is the one the head reads,
        so head(final_hidden) are the teacher's logits."""
        spec, policy = self.spec, self.spec.logits
        final, hidden = self.forward(examples)
        answers = [answer_positions(torch.tensor(e.labels)) for e in examples]
        counts = [len(a) for a in answers]
        b_idx = torch.repeat_interleave(torch.arange(len(examples)), torch.tensor(counts, dtype=torch.long)).to(self.device)
        p_idx = torch.cat([torch.as_tensor(a, dtype=torch.long) for a in answers]).to(self.device)
        final_rows = final[b_idx, p_idx]  # [N_answers, d]
        outputs = {S.FINAL_HIDDEN: final_rows}
        for layer in spec.layers:  # [B, T, d] (positions all) or [N_answers, d]
            outputs[S.hidden_array(layer)] = hidden[layer] if spec.positions == "all" else hidden[layer][b_idx, p_idx]
        if policy.kind != "exact":
            logits = self.model.head_logits(final_rows).float()
            if policy.kind == "topk":
                top = logits.topk(policy.k, dim=-1)
                outputs[S.TOPK_VALUES], outputs[S.TOPK_INDICES] = top.values, top.indices
            else:
                outputs[S.FULL_LOGITS] = logits
        return BatchOutputs(list(examples), list(indices), answers, counts,
                            {name: x.to(self._storage[name]).cpu() for name, x in outputs.items()})

    def shard_outputs(self, rows: Sequence[dict]) -> list[BatchOutputs]:
        """All teacher outputs of a shard's examples (rows in shard order), batch by batch."""
        encoded = self.encode(rows)
        return [self.run_batch([encoded[i] for i in batch], batch) for batch in self.batches(encoded)]


# ---------------------------------------------------------------- the recipe


def build_spec(model: RecLM, examples: ExampleSet, teacher_dir: Path, settings: CacheTeacherSettings, pad_id: int) -> CacheSpec:
    layers = tuple(settings.layers) if settings.layers else tuple(late_layers(model.num_layers))
    bad = [layer for layer in layers if not 1 <= layer <= model.num_layers]
    if bad:
        raise C2KDError(f"--layers {list(layers)}: the teacher has layers 1..{model.num_layers}")
    policy = settings.logits
    if policy.kind == "topk" and policy.k > model.vocab_size:
        raise C2KDError(f"--logits {settings.logits}: the teacher's vocabulary has {model.vocab_size:,} tokens")
    weights = sorted(teacher_dir.glob("*.safetensors"))
    if not weights:
        raise C2KDError(f"{teacher_dir}: no safetensors weights to fingerprint")
    return CacheSpec(
        layers=tuple(sorted(set(layers))),
        hidden_size=model.hidden_size,
        vocab_size=model.vocab_size,
        dtype=settings.dtype,
        positions=settings.positions,
        logits=settings.logits,
        compression=settings.compression,
        examples_per_shard=settings.examples_per_shard,
        splits=tuple(settings.splits),
        teacher_fingerprint=fingerprint_files(weights),
        tokenizer_fingerprint=fingerprint_tokenizer(model.tokenizer),
        data_fingerprint=examples.fingerprint,
        teacher_description=model.spec.base,
        teacher_num_layers=model.num_layers,
        prompt_format=model.spec.format,
        pad_token_id=pad_id,
        part=settings.part,
        backend=settings.backend,
        extra={"num_items": model.spec.num_items},
    )


def teacher_config(model: RecLM) -> dict:
    return {
        "reclm": model.spec.to_json(),
        "lm_config": model.base_lm().config.to_dict(),
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "vocab_size": model.vocab_size,
        "format": model.spec.format,
    }


def rows_by_id(examples: ExampleSet, splits: Sequence[str]) -> dict[int, dict]:
    rows = {}
    for split in splits:
        for r in examples.split(split).select("example_id", "user", "history", "target", "candidates").iter_rows(named=True):
            rows[int(r["example_id"])] = r
    return rows


def _progress(enabled: bool, total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("[bold]caching teacher"), BarColumn(), MofNCompleteColumn(), TextColumn("examples"),
        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(), disable=not enabled,
    )
    task = progress.add_task("cache", total=total, rate="")
    return progress, task


def cache_teacher(
    teacher: str | os.PathLike,
    data: str | os.PathLike | ExampleSet,
    out: str | os.PathLike,
    settings: CacheTeacherSettings = CacheTeacherSettings(),
) -> dict:
    """Write (or finish) the teacher cache at `out`; returns a summary of this rank's work."""
    wall = time.perf_counter()
    rank, world_size, _ = distributed.dist_env()
    if settings.part == NODE_PART:  # this node's processes write this node's part; its first one seals it
        node, nodes, rank, world_size = distributed.node_env()
        settings = replace(settings, part=f"{node + 1}/{nodes}")
    device = distributed.pick_device(settings.device)
    started_dist = distributed.init(device)
    # started first: its start-up (seconds of imports) overlaps with loading the teacher
    background = start_shard_writer(settings.writer, settings.queue_shards)
    try:
        teacher_dir = Path(teacher)
        examples = data if isinstance(data, ExampleSet) else load_examples(data)
        for split in settings.splits:
            examples.split(split)  # unknown split names fail here, clearly
        model = RecLM.load(teacher_dir, device=device).eval()
        if model.spec.data_fingerprint and model.spec.data_fingerprint != examples.fingerprint:
            raise C2KDError(
                f"{teacher_dir} was trained on other data (fingerprint {model.spec.data_fingerprint[:12]}…) than "
                f"{examples.root} ({examples.fingerprint[:12]}…); item ids would not match"
            )
        encoder = PromptEncoder(model.tokenizer, model.spec.format, examples.titles())
        spec = build_spec(model, examples, teacher_dir, settings, encoder.pad_id)
        ids = {s: examples.split(s)["example_id"].to_numpy() for s in settings.splits}
        plan = plan_shards({s: v[fixed_subset(len(v), settings.max_examples)].tolist() for s, v in ids.items()},
                           spec.examples_per_shard)
        plan = part_plan(plan, settings.part)
        writer = CacheWriter(out, spec, rank=rank, world_size=world_size)
        summary = {"out": str(out), "rank": rank, "world_size": world_size, "shards_planned": len(plan),
                   "layers": list(spec.layers), "already_complete": writer.already_complete}
        if writer.already_complete:
            return {**summary, "complete": True, "shards_written": 0, "examples": 0, "seconds": time.perf_counter() - wall}
        if rank == 0:
            writer.write_assets(model.tokenizer, model.effective_head_weight(), model.item_embeddings, teacher_config(model))
        stats = write_shards(model, encoder, spec, plan, writer, rows_by_id(examples, settings.splits), device, settings,
                             rank, world_size, background=background)
        background = None  # closed by write_shards
        distributed.barrier()  # every process of every node
        if rank == 0:
            writer.seal(plan)
        return {**summary, **stats, "complete": True, "seconds": time.perf_counter() - wall}
    finally:
        if background is not None:  # refused or already complete: nothing was written through it
            background.discard()
        if started_dist:
            dist.destroy_process_group()


def write_shards(
    model: RecLM,
    encoder: PromptEncoder,
    spec: CacheSpec,
    plan: ShardPlan,
    writer: CacheWriter,
    rows: dict[int, dict],
    device: torch.device,
    settings: CacheTeacherSettings,
    rank: int = 0,
    world_size: int = 1,
    background: ShardWriter | None = None,
) -> dict:
    """This rank's missing shards: teacher forward on the main thread, writing in the background
    (on `background` when given, started early; it is closed here either way)."""
    done = writer.done_shards()
    todo = [s for s in plan.owned_by(rank, world_size) if s.shard_id not in done]
    states = None
    if settings.backend == "vllm":
        from c2kd.pipeline.vllm_backend import VllmStates

        longest = max(len(encoder.encode(0, r["history"], r["candidates"], r["target"])) for r in rows.values())
        states = VllmStates(model, spec.teacher_fingerprint, spec.layers, max_length=longest + 8,
                            tensor_parallel_size=settings.tensor_parallel, memory_share=settings.vllm_memory,
                            mechanism=None if settings.vllm_states == "auto" else settings.vllm_states)
    runner = TeacherRunner(model, encoder, spec, device, settings.max_tokens_per_batch, states)
    background = background or start_shard_writer(settings.writer, settings.queue_shards)
    background.attach(writer)
    total = sum(len(s.example_ids) for s in todo)
    progress, task = _progress(settings.progress and rank == 0, total)
    start = time.perf_counter()
    n_examples = n_tokens = 0
    try:
        with progress:
            for shard in todo:
                shard_rows = [rows[i] for i in shard.example_ids]
                outputs = runner.shard_outputs(shard_rows)
                background.put(ShardJob(shard.shard_id, shard.split, shard_rows, outputs, spec))
                n_examples += len(shard_rows)
                n_tokens += sum(len(e) for o in outputs for e in o.examples)
                elapsed = max(time.perf_counter() - start, 1e-9)
                rate = f"{n_examples / elapsed:,.1f} ex/s · {background.bytes_written / elapsed / 1e6:,.2f} MB/s written"
                progress.update(task, advance=len(shard_rows), rate=rate)
    finally:
        background.close()  # waits for the queued shards; re-raises a writer failure
        if states is not None:
            states.close()
    return {
        "shards_written": len(todo),
        "shards_skipped": len(plan.owned_by(rank, world_size)) - len(todo),
        "examples": n_examples,
        "tokens": n_tokens,
        "bytes_written": background.bytes_written,
        "forward_seconds": runner.forward_seconds,
        "write_seconds": background.write_seconds,
        "writer_process_cpu_seconds": getattr(background, "cpu_seconds", 0.0),  # a thread's is in this process's
        "loop_seconds": time.perf_counter() - start,
        "vllm_states": states.mechanism if states is not None else None,
        "vllm_memory": states.memory if states is not None else None,
    }
