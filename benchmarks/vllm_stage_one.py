"""Stage one on vLLM against transformers: the same arrays, and examples/s side by side.

    $(bash scripts/setup_vllm.sh) benchmarks/vllm_stage_one.py --work runs/bench/vllm --json runs/bench/vllm_stage_one.json

Runs in the vLLM environment (scripts/setup_vllm.sh prints its python). For a random tiny-teacher
and for SmolLM2-135M (pretrained body, its own tokenizer plus the item tokens), in `ids` and in
`llara`: the first --eq-examples validation/test examples are cached by both backends (all positions, bfloat16,
top-20 logits) and compared array by array — the largest difference per array, and how many
top-k indices differ (ties and rounding can swap neighbours). vLLM gives its layers back two ways
(`--vllm-states`): `extract` (its extract_hidden_states method; `ids` only) and `hooks`; `ids` is
compared with both. Then, `ids` only, cache-teacher's examples/s with transformers and with each
vLLM way, alternating, one thread (engine start-up excluded: `loop_seconds`), and with vLLM the
writer's overhead (cache-teacher ÷ the bare vLLM forward of the same batches).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file (python benchmarks/vllm_stage_one.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_result  # noqa: E402

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


VARIANTS = {"transformers": {"backend": "transformers"},
            "vllm extract": {"backend": "vllm", "vllm_states": "extract"},
            "vllm hooks": {"backend": "vllm", "vllm_states": "hooks"}}


def teachers(work: Path, examples, sasrec: Path) -> dict[str, dict[str, Path]]:
    """{name: {format: saved teacher}}: a random tiny-teacher and SmolLM2-135M, in ids and llara."""
    from c2kd.sasrec.train import load_item_embeddings
    from c2kd.recmodel.model import RecLM
    from c2kd.recmodel.tokenizer import build_word_tokenizer

    out: dict = {"tiny-teacher": {}, "smollm2-135m": {}}
    emb = load_item_embeddings(sasrec)
    for fmt in ("ids", "llara"):
        folder = work / f"tiny-{fmt}"
        if not folder.exists():
            tokenizer = build_word_tokenizer(examples.titles()[1:], examples.num_items)
            RecLM.from_preset("tiny-teacher", tokenizer, emb, fmt, seed=0, data_fingerprint=examples.fingerprint).save(folder)
        out["tiny-teacher"][fmt] = folder
        folder = work / f"smollm2-{fmt}"
        if not folder.exists():
            RecLM.from_pretrained("smollm2-135m", emb, fmt, data_fingerprint=examples.fingerprint).save(folder)
        out["smollm2-135m"][fmt] = folder
    return out


def compare(a, b) -> dict:
    ids = a.index["example_id"].to_list()
    diffs: dict = {}
    for start in range(0, len(ids), 64):
        x, y = a.get(ids[start : start + 64]), b.get(ids[start : start + 64])
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.answer_positions, y.answer_positions)
        rows, answers = x.hidden_mask, x.answer_mask
        pairs = {f"layer {l}": (x.hidden[l][rows], y.hidden[l][rows]) for l in a.layers}
        pairs["final_hidden"] = (x.final_hidden[answers], y.final_hidden[answers])
        pairs["topk_values"] = (x.topk_values[answers], y.topk_values[answers])
        for name, (u, v) in pairs.items():
            diffs[name] = max(diffs.get(name, 0.0), (u.float() - v.float()).abs().max().item())
        differ = (x.topk_indices[answers] != y.topk_indices[answers]).sum().item()
        diffs["topk_indices_differing"] = diffs.get("topk_indices_differing", 0) + differ
        diffs["topk_indices_total"] = diffs.get("topk_indices_total", 0) + x.topk_indices[answers].numel()
    return diffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("runs/bench/vllm"))
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--eq-examples", type=int, default=128, help="validation/test examples compared per teacher")
    parser.add_argument("--speed-examples", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from c2kd.cache_schema import TeacherCache
    from c2kd.pipeline.cache_teacher import CacheTeacherSettings, cache_teacher
    from c2kd.data.examples import load_examples
    from c2kd.data.prepare import prepare
    from c2kd.sasrec.train import SASRecTrainConfig, train_sasrec

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    data, sasrec = work / "data", work / "sasrec"
    if not data.exists():
        prepare("movielens-100k", data, max_train_per_user=5)
    examples = load_examples(data)
    if not sasrec.exists():
        train_sasrec(examples, sasrec, SASRecTrainConfig(epochs=20))
    result: dict = {"equivalence": {}, "speed": {}}
    for name, formats in teachers(work, examples, sasrec).items():
        for fmt, teacher in formats.items():
            caches = {}
            for variant, settings in VARIANTS.items():
                if fmt == "llara" and settings.get("vllm_states") == "extract":
                    continue
                out = work / f"eq-{name}-{fmt}-{variant.replace(' ', '-')}"
                cache_teacher(teacher, examples, out, CacheTeacherSettings(
                    splits=("validation", "test"), max_examples=args.eq_examples, logits="topk:20", writer="thread",
                    progress=False, **settings))
                caches[variant] = TeacherCache.open(out)
            for variant in caches.keys() - {"transformers"}:
                key = f"{name} {fmt} ({variant})"
                result["equivalence"][key] = compare(caches["transformers"], caches[variant])
                print(key, result["equivalence"][key], flush=True)
        speed: dict = {v: [] for v in VARIANTS} | {f"{v} bare forward": [] for v in VARIANTS if v != "transformers"}
        for repeat in range(args.repeats):
            for variant, settings in VARIANTS.items():
                out = work / f"speed-{name}-{variant.replace(' ', '-')}-{repeat}"
                shutil.rmtree(out, ignore_errors=True)  # timed from nothing every time
                summary = cache_teacher(formats["ids"], examples, out, CacheTeacherSettings(
                    splits=("train",), max_examples=args.speed_examples, progress=False, **settings))
                speed[variant].append(summary["examples"] / summary["loop_seconds"])
                if variant != "transformers":  # the same batches through the engine, nothing written
                    speed[f"{variant} bare forward"].append(summary["examples"] / summary["forward_seconds"])
        best = {v: max(rates) for v, rates in speed.items()}
        result["speed"][name] = {"examples_per_s": speed} | {
            f"{v} / transformers": best[v] / best["transformers"] for v in VARIANTS if v != "transformers"} | {
            f"{v} writer overhead (cache-teacher / bare forward)": best[v] / best[f"{v} bare forward"]
            for v in VARIANTS if v != "transformers"}
        print(name, result["speed"][name], flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.json, result)


if __name__ == "__main__":
    main()
