"""Stage two speed and memory, measured side by side in one run.

    python benchmarks/stage_two.py                        # ML-100k (cap 5), tiny-teacher -> tiny-student
    python benchmarks/stage_two.py --data DIR --teacher RUN_DIR --cache CACHE --json out.json
    python benchmarks/stage_two.py --teacher-shape 576,30,9,1536      # a SmolLM2-135M-shaped teacher
    python benchmarks/stage_two.py --data D --teacher T --cache C --student smollm2-135m --shrink first:3

Three training steps of the same student on the same batches (forward, backward, AdamW step,
the cache read or the teacher forward included):
    c2kd-cache   C2KD loss, teacher outputs read from the cache (what `c2kd distill` does: 8
                 micro-batches per read, in a background thread, one read ahead)
    c2kd-items-cache  the same with --kd-over items (the logit losses over the item tokens only)
    sft-cache    L_LM only, token ids read from the cache the same way
    c2kd-live    C2KD loss with the teacher run live on every batch (no cache)
The variants take turns in blocks of --block steps (so load changes on a shared machine hit all
of them); the first block of each is warm-up and the first step of every block (nothing read
ahead yet) is left out. Ratios are of median step times: c2kd-cache / sft-cache,
c2kd-items-cache / sft-cache and c2kd-live / c2kd-cache. --no-read-ahead reads inside the step instead.

Peak memory: each variant runs again alone in a fresh process; on a GPU, the peak of
torch.cuda.max_memory_allocated; on CPU, how far the resident memory (sampled every ms) rises
above what the process held just before the variant was set up (so the live variant's teacher
weights count, the libraries do not).
The teacher is a `tiny-teacher` with random weights unless --teacher gives a trained one (speed
does not depend on the weights); the cache holds the train split, bfloat16, exact logits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from c2kd.cache_schema.reader import TeacherCache
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, cache_teacher
from c2kd.data.examples import load_examples
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.presets import ModelPreset
from c2kd.recmodel.prompts import PromptEncoder, collate, encode_frame
from c2kd.recmodel.tokenizer import build_word_tokenizer
from c2kd.student.distill import DistillRecipe, build_student
from c2kd.student.objective import DistillModel

if __package__ in (None, ""):  # run as a file (python benchmarks/stage_two.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.live_teacher import live_teacher_batch  # noqa: E402  (the live-teacher batch the tests check the cache against)
from benchmarks.common import write_result  # noqa: E402

VARIANTS = ("c2kd-cache", "c2kd-items-cache", "sft-cache", "c2kd-live")
CACHE_KD = ("c2kd-cache", "c2kd-items-cache")  # read the teacher's states from the cache


def prepare_inputs(args, work: Path) -> tuple[Path, Path, Path]:
    """(data, teacher, cache) folders: given ones are used, missing ones are made in `work`."""
    data = args.data
    if data is None:
        from c2kd.data.prepare import prepare

        data = work / "examples"
        prepare("movielens-100k", data, seed=0, max_train_per_user=5)
    examples = load_examples(data)
    teacher = args.teacher
    if teacher is None:
        tokenizer = build_word_tokenizer(examples.titles()[1:], examples.num_items)
        emb = torch.randn(examples.num_items + 1, 64, generator=torch.Generator().manual_seed(0))
        if args.teacher_shape:
            hidden, layers, heads, inter = (int(x) for x in args.teacher_shape.split(","))
            shape = ModelPreset("bench-teacher", hidden, layers, heads, inter)
            torch.manual_seed(0)
            lm = AutoModelForCausalLM.from_config(shape.llama_config(
                len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id))
            model = RecLM(lm, tokenizer, emb, "ids", examples.fingerprint, base=f"random llama {args.teacher_shape}")
        else:
            model = RecLM.from_preset("tiny-teacher", tokenizer, emb, "ids", seed=0, data_fingerprint=examples.fingerprint)
        teacher = model.save(work / "teacher")
    cache = args.cache
    if cache is None:  # the first --cache-examples train examples are all the timed steps draw from
        cache = work / "cache"
        train = examples.split("train").head(args.cache_examples)
        cache_teacher(teacher, replace(examples, splits={**examples.splits, "train": train}), cache,
                      CacheTeacherSettings(splits=("train",), positions=args.positions, progress=False, device=args.device))
    return Path(data), Path(teacher), Path(cache)


class Bench:
    """One student per variant (same init), the same batches for all."""

    def __init__(self, args, data: Path, teacher_dir: Path, cache_dir: Path, variants=VARIANTS):
        self.device = torch.device(args.device)
        self.cache = TeacherCache.open(cache_dir)
        spec = self.cache.spec
        self.examples = load_examples(data)
        ids = self.cache.split_ids("train")
        rng = np.random.default_rng(0)
        self.batches = [rng.choice(ids, args.batch_size, replace=False).tolist() for _ in range(args.steps + args.block)]
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.group = args.group
        head = self.cache.head_weight()
        self.models, self.optims = {}, {}
        for name in variants:
            recipe = DistillRecipe(method="sft" if name == "sft-cache" else "c2kd", student=args.student,
                                   shrink=args.shrink, kd_over="items" if name == "c2kd-items-cache" else "vocab")
            student = build_student(recipe, self.cache, seed=0)
            torch.manual_seed(0)
            filters = recipe.layer_filters(spec, student) if recipe.method == "c2kd" else None
            model = DistillModel(student, recipe, spec, head, filters)
            model.to(self.device).train()
            self.models[name] = model
            self.optims[name] = torch.optim.AdamW(model.trainable_parameters(), lr=1e-4)
        self.teacher = None
        if "c2kd-live" in variants:
            self.teacher = RecLM.load(teacher_dir, device=self.device).eval()
            encoder = PromptEncoder(self.teacher.tokenizer, self.teacher.spec.format, self.examples.titles())
            self.encoded = {e.example_id: e for e in encode_frame(encoder, self.examples.split("train"))}
            self.pad_id = encoder.pad_id

    def _to_device(self, b: dict) -> dict:
        return {k: ({l: t.to(self.device) for l, t in v.items()} if isinstance(v, dict) else v.to(self.device))
                for k, v in b.items()}

    def reads(self, name: str):
        """What `c2kd distill` reads for this variant: one cache read for a group of batches."""
        c2kd = name in CACHE_KD
        kw = {"layers": self.cache.spec.layers if c2kd else [], "final_hidden": c2kd, "logits": c2kd}
        return lambda groups: self.cache.get_batches(groups, **kw)

    def block(self, name: str, batches: list[list[int]], read_ahead: bool) -> list[float]:
        """Train steps of one variant on consecutive batches; the time of each step (its cache read,
        or its teacher forward, included). With read_ahead the cache is read as `c2kd distill`
        reads it: `group` batches per read, in a background thread, one group ahead."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        model = self.models[name]
        if name != "c2kd-live":
            reads = self.reads(name)
            size = self.group if read_ahead else 1
            groups = [batches[i : i + size] for i in range(0, len(batches), size)]
            futures = [self.pool.submit(reads, groups[0])] if read_ahead else []
        times = []
        for k, ids in enumerate(batches):
            sync()
            start = time.perf_counter()
            if name == "c2kd-live":
                tokens = self._to_device(collate([self.encoded[i] for i in ids], self.pad_id))
                batch = live_teacher_batch(self.teacher, tokens, self.cache.spec.layers, self.cache.spec.positions)
            elif read_ahead:
                g, j = divmod(k, self.group)
                if j == 0 and g + 1 < len(groups):
                    futures.append(self.pool.submit(reads, groups[g + 1]))
                batch = futures[g].result()[j].to(self.device)
            else:
                batch = reads([ids])[0].to(self.device)
            terms = model(batch)
            terms["loss"].backward()
            self.optims[name].step()
            self.optims[name].zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - start)
        return times


