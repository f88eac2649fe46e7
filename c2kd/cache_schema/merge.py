"""`cache merge`: part caches written on different machines (`cache-teacher --part i/n`) into one.

Part i of n holds the shards i-1, i-1+n, i-1+2n, ... of the full shard plan, written exactly as a
single run writes them (a shard's bytes do not depend on the part). Merging checks that the parts
are parts 1..n of one cache — the same spec but for `part` (a different field is named), the same
assets — copies every shard in after checking its files against its part's manifest, and seals:
the result is the cache a single run would have written (same shards, same content digest).
"""

from __future__ import annotations

import os

from c2kd.cache_schema import schema as S
from c2kd.cache_schema.plan import PlannedShard, ShardPlan
from c2kd.cache_schema.reader import TeacherCache
from c2kd.cache_schema.writer import CacheWriter
from c2kd.errors import CacheError


def _check_parts(parts: list[TeacherCache]) -> S.CacheSpec:
    """The merged cache's spec, after checking that `parts` are parts 1..n of one cache."""
    first = parts[0]
    numbers = []
    for cache in parts:
        part = S.parse_part(cache.spec.part)
        if part is None:
            raise CacheError(f"{cache.location}: not a part cache (written without --part i/n)")
        numbers.append(part)
        mine, theirs = first.spec.to_dict(), cache.spec.to_dict()
        different = sorted(k for k in mine if k != "part" and mine[k] != theirs[k])
        if different:
            raise CacheError(f"{cache.location}: not a part of the same cache as {first.location} "
                             f"(spec field {different[0]!r} differs: {theirs[different[0]]!r} vs {mine[different[0]]!r})")
        if cache.manifest["assets"] != first.manifest["assets"]:
            name = next(rel for rel in sorted({*cache.manifest["assets"], *first.manifest["assets"]})
                        if cache.manifest["assets"].get(rel) != first.manifest["assets"].get(rel))
            raise CacheError(f"{cache.location}: asset {name} differs from {first.location}'s (another teacher or tokenizer)")
    count = numbers[0][1]
    if any(n != count for _, n in numbers) or sorted(i for i, _ in numbers) != list(range(1, count + 1)):
        given = ", ".join(f"{i}/{n}" for i, n in sorted(numbers))
        raise CacheError(f"parts {given} given; merging needs each of the parts 1/{count} .. {count}/{count} once")
    return S.CacheSpec.from_dict({**first.spec.to_dict(), "part": ""})


def merge_caches(parts: list[str | os.PathLike], out: str | os.PathLike) -> dict:
    """Merge local part caches into the cache `out`; returns its manifest. Rerun to resume."""
    if len(parts) < 2:
        raise CacheError("give at least two part caches to merge")
    opened = [TeacherCache.open(p) for p in parts]
    for cache in opened:
        if not cache.location.is_local:
            raise CacheError(f"{cache.location}: merge reads local folders; `c2kd cache pull` it first")
    spec = _check_parts(opened)
    writer = CacheWriter(out, spec)
    if writer.already_complete:
        return writer.manifest()
    writer.adopt_assets(opened[0].location.local_root / S.ASSETS)
    done = writer.done_shards()
    planned = []
    for cache in opened:
        index = cache.index
        for entry in cache.manifest["shards"]:
            sid = int(entry["shard"])
            ids = index.filter(index["shard"] == sid)["example_id"].to_list()
            planned.append(PlannedShard(sid, entry["split"], tuple(ids)))
            if sid not in done:
                writer.adopt_shard(entry, cache.location.local_root / S.shard_path(sid))
    plan = ShardPlan(tuple(sorted(planned, key=lambda s: s.shard_id)))
    if [s.shard_id for s in plan.shards] != list(range(len(plan))):
        raise CacheError(f"the parts hold shards {[s.shard_id for s in plan.shards][:8]}…, not 0..{len(plan) - 1}")
    return writer.seal(plan)


def part_plan(plan: ShardPlan, part: str) -> ShardPlan:
    """The shards of the full plan that part `part` ("i/n") writes."""
    parsed = S.parse_part(part)
    if parsed is None:
        return plan
    i, n = parsed
    return ShardPlan(tuple(s for s in plan.shards if s.shard_id % n == i - 1))
