"""`verify_cache` (schema, completeness, index consistency, every checksum) and `cache_info`."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import polars as pl

from c2kd.cache_schema import schema as S
from c2kd.cache_schema.checksum import bytes_digest, files_digest
from c2kd.cache_schema.storage import CacheLocation, list_local_files
from c2kd.cache_schema.zarr_io import open_array
from c2kd.errors import CacheError

_EXAMPLE_ARRAYS = {
    "example_id": S.EXAMPLE_ID,
    "token_offset": S.EXAMPLE_TOKEN_OFFSET,
    "token_length": S.EXAMPLE_TOKEN_LENGTH,
    "answer_offset": S.EXAMPLE_ANSWER_OFFSET,
    "answer_length": S.EXAMPLE_ANSWER_LENGTH,
    "user": S.EXAMPLE_USER,
    "target": S.EXAMPLE_TARGET,
}
_POLARS_TYPES = {"int64": pl.Int64, "int32": pl.Int32, "string": pl.String, "list<int32>": pl.List(pl.Int32)}


@dataclass
class VerifyReport:
    path: str
    problems: list[str] = field(default_factory=list)
    bad_shards: list[str] = field(default_factory=list)
    shards_checked: int = 0
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def bad(self, shard: str, problem: str) -> None:
        if shard not in self.bad_shards:
            self.bad_shards.append(shard)
        self.problems.append(f"{shard}: {problem}")


def _location(path_or_url: str | os.PathLike | CacheLocation, storage_options: dict | None) -> CacheLocation:
    return path_or_url if isinstance(path_or_url, CacheLocation) else CacheLocation(path_or_url, storage_options)


def verify_cache(
    path_or_url: str | os.PathLike | CacheLocation,
    storage_options: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check a cache completely; the report names every bad shard. `progress(done, total)` per shard."""
    loc = _location(path_or_url, storage_options)
    report = VerifyReport(str(loc))
    try:
        from c2kd.cache_schema.reader import read_manifest

        manifest = read_manifest(loc)
        spec = S.CacheSpec.from_dict(manifest["spec"])
    except CacheError as e:
        report.problems.append(str(e))
        return report

    for rel, entry in manifest["assets"].items():
        try:
            digest = bytes_digest(loc.iter_bytes(rel))
        except FileNotFoundError:
            report.problems.append(f"{rel}: missing")
            continue
        if digest != entry["sha256"]:
            report.problems.append(f"{rel}: checksum mismatch (corrupted)")

    index = _check_index(loc, manifest, report)
    shards = manifest["shards"]
    totals = manifest["totals"]
    for key in ("examples", "tokens", "answers"):
        if sum(s[key] for s in shards) != totals[key]:
            report.problems.append(f"manifest: shard {key} do not add up to totals.{key}")
    for i, entry in enumerate(shards):
        _check_shard(loc, spec, entry, index, report)
        report.shards_checked += 1
        if progress:
            progress(i + 1, len(shards))
    return report


def _check_index(loc: CacheLocation, manifest: dict, report: VerifyReport) -> pl.DataFrame | None:
    try:
        raw = loc.read_bytes(S.INDEX)
    except FileNotFoundError:
        report.problems.append(f"{S.INDEX}: missing")
        return None
    if bytes_digest([raw]) != manifest["index"]["sha256"]:
        report.problems.append(f"{S.INDEX}: checksum mismatch (corrupted or replaced)")
        return None
    index = pl.read_parquet(io.BytesIO(raw))
    for name, kind in S.INDEX_COLUMNS:
        if name not in index.columns:
            report.problems.append(f"{S.INDEX}: column {name!r} missing")
        elif index.schema[name] != _POLARS_TYPES[kind]:
            report.problems.append(f"{S.INDEX}: column {name!r} is {index.schema[name]}, expected {kind}")
    if report.problems:
        return None
    if index.height != manifest["totals"]["examples"]:
        report.problems.append(f"{S.INDEX}: {index.height} rows, manifest totals say {manifest['totals']['examples']}")
    if index["example_id"].n_unique() != index.height:
        report.problems.append(f"{S.INDEX}: example ids are not unique")
    known = {int(s["shard"]) for s in manifest["shards"]}
    stray = set(index["shard"].unique().to_list()) - known
    if stray:
        report.problems.append(f"{S.INDEX}: rows point to shards {sorted(stray)[:5]} that the manifest does not list")
    return index


