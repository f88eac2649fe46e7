"""Render benchmark results as markdown: docs/RESULTS.md from benchmarks/results/, and the README's results table.

    python benchmarks/render_results.py                                   # docs/RESULTS.md + README's table
    python benchmarks/render_results.py --results runs/bench --out runs/bench/report.md --no-readme

Every number in the output is read from a result file (each section links its file); the text
around the tables (what a benchmark measures, its command, how to read it) lives here, in
SECTIONS and FILES, and holds no measurements. A result file with no entry in FILES is still
rendered, under its file name, so nothing measured is left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (python benchmarks/render_results.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, ROOT, md_table  # noqa: E402

README_BEGIN = "<!-- results table: written by benchmarks/render_results.py -->"
README_END = "<!-- end of results table -->"

# script folder: (title, what it measures / how it runs / how to read it — no measurements)
SECTIONS: dict[str, tuple[str, str]] = {
    "demo": ("The demo (`c2kd demo`)", """
The whole pipeline on MovieLens-100k on a CPU: prepare, SASRec, a SmolLM2-135M teacher fine-tuned
with SASRec's catalog distribution distilled into it (`--sasrec-kd`), its cache, a student of its
first 2 layers trained alone and a C2KD student (with the own-head term, `--w-own-logit`, its logit
losses over the item tokens), evaluation on the test split, export to ONNX. Each file is one run's
`results.json` (it records the CPU), or a set of such runs over seeds. Test split, 943 users, 20
candidates. The demo trains for a few dozen steps: its students are noisy (one standard error of
an HR@1 on 943 users is about 0.013), so compare the means over seeds, not single runs."""),
    "demo_students": ("Other recipes for the demo's students (`benchmarks/demo_students.py`)", """
Students distilled from the cache of a finished demo run with that run's settings and per-student
overrides (method, weights, epochs, learning rate, another cache). `earlier-recipes.jsonl` holds
one line per student of the earlier 640-example float32 demo; the names' suffixes `_b`, `_c`, `_d`
mark students trained on the caches of repeated demo runs."""),
    "real_llm": ("Real pretrained teachers: SmolLM2-135M and Gemma-3-270M (`benchmarks/real_llm.py`)", """
Per family: the teacher fine-tuned on ML-100k (≤5 train windows per user, `ids`, hybrid item head),
its test metrics, a cache of its train split, and students of its first layers (3 of 30 for
SmolLM2, 2 of 18 for Gemma: about 10× and 9× fewer non-embedding parameters) trained alone and
from the cache with SFT, logit KD, feature KD and C2KD at DESIGN's weights; SASRec over 3 seeds;
batch-1 latency; the goals as measured. One teacher per family (seed 0); the seeds change the
students. Rows give mean ± sample std over seeds, then the per-seed values.

    python benchmarks/real_llm.py --out runs/bench/real_llm --teacher-sasrec-kd 4.0

How to read it:
- "SFT from the cache" and "student alone" are the same training, once from the cache and once
  from `train-teacher`; they agree to the last digit, which checks that the cache feeds the
  student exactly.
- Trained metrics are not bit-equal across CPUs (other kernels, other rounding) and the teacher of
  the float32 runs trained with two threads, which was not bit-reproducible then: differences
  between distilled rows smaller than about 0.02 HR@1 are within noise. Compare means over seeds.
- At DESIGN's KD weights (L_logit at 0.5) every distilled student is underweighted; the raised
  weights are in the student-variant results below.
- The file names say the run: `f32` float32 (`--no-bf16`), `bf16-amx` / `bf16-amd` under bf16
  autocast on a CPU with AMX / an AMD EPYC with AVX512-BF16, `sasrec-kd-teacher` the teacher
  trained with `--sasrec-kd 4.0`, `tier-xeon` / `tier-fast-xeon` the whole tier on an Intel Xeon
  with AMX (the latter with the plain attention on CPU and the frozen head cast once). Each
  `-timings.json` holds the seconds of every step of its run."""),
    "student_variants": ("Student recipe variants, paired by seed (`benchmarks/student_variants.py`)", """
On one of `real_llm.py`'s pairs (its data, teacher and cache), students of a variant recipe per
method and seed, paired with the benchmark's students of the same method and seed. Variants:
`items` / `candidates` (`--kd-over`), `6-epochs`, `own-logit[-W]` (C2KD with `--w-own-logit W`),
`logit-W` (logit KD with `--w-logit W`), `cross-head-4` (the paper's C2KD with its cross-head term
at `--w-logit 4.0`).

    python benchmarks/student_variants.py --variant own-logit-8 --out runs/bench/real_llm_skd \\
        --summary runs/bench/real_llm_skd/summary.json --seeds 0 1 2 --json OUT.json

How to read it: the KD term's weight, not where it is applied, separates the methods. At a
matched weight the paper's C2KD, C2KD with the own-head term and plain logit KD land level on
SmolLM2; on Gemma over three seeds C2KD with the own-head term is ahead of logit KD at the same
weight by a small margin on each seed. C2KD is not shown better than logit KD."""),
    "teacher_search": ("Finding the teacher (`c2kd train-teacher`, validation)", """
Teacher settings searched on validation (SmolLM2-135M, ML-100k): the prompt format (`ids`
against `llara`), the amount of data, the schedule, SASRec's every-position objective
(`--history-loss`) and SASRec's catalog distribution distilled into the teacher (`--sasrec-kd`);
and the chosen `--sasrec-kd 4.0` teacher over three seeds, on test. Each file records its
commands. The hybrid item head (the item's token row plus its projected SASRec embedding) and
full fine-tuning at lr 1e-4 were chosen in an earlier search whose figures were not kept as files."""),
    "distill_quality": ("Stage two: every method and ablation from one cache (`benchmarks/distill_quality.py`)", """
One teacher, one cache, seven ways to train the same student with one budget (SFT, logit KD,
feature KD, C2KD, and C2KD with a fixed layer, without cross-head, with the soft router), three
seeds each, each selected on validation NDCG@10. A small teacher trained from scratch (`tiny-teacher`,
128 wide × 6 layers) and student (`tiny-student`, 64 × 2).

    python benchmarks/distill_quality.py --data DATA --out runs/bench/distill_quality --jobs 2

How to read it: every KD variant beats SFT by a clear margin and the distilled students edge past
this small teacher, which is itself below SASRec; C2KD is not distinguishable from the simpler
baselines (all within one standard deviation). With 6 teacher layers and 4 cached there is little
cross-layer signal for the router.

![test HR@1 and NDCG@10 per method, mean and std over 3 seeds](distill-quality.png)

![a C2KD run (seed 0): loss terms, the teacher layer the router picks per epoch, validation NDCG@10](c2kd-s0-router-and-losses.png)

The second figure is the `distill.png` every `c2kd distill` run writes: after the first epoch the
top-1 router sends (nearly) every example to one teacher layer."""),
    "sasrec_quality": ("SASRec (`benchmarks/sasrec_quality.py`)", """
SASRec over seeds 0–2, selected on validation NDCG@10 only; 20 candidates unless full-catalog.

    python benchmarks/sasrec_quality.py --data DATA --seeds 0 1 2"""),
    "lm_quality": ("Recommender LMs trained from scratch (`benchmarks/lm_quality.py`)", """
The `tiny-teacher` and `tiny-student` presets trained alone (`ids`), beside SASRec; and `llara`
(titles, generation) from scratch, scored by the paper's generation protocol (ValidRatio, HR@1 of
the first line) and by ranking the candidates by log-likelihood. A small LM trained from scratch
mostly generates popular titles that are not among the candidates, so ValidRatio is low.

    OMP_NUM_THREADS=1 python benchmarks/lm_quality.py --jobs 2 --llara"""),
    "stage_one": ("Stage one: the teacher cache (`benchmarks/stage_one.py`)", """
