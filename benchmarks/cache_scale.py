"""Caches at 1x, 5x and 20x the benchmark's size: stage one's rate, stage two's rate and memory.

The uncapped ML-100k train split (95,285 examples, 20x the 4,715 of the capped benchmark) through
a random-weight teacher (tiny-teacher, or --teacher-shape WIDTH,LAYERS,HEADS,INTER for real bytes
per token), cached at 1x, 5x and 20x (--scales). Each step runs in a fresh process, one at a time:

- stage one per cache: examples/s over the run and the process's peak RSS, and ÷ the teacher's
  bare forward over the 1x examples in stage one's batches (a separate process, run after them);
- `cache verify` of the largest cache: seconds per GB;
- stage two (`distill --method c2kd --max-steps S`; --student tiny-student, or `teacher:first:K`,
  the teacher's first K layers at its width): the median examples/s of the logged steps of each
  stage, stage two's examples over its wall seconds (waits for the reader included) and the peak
  RSS, for each cache with the default shard-aware order and for the largest cache with one full
  shuffle (--shuffle-block 0, the order before it existed), in --rounds interleaved rounds (load
  changes on a shared machine hit every variant);
- the reader alone (CacheBatches over the 1x and the largest cache, C2KD's reads, both orders at
  the largest; shards decoded as they come) against the student's rate;
- entries per folder, and by the plan's arithmetic for 1M examples.

Every step resumes (a finished cache or run is kept; the JSON holds what is measured so far):

    python benchmarks/cache_scale.py --out runs/bench/cache_scale [--teacher-shape 576,4,9,1536] [--rounds 2] [--scales 1,5,20]
        [--student teacher:first:2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from c2kd.data.examples import load_examples

if __package__ in (None, ""):  # run as a file: the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ROOT, write_result  # noqa: E402

BASE_EXAMPLES = 4715  # the capped benchmark's train split (ML-100k, 5 windows per user)
EXAMPLES_PER_SHARD = 256  # cache-teacher's default
HUB_FOLDER_LIMIT = 10_000  # entries per folder the Hugging Face Hub asks to stay under


def child(code: str, *args: str) -> dict:
    """Run `code` in a fresh Python process; it prints one JSON line last. Adds its peak RSS."""
    wrapped = code + "\nimport resource as _r, json as _j\nprint(_j.dumps({**RESULT, 'peak_rss_mib': _r.getrusage(_r.RUSAGE_SELF).ru_maxrss / 1024}))"
    proc = subprocess.run([sys.executable, "-c", wrapped, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(f"step failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def prepare_inputs(out: Path, teacher_shape: str | None) -> tuple[Path, Path]:
    """(data, teacher): the uncapped ML-100k split and a random-weight teacher, made once."""
    data, teacher = out / "data", out / "teacher"
    if not (data / "manifest.json").exists():
        from c2kd.data.prepare import prepare

        prepare("movielens-100k", data, seed=0, max_train_per_user=None, overwrite=True)
    if not (teacher / "reclm.json").exists():
        from transformers import AutoModelForCausalLM

        from c2kd.recmodel.model import RecLM
        from c2kd.recmodel.presets import ModelPreset
        from c2kd.recmodel.tokenizer import build_word_tokenizer

        examples = load_examples(data)
        tokenizer = build_word_tokenizer(examples.titles()[1:], examples.num_items)
        emb = torch.randn(examples.num_items + 1, 64, generator=torch.Generator().manual_seed(0))
        if teacher_shape:
            hidden, layers, heads, inter = (int(x) for x in teacher_shape.split(","))
            torch.manual_seed(0)
            lm = AutoModelForCausalLM.from_config(ModelPreset("bench-teacher", hidden, layers, heads, inter).llama_config(
                len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id))
            model = RecLM(lm, tokenizer, emb, "ids", examples.fingerprint, base=f"random llama {teacher_shape}")
        else:
            model = RecLM.from_preset("tiny-teacher", tokenizer, emb, "ids", seed=0, data_fingerprint=examples.fingerprint)
        shutil.rmtree(teacher, ignore_errors=True)
        model.save(teacher)
    return data, teacher


STAGE_ONE = """
import sys, time
from dataclasses import replace
from c2kd.data.examples import load_examples
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, cache_teacher
data, teacher, out, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
examples = load_examples(data)
train = examples.split("train").head(n)
examples = replace(examples, splits={**examples.splits, "train": train})
start = time.perf_counter()
cache_teacher(teacher, examples, out, CacheTeacherSettings(splits=("train",), progress=False))
seconds = time.perf_counter() - start
RESULT = {"examples": len(train), "seconds": seconds, "examples_per_s": len(train) / seconds}
"""

BARE = """
import sys, time
from dataclasses import replace
import torch
from benchmarks.stage_one import time_bare
from c2kd.cache_schema import plan_shards
from c2kd.data.examples import load_examples
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, TeacherRunner, build_spec, rows_by_id
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.prompts import PromptEncoder
from pathlib import Path
data, teacher, n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
examples = load_examples(data)
examples = replace(examples, splits={**examples.splits, "train": examples.split("train").head(n)})
model = RecLM.load(teacher).eval()
encoder = PromptEncoder(model.tokenizer, model.spec.format, examples.titles())
settings = CacheTeacherSettings(splits=("train",), progress=False)
spec = build_spec(model, examples, teacher, settings, encoder.pad_id)
plan = plan_shards({"train": examples.split("train")["example_id"].to_list()}, spec.examples_per_shard)
runner = TeacherRunner(model, encoder, spec, torch.device("cpu"), settings.max_tokens_per_batch)
seconds, _ = time_bare(runner, plan, rows_by_id(examples, ("train",)))
RESULT = {"examples": n, "seconds": seconds, "examples_per_s": n / seconds}
"""

STAGE_TWO = """
import json, sys
from pathlib import Path
from benchmarks.cache_scale import step_rate, wall_rate
from c2kd.student.distill import DistillRecipe, distill
cache, data, out, steps, block = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
student = json.loads(sys.argv[6])
read_cache = sys.argv[7] if len(sys.argv) > 7 else None
recipe = DistillRecipe(max_val=50, shuffle_block=block, **student)
distill(cache, data, out, recipe, {"max_steps": steps, "log_every": 1, "progress": False, "checkpoint_every": 0},
        final_splits=("validation",), read_cache=read_cache)
