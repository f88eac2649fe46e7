"""Hidden states in float8 (and int8) against bfloat16: bytes per token, feature cosine, logit error.

    python benchmarks/cache_dtype.py --teacher runs/demo-base/teacher --data runs/demo-base/data \\
        --max-examples 256 --splits train --work /tmp/c2kd-cache-dtype --json benchmarks/results/cache_dtype/result.json

Caches the same teacher and examples with `c2kd cache-teacher --dtype bfloat16` and `--dtype float8`
into WORK (a finished cache is reused: rerunning resumes where it stopped), then reports

- bytes per token: all shard bytes / tokens, and the hidden-state arrays' bytes alone, per dtype;
- feature cosine: per token and cached layer, float8-decoded vs bfloat16 (min, 0.1 % quantile, mean);
- exact logits: max |head(final_hidden) of the float8 cache - that of the bfloat16 cache| (the final
  state stays bfloat16 in both), and, to decide that, the error float8 WOULD cause: the bfloat16
  final states quantised to e4m3 (per-row scale) -> max |logit error|, relative to max |logit|, and
  how often the top-1 token changes;
- int8 as the alternative: the bfloat16 hidden states quantised to int8 with one absmax scale per
  row, its cosine, and its zstd bytes against float8's on the same arrays (each also with its chunks
  stored feature-major, as float8 caches store them, bfloat16 included: what that layout alone gives);
- with --student-seeds 0,1: a C2KD student distilled from each cache per seed (WORK/students/DTYPE-sSEED,
  kept and reused), compared paired per user on test (c2kd.compare): the HR@1 difference float8 -
  bfloat16 with its bootstrap CI; the goal is a CI that contains 0 and |difference| <= 0.005.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as a file: the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_result  # noqa: E402
from c2kd.cache_schema import TeacherCache  # noqa: E402
from c2kd.compare import paired_comparison  # noqa: E402
from c2kd.cache_schema.dtypes import dequantize_e4m3, quantize_e4m3  # noqa: E402
from c2kd.cache_schema.zarr_io import chunk_rows  # noqa: E402

DTYPES = ("bfloat16", "float8")


def make_cache(dtype: str, args: argparse.Namespace) -> dict:
    """Write (or reuse) the cache of one dtype with the CLI; its wall time when written now."""
    out = Path(args.work) / dtype
    command = [sys.executable, "-m", "c2kd.cli", "cache-teacher", "--teacher", args.teacher, "--data", args.data,
               "--out", str(out), "--splits", args.splits, "--dtype", dtype, "--no-progress",
               *(["--max-examples", str(args.max_examples)] if args.max_examples else [])]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"cache-teacher --dtype {dtype} failed: {proc.stderr.strip()[-2000:]}")
    reused = "already a complete cache" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    hidden = sum(p.stat().st_size for p in out.glob("shards/*/hidden/**/*") if p.is_file())
    tokens = manifest["totals"]["tokens"]
    return {"path": str(out), "command": " ".join(command[1:]), "seconds": None if reused else time.perf_counter() - start,
            "tokens": tokens, "answers": manifest["totals"]["answers"], "shard_bytes": manifest["totals"]["shard_bytes"],
            "bytes_per_token": manifest["totals"]["shard_bytes"] / tokens, "hidden_bytes_per_token": hidden / tokens}


def int8_rows(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """int8 with one absmax scale per row (the alternative to float8)."""
    scale = (x.abs().amax(1) / 127).clamp_min(1e-30)
    return (x / scale[:, None]).round().clamp(-127, 127).to(torch.int8).numpy(), scale.numpy().astype(np.float32)


def zstd_bytes(a: np.ndarray, feature_major: bool = False) -> int:
    """zstd:3 bytes of `a` [rows, d] cut into the cache's inner chunks, each row- or feature-major."""
    from numcodecs import Zstd

    rows = chunk_rows(a.shape, a.dtype.itemsize)
    chunks = [a[i : i + rows] for i in range(0, len(a), rows)]
    return sum(len(Zstd(level=3).encode(np.ascontiguousarray(c.T if feature_major else c))) for c in chunks)


