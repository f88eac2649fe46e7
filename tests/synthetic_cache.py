"""Small deterministic synthetic caches: exercise writers, readers and tools without a teacher.

Every record is a pure function of (seed, example id), so a cache written in one go, in pieces
after a crash, or by several ranks holds the same content. Also runnable as a script (used by
the crash and multi-writer tests):

    python tests/synthetic_cache.py OUT --examples 24 --per-shard 4 [--rank R --world-size N] [--no-seal]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from c2kd.cache_schema.plan import ShardPlan, plan_shards
from c2kd.cache_schema.records import ExampleRecord
from c2kd.cache_schema.schema import FINAL_HIDDEN, FULL_LOGITS, IGNORE_INDEX, TOPK_INDICES, TOPK_VALUES, CacheSpec, hidden_array
from c2kd.cache_schema.writer import CacheWriter


def synthetic_spec(**overrides: object) -> CacheSpec:
    base = dict(
        layers=(2, 3),
        hidden_size=16,
        vocab_size=40,
        dtype="bfloat16",
        positions="all",
        logits="exact",
        compression="zstd",
        examples_per_shard=4,
        splits=("train", "validation"),
        teacher_fingerprint="teacher-synthetic",
        tokenizer_fingerprint="tokenizer-synthetic",
        data_fingerprint="data-synthetic",
        teacher_description="synthetic",
        teacher_num_layers=4,
        prompt_format="ids",
        pad_token_id=0,
    )
    base.update(overrides)
    return CacheSpec(**base)


def synthetic_examples(num_examples: int, splits: Sequence[str] = ("train", "validation")) -> dict[str, list[int]]:
    """Example ids 0..n-1 dealt to the splits: the first split gets ~3/4, the others share the rest."""
    ids = list(range(num_examples))
    if len(splits) == 1:
        return {splits[0]: ids}
    head = (3 * num_examples) // 4
    out = {splits[0]: ids[:head]}
    rest = ids[head:]
    for k, split in enumerate(splits[1:]):
        out[split] = rest[k :: len(splits) - 1]
    return out


def synthetic_record(example_id: int, split: str, spec: CacheSpec, seed: int = 0) -> ExampleRecord:
    rng = np.random.default_rng([seed, example_id])
    t = int(rng.integers(6, 15))
    n_answer = 0 if example_id % 7 == 3 else int(rng.integers(1, 4))  # some examples have no answer
    input_ids = rng.integers(1, spec.vocab_size, size=t).astype(np.int64)
    labels = np.full(t, IGNORE_INDEX, dtype=np.int64)
    if n_answer:
        labels[t - n_answer :] = input_ids[t - n_answer :]
    slot_items = np.where(rng.random(t) < 0.3, rng.integers(1, 50, size=t), 0)
    a = n_answer
    rows = t if spec.positions == "all" else a
    d = spec.hidden_size
    gen = torch.Generator().manual_seed(seed * 1_000_003 + example_id)
    hidden = {layer: torch.randn(rows, d, generator=gen) * 3 for layer in spec.layers}
    final = torch.randn(a, d, generator=gen)
    outputs = {**{hidden_array(layer): h for layer, h in hidden.items()}, FINAL_HIDDEN: final}
    policy = spec.logits
    if policy.kind == "topk":
        outputs[TOPK_VALUES] = torch.randn(a, policy.k, generator=gen).sort(dim=-1, descending=True).values
        outputs[TOPK_INDICES] = torch.stack([torch.randperm(spec.vocab_size, generator=gen)[: policy.k] for _ in range(a)]) if a else torch.zeros(0, policy.k, dtype=torch.long)
    elif policy.kind == "full":
        outputs[FULL_LOGITS] = torch.randn(a, spec.vocab_size, generator=gen)
    history = rng.integers(1, 50, size=int(rng.integers(3, 11))).tolist()
    candidates = rng.permutation(np.arange(1, 50))[:20].tolist()
    return ExampleRecord(
        example_id=example_id,
        split=split,
        user=int(example_id // 3 + 1),
        target=int(candidates[0]),
        history=history,
        candidates=candidates,
        input_ids=input_ids,
        slot_items=slot_items,
        labels=labels,
        outputs=outputs,
    )


def synthetic_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")


def write_synthetic_assets(writer: CacheWriter, seed: int = 0) -> None:
    spec = writer.spec
    gen = torch.Generator().manual_seed(seed)
    writer.write_assets(
        synthetic_tokenizer(spec.vocab_size),
        torch.randn(spec.vocab_size, spec.hidden_size, generator=gen),
        torch.randn(50, 8, generator=gen),
        {"kind": "synthetic", "hidden_size": spec.hidden_size},
    )


def write_synthetic_cache(
    root: str | Path,
    spec: CacheSpec,
    plan: ShardPlan,
    *,
    rank: int = 0,
    world_size: int = 1,
    seal: bool = True,
    seed: int = 0,
    sleep: float = 0.0,
) -> CacheWriter:
    """Write (or resume) this rank's shards of `plan`; rank 0 also writes assets and seals."""
    writer = CacheWriter(root, spec, rank=rank, world_size=world_size)
    if writer.already_complete:
        return writer
    if rank == 0:
        write_synthetic_assets(writer, seed)
    done = writer.done_shards()
    for shard in plan.owned_by(rank, world_size):
        if shard.shard_id in done:
            continue
        writer.write_shard(shard.shard_id, [synthetic_record(i, shard.split, spec, seed) for i in shard.example_ids])
        if sleep:
            time.sleep(sleep)
    if seal and rank == 0:
        writer.seal(plan)
    return writer


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write a synthetic teacher cache.")
    p.add_argument("out")
    p.add_argument("--examples", type=int, default=24)
    p.add_argument("--per-shard", type=int, default=4)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--no-seal", action="store_true")
    p.add_argument("--sleep", type=float, default=0.0, help="pause after each shard (to be killed mid-run)")
    p.add_argument("--spec", default="{}", help="JSON overrides of the synthetic spec")
    args = p.parse_args(argv)
    spec = synthetic_spec(**json.loads(args.spec), examples_per_shard=args.per_shard)
    plan = plan_shards(synthetic_examples(args.examples, spec.splits), spec.examples_per_shard)
    write_synthetic_cache(args.out, spec, plan, rank=args.rank, world_size=args.world_size, seal=not args.no_seal, sleep=args.sleep)


if __name__ == "__main__":
    main()
