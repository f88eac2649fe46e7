"""Writing a teacher cache: atomic shards, a per-rank journal, resume, and sealing.

A shard is part of the cache only when its folder was renamed into place AND a line for it was
appended (fsync'd) to its rank's journal. Anything else found on restart (temp folders,
renamed-but-unjournaled shards) is deleted and written again, so an interrupted run finishes
with the same content as an uninterrupted one. Rank 0 seals: it checks that every planned shard
is journaled, writes the merged index, then the manifest with complete=true (atomically, last).
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
from safetensors.torch import save_file

from c2kd import __version__
from c2kd.atomic import check_destination, publish_dir, staged_dir, temp_sibling, write_bytes
from c2kd.cache_schema import schema as S
from c2kd.cache_schema.checksum import bytes_digest, files_digest
from c2kd.cache_schema.dtypes import quantize_e4m3, to_storage
from c2kd.cache_schema.plan import ShardPlan, example_ids_digest
from c2kd.cache_schema.records import ExampleRecord, check_record
from c2kd.cache_schema.schema import CacheSpec
from c2kd.cache_schema.storage import list_local_files
from c2kd.cache_schema.zarr_io import open_array, write_group
from c2kd.errors import CacheError

_WRITER_DIRS = {S.SHARDS, S.JOURNAL, S.ASSETS}
_WRITER_FILES = {S.MANIFEST, S.INDEX}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _read_local(root: Path):
    def read(rel: str):
        with open(root / rel, "rb") as f:
            while block := f.read(8 * 1024 * 1024):
                yield block

    return read


def _ints(x: Any) -> np.ndarray:
    return np.asarray(torch.as_tensor(x).cpu().numpy(), dtype=np.int64).reshape(-1)


def _padded(rows: Sequence[Sequence[int]]) -> np.ndarray:
    width = max((len(r) for r in rows), default=0)
    out = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = np.asarray(r, dtype=np.int32)
    return out


def _floats(parts: list[Any], width: int, logical: str) -> np.ndarray:
    if not parts:
        return to_storage(torch.zeros(0, width), logical)
    return to_storage(torch.cat([torch.as_tensor(p).reshape(-1, width) for p in parts]), logical)


class CacheWriter:
    """Writes shards of one cache; one instance per rank, each writing shard_id % world_size == rank."""

    def __init__(self, root: str | os.PathLike, spec: CacheSpec, rank: int = 0, world_size: int = 1) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise CacheError(f"rank {rank} is not in 0..{world_size - 1}")
        self.root = Path(root).expanduser().resolve()
        self.spec = spec
        self.spec_hash = spec.spec_hash
        self.content_hash = spec.content_hash
        self.rank, self.world_size = rank, world_size
        self.already_complete = self._check_existing()
        self._entries: dict[int, dict] = {}
        if self.already_complete:  # a sealed cache is never touched (it may even lack its journal)
            return
        (self.root / S.SHARDS).mkdir(parents=True, exist_ok=True)
        (self.root / S.JOURNAL).mkdir(parents=True, exist_ok=True)
        if rank == 0:
            self._write_manifest({"complete": False, "created_at": _now()})
        self._repair_own_journal()
        self._entries = self._read_journals()
        self._clean_leftovers()

    # --- starting / resuming ------------------------------------------------------------------
    def _check_existing(self) -> bool:
        """Refuse a folder holding something else; say whether it holds this cache, finished."""
        manifest_path = self.root / S.MANIFEST
        if self.root.exists() and not self.root.is_dir():
            raise CacheError(f"{self.root}: exists and is not a folder; choose another output folder")
        check_destination(self.root)  # before any folder is made: a read-only place, /proc, a file in the way
        if manifest_path.is_file():
            manifest = S.parse_manifest(manifest_path.read_bytes(), str(manifest_path))
            if manifest.get("schema_version") != self.spec.schema_version:
                raise CacheError(
                    f"{self.root}: a cache of schema version {manifest.get('schema_version')!r}; this c2kd writes "
                    f"version {self.spec.schema_version} for these settings — choose another output folder"
                )
            if manifest.get("spec_hash") != self.spec_hash:
                raise CacheError(
                    f"{self.root}: holds a cache made with other settings (teacher, data, layers, "
                    "positions, logits, dtype, compression or shard size); choose another output folder "
                    "or delete this one"
                )
            return bool(manifest.get("complete"))
        if self.root.is_dir():
            foreign = [
                p.name
                for p in self.root.iterdir()
                if p.name not in _WRITER_DIRS | _WRITER_FILES and not p.name.startswith(S.TMP_PREFIX)
            ]
            if foreign:
                raise CacheError(
                    f"{self.root}: not empty and not a teacher cache (found {', '.join(sorted(foreign)[:5])}); "
                    "choose an empty or new output folder"
                )
        return False

    def _write_manifest(self, fields: dict) -> None:
        manifest = {
            "format": S.FORMAT,
            "schema_version": self.spec.schema_version,
            "complete": False,
            "created_by": f"c2kd {__version__}",
            "spec_hash": self.spec_hash,
            "spec": self.spec.to_dict(),
            "dtype": self.spec.dtype_field(),
            **fields,
        }
        if manifest["complete"]:
            manifest["digest"] = S.manifest_digest(manifest)
        write_bytes(self.root / S.MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode(), durable=True)

    def _journal_path(self, rank: int) -> Path:
        return self.root / S.journal_name(rank)

    def _repair_own_journal(self) -> None:
        """Drop a half-appended last line (a crash during the append): its shard gets rewritten."""
        path = self._journal_path(self.rank)
        if not path.is_file():
            return
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            write_bytes(path, data[: data.rfind(b"\n") + 1], durable=True)

    def _read_journals(self) -> dict[int, dict]:
        """The latest journal entry per shard, from the journals of every rank."""
        entries: dict[int, dict] = {}
        for path in sorted((self.root / S.JOURNAL).glob("rank-*.jsonl")):
            data = path.read_bytes()
            lines = data.split(b"\n")
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    if number == len(lines) and not data.endswith(b"\n"):
                        continue  # a line being appended right now (or torn by a crash): not a finished shard
                    raise CacheError(f"{path}: line {number} is not a journal entry (the journal is damaged); "
                                     "delete the cache folder and write it again") from None
                if entry.get("spec_hash") != self.content_hash:
                    raise CacheError(
                        f"{path}: shards of a cache made with other settings; choose another output folder"
                    )
                sid = int(entry["shard"])
                if sid not in entries or entry["written_ns"] >= entries[sid]["written_ns"]:
                    entries[sid] = entry
        return entries

    def _refuse_if_sealed(self) -> None:
        if self.already_complete:
            raise CacheError(f"{self.root}: the cache is sealed (complete); it is never written again")

    def _owns(self, shard_id: int) -> bool:
        return shard_id % self.world_size == self.rank

    def _clean_leftovers(self) -> None:
        """Delete this rank's temp folders and its renamed-but-unjournaled shards."""
        shards = self.root / S.SHARDS
        for p in shards.iterdir():
            name = p.name
            if name.startswith(S.TMP_PREFIX):  # .tmp-shard-00003-<pid>-<random>
                sid = S.parse_shard_name("-".join(name[len(S.TMP_PREFIX) :].split("-")[:2]))
                if sid is None or self._owns(sid):
                    shutil.rmtree(p, ignore_errors=True)
                continue
            sid = S.parse_shard_name(name)
            if sid is not None and self._owns(sid) and sid not in self._entries:
                shutil.rmtree(p)
        if self.rank == 0:
            for p in self.root.iterdir():
                if p.name.startswith(S.TMP_PREFIX):
                    shutil.rmtree(p) if p.is_dir() else p.unlink()

    def manifest(self) -> dict:
        """The manifest as it is on disk now."""
        return json.loads((self.root / S.MANIFEST).read_text())

    def done_shards(self) -> set[int]:
        """Shards already part of the cache (journaled and present): skip them on resume."""
        return {sid for sid in self._entries if (self.root / S.shard_path(sid)).is_dir()}

    # --- writing ------------------------------------------------------------------------------
    def write_assets(
        self,
        tokenizer: Any,
        head_weight: torch.Tensor,
        item_embeddings: torch.Tensor,
        teacher_config: dict,
    ) -> None:
        """Write assets/ (tokenizer, LM head [V, d], item embeddings, teacher config) atomically."""
        self._refuse_if_sealed()
        if self.rank != 0:
            raise CacheError("only rank 0 writes the cache assets")
        head = torch.as_tensor(head_weight).detach().cpu().contiguous()
        if tuple(head.shape) != (self.spec.vocab_size, self.spec.hidden_size):
            raise CacheError(
                f"teacher head weight shape {tuple(head.shape)}, expected "
                f"{(self.spec.vocab_size, self.spec.hidden_size)} (vocab, hidden)"
            )
        emb = torch.as_tensor(item_embeddings).detach().cpu().contiguous()
        if emb.ndim != 2 or not emb.is_floating_point():
            raise CacheError(f"item embeddings must be a 2-D float tensor, got {tuple(emb.shape)} {emb.dtype}")
        if not (hasattr(tokenizer, "save_pretrained") or Path(tokenizer).is_dir()):
            raise CacheError(f"tokenizer {tokenizer!r}: expected a tokenizer object or a tokenizer folder")
        with staged_dir(self.root / S.ASSETS, replace=True, durable=True) as tmp:
            if hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(str(tmp / "tokenizer"))
            else:
                shutil.copytree(tokenizer, tmp / "tokenizer")
            save_file({S.HEAD_TENSOR: head}, str(tmp / Path(S.HEAD_FILE).name))
            save_file({S.ITEM_EMBEDDINGS_TENSOR: emb}, str(tmp / Path(S.ITEM_EMBEDDINGS_FILE).name))
            (tmp / Path(S.TEACHER_CONFIG_FILE).name).write_text(json.dumps(teacher_config, indent=1, sort_keys=True))

    def write_shard(self, shard_id: int, records: Sequence[ExampleRecord]) -> dict:
        """Write one whole shard (all its examples, in order) and record it; returns its journal entry."""
        self._refuse_if_sealed()
        if not self._owns(shard_id):
            raise CacheError(f"shard {shard_id} belongs to rank {shard_id % self.world_size}, not rank {self.rank}")
        if not self.spec.owns(shard_id):
            raise CacheError(f"shard {shard_id} is not in part {self.spec.part} of the plan")
        if not records:
            raise CacheError(f"shard {shard_id}: no examples")
        split = records[0].split
        for rec in records:
            check_record(rec, self.spec, split)
        arrays, n_tok, n_ans = self._assemble(records)
        attrs = {
            "shard_id": shard_id,
            "split": split,
            "examples": len(records),
            "tokens": n_tok,
            "answers": n_ans,
            "spec_hash": self.content_hash,
            "positions": self.spec.positions,
            "layers": list(self.spec.layers),
        }
        final = self.root / S.shard_path(shard_id)
        tmp = temp_sibling(final)
        try:
            write_group(tmp, arrays, attrs, self.spec.compression_codec, self.spec.schema_version)
            files = list_local_files(tmp)
            digest, per_file = files_digest(files, _read_local(tmp))
            publish_dir(tmp, final, replace=True, durable=True)  # replaces an unjournaled leftover of an earlier run
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        entry = {
            "shard": shard_id,
            "name": S.shard_name(shard_id),
            "split": split,
            "examples": len(records),
            "tokens": n_tok,
            "answers": n_ans,
            "bytes": sum(size for _, size in files),
            "sha256": digest,
            "files": [[rel, size, per_file[rel]] for rel, size in files],
            "example_ids_sha256": example_ids_digest([r.example_id for r in records]),
            "spec_hash": self.content_hash,
            "rank": self.rank,
            "written_ns": time.time_ns(),
        }
        self._journal(entry)
        return entry

    def _journal(self, entry: dict) -> None:
        """Append a finished shard's line to this rank's journal (fsync'd): now it is part of the cache."""
        with open(self._journal_path(self.rank), "ab") as f:
            f.write((json.dumps(entry, separators=(",", ":")) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        self._entries[int(entry["shard"])] = entry

    def adopt_assets(self, folder: Path) -> None:
        """Copy the assets folder of another cache of the same teacher (`cache merge`)."""
        self._refuse_if_sealed()
        with staged_dir(self.root / S.ASSETS, replace=True, durable=True) as tmp:
            shutil.copytree(folder, tmp, dirs_exist_ok=True)

    def adopt_shard(self, entry: dict, folder: Path) -> None:
        """Take a finished shard of another cache of this content (`cache merge`): its files are
        checked against `entry` (that cache's manifest entry), copied in whole, then journaled."""
        self._refuse_if_sealed()
        sid = int(entry["shard"])
        if not self._owns(sid) or not self.spec.owns(sid):
            raise CacheError(f"shard {sid} does not belong to this cache")
        final = self.root / S.shard_path(sid)
        tmp = temp_sibling(final)
        try:
            shutil.copytree(folder, tmp)
            files = list_local_files(tmp)
            if files != [(rel, size) for rel, size, _ in entry["files"]]:
                raise CacheError(f"{folder}: its files differ from its manifest entry; run `c2kd cache verify` on it")
            _, per_file = files_digest(files, _read_local(tmp))
            bad = [rel for rel, _, sha in entry["files"] if per_file[rel] != sha]
            if bad:
                raise CacheError(f"{folder}/{bad[0]}: checksum does not match its manifest; run `c2kd cache verify` on it")
            publish_dir(tmp, final, replace=True, durable=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self._journal({**entry, "spec_hash": self.content_hash, "rank": self.rank, "written_ns": time.time_ns()})

    def _assemble(self, records: Sequence[ExampleRecord]) -> tuple[dict, int, int]:
        """The shard's arrays, as `schema.array_defs` lays them out."""
        spec = self.spec
        tok_len = np.array([r.num_tokens for r in records], dtype=np.int32)
        ans_len = np.array([len(r.answers) for r in records], dtype=np.int32)
        per_example = {
            "example_id": [r.example_id for r in records], "user": [r.user for r in records],
            "target": [r.target for r in records], "history": _padded([list(r.history) for r in records]),
            "candidates": _padded([list(r.candidates) for r in records]),
            "token_offset": np.concatenate([[0], np.cumsum(tok_len, dtype=np.int64)[:-1]]), "token_length": tok_len,
            "answer_offset": np.concatenate([[0], np.cumsum(ans_len, dtype=np.int64)[:-1]]), "answer_length": ans_len,
        }
        arrays: dict[str, tuple[np.ndarray, dict, tuple[str, ...], bool]] = {}
        defs = {a.name: a for a in S.array_defs(spec)}
        for a in defs.values():
            if a.scale_of:
                continue  # written with the float8 array it scales
            if a.rows == "examples":
                data = np.asarray(per_example[a.field], dtype=a.dtype)
            else:
                parts = [r.values(a) for r in records]
                width = int(np.prod(a.columns)) if a.columns else 1
                if a.is_quantized:  # the record's floats (any dtype) -> e4m3 bytes + per-row scales
                    data, scale = quantize_e4m3(_floats(parts, width, "float32"))
                    arrays[a.name] = (data, {S.LOGICAL_DTYPE_ATTR: S.FLOAT8_E4M3, S.SCALE_ATTR: a.scale}, a.dims,
                                      a.feature_major)
                    arrays[a.scale] = (scale, {S.LOGICAL_DTYPE_ATTR: S.SCALE_DTYPE}, defs[a.scale].dims, False)
                    continue
                if a.is_float:
                    data = _floats(parts, width, spec.float_dtype)
                else:
                    data = np.concatenate([_ints(p) for p in parts]).astype(a.dtype).reshape(-1, *a.columns)
            arrays[a.name] = (data, {S.LOGICAL_DTYPE_ATTR: spec.float_dtype} if a.is_float else {}, a.dims, a.feature_major)
        return arrays, int(tok_len.sum()), int(ans_len.sum())

    # --- sealing ------------------------------------------------------------------------------
    def seal(self, plan: ShardPlan) -> dict:
        """Rank 0, after every rank finished: write index.parquet, then the complete manifest."""
        self._refuse_if_sealed()
        if self.rank != 0:
            raise CacheError("only rank 0 seals the cache")
        self._entries = self._read_journals()  # other ranks have appended since we started
        planned = {s.shard_id: s for s in plan.shards}
        missing = [sid for sid in planned if sid not in self.done_shards()]
        if missing:
            raise CacheError(
                f"{self.root}: cannot seal, {len(missing)} planned shard(s) not written "
                f"(first: {', '.join(S.shard_name(s) for s in missing[:5])})"
            )
        extra = sorted(set(self._entries) - set(planned))
        if extra:
            raise CacheError(f"{self.root}: journaled shards {extra[:5]} are not in the plan")
        for sid, ps in planned.items():
            entry = self._entries[sid]
            if entry["example_ids_sha256"] != ps.digest or entry["split"] != ps.split:
                raise CacheError(f"{self.root}: {S.shard_name(sid)} holds other examples than planned")
            on_disk = list_local_files(self.root / S.shard_path(sid))
            if on_disk != [(rel, size) for rel, size, _ in entry["files"]]:
                raise CacheError(f"{self.root}: {S.shard_name(sid)} files differ from its journal entry")
        self._check_assets()
        index = self._build_index(plan)
        index_path = self.root / S.INDEX
        buffer = io.BytesIO()
        index.write_parquet(buffer, compression="zstd", statistics=True)
        write_bytes(index_path, buffer.getvalue(), durable=True)
        shards = [{k: v for k, v in self._entries[s.shard_id].items() if k not in ("spec_hash", "written_ns")} for s in plan.shards]
        per_split: dict[str, int] = {}
        for s in shards:
            per_split[s["split"]] = per_split.get(s["split"], 0) + s["examples"]
        manifest_fields = {
            "complete": True,
            "created_at": self._created_at(),
            "sealed_at": _now(),
            "teacher_config": json.loads((self.root / S.TEACHER_CONFIG_FILE).read_text()),
            "arrays": S.array_layout(self.spec),
            "assets": self._asset_list(),
            "index": {
                "path": S.INDEX,
                "rows": index.height,
                "bytes": index_path.stat().st_size,
                "sha256": bytes_digest(_read_local(self.root)(S.INDEX)),
            },
            "shards": shards,
            "totals": {
                "examples": sum(s["examples"] for s in shards),
                "tokens": sum(s["tokens"] for s in shards),
                "answers": sum(s["answers"] for s in shards),
                "shard_bytes": sum(s["bytes"] for s in shards),
                "splits": per_split,
            },
        }
        self._write_manifest(manifest_fields)
        for p in (self.root / S.SHARDS).iterdir():
            if p.name.startswith(S.TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
        self.already_complete = True
        return json.loads((self.root / S.MANIFEST).read_text())

    def _created_at(self) -> str:
        try:
            return json.loads((self.root / S.MANIFEST).read_text()).get("created_at") or _now()
        except (OSError, json.JSONDecodeError):
            return _now()

    def _check_assets(self) -> None:
        need = [S.HEAD_FILE, S.ITEM_EMBEDDINGS_FILE, S.TEACHER_CONFIG_FILE]
        missing = [p for p in need if not (self.root / p).is_file()]
        if not (self.root / S.TOKENIZER_DIR).is_dir():
            missing.append(S.TOKENIZER_DIR)
        if missing:
            raise CacheError(f"{self.root}: cannot seal, assets missing: {', '.join(missing)} (call write_assets)")

    def _asset_list(self) -> dict[str, dict]:
        read = _read_local(self.root)
        return {
            f"{S.ASSETS}/{rel}": {"bytes": size, "sha256": bytes_digest(read(f"{S.ASSETS}/{rel}"))}
            for rel, size in list_local_files(self.root / S.ASSETS)
        }

    def _build_index(self, plan: ShardPlan) -> pl.DataFrame:
        frames = []
        for ps in plan.shards:
            store = str(self.root / S.shard_path(ps.shard_id))
            arrays = {name: np.asarray(open_array(store, name)[...]) for name in S.example_array_names(self.spec)}
            frames.append(S.index_rows(self.spec, arrays, ps.split, ps.shard_id))
        index = pl.concat(frames) if frames else pl.DataFrame(schema=S.index_schema())
        if index["example_id"].n_unique() != index.height:
            raise CacheError(f"{self.root}: an example id appears in more than one shard")
        return index