Writer overhead (cache-teacher throughput ÷ the bare teacher forward on the same batches, pairs
alternated in one process), exact-logit error per storage dtype, bytes per token per storage mode,
zstd's gain, and the reader's throughput against a student step; a tiny teacher and a
SmolLM2-135M-shaped one (random weights: sizes and speed do not depend on them).

    python benchmarks/stage_one.py --data DATA --threads 1 --json OUT.json

The writer-overhead target (≥ 0.95) holds for a SmolLM2-sized teacher on the median of pairs and
not for the tiny teacher, whose forward is so cheap that writing its states costs a large share
of a core on a 2-vCPU machine. On a GPU, where the forward leaves the CPU alone, the writer should
be hidden; not measured here."""),
    "vllm_stage_one": ("Stage one on vLLM (`benchmarks/vllm_stage_one.py`)", """
The same teacher caches the same examples with `--backend transformers` and `--backend vllm`
(all positions, bfloat16, top-20 logits) and the arrays are compared: the largest |difference| per
array, and top-k indices that differ. `extract` is vLLM's own hidden-state extraction (compiled
model), `hooks` forward hooks on the eager model. Then examples/s of each, alternating, and the
writer overhead under vLLM. SmolLM2's largest hidden-state differences are one bfloat16 step at
the value where they occur (its residual stream is large). Runs in the vLLM venv:

    $(bash scripts/setup_vllm.sh) benchmarks/vllm_stage_one.py --work runs/bench/vllm --json OUT.json"""),
    "stage_two": ("Stage two: step time and memory (`benchmarks/stage_two.py`)", """
A C2KD step reading the cache ÷ an SFT step (with the paper's vocabulary-wide logit losses, and
with `--kd-over items`), a KD step with the live teacher ÷ the C2KD step from the cache, and each
variant's peak memory growth; one process, variants interleaved in blocks, median step times,
batch 32, one thread. The pairs: a trained tiny teacher → tiny student; a random SmolLM2-shaped
teacher → tiny student; the fine-tuned SmolLM2-135M → its first 3 layers; Gemma-3-270M → its first
2 layers.

    python benchmarks/stage_two.py --data DATA --teacher T --cache C --student smollm2-135m --shrink first:3 --json OUT.json

The goal for a C2KD step was ≤ 1.1× an SFT step: missed with the vocabulary-wide logit losses,
met with `--kd-over items` on the real SmolLM2 pair."""),
    "head_step": ("The LM head only where it is read (`benchmarks/head_step.py`)", """
A student training step with the head at the answer positions only ÷ with the head at every
position (same loss, checked), for the SmolLM2 and Gemma students, alternating in one process."""),
    "bf16_step": ("bf16 autocast ÷ float32, one training step (`benchmarks/bf16_step.py`)", """
Per family, the teacher and the student of `real_llm.py`: one AdamW step with and without
`torch.autocast("cpu", bfloat16)`, one process, one thread, alternating in blocks; the losses at
the starting weights differ only by bf16 rounding. `amx`: a CPU with AMX; `amd`: an AMD EPYC with
AVX512-BF16."""),
    "cpu_step": ("CPU step: the plain attention and the head cast once (`benchmarks/cpu_step.py`)", """
Per family, the teacher (two threads) and the student (one thread) under bf16 autocast: one AdamW
step in four variants — the fused SDPA or the plain attention (what training on CPU uses), the
frozen head cast at every call or once — alternating in blocks; ratios are to the fused attention
with the head cast every call. Two runs (3 and 6 steps per block) on an Intel Xeon with AMX: where
they disagree, the machine's noise is as large as the effect."""),
    "item_mass": ("A teacher's answer mass on the item tokens (`benchmarks/item_mass.py`)", """
The share of the teacher's softmax (rebuilt from an exact `ids` cache) on the catalog's item
tokens at every answer that is an item: what `--kd-over items` keeps."""),
    "prompt_copy": ("Does an `ids` model copy its full-catalog top 10 from the prompt? (`benchmarks/prompt_copy.py`)", """
The share of a model's full-catalog top 10 (history excluded) that are candidates listed in its
prompt, against chance (20 of the catalog): the full-catalog column of an `ids` model is
comparable with SASRec's only while that share stays near chance."""),
    "remote_read": ("Training from a cache behind HTTP (`benchmarks/remote_read.py`)", """
A tiny-teacher cache served from 127.0.0.1 by Python's `http.server` (no Range) and with Range
support; bytes sent to `cache info`, `cache verify` and a 2-epoch `distill` through the local read
cache, as a ratio to the cache's size. Goal: the distill fetches ≤ 1.05× the cache."""),
    "deployment": ("Deployment: the exported student (`benchmarks/deployment.py`)", """
`c2kd export` (ONNX fp32 and int8, ExecuTorch): parity with PyTorch on the whole test split (max
|score difference|, HR@1, NDCG@10), batch-1 latency (p50, p95; one thread; requests interleaved
between the variants; a request ranks one user's 20 candidates), size on disk and the peak
resident memory of a fresh process per variant. ExecuTorch is measured through its Python
bindings, which import torch: its memory includes torch's.

    python benchmarks/deployment.py --data DATA --teacher TEACHER --student STUDENT --sasrec SASREC --out DIR"""),
    "gpu_stage_one": ("Stage one on a GPU (`benchmarks/gpu_stage_one.py`)", """
A random Llama-3-8B-shaped teacher: cache-teacher examples/s and the writer overhead on a GPU."""),
}
ORDER = ["demo", "real_llm", "student_variants", "teacher_search", "demo_students", "distill_quality", "sasrec_quality",
         "lm_quality", "stage_one", "vllm_stage_one", "stage_two", "head_step", "bf16_step", "cpu_step", "item_mass",
         "prompt_copy", "remote_read", "deployment", "gpu_stage_one"]

