"""`verify_cache`: every byte and every manifest field that can be recomputed, and `cache_info`.

Verify trusts nothing but the manifest's own digest: it recomputes the spec hash, the array layout,
the copied teacher config, every asset's size and checksum, the index (checksum, schema, rows,
offsets, and its agreement with each shard's `examples/*` arrays), each shard's files (sizes,
per-file checksums, the shard checksum), its example ids digest, its row counts and array shapes,
and the totals. Every problem names the file (or manifest field) and what was expected.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from c2kd.cache_schema import schema as S
from c2kd.cache_schema.checksum import bytes_digest, files_digest
from c2kd.cache_schema.identity import content_identity
from c2kd.cache_schema.plan import example_ids_digest
from c2kd.cache_schema.reader import read_manifest
from c2kd.cache_schema.storage import CacheLocation, list_local_files
from c2kd.cache_schema.zarr_io import open_array
from c2kd.errors import CacheError

_READ_ERRORS = (ValueError, RuntimeError, OSError, KeyError, TypeError)


@dataclass
class VerifyReport:
    path: str
    problems: list[str] = field(default_factory=list)
    bad_shards: list[str] = field(default_factory=list)
    shards_checked: int = 0
    bytes_checked: int = 0
    digest: str | None = None  # the manifest digest (tamper detection), when the manifest is sound
    content_id: str | None = None  # what the cache holds, from what (identity.py)

    @property
    def ok(self) -> bool:
        return not self.problems

    def bad(self, shard: str, problem: str) -> None:
        if shard not in self.bad_shards:
            self.bad_shards.append(shard)
        self.problems.append(f"{S.SHARDS}/{shard}{problem}")


def _location(path_or_url: str | os.PathLike | CacheLocation, storage_options: dict | None) -> CacheLocation:
    return path_or_url if isinstance(path_or_url, CacheLocation) else CacheLocation(path_or_url, storage_options)


def verify_cache(
    path_or_url: str | os.PathLike | CacheLocation,
    storage_options: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check a cache completely; the report names every bad file. `progress(done, total)` per shard."""
    loc = _location(path_or_url, storage_options)
    report = VerifyReport(str(loc))
    try:
        manifest = read_manifest(loc)
        spec = S.CacheSpec.from_dict(manifest["spec"])
    except (CacheError, TypeError) as e:
        report.problems.append(str(e))
        return report
    report.digest = manifest["digest"]
    try:
        report.content_id = content_identity(manifest)
    except (KeyError, TypeError, AttributeError) as e:
        report.problems.append(f"{S.MANIFEST}: a field the content identity needs is missing or malformed ({e})")
    _check_manifest_fields(loc, manifest, spec, report)
    _check_assets(loc, manifest, report)
    index = _check_index(loc, manifest, report)
    shards = manifest["shards"]
    if loc.is_local and (loc.local_root / S.SHARDS).is_dir():
        listed = {s.get("name") for s in shards}
        stray = sorted(p.name for p in (loc.local_root / S.SHARDS).iterdir()
                       if p.name not in listed and not p.name.startswith(S.TMP_PREFIX))
        if stray:
            report.problems.append(f"{S.SHARDS}/: {', '.join(stray[:5])} not listed in the manifest (stray files)")
    for i, entry in enumerate(shards):
        _check_shard(loc, spec, entry, index, report)
        report.shards_checked += 1
        if progress:
            progress(i + 1, len(shards))
    return report


