"""Deterministic shard plan: which examples go into which shard, and which rank writes it.

Shards hold a fixed number of consecutive examples of one split (the last shard of a split may
be smaller); shard i is written by rank i % world_size. The plan depends only on the example
list, so 1-rank and N-rank runs produce the same shards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from c2kd.errors import CacheError


def example_ids_digest(example_ids: Sequence[int]) -> str:
    """sha256 of the example ids (int64 little-endian, in shard order)."""
    return hashlib.sha256(np.asarray(example_ids, dtype="<i8").tobytes()).hexdigest()


@dataclass(frozen=True)
class PlannedShard:
    shard_id: int
    split: str
    example_ids: tuple[int, ...]

    @property
    def digest(self) -> str:
        return example_ids_digest(self.example_ids)


@dataclass(frozen=True)
class ShardPlan:
    shards: tuple[PlannedShard, ...]

    def owned_by(self, rank: int, world_size: int) -> list[PlannedShard]:
        return [s for s in self.shards if s.shard_id % world_size == rank]

    @property
    def num_examples(self) -> int:
        return sum(len(s.example_ids) for s in self.shards)

    def __len__(self) -> int:
        return len(self.shards)


def plan_shards(examples: Mapping[str, Sequence[int]], examples_per_shard: int) -> ShardPlan:
    """Cut each split's example ids (in the given split order and row order) into shards."""
    if examples_per_shard <= 0:
        raise CacheError(f"examples per shard must be positive, got {examples_per_shard}")
    seen: set[int] = set()
    shards: list[PlannedShard] = []
    for split, ids in examples.items():
        ids = [int(i) for i in ids]
        dup = seen.intersection(ids) or (len(set(ids)) != len(ids))
        if dup:
            raise CacheError(f"split {split!r}: example ids must be unique across the cached splits")
        seen.update(ids)
        for start in range(0, len(ids), examples_per_shard):
            shards.append(PlannedShard(len(shards), split, tuple(ids[start : start + examples_per_shard])))
    return ShardPlan(tuple(shards))