def _check_shard(loc: CacheLocation, spec: S.CacheSpec, entry: dict, index: pl.DataFrame | None, report: VerifyReport) -> None:
    sid = int(entry["shard"])
    name = S.shard_name(sid)
    rel_root = S.shard_path(sid)
    files = [(rel, int(size)) for rel, size in entry["files"]]
    if loc.is_local:
        on_disk = list_local_files(loc.local_root / rel_root) if (loc.local_root / rel_root).is_dir() else []
        if not on_disk:
            report.bad(name, "folder missing")
            return
        if on_disk != files:
            extra = sorted({f for f, _ in on_disk} - {f for f, _ in files})
            report.bad(name, f"files differ from the manifest (extra: {extra[:3]})" if extra else "file missing or resized")
    try:
        digest = files_digest(files, lambda rel: loc.iter_bytes(f"{rel_root}/{rel}"))
        report.bytes_checked += sum(size for _, size in files)
        if digest != entry["sha256"]:
            report.bad(name, "checksum mismatch (a file is corrupted)")
    except FileNotFoundError as e:
        report.bad(name, f"file missing ({e.filename or e})")
        return
    except ValueError as e:
        report.bad(name, f"file truncated or grown ({e})")
        return
    if index is None:
        return
    rows = index.filter(pl.col("shard") == sid)
    if rows.height != entry["examples"]:
        report.bad(name, f"index has {rows.height} examples, manifest says {entry['examples']}")
        return
    if set(rows["split"].unique().to_list()) - {entry["split"]}:
        report.bad(name, "index rows name another split")
    tok, ans = rows["token_length"].to_numpy(), rows["answer_length"].to_numpy()
    if int(tok.sum()) != entry["tokens"] or int(ans.sum()) != entry["answers"]:
        report.bad(name, "index token/answer lengths do not add up to the manifest counts")
    for col, lengths in (("token_offset", tok), ("answer_offset", ans)):
        expected = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else lengths
        if not np.array_equal(rows[col].to_numpy(), expected):
            report.bad(name, f"index {col} is not contiguous in storage order")
    store = loc.zarr_store(rel_root)
    try:
        for col, arr_name in _EXAMPLE_ARRAYS.items():
            stored = np.asarray(open_array(store, arr_name)[...])
            if not np.array_equal(stored, rows[col].to_numpy()):
                report.bad(name, f"index column {col} differs from the shard's {arr_name}")
        counts = {"tokens": entry["tokens"], "answers": entry["answers"], "examples": entry["examples"]}
        for arr_name, info in S.array_layout(spec).items():
            shape = open_array(store, arr_name).shape
            fixed = [c for c in info["columns"] if isinstance(c, int)]
            if shape[0] != counts[info["rows"]] or (fixed and list(shape[1:]) != fixed):
                report.bad(name, f"array {arr_name} has shape {shape}, expected ({counts[info['rows']]}, {fixed})")
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        report.bad(name, f"unreadable ({e})")


def _dir_bytes(loc: CacheLocation, manifest: dict) -> dict[str, int]:
    shards = sum(int(s["bytes"]) for s in manifest.get("shards", []))
    assets = sum(int(a["bytes"]) for a in manifest.get("assets", {}).values())
    index = int(manifest.get("index", {}).get("bytes", 0))
    return {"shards": shards, "index": index, "assets": assets, "total": shards + index + assets}


def _array_bytes(manifest: dict) -> dict[str, int]:
    """Bytes on disk per array name over all shards (group metadata under "metadata")."""
    arrays = set(manifest.get("arrays", {}))
    out: dict[str, int] = {}
    for shard in manifest.get("shards", []):
        for rel, size in shard["files"]:
            parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
            name = parent if parent in arrays else "metadata"
            out[name] = out.get(name, 0) + int(size)
    return dict(sorted(out.items()))


