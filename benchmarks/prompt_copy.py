"""How much of an `ids` model's full-catalog top 10 is copied from the candidates in its prompt.

    python benchmarks/prompt_copy.py --model runs/bench/real_llm_skd/gemma/teacher \
        --data runs/bench/real_llm_skd/data --limit 200

An `ids` prompt lists the 20 candidates, target included, and the full-catalog metrics read the
scores at its end, so a model can rank the catalog by copying from its prompt (README, "Finding
the teacher"). Prints the share of the top 10 (history items excluded, as the metric excludes
them) that are prompt candidates; chance is 20 / N for a catalog of N items.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from c2kd.evaluate import rank_scores
from c2kd.data.examples import load_examples
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.prompts import PromptEncoder

if __package__ in (None, ""):  # run as a file (python benchmarks/prompt_copy.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a saved `ids` model folder")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=200, help="the first N examples of the split")
    parser.add_argument("--json", type=Path, help="also write the result here (with its provenance)")
    args = parser.parse_args()
    examples = load_examples(args.data)
    frame = examples.split(args.split).head(args.limit)
    model = RecLM.load(args.model).eval()
    if model.spec.format != "ids":
        raise SystemExit(f"{args.model}: format {model.spec.format!r}; only `ids` models rank the whole catalog")
    encoder = PromptEncoder(model.tokenizer, "ids", examples.titles())
    rows = list(zip(*(frame[c].to_list() for c in ("example_id", "history", "candidates")), strict=True))
    copied = 0
    with torch.no_grad():
        for start in range(0, len(rows), 32):
            chunk = rows[start : start + 32]
            candidates = torch.tensor([c for _, _, c in chunk])
            scores = rank_scores(model, encoder, [encoder.encode(*row) for row in chunk], candidates).full_catalog
            scores[:, 0] = float("-inf")  # padding, and the history below: excluded as by the metric
            for i, (_, history, _) in enumerate(chunk):
                scores[i, torch.tensor(history, dtype=torch.long)] = float("-inf")
            top = scores.topk(10, dim=1).indices
            copied += int((top[:, :, None] == candidates[:, None, :]).any(-1).sum())
    result = {"model": str(args.model), "split": args.split, "examples": len(rows),
              "top10_share_in_prompt": copied / (10 * len(rows)), "chance": len(rows[0][2]) / encoder.num_items}
    print(json.dumps(result, indent=2))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