class RssSampler:
    """Peak resident memory of this process, sampled from /proc every millisecond (Linux)."""

    def __init__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def peak_memory(args, data: Path, teacher: Path, cache: Path, variant: str) -> dict:
    """Run one variant alone in this process and report its peak memory (setup included: the live
    variant's teacher weights count)."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with RssSampler() as rss:
        before = rss.now()
        bench = Bench(args, data, teacher, cache, variants=(variant,))
        bench.block(variant, bench.batches, read_ahead=not args.no_read_ahead)
    out = {"variant": variant, "rss_before_mib": before / 2**20, "peak_rss_growth_mib": (rss.peak - before) / 2**20}
    if bench.teacher is not None:
        out["teacher_weights_mib"] = sum(p.numel() * p.element_size() for p in bench.teacher.parameters()) / 2**20
    if device.type == "cuda":
        out["cuda_peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="prepared folder; default: ML-100k (cap 5) in a temp folder")
    parser.add_argument("--teacher", type=Path, help="teacher model folder; default: tiny-teacher, random weights")
    parser.add_argument("--teacher-shape", help="instead: a random Llama teacher HIDDEN,LAYERS,HEADS,INTERMEDIATE "
                        "(e.g. 576,30,9,1536 = SmolLM2-135M's shape)")
    parser.add_argument("--cache", type=Path, help="cache of that teacher; default: written in a temp folder")
    parser.add_argument("--cache-examples", type=int, default=1024,
                        help="train examples to cache when no --cache is given (the steps sample from them)")
    parser.add_argument("--student", default="tiny-student")
    parser.add_argument("--shrink", help="with a pretrained --student: first:K | narrow:WIDTHxLAYERS")
    parser.add_argument("--positions", default="all", choices=["all", "answer"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32, help="timed steps per variant")
    parser.add_argument("--block", type=int, default=16, help="consecutive steps of one variant before the next")
    parser.add_argument("--group", type=int, default=8, help="micro-batches per cache read (as c2kd distill)")
    parser.add_argument("--no-read-ahead", action="store_true", help="read the cache inside the step (no background thread)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--memory-of", choices=VARIANTS, help=argparse.SUPPRESS)  # child process mode
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="c2kd-bench-") as tmp:
        data, teacher, cache = prepare_inputs(args, Path(tmp))
        if args.memory_of:
            print(json.dumps(peak_memory(args, data, teacher, cache, args.memory_of)))
            return
        bench = Bench(args, data, teacher, cache)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        # Blocks of consecutive steps, the variants taking turns; the first block of each is warm-up
        # and the first step of every block (its read not ahead yet) is left out.
        for start in range(0, len(bench.batches), args.block):
            for name in VARIANTS:
                block = bench.block(name, bench.batches[start : start + args.block], not args.no_read_ahead)
                if start > 0:
                    times[name] += block[1:]
        median = {v: statistics.median(ts) for v, ts in times.items()}
        memory = []
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--data", str(data), "--teacher", str(teacher), "--cache", str(cache),
                   "--student", args.student, "--positions", args.positions, "--batch-size", str(args.batch_size),
                   "--steps", str(min(args.steps, 16)), "--block", "16", "--group", str(args.group), "--threads", str(args.threads),
                   "--device", args.device, "--memory-of", variant, *(["--shrink", args.shrink] if args.shrink else [])]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            memory.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        spec = bench.cache.spec
        result = {
            "setup": {"teacher": spec.teacher_description, "teacher_layers": spec.teacher_num_layers,
                      "teacher_width": spec.hidden_size, "student": args.student, "shrink": args.shrink,
                      "student_non_embedding_parameters": bench.models["sft-cache"].student.non_embedding_parameters(),
                      "cached_layers": list(spec.layers), "positions": spec.positions, "dtype": spec.dtype,
                      "batch_size": args.batch_size, "steps": args.steps, "device": args.device,
                      "threads": args.threads, "read_ahead": not args.no_read_ahead},
            "median_step_s": median,
            "ratios": {"c2kd_cache_over_sft": median["c2kd-cache"] / median["sft-cache"],
                       "c2kd_items_cache_over_sft": median["c2kd-items-cache"] / median["sft-cache"],
                       "live_teacher_kd_over_c2kd_cache": median["c2kd-live"] / median["c2kd-cache"]},
            "memory": memory,
        }
    print(json.dumps(result, indent=2))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
