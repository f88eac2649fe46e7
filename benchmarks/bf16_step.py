"""A training step under bfloat16 autocast ÷ the same step in float32, for the real-LLM benchmark's models.

    python benchmarks/bf16_step.py --data DATA --sasrec SASREC --json out.json [--families smollm2 gemma]

Per family, the teacher (the whole pretrained model) and the student (its first K layers), each
with the hybrid item head, as `benchmarks/real_llm.py --bf16` trains them: one AdamW step on the
same batch of 32 `ids` training examples, with and without `torch.autocast("cpu", bfloat16)`
(what `TrainConfig.bf16` does), alternating in blocks at one thread, medians of the timed steps.
Also the two losses at the starting weights, which differ only by bf16 rounding.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file (python benchmarks/bf16_step.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.head_step import FAMILIES, median_step_s, step_arguments, train_batch  # noqa: E402
from benchmarks.common import write_result  # noqa: E402


def measure(alias: str, shrink: str | None, data: Path, sasrec: Path, steps: int, blocks: int) -> dict:
    model, batch = train_batch(alias, shrink, data, sasrec)

    def bf16_loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(**batch).loss

    variants = {"float32": lambda: model(**batch).loss, "bf16 autocast": bf16_loss}
    with torch.no_grad():
        losses = {name: v().item() for name, v in variants.items()}
    median = median_step_s(model, variants, steps, blocks)
    return {"model": model.spec.base, "layers": model.num_layers, "batch": 32, "loss_at_start": losses,
            "median_step_s": median, "ratio": median["bf16 autocast"] / median["float32"], "steps_timed": steps * blocks}


def main() -> None:
    args = step_arguments(__doc__.splitlines()[0], steps=2)
    torch.set_num_threads(1)
    out = {f"{name} {role}": measure(alias, shrink, args.data, args.sasrec, args.steps, args.blocks)
           for name in args.families for role, (alias, shrink) in
           (("teacher", (FAMILIES[name][0], None)), ("student", FAMILIES[name]))}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.json, out)
    for name, r in out.items():
        print(f"{name} ({r['model']}, {r['layers']} layers): bf16 step ÷ float32 step {r['ratio']:.2f}; "
              f"loss at start {r['loss_at_start']['float32']:.4f} / {r['loss_at_start']['bf16 autocast']:.4f}")


if __name__ == "__main__":
    main()
