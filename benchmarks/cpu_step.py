"""A bf16 training step on CPU as `c2kd.training.train` runs it ÷ the same step before its two speed-ups.

    python benchmarks/cpu_step.py --data DATA --sasrec SASREC --json out.json [--families smollm2 gemma]

Per family, the teacher (two threads) and the student (its first K layers, one thread), as
`benchmarks/real_llm.py` trains them (hybrid item head, vocabulary frozen, bf16 autocast): one
AdamW step on the same batch of 32 `ids` training examples in four variants — the fused SDPA
attention or the plain one (`hf.plain_attention_for_training`, what training on CPU now uses),
and the frozen head's weight cast to bf16 at every call (what nn.Linear does under autocast) or
once (`AddedTokenRows.frozen_logits`). The variants alternate in blocks, medians of the timed
steps; the losses at the starting weights are reported too (equal up to bf16 rounding).
"""

from __future__ import annotations

import sys
from pathlib import Path


import torch

if __package__ in (None, ""):  # run as a file (python benchmarks/cpu_step.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.head_step import FAMILIES, median_step_s, step_arguments, train_batch  # noqa: E402
from benchmarks.common import write_result  # noqa: E402


VARIANTS = {  # name: (plain attention, head cast once)
    "before (fused attention, head cast every call)": (False, False),
    "plain attention": (True, False),
    "head cast once": (False, True),
    "after (both)": (True, True),
}


def measure(alias: str, shrink: str | None, data, sasrec, steps: int, blocks: int) -> dict:
    model, batch = train_batch(alias, shrink, data, sasrec)
    head = model.base_lm().get_output_embeddings()
    cast_once = model.added.frozen_logits

    def loss_of(plain: bool, once: bool):
        def loss() -> torch.Tensor:
            want = "eager" if plain else "sdpa"  # switched on a block's first step only, not inside every timed step
            if model.base_lm().config._attn_implementation != want:
                model.base_lm().set_attn_implementation(want)
            model.added.frozen_logits = cast_once if once else (lambda _head, h: head(h))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(**batch).loss
        return loss

    variants = {name: loss_of(*flags) for name, flags in VARIANTS.items()}
    with torch.no_grad():
        losses = {name: v().item() for name, v in variants.items()}
    median = median_step_s(model, variants, steps, blocks)
    before = median[next(iter(VARIANTS))]
    return {"model": model.spec.base, "threads": torch.get_num_threads(), "batch": 32, "loss_at_start": losses,
            "median_step_s": median, "ratio_to_before": {k: v / before for k, v in median.items()},
            "steps_timed": steps * blocks}


def main() -> None:
    args = step_arguments(__doc__.splitlines()[0], steps=2)
    out = {}
    for name in args.families:
        for role, (alias, shrink), threads in (("teacher", (FAMILIES[name][0], None), 2), ("student", FAMILIES[name], 1)):
            torch.set_num_threads(threads)  # as the tier trains them: teachers on both cores, students one each
            out[f"{name} {role}"] = measure(alias, shrink, args.data, args.sasrec, args.steps, args.blocks)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.json, out)
    for name, r in out.items():
        print(f"{name} ({r['model']}, {r['threads']} threads): " +
              ", ".join(f"{k} {v:.2f}" for k, v in r["ratio_to_before"].items()))


if __name__ == "__main__":
    main()