def _check_manifest_fields(loc: CacheLocation, manifest: dict, spec: S.CacheSpec, report: VerifyReport) -> None:
    """The manifest fields that follow from others."""
    where = S.MANIFEST
    if manifest.get("spec_hash") != spec.spec_hash:
        report.problems.append(f"{where}: spec_hash does not match the spec (expected {spec.spec_hash[:16]}…)")
    if manifest.get("dtype") != spec.dtype_field():
        report.problems.append(f"{where}: dtype {manifest.get('dtype')} does not match spec.dtype {spec.dtype!r}")
    if manifest["arrays"] != S.array_layout(spec):
        report.problems.append(f"{where}: arrays do not match the layout the spec implies")
    try:
        copied = json.loads(loc.read_bytes(S.TEACHER_CONFIG_FILE))
        if manifest.get("teacher_config") != copied:
            report.problems.append(f"{where}: teacher_config differs from {S.TEACHER_CONFIG_FILE}")
    except (FileNotFoundError, ValueError, CacheError):
        pass  # reported by the asset check
    items = spec.extra.get("num_items") if isinstance(spec.extra, dict) else None
    recorded = ((manifest.get("teacher_config") or {}).get("reclm") or {}).get("num_items")
    if items is not None and recorded is not None and items != recorded:
        report.problems.append(f"{where}: spec.extra.num_items is {items}, the teacher config says {recorded}")
    try:
        embeddings = _safetensors_shape(loc.read_bytes(S.ITEM_EMBEDDINGS_FILE), S.ITEM_EMBEDDINGS_TENSOR)
        if items is not None and embeddings is not None and embeddings[0] != items + 1:
            report.problems.append(f"{where}: spec.extra.num_items is {items}, {S.ITEM_EMBEDDINGS_FILE} has "
                                   f"{embeddings[0]} rows (items + padding)")
        head = _safetensors_shape(loc.read_bytes(S.HEAD_FILE), S.HEAD_TENSOR)
        if head is not None and head != [spec.vocab_size, spec.hidden_size]:
            report.problems.append(f"{where}: spec says vocab {spec.vocab_size} x width {spec.hidden_size}, "
                                   f"{S.HEAD_FILE} is {head[0]} x {head[1]}")
    except (FileNotFoundError, CacheError):
        pass  # reported by the asset check
    shards = manifest["shards"]
    part = S.parse_part(spec.part) or (1, 1)  # part i/n holds shards i-1, i-1+n, ...
    expected = list(range(part[0] - 1, part[0] - 1 + part[1] * len(shards), part[1]))
    if [s.get("shard") for s in shards] != expected:
        report.problems.append(f"{where}: shards are not numbered {expected[:3]}… in order")
    totals = manifest["totals"]
    for key, of in (("examples", "examples"), ("tokens", "tokens"), ("answers", "answers"), ("shard_bytes", "bytes")):
        held = sum(int(s.get(of, 0)) for s in shards)
        if held != totals.get(key):
            report.problems.append(f"{where}: totals.{key} is {totals.get(key)}, the shards hold {held}")
    per_split: dict[str, int] = {}
    for s in shards:
        per_split[s.get("split")] = per_split.get(s.get("split"), 0) + int(s.get("examples", 0))
    if totals.get("splits") != per_split or set(per_split) - set(spec.splits):
        report.problems.append(f"{where}: totals.splits {totals.get('splits')} do not match the shards {per_split}")
    for s in shards:
        name = S.shard_name(int(s.get("shard", -1)))
        if s.get("name") != name:
            report.problems.append(f"{where}: shard {s.get('shard')} is named {s.get('name')!r}, expected {name!r}")
        if s.get("bytes") != sum(int(f[1]) for f in s.get("files", [])):
            report.problems.append(f"{where}: {name} bytes is not the sum of its file sizes")


def _safetensors_shape(data: bytes, tensor: str) -> list[int] | None:
    """The shape of `tensor` from a safetensors file's JSON header (None when it cannot be read)."""
    try:
        size = int.from_bytes(data[:8], "little")
        return list(json.loads(data[8 : 8 + size])[tensor]["shape"])
    except (ValueError, KeyError, TypeError):
        return None


def _check_assets(loc: CacheLocation, manifest: dict, report: VerifyReport) -> None:
    assets = manifest["assets"]
    for need in (S.HEAD_FILE, S.ITEM_EMBEDDINGS_FILE, S.TEACHER_CONFIG_FILE):
        if need not in assets:
            report.problems.append(f"{S.MANIFEST}: asset {need} is not listed")
    if not any(rel.startswith(S.TOKENIZER_DIR + "/") for rel in assets):
        report.problems.append(f"{S.MANIFEST}: no {S.TOKENIZER_DIR}/ files are listed")
    for rel, entry in assets.items():
        try:
            data = loc.read_bytes(rel)
        except FileNotFoundError:
            report.problems.append(f"{rel}: missing")
            continue
        if len(data) != entry.get("bytes") or bytes_digest([data]) != entry.get("sha256"):
            report.problems.append(f"{rel}: checksum or size mismatch (corrupted)")
    if loc.is_local and (loc.local_root / S.ASSETS).is_dir():
        stray = sorted(f"{S.ASSETS}/{rel}" for rel, _ in list_local_files(loc.local_root / S.ASSETS)
                       if f"{S.ASSETS}/{rel}" not in assets)
        if stray:
            report.problems.append(f"{', '.join(stray[:3])}: not listed in the manifest (stray files)")


