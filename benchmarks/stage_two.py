"""Stage two speed and memory, measured side by side in one run.

    python benchmarks/stage_two.py                        # ML-100k (cap 5), tiny-teacher -> tiny-student
    python benchmarks/stage_two.py --data DIR --teacher RUN_DIR --steps 30 --json out.json

Three training steps of the same student on the same batches (forward, backward, AdamW step,
the cache read or the teacher forward included):
    c2kd-cache   C2KD loss, teacher outputs read from the cache (what `c2kd distill` does)
    sft-cache    L_LM only, token ids read from the cache
    c2kd-live    C2KD loss with the teacher run live on every batch (no cache)
The variants take turns step by step (so load changes on a shared machine hit all of them) and
the ratios are of median step times:  c2kd-cache / sft-cache  and  c2kd-live / c2kd-cache.

Peak memory: each variant runs again alone in a fresh process; on a GPU, the peak of
torch.cuda.max_memory_allocated; on CPU, the growth of the peak RSS from just before the variant
is set up (so the live variant's teacher weights count, and the libraries do not).
The teacher is a `tiny-teacher` with random weights unless --teacher gives a trained one (speed
does not depend on the weights); the cache holds the train split, bfloat16, exact logits.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from c2kd.cache_schema.reader import TeacherCache
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, cache_teacher
from c2kd.pipeline.examples import load_examples
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.prompts import PromptEncoder, collate, encode_frame
from c2kd.recmodel.tokenizer import build_word_tokenizer
from c2kd.student.c2kd_modules import LayerFilters
from c2kd.student.distill import DistillModel, DistillRecipe, batch_dict, build_student, live_teacher_batch

VARIANTS = ("c2kd-cache", "sft-cache", "c2kd-live")


def prepare_inputs(args, work: Path) -> tuple[Path, Path, Path]:
    """(data, teacher, cache) folders: given ones are used, missing ones are made in `work`."""
    data = args.data
    if data is None:
        from c2kd.pipeline.prepare import prepare

        data = work / "examples"
        prepare("movielens-100k", data, seed=0, max_train_per_user=5)
    examples = load_examples(data)
    teacher = args.teacher
    if teacher is None:
        tokenizer = build_word_tokenizer(examples.titles()[1:], examples.num_items)
        emb = torch.randn(examples.num_items + 1, 64, generator=torch.Generator().manual_seed(0))
        model = RecLM.from_preset("tiny-teacher", tokenizer, emb, "ids", seed=0, data_fingerprint=examples.fingerprint)
        teacher = model.save(work / "teacher")
    cache = args.cache
    if cache is None:
        cache = work / "cache"
        cache_teacher(teacher, examples, cache, CacheTeacherSettings(splits=("train",), positions=args.positions,
                                                                      progress=False, device=args.device))
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
        self.batches = [rng.choice(ids, args.batch_size, replace=False).tolist() for _ in range(args.steps + args.warmup)]
        head = self.cache.head_weight()
        self.models, self.optims = {}, {}
        for name in variants:
            recipe = DistillRecipe(method="sft" if name == "sft-cache" else "c2kd", student=args.student)
            student = build_student(recipe, self.cache, seed=0)
            torch.manual_seed(0)
            filters = LayerFilters(spec.layers, spec.hidden_size, student.hidden_size, spec.vocab_size)
            model = DistillModel(student, recipe, spec, head, filters if recipe.method == "c2kd" else None)
            model.to(self.device).train()
            self.models[name] = model
            self.optims[name] = torch.optim.AdamW(model.trainable_parameters(), lr=1e-4)
        self.teacher = None
        if "c2kd-live" in variants:
            self.teacher = RecLM.load(teacher_dir, device=self.device).eval()
            encoder = PromptEncoder(self.teacher.tokenizer, self.teacher.spec.format, self.examples.titles())
            self.encoded = {e.example_id: e for e in encode_frame(encoder, self.examples.split("train"))}
            self.pad_id = encoder.pad_id

    def batch(self, name: str, ids: list[int]) -> dict:
        spec = self.cache.spec
        if name == "c2kd-cache":
            b = batch_dict(self.cache.get(ids))
        elif name == "sft-cache":
            b = batch_dict(self.cache.get(ids, layers=[], final_hidden=False, logits=False))
        else:
            tokens = collate([self.encoded[i] for i in ids], self.pad_id)
            tokens = {k: v.to(self.device) for k, v in tokens.items()}
            return live_teacher_batch(self.teacher, tokens, spec.layers, spec.positions)
        return {k: ({l: t.to(self.device) for l, t in v.items()} if isinstance(v, dict) else v.to(self.device))
                for k, v in b.items()}

    def step(self, name: str, ids: list[int]) -> float:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        terms = self.models[name](self.batch(name, ids))
        terms["loss"].backward()
        self.optims[name].step()
        self.optims[name].zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start


def peak_memory(args, data: Path, teacher: Path, cache: Path, variant: str) -> dict:
    """Run one variant alone in this process and report its peak memory (setup included: the live
    variant's teacher weights count)."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux reports KiB)
    bench = Bench(args, data, teacher, cache, variants=(variant,))
    for ids in bench.batches:
        bench.step(variant, ids)
    out = {"variant": variant, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    out["rss_growth_mib"] = out["peak_rss_mib"] - rss_before
    if device.type == "cuda":
        out["cuda_peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="prepared folder; default: ML-100k (cap 5) in a temp folder")
    parser.add_argument("--teacher", type=Path, help="teacher model folder; default: tiny-teacher, random weights")
    parser.add_argument("--cache", type=Path, help="cache of that teacher; default: written in a temp folder")
    parser.add_argument("--student", default="tiny-student")
    parser.add_argument("--positions", default="all", choices=["all", "answer"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
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
        for k, ids in enumerate(bench.batches):
            for name in VARIANTS:
                t = bench.step(name, ids)
                if k >= args.warmup:
                    times[name].append(t)
        median = {v: statistics.median(ts) for v, ts in times.items()}
        memory = []
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--data", str(data), "--teacher", str(teacher), "--cache", str(cache),
                   "--student", args.student, "--positions", args.positions, "--batch-size", str(args.batch_size),
                   "--steps", str(min(args.steps, 5)), "--warmup", "1", "--threads", str(args.threads),
                   "--device", args.device, "--memory-of", variant]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            memory.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        spec = bench.cache.spec
        result = {
            "setup": {"teacher": spec.teacher_description, "teacher_layers": spec.teacher_num_layers,
                      "teacher_width": spec.hidden_size, "student": args.student,
                      "student_non_embedding_parameters": bench.models["sft-cache"].student.non_embedding_parameters(),
                      "cached_layers": list(spec.layers), "positions": spec.positions, "dtype": spec.dtype,
                      "batch_size": args.batch_size, "steps": args.steps, "device": args.device,
                      "threads": args.threads},
            "median_step_s": median,
            "ratios": {"c2kd_cache_over_sft": median["c2kd-cache"] / median["sft-cache"],
                       "live_teacher_kd_over_c2kd_cache": median["c2kd-live"] / median["c2kd-cache"]},
            "memory": memory,
        }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
