"""Render a benchmark-suite folder (from run_all.py) as report.md and speed.png, from its JSON only.

    python benchmarks/report.py runs/bench

Every section is written only when its benchmark's JSON is there, so a partial suite still gets
a report of what ran.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python benchmarks/report.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import mean_std  # noqa: E402


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def machine_section(suite: dict) -> list[str]:
    m = suite["machine"]
    lines = ["## Machine", "", f"{m['cpu']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}"
             + (f", GPU {m['cuda']}" if m.get("cuda") else ", no GPU") + f"; started {m['started']}.", ""]
    if suite.get("quick"):
        lines += ["**A `--quick` smoke run: the numbers below mean nothing.**", ""]
    lines += ["| benchmark | status | seconds |", "|---|---|---|"]
    lines += [f"| {name} | {b['status']} | {b.get('seconds', '-')} |" for name, b in suite["benchmarks"].items()]
    return lines + [""]


def quality_section(out: Path) -> list[str]:
    summary = _load(out / "distill_quality" / "summary.json")
    sasrec = _load(out / "sasrec_quality.json")
    teacher = _load(out / "distill_quality" / "teacher-test.json")
    if summary is None:
        return []
    seeds = next(iter(summary.values()))["seeds"]
    lines = ["## Quality (test split, 20 candidates)", "",
             f"One teacher cache; every student has the same preset and budget; seeds {seeds}; each run keeps its "
             "best validation checkpoint.", "",
             "| model | HR@1 | NDCG@10 | MRR | full-catalog NDCG@10 |", "|---|---|---|---|---|"]
    if sasrec:
        s = sasrec["summary"]
        cells = [f"{s[k]['mean']:.3f} ± {s[k]['std']:.3f}" for k in
                 ("candidates/HR@1", "candidates/NDCG@10", "candidates/MRR", "full_catalog/NDCG@10")]
        lines.append("| SASRec | " + " | ".join(cells) + " |")
    if teacher:
        t = teacher
        lines.append(f"| teacher (seed 0) | {t['candidates']['HR@1']:.3f} | {t['candidates']['NDCG@10']:.3f} | "
                     f"{t['candidates']['MRR']:.3f} | {t['full_catalog']['NDCG@10']:.3f} |")
    for name, row in summary.items():
        cells = [mean_std(row[k]) for k in ("candidates/HR@1", "candidates/NDCG@10", "candidates/MRR", "full_catalog/NDCG@10")]
        lines.append(f"| student: {name} | " + " | ".join(cells) + " |")
    lines += ["", "![quality](distill_quality/summary.png)", "",
              "Router layer choices and loss curves of the C2KD student, seed 0:", "",
              "![c2kd seed 0](distill_quality/c2kd-s0/distill.png)", ""]
    return lines


def stage_one_section(out: Path) -> list[str]:
    data = _load(out / "stage_one.json")
    if data is None:
        return []
    lines = ["## Stage one: the teacher cache", "", f"torch threads: {data['threads']}.", "",
             "| teacher | writer overhead (best / median of pairs; target ≥ 0.95) | with a writer thread | CPU-time ratio | "
             "exact-logit max error (bf16) | final state vs fp32 logits, bytes per answer | "
             "bytes/token (all, bf16, zstd) | zstd gain on bf16 states | reader ex/s vs student step ex/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in data["results"].items():
        t, x, z, rd = r["throughput"], r["exact_vs_full_fp32_logits"], r["zstd_gain_bf16_hidden"], r["reader"]
        e = r["exact_logit_error"]["bfloat16"]
        lines.append(
            f"| {name} | {t['ratio']:.3f} / {t['ratio_median_of_pairs']:.3f} | {t['thread_writer_ratio']:.3f} | {t['cpu_ratio']:.3f} | "
            f"{e['max_abs_error']:.3g} (max logit {e['max_abs_logit']:.3g}) | "
            f"{x['final_hidden_bf16_bytes_per_answer']:,.0f} vs {x['full_fp32_logits_bytes_per_answer']:,.0f} "
            f"({x['ratio_full_over_exact']:.0f}×) | {r['modes']['all/exact/bfloat16/zstd']['bytes_per_token']:,.0f} | "
            f"{z['positions_all']:.2f}× (all) / {z['positions_answer']:.2f}× (answer) | "
            f"{rd['examples_per_s']:,.0f} vs {rd['tiny_student_step_examples_per_s']:,.0f} |")
    lines += ["", "Bytes per token, every storage mode:", "", "| teacher | mode | bytes/token | bytes/answer |", "|---|---|---|---|"]
    for name, r in data["results"].items():
        for mode, m in r["modes"].items():
            lines.append(f"| {name} | `{mode}` | {m['bytes_per_token']:,.1f} | {m['bytes_per_answer']:,.0f} |")
    return lines + [""]


def stage_two_section(out: Path) -> list[str]:
    runs = {label: _load(out / f"{stem}.json") for label, stem in
            (("tiny-teacher (trained)", "stage_two"), ("SmolLM2-135M shape (random)", "stage_two_smollm2_shape"))}
    runs = {k: v for k, v in runs.items() if v}
    if not runs:
        return []
    lines = ["## Stage two: step time and memory", "",
             "| teacher | C2KD step from cache ÷ SFT step | the same, --kd-over items | "
             "live-teacher KD step ÷ C2KD step from cache | "
             "peak memory growth: SFT / C2KD cache / C2KD live (MiB) |", "|---|---|---|---|---|"]
    for label, r in runs.items():
        mem = {m["variant"]: m["peak_rss_growth_mib"] for m in r["memory"]}
        items = r["ratios"].get("c2kd_items_cache_over_sft")  # absent in results of earlier runs
        lines.append(f"| {label} | {r['ratios']['c2kd_cache_over_sft']:.2f} | "
                     f"{'–' if items is None else f'{items:.2f}'} | "
                     f"{r['ratios']['live_teacher_kd_over_c2kd_cache']:.2f} | "
                     f"{mem.get('sft-cache', float('nan')):.0f} / {mem.get('c2kd-cache', float('nan')):.0f} / "
                     f"{mem.get('c2kd-live', float('nan')):.0f} |")
    return lines + [""]


def deployment_section(out: Path) -> list[str]:
    d = _load(out / "deployment.json")
    if d is None:
        return []
    lat = d["latency_ms"]
    return ["## Deployment (CPU, batch 1)", "",
            f"{d['machine']['cpu']}, {d['machine']['torch_threads']} torch thread(s).", "",
            "| model | parameters | non-embedding | latency ms |", "|---|---|---|---|",
            *(f"| {m} | {d['parameters'].get(m, 0):,} | {d['non_embedding_parameters'].get(m, 0):,} | {lat[m]:.2f} |"
              for m in ("teacher", "student")),
            *([f"| SASRec | - | - | {lat['SASRec']:.2f} |"] if "SASRec" in lat else []), "",
            "Ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in d["ratios"].items()) + ".", ""]


def speed_plot(out: Path) -> bool:
    """One bar per measured ratio (1 = no difference)."""
    bars: dict[str, float] = {}
    s1 = _load(out / "stage_one.json")
    for name, r in (s1 or {}).get("results", {}).items():
        bars[f"stage one, {name}: cache-teacher ÷ bare forward"] = r["throughput"]["ratio"]
        bars[f"stage one, {name}: reader ÷ student step (ex/s)"] = (
            r["reader"]["examples_per_s"] / r["reader"]["tiny_student_step_examples_per_s"])
    for label, stem in (("tiny", "stage_two"), ("SmolLM2 shape", "stage_two_smollm2_shape")):
        r = _load(out / f"{stem}.json")
        if r:
            bars[f"stage two, {label}: C2KD-cache step ÷ SFT step"] = r["ratios"]["c2kd_cache_over_sft"]
            if "c2kd_items_cache_over_sft" in r["ratios"]:
                bars[f"stage two, {label}: C2KD-cache (items) step ÷ SFT step"] = r["ratios"]["c2kd_items_cache_over_sft"]
            bars[f"stage two, {label}: live-KD step ÷ C2KD-cache step"] = r["ratios"]["live_teacher_kd_over_c2kd_cache"]
    d = _load(out / "deployment.json")
    if d:
        bars["deployment: student ÷ teacher latency"] = d["ratios"]["student/teacher latency"]
    if not bars:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.45 * len(bars) + 1))
    ax.barh(list(bars), list(bars.values()), color="tab:green", alpha=0.8)
    ax.axvline(1.0, color="black", lw=0.8)
    for i, v in enumerate(bars.values()):
        ax.text(v, i, f" {v:.2f}", va="center")
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ratio (log scale), measured side by side in one run")
    fig.tight_layout()
    fig.savefig(out / "speed.png", dpi=110)
    plt.close(fig)
    return True


def render(out: Path) -> str:
    suite = _load(out / "suite.json")
    lines = ["# c2kd benchmark report", ""]
    if suite:
        lines += machine_section(suite)
    lines += quality_section(out) + stage_one_section(out) + stage_two_section(out) + deployment_section(out)
    if speed_plot(out):
        lines += ["## Speed ratios", "", "![speed ratios](speed.png)", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    text = render(args.folder)
    (args.folder / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