def _check_index(loc: CacheLocation, manifest: dict, report: VerifyReport) -> pl.DataFrame | None:
    try:
        raw = loc.read_bytes(S.INDEX)
    except FileNotFoundError:
        report.problems.append(f"{S.INDEX}: missing")
        return None
    entry = manifest["index"]
    if bytes_digest([raw]) != entry.get("sha256") or len(raw) != entry.get("bytes"):
        report.problems.append(f"{S.INDEX}: checksum or size mismatch (corrupted or replaced)")
        return None
    try:
        index = pl.read_parquet(io.BytesIO(raw))
    except Exception as e:  # noqa: BLE001 - any Parquet decoding error means the same: unreadable
        report.problems.append(f"{S.INDEX}: unreadable Parquet ({type(e).__name__}: {e})")
        return None
    if dict(index.schema) != S.index_schema():
        report.problems.append(f"{S.INDEX}: columns {dict(index.schema)}, expected {S.index_schema()}")
        return None
    if index.height != entry.get("rows"):  # (totals.examples against the shards: _check_manifest_fields)
        report.problems.append(f"{S.INDEX}: {index.height} rows, the manifest's index.rows says {entry.get('rows')}")
    if index["example_id"].n_unique() != index.height:
        report.problems.append(f"{S.INDEX}: example ids are not unique")
    known = {int(s["shard"]) for s in manifest["shards"]}
    stray = set(index["shard"].unique().to_list()) - known
    if stray:
        report.problems.append(f"{S.INDEX}: rows point to shards {sorted(stray)[:5]} that the manifest does not list")
    return index


def _check_shard(loc: CacheLocation, spec: S.CacheSpec, entry: dict, index: pl.DataFrame | None,
                 report: VerifyReport) -> None:
    sid = int(entry["shard"])
    name = S.shard_name(sid)
    rel_root = S.shard_path(sid)
    files = [(rel, int(size)) for rel, size, _ in entry["files"]]
    shas = {rel: sha for rel, _, sha in entry["files"]}
    if loc.is_local:
        on_disk = list_local_files(loc.local_root / rel_root) if (loc.local_root / rel_root).is_dir() else []
        if not on_disk:
            report.bad(name, ": folder missing")
            return
        extra = sorted({f for f, _ in on_disk} - set(shas))
        if extra:
            report.bad(name, f"/{extra[0]}: not listed in the manifest (stray file)")
        sizes = dict(on_disk)
        for rel, size in files:
            if rel not in sizes:
                report.bad(name, f"/{rel}: missing")
            elif sizes[rel] != size:
                report.bad(name, f"/{rel}: {sizes[rel]} bytes, the manifest says {size}")
        if name in report.bad_shards:
            return
    try:
        digest, per_file = files_digest(files, lambda rel: loc.iter_bytes(f"{rel_root}/{rel}"))
    except FileNotFoundError as e:
        report.bad(name, f": file missing ({e.filename or e})")
        return
    except ValueError as e:
        report.bad(name, f": file truncated or grown ({e})")
        return
    report.bytes_checked += sum(size for _, size in files)
    damaged = [rel for rel, sha in per_file.items() if sha != shas[rel]]
    for rel in damaged:
        report.bad(name, f"/{rel}: checksum mismatch (corrupted)")
    if digest != entry["sha256"] and not damaged:
        report.bad(name, ": the shard checksum in the manifest does not match its files")
    if damaged:
        return
    try:
        _check_shard_content(loc.zarr_store(rel_root), spec, entry, index, name, report)
    except _READ_ERRORS as e:
        report.bad(name, f": unreadable ({e})")


