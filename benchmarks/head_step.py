"""A student training step with the LM head at the answer positions only ÷ with the head everywhere.

    python benchmarks/head_step.py --data DATA --sasrec SASREC --json out.json [--families smollm2 gemma]

The students of benchmarks/real_llm.py (a pretrained family's first K layers, the hybrid item
head, the vocabulary frozen but for the added tokens): one AdamW step on the same batch of 32
`ids` training examples, with the loss from `RecLM.forward(labels=...)` (the head at the 2 answer
positions of each prompt) and from the head applied at every position followed by the same
cross-entropy (what a Hugging Face causal LM computes). Both give the same loss (checked). The
two variants alternate in blocks, one thread, medians of the timed steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from c2kd.data.examples import load_examples
from c2kd.sasrec.train import load_item_embeddings
from c2kd.recmodel.build import build_model
from c2kd.recmodel.prompts import PromptEncoder, answer_mask, collate, encode_frame

if __package__ in (None, ""):  # run as a file (python benchmarks/head_step.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_result  # noqa: E402

FAMILIES = {"smollm2": ("smollm2-135m", "first:3"), "gemma": ("gemma3-270m", "first:2")}


def head_everywhere_loss(model, batch: dict) -> torch.Tensor:
    logits = model(batch["input_ids"], batch["attention_mask"], batch["slot_items"]).logits  # [B, T, V]
    mask = answer_mask(batch["labels"])
    targets = batch["labels"][:, 1:][mask[:, :-1]]
    return F.cross_entropy(logits[mask].float(), targets)


def train_batch(alias: str, shrink: str | None, data: Path, sasrec: Path) -> tuple:
    """(model in train mode, a batch of the first 32 `ids` training examples): the benchmark's
    model of `alias` (shrink None = the whole teacher) with the hybrid item head."""
    examples = load_examples(data)
    model = build_model(alias, fmt="ids", item_embeddings=load_item_embeddings(sasrec), seed=0, shrink=shrink,
                        data_fingerprint=examples.fingerprint, preset_tokenizer=lambda: None)
    encoder = PromptEncoder(model.tokenizer, "ids", examples.titles())
    return model.train(), collate(encode_frame(encoder, examples.split("train").head(32)), encoder.pad_id)


def median_step_s(model, variants: dict[str, Callable[[], torch.Tensor]], steps: int, blocks: int) -> dict[str, float]:
    """Median seconds of one AdamW step (loss, backward, update) per variant; the variants
    alternate in blocks of `steps` so that drifts of the machine hit them alike; block 0 warms up."""
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for block in range(blocks + 1):
        for name, loss_of in variants.items():
            for _ in range(steps):
                start = time.perf_counter()
                loss_of().backward()
                optim.step()
                optim.zero_grad(set_to_none=True)
                if block:
                    times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(alias: str, shrink: str, data: Path, sasrec: Path, steps: int, blocks: int) -> dict:
    model, batch = train_batch(alias, shrink, data, sasrec)
    variants = {"answer positions only": lambda: model(**batch).loss,
                "head everywhere": lambda: head_everywhere_loss(model, batch)}
    with torch.no_grad():
        a, b = (v().item() for v in variants.values())
    median = median_step_s(model, variants, steps, blocks)
    return {"model": model.spec.base, "vocabulary": model.vocab_size, "batch": 32,
            "loss_answer_only": a, "loss_head_everywhere": b, "median_step_s": median,
            "ratio": median["answer positions only"] / median["head everywhere"], "steps_timed": steps * blocks}


def step_arguments(description: str, steps: int) -> argparse.Namespace:
    """The command line shared by the step-timing scripts (this one, bf16_step.py and cpu_step.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--sasrec", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--blocks", type=int, default=3)
    return parser.parse_args()


def main() -> None:
    args = step_arguments(__doc__.splitlines()[0], steps=3)
    torch.set_num_threads(1)
    out = {name: measure(*FAMILIES[name], args.data, args.sasrec, args.steps, args.blocks) for name in args.families}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.json, out)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