# file (relative to the results folder): its title — what run it is, no measurements
FILES: dict[str, str] = {
    "demo/default.json": "The demo as it ships (AMD EPYC without native bf16, so float32)",
    "c2kd_parts/demo.json": "C2KD's parts, searches and terms on the SmolLM2 demo's pair (`benchmarks/c2kd_parts.py`)",
    "c2kd_parts/demo-feature-kd.json": "Feature KD at its validation-tuned weight against the default C2KD on the demo's SmolLM2 pair (`benchmarks/c2kd_parts.py --layers 15,26,27,28,29 --router-layers 26,27,28,29 --rows feature-kd-tuned,c2kd-default`)",
    "c2kd_parts/gemma.json": "The Gemma-3 demo's pair: the shipped recipes, each method searched on validation, the routers (`benchmarks/c2kd_parts.py --steps tune,test,routers`)",
    "c2kd_parts/first3.json": "SmolLM2-135M → first 3 layers on the demo's teacher and cache: C2KD and logit KD searched on validation, the default C2KD, tuned logit KD and the student alone over 5 seeds (`benchmarks/c2kd_parts.py --shrink first:3 --steps tune,test`)",
    "c2kd_parts/first3-feature-kd.json": "Feature KD at its validation-tuned weight against the default C2KD, SmolLM2 → first 3 layers (`benchmarks/c2kd_parts.py --shrink first:3 --layers 10,20,26,27,28,29 --router-layers 26,27,28,29 --rows feature-kd-tuned,c2kd-default`)",
    "c2kd_parts/gemma-feature-kd.json": "Feature KD at its validation-tuned weight against the default C2KD on the Gemma-3 demo's pair (`benchmarks/c2kd_parts.py --layers 9,14,15,16,17 --router-layers 14,15,16,17 --rows feature-kd-tuned,c2kd-default`)",
    "demo/gemma.json": "The demo with the Gemma-3-270M pair (`c2kd demo --family gemma3-270m`, AMD EPYC, float32)",
    "demo/seeds-bf16-amd.json": "The demo's recipe before `--sasrec-kd`, five seeds, with more student recipes per seed (AMD EPYC)",
    "demo/teacher-sasrec-kd-seeds.json": "The demo's teacher with and without `--sasrec-kd 4.0`, seeds 0–2 (AMD EPYC)",
    "demo/vocab-amd.json": "The demo with the C2KD student's logit losses over the vocabulary (AMD EPYC)",
    "demo/items-first-run.json": "First run of the demo with the C2KD student's logit losses over the item tokens",
    "demo/no-bf16-amd.json": "The demo in float32 (`--no-bf16`, AMD EPYC)",
    "demo/640-examples-bf16-amd.json": "An earlier recipe: 640 examples, bf16 (AMD EPYC)",
    "demo/640-examples-f32-amd.json": "An earlier recipe: 640 examples, float32, the paper's C2KD (AMD EPYC)",
    "demo_students/c2kd-kd-over-items.json": "The demo's C2KD student over the vocabulary and over the item tokens, seeds 0–2",
    "demo_students/earlier-recipes.jsonl": "Student recipes on the earlier 640-example demo's caches",
    "real_llm/tier-fast-xeon.json": "The whole tier, `--sasrec-kd 4.0` teachers, logit losses over the items, one run (Intel Xeon with AMX)",
    "real_llm/tier-fast-xeon-gemma-3-seeds.json": "The same folder with Gemma's students over three seeds",
    "real_llm/tier-xeon.json": "The tier before the plain attention on CPU (Intel Xeon with AMX; both families)",
    "real_llm/tier-xeon-smollm2.json": "Its SmolLM2 part",
    "real_llm/gemma-items-amd.json": "Gemma, `--sasrec-kd 4.0` teacher, logit losses over the items (AMD EPYC)",
    "real_llm/sasrec-kd-teacher-amd.json": "`--sasrec-kd 4.0` teachers, logit losses over the vocabulary (AMD EPYC)",
    "real_llm/bf16-amd-smollm2.json": "SmolLM2 under bf16 on an AMD EPYC",
    "real_llm/bf16-amx.json": "Both families under bf16 on a CPU with AMX",
    "real_llm/f32.json": "Float32, the first recorded run (SmolLM2 3 seeds; Gemma with a 1-epoch teacher)",
    "real_llm/f32-gemma-teacher-3-epochs.json": "Float32, Gemma with a 3-epoch teacher",
    "real_llm/f32-timed-smollm2.json": "Float32, SmolLM2, a timed rerun from an empty folder",
    "real_llm/f32-timed-gemma.json": "Float32, Gemma, a timed rerun from an empty folder",
    "real_llm/c2kd-ablations.json": "What C2KD's parts do on the SmolLM2 pair (no cross-head; no feature loss), seeds 0–1",
    "real_llm/first2-6-epochs.json": "A smaller SmolLM2 student (first 2 layers), 6 epochs, seed 0",
    "student_variants/gemma-3-seeds-own-logit-8.json": "Gemma, C2KD + own head `--w-own-logit 8.0`, three seeds (the tier-fast-xeon teacher)",
    "student_variants/gemma-3-seeds-logit-8.json": "Gemma, logit KD `--w-logit 8.0`, three seeds (the same teacher)",
    "student_variants/sasrec-kd-teacher-own-logit-8.json": "SmolLM2 `--sasrec-kd` teacher: C2KD + own head `--w-own-logit 8.0`",
    "student_variants/sasrec-kd-teacher-logit-8.json": "SmolLM2 `--sasrec-kd` teacher: logit KD `--w-logit 8.0`",
    "student_variants/sasrec-kd-teacher-logit-4.json": "SmolLM2 `--sasrec-kd` teacher: logit KD `--w-logit 4.0`",
    "student_variants/sasrec-kd-teacher-cross-head-4.json": "SmolLM2 `--sasrec-kd` teacher: the paper's C2KD at `--w-logit 4.0`",
    "student_variants/sasrec-kd-teacher-gemma-own-logit-8.json": "Gemma `--sasrec-kd` teacher (vocabulary): C2KD + own head `--w-own-logit 8.0`, seed 0",
    "student_variants/sasrec-kd-teacher-gemma-logit-8.json": "Gemma `--sasrec-kd` teacher (vocabulary): logit KD `--w-logit 8.0`, seed 0",
    "student_variants/gemma-items-own-logit-8.json": "Gemma `--sasrec-kd` teacher (items): C2KD + own head `--w-own-logit 8.0`, seed 0",
    "student_variants/gemma-items-logit-8.json": "Gemma `--sasrec-kd` teacher (items): logit KD `--w-logit 8.0`, seed 0",
    "student_variants/own-logit-0.5-bf16-amd.json": "SmolLM2 (bf16, AMD EPYC): C2KD + own head, W = 0.5",
    "student_variants/own-logit-1-bf16-amd.json": "SmolLM2 (bf16, AMD EPYC): C2KD + own head, W = 1",
    "student_variants/own-logit-2-bf16-amd.json": "SmolLM2 (bf16, AMD EPYC): C2KD + own head, W = 2",
    "student_variants/own-logit-4-bf16-amd.json": "SmolLM2 (bf16, AMD EPYC): C2KD + own head, W = 4",
    "student_variants/own-logit-8-bf16-amd.json": "SmolLM2 (bf16, AMD EPYC): C2KD + own head, W = 8",
    "student_variants/logit-4-bf16-amd.json": "SmolLM2 (bf16, AMD EPYC): logit KD `--w-logit 4.0`",
    "student_variants/cross-head-4-bf16-amd.json": "SmolLM2 (bf16, AMD EPYC): the paper's C2KD at `--w-logit 4.0`",
    "student_variants/items-f32.json": "SmolLM2 (float32): `--kd-over items` against the vocabulary",
    "student_variants/candidates-f32-seed0.json": "SmolLM2 (float32): `--kd-over candidates`, seed 0",
    "student_variants/6-epochs-f32.json": "SmolLM2 (float32): 6 student epochs instead of 3",
    "teacher_search/ids-vs-llara.json": "`ids` against `llara` with a pretrained teacher",
    "teacher_search/10-windows.json": "Twice the train windows per user",
    "teacher_search/1-epoch.json": "A 1-epoch schedule instead of 2",
    "teacher_search/history-loss.json": "SASRec's every-position objective for the teacher (`--history-loss`)",
    "teacher_search/sasrec-kd.json": "SASRec's catalog distribution distilled into the teacher (`--sasrec-kd W`)",
    "teacher_search/sasrec-kd-teacher-seeds.json": "The `--sasrec-kd 4.0` teacher over three seeds, test",
    "stage_two/smollm2-first3-items.json": "Fine-tuned SmolLM2-135M → its first 3 layers, with the items variant",
    "stage_two/smollm2-first3.json": "Fine-tuned SmolLM2-135M → its first 3 layers",
    "stage_two/gemma-first2-items.json": "Gemma-3-270M → its first 2 layers",
    "stage_two/smollm2-shape.json": "A random SmolLM2-shaped teacher → tiny student",
    "stage_two/tiny.json": "Tiny teacher → tiny student",
    "deployment/smollm2.json": "SmolLM2-135M teacher and its first-3-layer C2KD student",
    "deployment/tiny.json": "Tiny teacher and tiny student",
}


