"""How much of a teacher's answer distribution sits on the item tokens (what --kd-over items keeps).

    python benchmarks/item_mass.py CACHE [--json out.json]

Reads an `ids` cache (any logits policy: it uses the cached final states): at every answer
position that predicts an item, the teacher's softmax over the whole vocabulary (rebuilt from the cached final state and head) and
the share of it on the catalog's item tokens. Prints the mean, median and lowest share.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from c2kd.cache_schema import TeacherCache
from c2kd.recmodel.tokenizer import item_token_ids
from c2kd.student.distill import DistillRecipe

if __package__ in (None, ""):  # run as a file (python benchmarks/item_mass.py): the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_result  # noqa: E402


def item_mass(cache: TeacherCache, batch_size: int = 64) -> torch.Tensor:
    """Per item-predicting answer position of the train split: teacher probability on item tokens."""
    head = cache.head_weight().float()
    items = torch.tensor(item_token_ids(cache.tokenizer(), cache.item_embeddings().shape[0] - 1)[1:])
    ids = cache.split_ids("train")
    shares = []
    for start in range(0, len(ids), batch_size):
        batch = cache.get(ids[start : start + batch_size], layers=[], final_hidden=True, logits=False)
        rows = torch.isin(batch.answer_targets(), items)
        p = (batch.final_hidden[batch.answer_mask][rows].float() @ head.T).softmax(-1)
        shares.append(p[:, items].sum(-1))
    return torch.cat(shares)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cache", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cache = TeacherCache.open(args.cache)
    DistillRecipe(method="logit-kd", kd_over="items").check_cache(cache.spec)  # the answers must be item tokens
    share = item_mass(cache)
    result = {"cache": str(args.cache), "teacher": cache.spec.teacher_description, "positions": len(share),
              "item_mass": {"mean": share.mean().item(), "median": share.median().item(), "min": share.min().item()}}
    print(json.dumps(result, indent=2))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