RESULT = {"stage1_examples_per_s": step_rate(out / "stage1_log.jsonl"), "stage2_examples_per_s": step_rate(out / "log.jsonl"),
          "stage2_wall_examples_per_s": wall_rate(out / "log.jsonl")}
"""

READER = """
import sys, time
from c2kd.cache_schema import TeacherCache
from c2kd.student.cache_batches import CacheBatches
cache = TeacherCache.open(sys.argv[1])
ids = cache.split_ids("train")
source = CacheBatches(cache, ids, 32, 0, block=int(sys.argv[2]), layers=cache.spec.layers)
# every shard touched first (its one-time checks), so both orders are timed in their steady state
shards = cache.shards_of(ids)
cache.get([ids[shards == s][0] for s in sorted(set(shards.tolist()))])
n, start = 0, time.perf_counter()
for i, batch in enumerate(source.batches(0)):
    n += len(batch.example_ids)
    if i == int(sys.argv[3]) - 1:
        break
RESULT = {"examples_per_s": n / (time.perf_counter() - start), "batches": i + 1}
"""


def _train_rates(log: Path) -> list[float]:
    return [r["examples_per_s"] for r in map(json.loads, log.read_text().splitlines()) if r.get("kind") == "train"]


def step_rate(log: Path) -> float | None:
    """The median of the logged steps (one step each), the first 3 (warm-up) left out: the pace of
    a step that does not wait for the reader."""
    rates = _train_rates(log)[3:]
    return statistics.median(rates) if rates else None


def wall_rate(log: Path) -> float | None:
    """Examples over the seconds of every step but the first (the harmonic mean of the per-step
    rates at one step per line): what a run gets, waits for the reader included."""
    rates = _train_rates(log)[1:]
    return len(rates) / sum(1 / r for r in rates) if rates else None


def s3_stream(args: argparse.Namespace, cache: Path, data: Path, student: str) -> dict:
    """Stage two from the cache pushed to s3:// (a moto server on 127.0.0.1) through a fresh read
    cache, beside the same run from the local folder, in --rounds interleaved rounds: examples/s
    of each, and the bytes the read cache holds afterwards (each file is fetched whole, once) ÷ the
    cache's size."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        url = "s3://c2kd-bench/cache-5x"
        subprocess.run([sys.executable, "-c", "import s3fs; s3fs.S3FileSystem().mkdir('c2kd-bench')"], check=True, env=env)
        subprocess.run([sys.executable, "-m", "c2kd.cli", "cache", "push", str(cache), url], check=True, env=env,
                       capture_output=True, cwd=ROOT)
        size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
        rounds: dict = {}
        for r in range(args.rounds):
            for name, source in (("local", str(cache)), ("s3", url)):
                run, read_cache = args.out / "runs" / f"s3-{name}-r{r}", args.out / f"read-cache-r{r}"
                shutil.rmtree(run, ignore_errors=True)
                if name == "s3":
                    shutil.rmtree(read_cache, ignore_errors=True)
                extra = [str(read_cache)] if name == "s3" else []
                measured = child(STAGE_TWO, source, str(data), str(run), str(args.steps), "4096", student, *extra)
                if name == "s3":
                    measured["fetched_bytes"] = sum(f.stat().st_size for f in read_cache.rglob("*") if f.is_file())
                    measured["fetched_over_cache_size"] = measured["fetched_bytes"] / size
                rounds.setdefault(name, []).append(measured)
                print(f"s3 step {name} round {r}: {measured}")
    finally:
        server.terminate()
        server.wait(timeout=30)
        os.environ.clear()
        os.environ.update(saved)
    local = statistics.median(m["stage2_examples_per_s"] for m in rounds["local"])
    remote = statistics.median(m["stage2_examples_per_s"] for m in rounds["s3"])
    return {"rounds": rounds, "cache_bytes": size, "s3_over_local_stage2_examples_per_s": remote / local,
            "fetched_over_cache_size": max(m["fetched_over_cache_size"] for m in rounds["s3"])}