def compare(bf16: TeacherCache, f8: TeacherCache, batch: int) -> dict:
    head = bf16.head_weight().float()
    ids = bf16.index["example_id"].to_list()
    cos = {layer: [] for layer in bf16.layers}
    cos_int8 = {layer: [] for layer in bf16.layers}
    size = {"float8": 0, "float8_feature_major": 0, "int8": 0, "int8_feature_major": 0, "bfloat16": 0,
            "bfloat16_feature_major": 0}
    logit = {"cache_max_abs_diff": 0.0, "float8_final_max_abs_err": 0.0, "max_abs_logit": 0.0, "top1_changed": 0,
             "answers": 0}
    for start in range(0, len(ids), batch):
        x, y = bf16.get(ids[start : start + batch]), f8.get(ids[start : start + batch])
        rows = x.hidden_mask
        for layer in bf16.layers:
            a, b = x.hidden[layer][rows].float(), y.hidden[layer][rows].float()
            cos[layer].append(torch.nn.functional.cosine_similarity(a, b, dim=-1))
            q8, s8 = int8_rows(a)
            cos_int8[layer].append(torch.nn.functional.cosine_similarity(
                a, torch.from_numpy(q8).float() * torch.from_numpy(s8)[:, None], dim=-1))
            qf, sf = quantize_e4m3(a)
            bits = x.hidden[layer][rows].view(torch.int16).numpy()
            for name, data, extra in (("float8", qf, sf.nbytes), ("int8", q8, s8.nbytes), ("bfloat16", bits, 0)):
                size[name] += zstd_bytes(data) + extra
                size[f"{name}_feature_major"] += zstd_bytes(data, feature_major=True) + extra
        answers = x.answer_mask
        fx, fy = x.final_hidden[answers].float(), y.final_hidden[answers].float()
        lx, ly = fx @ head.T, fy @ head.T
        qf, sf = quantize_e4m3(fx)
        lq = dequantize_e4m3(qf, sf, torch.float32) @ head.T
        logit["cache_max_abs_diff"] = max(logit["cache_max_abs_diff"], (lx - ly).abs().max().item())
        logit["float8_final_max_abs_err"] = max(logit["float8_final_max_abs_err"], (lx - lq).abs().max().item())
        logit["max_abs_logit"] = max(logit["max_abs_logit"], lx.abs().max().item())
        logit["top1_changed"] += int((lx.argmax(-1) != lq.argmax(-1)).sum())
        logit["answers"] += int(answers.sum())

    def summary(values: list[torch.Tensor]) -> dict:
        v = torch.cat(values).double()
        return {"min": v.min().item(), "q0.001": torch.quantile(v, 0.001).item(), "mean": v.mean().item()}

    logit["float8_final_rel_err"] = logit["float8_final_max_abs_err"] / logit["max_abs_logit"]
    return {"cosine_float8": {str(l): summary(v) for l, v in cos.items()},
            "cosine_int8": {str(l): summary(v) for l, v in cos_int8.items()},
            "hidden_zstd_bytes_same_arrays": size, "exact_logits": logit}


STUDENT = ["--student", "smollm2-135m", "--shrink", "first:2", "--kd-over", "items", "--epochs", "3", "--lr", "1e-3",
           "--max-train", "256", "--max-val", "200", "--no-progress"]


def students(args: argparse.Namespace, caches: dict) -> dict:
    """Distil a student from each cache per seed (reusing finished runs); compare them paired per user."""
    seeds = [int(s) for s in args.student_seeds.split(",") if s.strip()]
    runs: dict[str, dict[int, Path]] = {dtype: {} for dtype in DTYPES}
    for seed in seeds:
        for dtype in DTYPES:
            out = Path(args.work) / "students" / f"{dtype}-s{seed}"
            command = [sys.executable, "-m", "c2kd.cli", "distill", "--cache", caches[dtype]["path"], "--data",
                       args.data, "--out", str(out), "--seed", str(seed), *STUDENT]
            if not (out / "predictions.parquet").is_file():
                proc = subprocess.run(command, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise SystemExit(f"distill from the {dtype} cache, seed {seed}, failed: {proc.stderr.strip()[-2000:]}")
            runs[dtype][seed] = out
    c = paired_comparison(runs["float8"], runs["bfloat16"], "float8", "bfloat16", split="test")
    return {"command": "distill --cache CACHE --data DATA --out OUT --seed SEED " + " ".join(STUDENT), "text": str(c),
            "hr1_float8": c.mean_a, "hr1_bfloat16": c.mean_b, "diff": c.diff, "ci": [c.ci_low, c.ci_high],
            "p_value": c.p_value, "users": c.n_users, "seeds": list(c.seeds),
            "goal_met": c.ci_low <= 0 <= c.ci_high and abs(c.diff) <= 0.005}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--splits", default="train")
    p.add_argument("--max-examples", type=int, default=256)
    p.add_argument("--work", default="/tmp/c2kd-cache-dtype", help="where the caches are written (and reused)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--student-seeds", default="", help="e.g. 0,1: also compare students distilled from both caches")
    p.add_argument("--json", default="benchmarks/results/cache_dtype/result.json")
    args = p.parse_args(argv)
    caches = {dtype: make_cache(dtype, args) for dtype in DTYPES}
    result = {"caches": caches,
              "bytes_per_token_ratio": caches["float8"]["bytes_per_token"] / caches["bfloat16"]["bytes_per_token"],
              "hidden_bytes_ratio": caches["float8"]["hidden_bytes_per_token"] / caches["bfloat16"]["hidden_bytes_per_token"],
              **compare(TeacherCache.open(caches["bfloat16"]["path"]), TeacherCache.open(caches["float8"]["path"]),
                        args.batch)}
    if args.student_seeds:
        result["students"] = students(args, caches)
    path = write_result(args.json, result)
    print(json.dumps(result, indent=1))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