# ------------------------------------------------------------------------------ formatting


def num(x: Any) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        a = abs(x)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{x:,.0f}"
        if a >= 100:
            return f"{x:.1f}"
        if a >= 1:
            return f"{x:.2f}"
        if a >= 0.001:
            return f"{x:.3f}"
        return f"{x:.2g}"
    if x is None:
        return "–"
    return str(x).replace("|", "\\|").replace("\n", " ")


def is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def cell(x: Any) -> str:
    """A scalar, or a list of per-seed values as 'mean ± std (a / b / c)'."""
    if isinstance(x, list) and x and all(is_num(v) for v in x):
        if len(x) == 1:
            return num(float(x[0]))
        values = [float(v) for v in x]
        text = f"{num(statistics.mean(values))} ± {num(statistics.stdev(values))}"
        return text + (" (" + " / ".join(num(v) for v in values) + ")" if len(values) <= 5 else "")
    if isinstance(x, list):
        return ", ".join(num(v) for v in x)
    return num(x)


def leaves(d: Any, prefix: str = "") -> dict[str, Any] | None:
    """A dict flattened to 'a/b' -> scalar or list of scalars; None when it holds anything deeper."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            sub = leaves(v, key + "/")
            if sub is None:
                return None
            out.update(sub)
        elif isinstance(v, list) and any(isinstance(e, (dict, list)) for e in v):
            return None
        else:
            out[key] = v
    return out


TEXT_KEYS = ("what", "setup", "note", "run")
COMMAND_KEYS = ("command", "commands")
MAX_COLUMNS = 12


def table(d: dict) -> list[str] | None:
    """Rows = keys of d, columns = the leaves of its values; None when d does not fit a table."""
    if not d or not all(isinstance(v, dict) for v in d.values()):
        return None
    flat = {k: leaves(v) for k, v in d.items()}
    if any(f is None or not f for f in flat.values()):
        return None
    columns: list[str] = []
    for f in flat.values():
        columns += [c for c in f if c not in columns]
    if len(columns) > MAX_COLUMNS:
        return None
    return md_table(["", *columns], ([num(k), *(cell(f.get(c)) for c in columns)]
                                      for k, f in flat.items()))


def render_value(key: str, value: Any, depth: int) -> list[str]:
    if key in COMMAND_KEYS:
        commands = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else [value]
        names = list(value) if isinstance(value, dict) else [None] * len(commands)
        body = [f"{n}: {' '.join(c) if isinstance(c, list) else c}" if n else (' '.join(c) if isinstance(c, list) else str(c))
                for n, c in zip(names, commands)]
        return ["<details><summary>commands</summary>", "", "```", *body, "```", "", "</details>", ""]
    if isinstance(value, str):
        return [f"*{key}*: {value}", ""] if key in TEXT_KEYS or len(value) > 60 else [f"- {key}: {num(value)}", ""]
    if isinstance(value, dict):
        t = table(value)
        if t is not None:
            return [f"*{key}*", "", *t, ""]
        flat = leaves(value)
        if flat is not None and len(flat) <= 40:
            return [f"*{key}*", "", *md_table(["", "value"], ([k, cell(v)] for k, v in flat.items())), ""]
        if depth >= 3:
            return [f"*{key}*", "", "```json", json.dumps(value, indent=1)[:3000], "```", ""]
        lines = [f"*{key}*", ""]
        for k, v in value.items():
            lines += render_value(k, v, depth + 1)
        return lines
    if isinstance(value, list) and value and all(isinstance(e, dict) for e in value):
        t = table({str(i): e for i, e in enumerate(value)})
        return [f"*{key}*", "", *(t or ["```json", json.dumps(value, indent=1)[:3000], "```"]), ""]
    return [f"- {key}: {cell(value)}", ""]


def render_payload(d: dict) -> list[str]:
    lines: list[str] = []
    scalars = [(k, v) for k, v in d.items() if k != "provenance" and not isinstance(v, (dict, list))
               and not (isinstance(v, str) and (k in TEXT_KEYS or len(v) > 60))]
    for k, v in d.items():
        if k == "provenance" or (k, v) in scalars:
            continue
        lines += render_value(k, v, 0)
    if scalars:
        lines += md_table(["", "value"], ([k, cell(v)] for k, v in scalars)) + [""]
    return lines


def provenance_line(d: dict) -> str:
    p = d.get("provenance") or {}
    m = p.get("machine")
    if isinstance(m, dict):
        m = f"{m.get('cpu')}, {m.get('cores')} cores" + (f", GPU {m['gpu']}" if m.get("gpu") else "")
    commit = (p.get("commit") or "")[:10]
    parts = [f"commit `{commit}`" if commit else "", p.get("date", ""), m or ""]
    return "Provenance: " + "; ".join(x for x in parts if x) + "." if any(parts) else ""


def render_file(path: Path, results: Path, link_base: str) -> list[str]:
    rel = path.relative_to(results).as_posix()
    title = FILES.get(rel, rel)
    link = f"[`{rel}`]({link_base}{rel})"
    lines = [f"### {title}", "", link + ".", ""]
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        keep = [k for k in ("name", "overrides", "epochs", "lr", "val_HR@1", "test_HR@1", "test_NDCG@10", "wall_s")]
        return lines + md_table(keep, ([cell(r.get(k)) if k != "overrides" else num(json.dumps(r.get(k))) for k in keep]
                                       for r in rows)) + [""]
    d = json.loads(path.read_text())
    prov = provenance_line(d)
    return lines + ([prov, ""] if prov else []) + render_payload(d)


def render(results: Path, link_base: str) -> str:
    folders = sorted({p.parent.name for p in results.glob("*/*.json*") if p.parent.parent == results},
                     key=lambda f: (ORDER.index(f) if f in ORDER else len(ORDER), f))  # the rest by name: the same file every run
    lines = ["# Results", "",
             "Generated by `python benchmarks/render_results.py` from the files in "
             f"[`benchmarks/results/`]({link_base}): do not edit by hand. Every table is read from the file its "
             "section links; each file records the command that made it, the machine and the commit "
             "(`provenance`). Results from before provenance was recorded name the commit that added the file.",
             "", "Test split of MovieLens-100k (943 users, 20 candidates) unless a section says otherwise. "
             "Metrics: HR@k, NDCG@k and MRR over the 20 candidates with pessimistic ties; full-catalog NDCG@10 "
             "over every item except the user's history. ± is the sample standard deviation over seeds.", "",
             "## Contents", ""]
    lines += [f"- [{SECTIONS.get(f, (f, ''))[0]}](#{anchor(SECTIONS.get(f, (f, ''))[0])})" for f in folders] + [""]
    for folder in folders:
        title, text = SECTIONS.get(folder, (folder, ""))
        lines += [f"## {title}", "", text.strip(), ""]
        files = sorted((results / folder).glob("*.json*"), key=lambda p: list(FILES).index(p.relative_to(results).as_posix())
                       if p.relative_to(results).as_posix() in FILES else len(FILES))
        for path in files:
            if path.name.endswith(".provenance.json"):
                continue
            lines += render_file(path, results, link_base)
    return "\n".join(lines).rstrip() + "\n"


def anchor(title: str) -> str:
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return keep.replace(" ", "-")


# ------------------------------------------------------------------------------ the README's table


def _load(results: Path, rel: str) -> dict:
    return json.loads((results / rel).read_text())


def _hr(rows: dict, name: str) -> list[float]:
    return rows[name]["candidates/HR@1"]


def _paired(c: dict, p: bool = False) -> str:
    """A per-user paired comparison as "+d (95 % CI lo … hi[, p = x])"."""
    return (f"{c['diff']:+.4f} (95 % CI {c['ci_low']:+.4f} … {c['ci_high']:+.4f}"
            + (f", p = {c['p_value']:.2g})" if p else ")"))


def _on_splits(test: dict, validation: dict) -> str:
    """A comparison on test (with its p) and on validation: "+d on test (…), +d on validation (…)"."""
    t, v = _paired(test, p=True), _paired(validation)
    return f"{t.replace(' (', ' on test (', 1)}, {v.replace(' (', ' on validation (', 1)}"


def _chose_the_default(parts: dict) -> bool:
    """Whether C2KD's search in a c2kd_parts result chose the shipped default recipe (its weights to 2 digits)."""
    picked, default = parts["tune"]["c2kd"]["chosen"]["params"], parts["seeds"]["c2kd-default"]["recipe"]
    same = lambda a, b: f"{a:.2g}" == f"{b:.2g}" if isinstance(a, float) else a == b  # noqa: E731
    return all(same(v, default[k]) for k, v in picked.items())


