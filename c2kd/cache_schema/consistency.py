"""The checks a reader affords on every open and every first touch of an array, beyond the digest.

The manifest digest proves only that the manifest is the one that was sealed, or one whose digest
was recomputed after an edit: whoever edits a field can recompute the digest too. `cache verify`
recomputes everything; these are the cheap subset a training run (`distill`) does as it goes:

- on open: the spec hash against the spec, the items the spec counts against the teacher config,
  and each shard's entry (its split and example count) against the index rows of that shard;
- on the first touch of an array (local caches): the shape of the array against the layout the
  spec implies, and the sha256 of each of its files against the manifest, read in blocks (for a
  cache at a URL, the read cache checks each file as it arrives: `CacheLocation.kept`).
"""

from __future__ import annotations

import polars as pl

from c2kd.cache_schema import schema as S
from c2kd.cache_schema.checksum import bytes_digest
from c2kd.cache_schema.storage import CacheLocation
from c2kd.errors import CacheError

_VERIFY = "run `c2kd cache verify`"


def check_open(manifest: dict, spec: S.CacheSpec, index: pl.DataFrame, where: str) -> None:
    """Refuse a digest-valid manifest whose fields disagree with each other or with the index."""
    at = f"{where}/{S.MANIFEST}"
    if manifest.get("spec_hash") != spec.spec_hash:
        raise CacheError(f"{at}: spec_hash does not match the spec (the manifest was edited); {_VERIFY}")
    items = spec.extra.get("num_items") if isinstance(spec.extra, dict) else None
    recorded = ((manifest.get("teacher_config") or {}).get("reclm") or {}).get("num_items")
    if items is not None and recorded is not None and items != recorded:
        raise CacheError(f"{at}: spec.extra.num_items is {items}, the teacher config says {recorded} "
                         f"(the manifest was edited); {_VERIFY}")
    per_shard = {int(r["shard"]): r for r in index.group_by("shard").agg(
        pl.len().alias("examples"), pl.col("split").unique().alias("splits")).iter_rows(named=True)}
    for entry in manifest["shards"]:
        rows = per_shard.get(int(entry["shard"]), {"examples": 0, "splits": []})
        if rows["examples"] != entry.get("examples") or rows["splits"] != [entry.get("split")]:
            raise CacheError(f"{at}: {entry.get('name')} is listed as {entry.get('examples')} {entry.get('split')!r} "
                             f"examples, {S.INDEX} has {rows['examples']} ({', '.join(map(str, rows['splits']))}); "
                             f"{_VERIFY}")


def check_array(location: CacheLocation, spec: S.CacheSpec, shard: int, entry: dict, name: str,
                shape: tuple[int, ...]) -> None:
    """First touch of array `name` of a shard: its shape fits the spec's layout, and (local caches) its
    files match their per-file sha256 in the manifest."""
    root = S.shard_path(shard)
    info = S.array_layout(spec)[name]
    fixed = [c for c in info["columns"] if isinstance(c, int)]
    if list(shape[1 : 1 + len(fixed)]) != fixed:
        raise CacheError(f"{location}/{root}/{name}: shape {tuple(shape)}, the spec implies "
                         f"(rows, {', '.join(map(str, info['columns']))}); {_VERIFY}")
    if not location.is_local:
        return  # a read cache checked each file on arrival; plain ranged reads rely on the chunks' crc32c
    prefix = f"{name}/"
    for rel, _size, sha in entry["files"]:
        if rel.startswith(prefix) and "/" not in rel[len(prefix):]:
            if bytes_digest(location.iter_bytes(f"{root}/{rel}")) != sha:
                raise CacheError(f"{location}/{root}/{rel}: checksum does not match the manifest (corrupted, "
                                 f"or the manifest was edited); {_VERIFY}")