def student_fields(name: str, teacher: Path) -> dict:
    """The DistillRecipe fields of --student: a preset, or `teacher:first:K` for a student of the
    teacher's width (its tokenizer, its first K layers) — what a real student reads against."""
    if name.startswith("teacher:"):
        return {"student": str(teacher), "shrink": name.removeprefix("teacher:")}
    return {"student": name}


def folder_entries(cache: Path) -> dict:
    """The most entries in any folder of the cache."""
    entries, folder = max((len(names) + len(files), d) for d, names, files in os.walk(cache))
    return {"most_entries": entries, "folder": str(Path(folder).relative_to(cache))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--teacher-shape", default=None, help="WIDTH,LAYERS,HEADS,INTER of a random llama teacher")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--student", default="tiny-student",
                   help="stage two's student: a preset, or 'teacher:first:K' (the teacher's first K layers, its width)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reader-batches", type=int, default=200)
    p.add_argument("--scales", default="1,5,20", help="cache sizes in multiples of --base, comma-separated (1 first)")
    p.add_argument("--base", type=int, default=BASE_EXAMPLES, help="examples of the 1x cache (smaller: a quick check)")
    p.add_argument("--stage-one-only", action="store_true", help="stop after the caches and their verification")
    p.add_argument("--s3", action="store_true", help="also: distill from the 5x cache pushed to an S3 server (moto)")
    p.add_argument("--json", type=Path, default=None, help="result file [default: OUT/cache_scale.json]")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.json or args.out / "cache_scale.json"
    result = json.loads(target.read_text()) if target.exists() else {}
    result.setdefault("stage_one", {}), result.setdefault("stage_two", {})
    result["teacher"], result["base_examples"] = args.teacher_shape or "tiny-teacher", args.base
    data, teacher = prepare_inputs(args.out, args.teacher_shape)
    if result.get("stage_two") and result.get("student", "tiny-student") != args.student:
        raise SystemExit(f"{target}: its stage-two runs are of --student {result.get('student', 'tiny-student')}; "
                         "use that, or another --json")
    result["student"] = args.student
    student = json.dumps(student_fields(args.student, teacher))
    total = len(load_examples(data).split("train"))
    scales = sorted(int(x) for x in args.scales.split(","))
    if scales[0] != 1:
        raise SystemExit(f"--scales {args.scales}: the ratios are to the 1x cache; include 1")
    top = scales[-1]  # the largest cache: verified, read in both orders

    caches = {}
    for scale in scales:  # stage one, smallest first
        n = min(args.base * scale, total)
        caches[scale] = args.out / f"cache-{scale}x"
        if f"{scale}x" not in result["stage_one"]:
            shutil.rmtree(caches[scale], ignore_errors=True)  # one cut short: start it again
            measured = child(STAGE_ONE, str(data), str(teacher), str(caches[scale]), str(n))
            size = sum(f.stat().st_size for f in caches[scale].rglob("*") if f.is_file())
            result["stage_one"][f"{scale}x"] = {**measured, "bytes": size, "shards": len(list((caches[scale] / "shards").iterdir())),
                                                **folder_entries(caches[scale])}
            write_result(target, result)
        print(f"stage one {scale}x: {result['stage_one'][f'{scale}x']}")

    if "bare_forward" not in result:  # the teacher's forward alone over the 1x examples, in stage one's batches
        result["bare_forward"] = child(BARE, str(data), str(teacher), str(min(args.base, total)))
        write_result(target, result)
    for scale in scales:
        result["stage_one"][f"{scale}x"]["writer_over_bare_forward"] = (
            result["stage_one"][f"{scale}x"]["examples_per_s"] / result["bare_forward"]["examples_per_s"])

    if "verify" not in result or result["verify"].get("cache", "20x") != f"{top}x":
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "c2kd.cli", "cache", "verify", str(caches[top])], check=True,
                       capture_output=True, cwd=ROOT)
        seconds = time.perf_counter() - start
        result["verify"] = {"cache": f"{top}x", "seconds": seconds,
                            "seconds_per_gb": seconds / (result["stage_one"][f"{top}x"]["bytes"] / 1e9)}
        write_result(target, result)

    if args.stage_one_only:
        return
    variants = {f"{s}x": (caches[s], 4096) for s in scales} | {f"{top}x-full-shuffle": (caches[top], 0)}
    for r in range(args.rounds):  # interleaved rounds
        for name, (cache, block) in variants.items():
            key = f"round{r}"
            if key in result["stage_two"].get(name, {}):
                continue
            run = args.out / "runs" / f"{name}-r{r}"
            shutil.rmtree(run, ignore_errors=True)
            measured = child(STAGE_TWO, str(cache), str(data), str(run), str(args.steps), str(block), student)
            result["stage_two"].setdefault(name, {})[key] = measured
            write_result(target, result)
            print(f"stage two {name} round {r}: {measured}")

    for name in variants:  # wall rates of runs recorded before they were measured: from their logs
        for r, run in result["stage_two"][name].items():
            log = args.out / "runs" / f"{name}-r{r.removeprefix('round')}" / "log.jsonl"
            if "stage2_wall_examples_per_s" not in run and log.exists():
                run["stage2_wall_examples_per_s"] = wall_rate(log)

    def median(name: str, field: str) -> float:
        return statistics.median(v[field] for v in result["stage_two"][name].values())

    fields = ("stage1_examples_per_s", "stage2_examples_per_s", "stage2_wall_examples_per_s", "peak_rss_mib")
    summary = {name: {f: median(name, f) for f in fields} for name in variants}
    for name in variants:
        summary[name] |= {f"{f}_vs_1x": summary[name][f] / summary["1x"][f] for f in fields}
    result["summary"] = summary
    readers = {"1x": (caches[1], 4096), f"{top}x": (caches[top], 4096), f"{top}x-full-shuffle": (caches[top], 0)}
    for r in range(args.rounds):  # the reader alone (C2KD's reads, no student), interleaved rounds
        for name, (cache, block) in readers.items():
            if f"round{r}" not in result.setdefault("readers", {}).setdefault(name, {}):
                result["readers"][name][f"round{r}"] = child(READER, str(cache), str(block), str(args.reader_batches))
                write_result(target, result)
    result["reader"] = {name: {"examples_per_s": statistics.median(v["examples_per_s"] for v in result["readers"][name].values())}
                        for name in readers}
    for name in readers:
        result["reader"][name]["vs_student_step"] = (result["reader"][name]["examples_per_s"]
                                                     / summary[name]["stage2_examples_per_s"])
    if args.s3 and "s3" not in result:
        result["s3"] = s3_stream(args, caches[5], data, student)  # needs 5 in --scales
        write_result(target, result)
    shards_1m = math.ceil(1_000_000 / EXAMPLES_PER_SHARD)
    result["files_per_folder"] = {f"measured_{top}x": result["stage_one"][f"{top}x"]["most_entries"],
                                  "shards_folder_at_1M_examples": shards_1m, "hub_limit": HUB_FOLDER_LIMIT,
                                  "examples_before_limit": HUB_FOLDER_LIMIT * EXAMPLES_PER_SHARD}
    write_result(target, result)
    print(json.dumps({k: result.get(k) for k in ("summary", "reader", "verify", "files_per_folder", "s3")}, indent=1))


if __name__ == "__main__":
    main()