def _check_shard_content(store, spec: S.CacheSpec, entry: dict, index: pl.DataFrame | None, name: str,
                         report: VerifyReport) -> None:
    """Row counts, array shapes, the example ids digest, and the index rows of this shard."""
    counts = {"tokens": entry["tokens"], "answers": entry["answers"], "examples": entry["examples"]}
    examples: dict[str, np.ndarray] = {}
    for a in S.array_defs(spec):
        arr = open_array(store, a.name)
        fixed = [c for c in a.columns if isinstance(c, int)]
        if arr.shape[0] != counts[a.rows] or list(arr.shape[1 : 1 + len(fixed)]) != fixed:
            report.bad(name, f"/{a.name}: shape {arr.shape}, expected ({counts[a.rows]}, {', '.join(map(str, a.columns))})")
        if a.rows == "examples":
            examples[a.name] = np.asarray(arr[...])
        if a.scale_of:  # a float8 row's value is byte x scale: a scale that is not finite and > 0 decodes garbage
            scales = np.asarray(arr[...])
            if scales.dtype != np.float32 or not (np.isfinite(scales) & (scales > 0)).all():
                report.bad(name, f"/{a.name}: scales must be finite float32 > 0")
    if len(examples) < len(S.example_array_names(spec)):
        return
    if example_ids_digest(examples[S.EXAMPLE_ID].tolist()) != entry.get("example_ids_sha256"):
        report.bad(name, ": example_ids_sha256 in the manifest does not match its example ids")
    if int(examples[S.EXAMPLE_TOKEN_LENGTH].sum()) != entry["tokens"] or \
            int(examples[S.EXAMPLE_ANSWER_LENGTH].sum()) != entry["answers"]:
        report.bad(name, ": token/answer lengths do not add up to the manifest counts")
    for offsets, lengths in ((S.EXAMPLE_TOKEN_OFFSET, S.EXAMPLE_TOKEN_LENGTH), (S.EXAMPLE_ANSWER_OFFSET, S.EXAMPLE_ANSWER_LENGTH)):
        n = examples[lengths]
        if not np.array_equal(examples[offsets], np.concatenate([[0], np.cumsum(n)[:-1]]) if len(n) else n):
            report.bad(name, f"/{offsets}: offsets are not contiguous in storage order")
    if index is not None:
        rows = index.filter(pl.col("shard") == entry["shard"])
        if not S.index_rows(spec, examples, entry["split"], entry["shard"]).equals(rows):
            report.bad(name, f": its examples/* arrays and the {S.INDEX} rows differ")


def _storage_text(dtype: str) -> str:
    if dtype == S.FLOAT8:
        return (f"hidden states {S.FLOAT8_STORAGE} ({S.FLOAT8_E4M3}) + {S.SCALE_DTYPE} scale per row; other floats "
                f"{S.FLOAT8_OTHERS} as {S.STORAGE_DTYPES[S.FLOAT8_OTHERS]}")
    return S.STORAGE_DTYPES.get(dtype, "?")


def cache_info(path_or_url: str | os.PathLike | CacheLocation, storage_options: dict | None = None) -> dict:
    """A summary of a cache (works on an incomplete one too: `complete` is then False)."""
    loc = _location(path_or_url, storage_options)
    manifest = read_manifest(loc, complete=False)
    spec = manifest.get("spec", {})
    totals = manifest.get("totals", {})
    shards = manifest.get("shards", [])
    sizes = {"shards": sum(int(s["bytes"]) for s in shards),
             "index": int(manifest.get("index", {}).get("bytes", 0)),
             "assets": sum(int(a["bytes"]) for a in manifest.get("assets", {}).values())}
    sizes["total"] = sum(sizes.values())
    tokens, answers = int(totals.get("tokens", 0)), int(totals.get("answers", 0))
    info = {
        "path": str(loc),
        "digest": manifest.get("digest"),
        "content_id": _content_id(manifest),
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
        "storage_dtype": _storage_text(spec.get("dtype", "")),
        "positions": spec.get("positions"),
        "logits": spec.get("logits"),
        "compression": spec.get("compression"),
        "examples_per_shard": spec.get("examples_per_shard"),
        "shards": len(shards),
        "examples": int(totals.get("examples", 0)),
        "splits": totals.get("splits", {}),
        "tokens": tokens,
        "answer_tokens": answers,
        "bytes": sizes,
        "bytes_per_token": sizes["shards"] / tokens if tokens else None,
        "bytes_per_answer_token": sizes["shards"] / answers if answers else None,
        "array_bytes": _array_bytes(manifest),
    }
    if not info["complete"] and loc.is_local:
        journals = (loc.local_root / S.JOURNAL).glob("rank-*.jsonl")
        info["shards_written"] = sum(1 for p in journals for line in p.read_text().splitlines() if line.strip())
    return info


def _content_id(manifest: dict) -> str | None:
    """The content identity of a sealed cache; None while it is being written."""
    if manifest.get("complete") is not True:
        return None
    try:
        return content_identity(manifest)
    except (KeyError, TypeError, AttributeError):
        return None


def _array_bytes(manifest: dict) -> dict[str, int]:
    """Bytes on disk per array name over all shards (group metadata under "metadata")."""
    arrays = set(manifest.get("arrays", {}))
    out: dict[str, int] = {}
    for shard in manifest.get("shards", []):
        for rel, size, *_ in shard["files"]:
            parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
            name = parent if parent in arrays else "metadata"
            out[name] = out.get(name, 0) + int(size)
    return dict(sorted(out.items()))