def _routers_row(r: dict, what: str, file_link: str) -> list[str]:
    """A README row from a c2kd_parts result's routers step: each router's validation HR@1, the examples it
    sent to each layer in the last epoch, and its per-user difference from the default's router."""
    default = next(k for k, v in r.items() if "vs_default" not in v)

    def r_cell(name: str) -> str:
        counts = r[name]["diagnostics"]["epochs"][-1].get("router_counts", {})
        used = "/".join(str(counts[k]) for k in sorted(counts, key=int)) if counts else ""
        text = f"`{name}` {num(r[name]['validation']['HR@1'])}" + (f" (last epoch {used})" if used else "")
        return text + (f", {_paired(r[name]['vs_default'])}" if "vs_default" in r[name] else "")

    layers = sorted(next(iter(r.values()))["diagnostics"]["epochs"][-1]["router_counts"], key=int)
    return [f"Does the router's choice matter? {what} with each router, seed 0, validation "
            f"HR@1 (examples per layer {', '.join(layers)}; − the default `{default}`, per user)",
            "; ".join(r_cell(name) for name in r), file_link]


def readme_rows(results: Path) -> list[list[str]]:
    """The README's one results table: the best figures, each linked to its file."""
    def link(rel: str, text: str) -> str:
        return f"[{text}](benchmarks/results/{rel})"

    rows: list[list[str]] = []
    demo = _load(results, "demo/default.json")["results"]
    rows.append(["`c2kd demo` (SmolLM2-135M → first 2 layers, one CPU run)",
                 f"teacher {num(demo['teacher']['HR@1'])}, student alone {num(demo['student alone (SFT)']['HR@1'])}, "
                 f"**C2KD student {num(demo['C2KD student']['HR@1'])}**; SASRec {num(demo['SASRec']['HR@1'])}",
                 link("demo/default.json", "demo/default.json")])
    if (results / "demo/gemma.json").exists():
        gemma = _load(results, "demo/gemma.json")["results"]
        rows.append(["`c2kd demo --family gemma3-270m` (Gemma-3-270M → first 2 layers, one CPU run)",
                     f"teacher {num(gemma['teacher']['HR@1'])}, student alone {num(gemma['student alone (SFT)']['HR@1'])}, "
                     f"**C2KD student {num(gemma['C2KD student']['HR@1'])}**; SASRec {num(gemma['SASRec']['HR@1'])}",
                     link("demo/gemma.json", "demo/gemma.json")])
    skd = _load(results, "real_llm/sasrec-kd-teacher-amd.json")
    s_rows = skd["families"]["smollm2"]["rows"]
    own = _load(results, "student_variants/sasrec-kd-teacher-own-logit-8.json")["rows"]
    logit = _load(results, "student_variants/sasrec-kd-teacher-logit-8.json")["rows"]
    rows.append(["SmolLM2-135M → first 3 layers (10× fewer non-embedding parameters), best recipe, 3 seeds",
                 f"teacher {cell(_hr(s_rows, 'teacher'))}, SFT {cell(_hr(s_rows, 'SFT from cache'))}, "
                 f"**C2KD + own head (W = 8) {cell(_hr(own, 'C2KD'))}**, logit KD (W = 8) {cell(_hr(logit, 'logit KD'))}; "
                 f"SASRec {cell(skd['sasrec']['candidates/HR@1'])}",
                 ", ".join((link("real_llm/sasrec-kd-teacher-amd.json", "teacher, SFT"),
                            link("student_variants/sasrec-kd-teacher-own-logit-8.json", "C2KD"),
                            link("student_variants/sasrec-kd-teacher-logit-8.json", "logit KD")))])
    g3 = _load(results, "real_llm/tier-fast-xeon-gemma-3-seeds.json")
    g_rows = g3["families"]["gemma"]["rows"]
    g_own = _load(results, "student_variants/gemma-3-seeds-own-logit-8.json")["rows"]
    g_logit = _load(results, "student_variants/gemma-3-seeds-logit-8.json")["rows"]
    rows.append(["Gemma-3-270M → first 2 layers (9× fewer), best recipe, 3 seeds",
                 f"teacher {cell(_hr(g_rows, 'teacher'))}, SFT {cell(_hr(g_rows, 'SFT from cache'))}, "
                 f"**C2KD + own head (W = 8) {cell(_hr(g_own, 'C2KD'))}**, logit KD (W = 8) {cell(_hr(g_logit, 'logit KD'))}",
                 ", ".join((link("real_llm/tier-fast-xeon-gemma-3-seeds.json", "teacher, SFT"),
                            link("student_variants/gemma-3-seeds-own-logit-8.json", "C2KD"),
                            link("student_variants/gemma-3-seeds-logit-8.json", "logit KD")))])
    tier = g3["families"]
    rows.append(["The paper's C2KD at DESIGN's weights against logit KD (tier run, 3 seeds each)",
                 f"SmolLM2: C2KD {cell(_hr(tier['smollm2']['rows'], 'C2KD'))}, logit KD {cell(_hr(tier['smollm2']['rows'], 'logit KD'))}; "
                 f"Gemma: C2KD {cell(_hr(tier['gemma']['rows'], 'C2KD'))}, logit KD {cell(_hr(tier['gemma']['rows'], 'logit KD'))}",
                 link("real_llm/tier-fast-xeon-gemma-3-seeds.json", "real_llm/tier-fast-xeon-gemma-3-seeds.json")])
    parts = _load(results, "c2kd_parts/demo.json")
    if parts.get("comparisons"):
        seeds = {name: list(row["test_HR@1"].values()) for name, row in parts["seeds"].items()}
        vs = parts["comparisons"]["c2kd-tuned vs logit-kd-tuned"]
        rows.append(["The demo's pair, each method's recipe chosen on validation (`c2kd tune`, 12 trials each), "
                     f"{len(seeds['c2kd-tuned'])} seeds",
                     f"**C2KD (the default recipe) {cell(seeds['c2kd-tuned'])}**, logit KD (tuned) "
                     f"{cell(seeds['logit-kd-tuned'])}, student alone {cell(seeds['sft'])}, C2KD at the paper's weights "
                     f"{cell(seeds['c2kd-paper'])}; C2KD − logit KD per user {vs['diff']:+.4f} "
                     f"(95 % CI {vs['ci_low']:+.4f} … {vs['ci_high']:+.4f}, McNemar p = {vs['p_value']:.2g})",
                     link("c2kd_parts/demo.json", "c2kd_parts/demo.json")])
    if "c2kd-default vs own-head-only" in parts.get("comparisons", {}):
        cmp = parts["comparisons"]

        def vs_line(key: str, text: str) -> str:
            c = cmp[key]
            return f"{text} {_paired(c, p=True)[:-1]}, {len(c['seeds'])} seeds)"

        rows.append(["Which of the default C2KD recipe's terms carry its gain (the demo's pair; each term taken out, "
                     "per user against the default on test)",
                     f"the default (rounded weights) {cell(seeds['c2kd-default'])}; own-head term only (= logit KD at w 8) "
                     f"{cell(seeds['own-head-only'])}, no feature term {cell(seeds['no-feature-term'])}, no cross-head term "
                     f"{cell(seeds['no-cross-head-term'])}; "
                     + "; ".join((vs_line("c2kd-default vs own-head-only", "default − own head only"),
                                  vs_line("c2kd-default vs no-feature-term", "default − no feature term"),
                                  vs_line("c2kd-default vs no-cross-head-term", "default − no cross-head term"),
                                  vs_line("c2kd-default vs logit-kd-tuned", "default − tuned logit KD"))),
                     link("c2kd_parts/demo.json", "c2kd_parts/demo.json")])
    if (results / "c2kd_parts/gemma.json").exists():
        g = _load(results, "c2kd_parts/gemma.json")
        if "c2kd-default vs own-head-only" in g.get("comparisons", {}):
            gs = {name: list(row["test_HR@1"].values()) for name, row in g["seeds"].items()}

            def g_line(key: str, text: str) -> str:
                return f"{text} {_on_splits(g['comparisons'][key], g['comparisons_validation'][key])}"

            rows.append(["The Gemma-3 demo's pair, the shipped defaults (chosen on the SmolLM2 pair's validation), "
                         f"{len(gs['c2kd-default'])} seeds, per user",
                         f"**C2KD (the default recipe) {cell(gs['c2kd-default'])}**, logit KD (w 8) "
                         f"{cell(gs['own-head-only'])}, student alone {cell(gs['sft'])}; "
                         + "; ".join((g_line("c2kd-default vs own-head-only", "C2KD − logit KD"),
                                      g_line("c2kd-default vs sft", "C2KD − alone"))),
                         link("c2kd_parts/gemma.json", "c2kd_parts/gemma.json")])
        if "c2kd-default vs logit-kd-tuned" in g.get("comparisons", {}):
            trials = len(g["tune"]["logit-kd"]["trials"])
            w = g["tune"]["logit-kd"]["chosen"]["params"]["w_logit"]
            note = "; C2KD's search chose the default recipe" if _chose_the_default(g) else ""
            rows.append([f"The Gemma-3 demo's pair, each method's recipe chosen on its validation (`c2kd tune`, {trials} trials "
                         f"each{note}), "
                         f"{len(gs['logit-kd-tuned'])} seeds, per user",
                         f"**C2KD (the default recipe) {cell(gs['c2kd-default'])}**, logit KD (tuned: w {w:.2g}) "
                         f"{cell(gs['logit-kd-tuned'])}, logit KD (w 8) {cell(gs['own-head-only'])}; "
                         + "; ".join((g_line("c2kd-default vs logit-kd-tuned", "C2KD − tuned logit KD"),
                                      g_line("own-head-only vs logit-kd-tuned", f"logit KD w 8 − w {w:.2g}"))),
                         link("c2kd_parts/gemma.json", "c2kd_parts/gemma.json")])
        if len(g.get("routers", {})) > 1:
            rows.append(_routers_row(g["routers"], "The Gemma pair's default",
                                     link("c2kd_parts/gemma.json", "c2kd_parts/gemma.json")))
    if (results / "c2kd_parts/first3.json").exists():
        t = _load(results, "c2kd_parts/first3.json")
        if "c2kd-default vs logit-kd-tuned" in t.get("comparisons", {}):
            ts = {name: list(row["test_HR@1"].values()) for name, row in t["seeds"].items()}
            teacher = t["teacher_test_HR@1"]
            c2kd, alone = statistics.mean(ts["c2kd-default"]), statistics.mean(ts["sft"])
            note = "; C2KD's search chose the default recipe" if _chose_the_default(t) else ""

            def t_line(key: str, text: str) -> str:
                return f"{text} {_on_splits(t['comparisons'][key], t['comparisons_validation'][key])}"

            rows.append([f"SmolLM2-135M → first 3 layers, the demo's teacher and 512 cached examples, each method's recipe "
                         f"chosen on validation (`c2kd tune`, {len(t['tune']['logit-kd']['trials'])} trials each{note}), "
                         f"{len(ts['c2kd-default'])} seeds, per user",
                         f"**C2KD (the default recipe) {cell(ts['c2kd-default'])}**, logit KD (tuned: w "
                         f"{t['tune']['logit-kd']['chosen']['params']['w_logit']:.2g}) {cell(ts['logit-kd-tuned'])}, "
                         + (f"logit KD (w 8) {cell(ts['own-head-only'])}, " if "own-head-only" in ts else "")
                         + (f"C2KD (its search's choice: `{t['tune']['c2kd']['chosen']['params']['router']}` router, "
                            f"{t['tune']['c2kd']['chosen']['params']['student_layer']} layer) {cell(ts['c2kd-tuned'])}, "
                            if "c2kd-tuned" in ts else "")
                         + (f"C2KD at the paper's weights {cell(ts['c2kd-paper'])}, " if "c2kd-paper" in ts else "")
                         + f"student alone {cell(ts['sft'])}; teacher {num(teacher)}: the default C2KD reaches "
                         f"{c2kd / teacher:.0%} of it and {(c2kd - alone) / (teacher - alone):.0%} of the teacher − alone gap; "
                         + "; ".join((t_line("c2kd-default vs logit-kd-tuned", "C2KD − tuned logit KD"),
                                      *((t_line("c2kd-default vs c2kd-tuned", "default − search's choice"),)
                                        if "c2kd-tuned" in ts else ()),
                                      *((t_line("c2kd-default vs own-head-only", "C2KD − logit KD w 8"),
                                         t_line("own-head-only vs logit-kd-tuned", "logit KD w 8 − tuned"))
                                        if "own-head-only" in ts else ()),
                                      *((t_line("c2kd-default vs c2kd-paper", "default − paper's weights"),)
                                        if "c2kd-default vs c2kd-paper" in t["comparisons"] else ()),
                                      t_line("c2kd-default vs sft", "C2KD − alone"))),
                         link("c2kd_parts/first3.json", "c2kd_parts/first3.json")])
        if len(t.get("routers", {})) > 1:
            rows.append(_routers_row(t["routers"], "SmolLM2 → first 3 layers, the default",
                                     link("c2kd_parts/first3.json", "c2kd_parts/first3.json")))
    for rel, pair, layers in (("c2kd_parts/demo-feature-kd.json", "the demo's SmolLM2 pair", ("layer 15", "26–29")),
                              ("c2kd_parts/first3-feature-kd.json", "SmolLM2 → first 3 layers", ("layers 10 and 20", "26–29")),
                              ("c2kd_parts/gemma-feature-kd.json", "the Gemma-3 demo's pair", ("layer 9", "14–17"))):
        if not (results / rel).exists():
            continue
        f = _load(results, rel)
        if "c2kd-default vs feature-kd-tuned" in f.get("comparisons", {}):
            fs = {name: list(row["test_HR@1"].values()) for name, row in f["seeds"].items()}
            tuned = f["tune"]["feature-kd"]
            key, paper = "c2kd-default vs feature-kd-tuned", "c2kd-default vs c2kd-paper"
            rows.append([f"Feature KD (SLMRec's uniform layer map) on {pair}, its weight chosen on "
                         f"validation (`c2kd tune`, {len(tuned['trials'])} trials; a cache with teacher {layers[0]} too), "
                         f"{len(fs['feature-kd-tuned'])} seeds, per user",
                         f"feature KD (w_feat {tuned['chosen']['params']['w_feat']:.2g}) {cell(fs['feature-kd-tuned'])}, "
                         f"**C2KD (the default recipe, its router on layers {layers[1]}) {cell(fs['c2kd-default'])}**"
                         + (f", C2KD at the paper's weights {cell(fs['c2kd-paper'])}" if "c2kd-paper" in fs else "")
                         + f"; C2KD − feature KD {_on_splits(f['comparisons'][key], f['comparisons_validation'][key])}"
                         + (f"; default − paper's weights {_on_splits(f['comparisons'][paper], f['comparisons_validation'][paper])}"
                            if paper in f["comparisons"] else ""),
                         link(rel, rel)])
    dtype = _load(results, "cache_dtype/result.json")
    scale = _load(results, "cache_scale/tiny.json")
    summary = scale["summary"]
    rows.append(["Caches at scale: bytes per token; 1× → 20× the data (94,300 examples, tiny teacher)",
                 f"float8 ÷ bfloat16 bytes/token {num(dtype['bytes_per_token_ratio'])} (SmolLM2-135M); stage two at 20× ÷ 1×: "
                 f"examples/s over the run {num(summary['20x']['stage2_wall_examples_per_s_vs_1x'])} with the shard-aware "
                 f"order ({num(summary['20x-full-shuffle']['stage2_wall_examples_per_s_vs_1x'])} with a full shuffle), peak RSS "
                 f"{num(summary['20x']['peak_rss_mib_vs_1x'])}; stage one {num(scale['stage_one']['1x']['examples_per_s'])} → "
                 f"{num(scale['stage_one']['20x']['examples_per_s'])} examples/s; two torchrun nodes + `cache merge` = "
                 "the one-process cache, shard by shard (tested)",
                 ", ".join((link("cache_dtype/result.json", "cache_dtype"), link("cache_scale/tiny.json", "cache_scale")))])
    if (results / "cache_scale/smollm2-width.json").exists():
        wide = _load(results, "cache_scale/smollm2-width.json")
        if "reader" in wide:  # the whole run measured
            top = max(wide["stage_one"], key=lambda k: int(k.removesuffix("x")))
            s, r, one = wide["summary"][top], wide["reader"][top], wide["stage_one"]
            student = wide.get("student", "tiny-student")
            if student.startswith("teacher:first:"):
                student = f"the teacher's first {student.rsplit(':', 1)[1]} layers"
            times = top.replace("x", "×")
            rows.append([f"Caches at SmolLM2's width (a random 576-wide, 4-layer teacher; 1× → {times}: "
                         f"{num(one[top]['examples'])} examples, {num(one[top]['bytes'] / 1e9)} GB; student: {student})",
                         f"stage two at {times} ÷ 1×: examples/s over the run {num(s['stage2_wall_examples_per_s_vs_1x'])}, "
                         f"peak RSS {num(s['peak_rss_mib_vs_1x'])}; reader ÷ student step {num(r['vs_student_step'])}; "
                         f"stage one {num(one['1x']['examples_per_s'])} → {num(one[top]['examples_per_s'])} examples/s, "
                         f"writer ÷ bare forward {num(one[top]['writer_over_bare_forward'])}; `cache verify` "
                         f"{num(wide['verify']['seconds_per_gb'])} s/GB",
                         link("cache_scale/smollm2-width.json", "cache_scale/smollm2-width.json")])
    s1 = _load(results, "stage_one/default.json")["results"]["SmolLM2-135M"]
    rows.append(["Cache size, SmolLM2-135M teacher (bf16, zstd, exact logits)",
                 f"{num(s1['bytes_per_token_all_positions_exact_bf16']['zstd'])} B/token with 4 layers at every position, "
                 f"{num(s1['bytes_per_token_answer_only_bf16_zstd']['exact'])} B/token at the answers only; exact logits from "
                 f"{num(s1['bytes_per_answer']['final_state_bf16'])} B per answer instead of "
                 f"{num(s1['bytes_per_answer']['full_fp32_logits'])} (full fp32 logits)",
                 link("stage_one/default.json", "stage_one/default.json")])
    vllm = _load(results, "vllm_stage_one/default.json")["speed"]["smollm2-135m"]
    rows.append(["Stage one speed, SmolLM2-135M",
                 f"cache-teacher ÷ bare forward {num(s1['writer_overhead']['median_of_pairs'])} (median of pairs); "
                 f"vLLM extract ÷ transformers {num(vllm['vllm extract / transformers'])}×",
                 ", ".join((link("stage_one/default.json", "stage_one"), link("vllm_stage_one/default.json", "vllm_stage_one")))])
    s2 = _load(results, "stage_two/smollm2-first3-items.json")["ratios"]
    rows.append(["Stage two speed, SmolLM2 → first 3 layers",
                 f"C2KD step from the cache ÷ SFT step {num(s2['c2kd_cache_over_sft'])} (vocabulary), "
                 f"{num(s2['c2kd_items_cache_over_sft'])} (`--kd-over items`); live teacher ÷ cache "
                 f"{num(s2['live_teacher_kd_over_c2kd_cache'])}×",
                 link("stage_two/smollm2-first3-items.json", "stage_two/smollm2-first3-items.json")])
    dep = _load(results, "deployment/smollm2.json")["latency"]
    rows.append(["Batch-1 latency (CPU, one thread), p50",
                 f"teacher (PyTorch) {num(dep['teacher pytorch']['p50_ms'])} ms; student: PyTorch "
                 f"{num(dep['student pytorch']['p50_ms'])} ms, ONNX fp32 {num(dep['student onnx-fp32']['p50_ms'])} ms, "
                 f"ONNX int8 {num(dep['student onnx-int8']['p50_ms'])} ms",
                 link("deployment/smollm2.json", "deployment/smollm2.json")])
    return rows


def readme_table(results: Path) -> str:
    return "\n".join([README_BEGIN, *md_table(["what", "test HR@1 (mean ± std over seeds) or measure", "result file"],
                                              readme_rows(results)), README_END])


def write_readme_table(readme: Path, results: Path) -> None:
    text = readme.read_text()
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < 0:
        raise SystemExit(f"{readme}: no results-table markers ({README_BEGIN!r} … {README_END!r})")
    readme.write_text(text[:start] + readme_table(results) + text[end + len(README_END):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="a results folder (<script>/<variant>.json)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "RESULTS.md")
    parser.add_argument("--no-readme", action="store_true", help="leave README.md's results table alone")
    args = parser.parse_args()
    link_base = Path("..") / "benchmarks" / "results" if args.results.resolve() == RESULTS else args.results.resolve()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(args.results, f"{link_base.as_posix()}/"))
    print(f"written {args.out}")
    if not args.no_readme and args.results.resolve() == RESULTS:
        write_readme_table(ROOT / "README.md", args.results)
        print(f"written the results table of {ROOT / 'README.md'}")


if __name__ == "__main__":
    main()