def cache_info(path_or_url: str | os.PathLike | CacheLocation, storage_options: dict | None = None) -> dict:
    """A summary of a cache (works on an incomplete one too: `complete` is then False)."""
    loc = _location(path_or_url, storage_options)
    try:
        manifest = json.loads(loc.read_bytes(S.MANIFEST))
    except FileNotFoundError:
        raise CacheError(f"{loc}: no {S.MANIFEST} — not a teacher cache") from None
    except json.JSONDecodeError as e:
        raise CacheError(f"{loc}/{S.MANIFEST}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != S.FORMAT:
        raise CacheError(f"{loc}: not a c2kd teacher cache")
    spec = manifest.get("spec", {})
    totals = manifest.get("totals", {})
    sizes = _dir_bytes(loc, manifest)
    tokens, answers = int(totals.get("tokens", 0)), int(totals.get("answers", 0))
    info = {
        "path": str(loc),
        "schema_version": manifest.get("schema_version"),
        "complete": bool(manifest.get("complete")),
        "created_by": manifest.get("created_by"),
        "created_at": manifest.get("created_at"),
        "teacher": spec.get("teacher_description"),
        "teacher_layers": spec.get("teacher_num_layers"),
        "teacher_fingerprint": spec.get("teacher_fingerprint"),
        "tokenizer_fingerprint": spec.get("tokenizer_fingerprint"),
        "data_fingerprint": spec.get("data_fingerprint"),
        "prompt_format": spec.get("prompt_format"),
        "layers": spec.get("layers"),
        "hidden_size": spec.get("hidden_size"),
        "vocab_size": spec.get("vocab_size"),
        "dtype": spec.get("dtype"),
        "storage_dtype": S.STORAGE_DTYPES.get(spec.get("dtype", ""), "?"),
        "positions": spec.get("positions"),
        "logits": spec.get("logits"),
        "compression": spec.get("compression"),
        "examples_per_shard": spec.get("examples_per_shard"),
        "shards": len(manifest.get("shards", [])),
        "examples": int(totals.get("examples", 0)),
        "splits": totals.get("splits", {}),
        "tokens": tokens,
        "answer_tokens": answers,
        "bytes": sizes,
        "bytes_per_token": sizes["shards"] / tokens if tokens else None,
        "bytes_per_answer_token": sizes["shards"] / answers if answers else None,
    }
    info["array_bytes"] = _array_bytes(manifest)
    if not info["complete"] and loc.is_local:
        journals = (loc.local_root / S.JOURNAL).glob("rank-*.jsonl")
        info["shards_written"] = sum(1 for p in journals for line in p.read_text().splitlines() if line.strip())
    return info


def content_digest(cache_or_path: object, batch_size: int = 64) -> str:
    """sha256 of the per-example content (in example-id order), independent of sharding and codecs.

    Two caches of the same examples with the same dtype and policies have equal digests exactly
    when every example's tokens, positions, hidden states and logits are bit-identical.
    """
    import hashlib

    from c2kd.cache_schema.reader import TeacherCache

    cache = cache_or_path if isinstance(cache_or_path, TeacherCache) else TeacherCache.open(cache_or_path)
    h = hashlib.sha256()
    h.update(S.canonical_json({k: v for k, v in cache.spec.to_dict().items() if k not in ("compression", "examples_per_shard")}).encode())
    ids = np.sort(cache.index["example_id"].to_numpy())
    split_of = dict(zip(cache.index["example_id"].to_list(), cache.index["split"].to_list()))
    for start in range(0, len(ids), batch_size):
        batch = cache.get(ids[start : start + batch_size])
        for b, example_id in enumerate(batch.example_ids.tolist()):
            t, a = int(batch.attention_mask[b].sum()), int(batch.answer_mask[b].sum())
            rows = t if cache.positions == "all" else a
            parts = [
                np.int64(example_id).tobytes(), split_of[example_id].encode(),
                batch.users[b].numpy().tobytes(), batch.targets[b].numpy().tobytes(),
                batch.history[b].numpy().tobytes(), batch.candidates[b].numpy().tobytes(),
                batch.input_ids[b, :t].numpy().tobytes(), batch.slot_items[b, :t].numpy().tobytes(),
                batch.labels[b, :t].numpy().tobytes(), batch.answer_positions[b, :a].numpy().tobytes(),
            ]
            tensors = [batch.hidden[layer][b, :rows] for layer in cache.layers] + [batch.final_hidden[b, :a]]
            tensors += [x[b, :a] for x in (batch.topk_values, batch.topk_indices, batch.full_logits) if x is not None]
            for x in tensors:
                parts.append(x.contiguous().view(torch.uint8).numpy().tobytes() if x.numel() else b"")
            for p in parts:
                h.update(len(p).to_bytes(8, "little") + p)
    return h.hexdigest()
