"""Reading a teacher cache (directory or URL, read-only): refusals, random access, content digest.

`TeacherCache.open` refuses before any training a cache that is missing, incomplete, of an
unknown schema version, whose manifest was edited (its digest), whose index or assets do not
match their checksums, or that does not fit the caller's expectation. The first time a shard is
touched, its files' sizes and metadata checksums are checked and its `examples/*` arrays are
compared with the index rows (the two copies of per-example data must agree); every chunk read
is crc32c-checked by Zarr. `c2kd cache verify` checks everything, every byte. Zarr arrays are
opened lazily per process, so the object can be pickled into DataLoader workers.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
from safetensors.torch import load as load_safetensors

from c2kd.cache_schema import schema as S
from c2kd.cache_schema.batch import CachedBatch
from c2kd.cache_schema.checksum import bytes_digest
from c2kd.cache_schema.consistency import check_array, check_open
from c2kd.cache_schema.identity import content_identity
from c2kd.cache_schema.dtypes import TORCH_DTYPES, dequantize_e4m3, from_storage
from c2kd.cache_schema.expect import CacheExpectation, check_expectation
from c2kd.cache_schema.storage import CacheLocation
from c2kd.cache_schema.zarr_io import open_array, read_rows
from c2kd.errors import CacheError
from c2kd.heap import trim

_DECODE_ERRORS = (ValueError, RuntimeError, OSError, KeyError)


def read_manifest(location: CacheLocation, complete: bool = True) -> dict:
    """The manifest of a cache (CacheError naming the file otherwise); with `complete`, only of a
    sealed, unmodified cache of a schema version this code reads."""
    try:
        raw = location.read_bytes(S.MANIFEST)
    except FileNotFoundError:
        raise CacheError(
            f"{location}: no {S.MANIFEST} — not a teacher cache, or one whose writing has not started"
        ) from None
    manifest = S.parse_manifest(raw, f"{location}/{S.MANIFEST}")
    return S.check_manifest(manifest, str(location)) if complete else manifest


def _concat_ranges(offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    if lengths.sum() == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(o, o + n, dtype=np.int64) for o, n in zip(offsets, lengths)])


class TeacherCache:
    """A sealed teacher cache. Use `TeacherCache.open(path_or_url, expect=...)`."""

    def __init__(self, location: CacheLocation, manifest: dict, index: pl.DataFrame) -> None:
        self.location = location
        self.manifest = manifest
        self.spec = S.CacheSpec.from_dict(manifest["spec"])
        self.layout = S.array_layout(self.spec)
        self._defs = {a.name: a for a in S.array_defs(self.spec)}
        self.index = index
        self._shard_entries = {int(s["shard"]): s for s in manifest["shards"]}
        ids = index["example_id"].to_numpy()
        self._order = np.argsort(ids, kind="stable")
        self._sorted_ids = ids[self._order]
        self._col = {  # the index as numpy columns: the read path never touches polars (not fork-safe)
            name: index[name].to_numpy()
            for name in ("example_id", "shard", "token_offset", "token_length", "answer_offset", "answer_length",
                         "user", "target")
        }
        self._col["candidates"] = _pad_lists(index["candidates"].to_list())
        self._col["history"] = _pad_lists(index["history"].to_list())
        self._handles: dict[tuple[int, str], Any] = {}  # per process: zarr arrays opened so far
        self._checked: set[int] = set()  # shards whose files were checked against the manifest
        self._handles_pid = os.getpid()
        # decoded arrays of the shards read last (keep_decoded): a shard-aware order reads each shard's
        # examples over several reads, and decoding its chunks once beats decoding them on every read
        self._decoded: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()
        self._decoded_capacity = 0
        self._decoded_lock = threading.Lock()

    # --- opening ------------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        path_or_url: str | os.PathLike,
        expect: CacheExpectation | Mapping | None = None,
        *,
        storage_options: dict | None = None,
        read_cache: str | os.PathLike | None = None,
    ) -> TeacherCache:
        """Open a cache read-only (see the module docstring for what is checked when); for a URL,
        `read_cache` is a local folder that keeps each fetched file (see CacheLocation)."""
        location = CacheLocation(path_or_url, storage_options, read_cache)
        manifest = read_manifest(location)
        location.use_digest(manifest["digest"])
        spec = S.CacheSpec.from_dict(manifest["spec"])
        if manifest["arrays"] != S.array_layout(spec):
            raise CacheError(f"{location}/{S.MANIFEST}: the array layout does not follow from the spec (damaged)")
        check_expectation(spec, expect, str(location))
        if location.is_local and (location.local_root / S.SHARDS).is_dir():
            listed = {entry["name"] for entry in manifest["shards"]}
            stray = sorted(p.name for p in (location.local_root / S.SHARDS).iterdir()
                           if p.name not in listed and not p.name.startswith(S.TMP_PREFIX))
            if stray:
                raise CacheError(f"{location}/{S.SHARDS}: {', '.join(stray[:3])} not listed in the manifest; "
                                 "run `c2kd cache verify`")
        try:
            raw = location.read_bytes(S.INDEX)
        except FileNotFoundError:
            raise CacheError(f"{location}/{S.INDEX}: missing; the cache is incomplete or damaged") from None
        if bytes_digest([raw]) != manifest["index"]["sha256"]:
            raise CacheError(f"{location}/{S.INDEX}: checksum does not match the manifest (corrupted or replaced)")
        index = pl.read_parquet(io.BytesIO(raw))
        if dict(index.schema) != S.index_schema():
            raise CacheError(f"{location}/{S.INDEX}: columns {dict(index.schema)} are not the index schema")
        if index.height != manifest["totals"]["examples"]:
            raise CacheError(f"{location}/{S.INDEX}: {index.height} rows, manifest says {manifest['totals']['examples']}")
        check_open(manifest, spec, index, str(location))  # a digest recomputed after an edit
        return cls(location, manifest, index)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handles"], state["_checked"], state["_decoded"] = {}, set(), OrderedDict()
        del state["_decoded_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._handles_pid = -1
        self._decoded_lock = threading.Lock()

    def keep_decoded(self, shards: int) -> None:
        """Keep the decoded arrays of the last `shards` shards read (0: none). Memory: that many
        shards' arrays as read, e.g. 17 shards for CacheBatches' 4,096-example blocks."""
        with self._decoded_lock:
            self._decoded_capacity = max(0, int(shards))
            dropped = self._drop_decoded()
        if dropped:
            trim()

    # --- metadata -----------------------------------------------------------------------------
    @property
    def digest(self) -> str:
        """The cache's identity: the digest of its sealed manifest."""
        return self.manifest["digest"]

    @property
    def content_id(self) -> str:
        """What the cache holds, from what (`identity.py`): equal for equal content, wherever and
        whenever it was written."""
        return content_identity(self.manifest)

    @property
    def layers(self) -> tuple[int, ...]:
        return self.spec.layers

    @property
    def positions(self) -> str:
        return self.spec.positions

    def __len__(self) -> int:
        return self.index.height

    def split_ids(self, split: str) -> np.ndarray:
        """Example ids of a split, in storage order."""
        if split not in self.spec.splits:
            raise CacheError(f"{self.location}: split {split!r} is not cached (cached: {list(self.spec.splits)})")
        return self.index.filter(pl.col("split") == split)["example_id"].to_numpy()

    def teacher_config(self) -> dict:
        return json.loads(self._asset_bytes(S.TEACHER_CONFIG_FILE))

    def _asset_bytes(self, rel: str) -> bytes:
        entry = self.manifest["assets"].get(rel)
        if entry is None:
            raise CacheError(f"{self.location}: asset {rel} is not listed in the manifest")
        try:
            data = self.location.read_bytes(rel)
        except FileNotFoundError:
            raise CacheError(f"{self.location}/{rel}: missing; the cache is incomplete or damaged") from None
        if bytes_digest([data]) != entry["sha256"]:
            raise CacheError(f"{self.location}/{rel}: checksum does not match the manifest (corrupted)")
        return data

    def head_weight(self) -> torch.Tensor:
        """The teacher's LM head [V, d] in the dtype it was saved in."""
        return load_safetensors(self._asset_bytes(S.HEAD_FILE))[S.HEAD_TENSOR]

    def item_embeddings(self) -> torch.Tensor:
        """The SASRec item embeddings [N + 1, d_item] the prompts were built with (row 0 = padding)."""
        return load_safetensors(self._asset_bytes(S.ITEM_EMBEDDINGS_FILE))[S.ITEM_EMBEDDINGS_TENSOR]

    def tokenizer(self) -> Any:
        """The teacher's tokenizer (copied to a temp folder first when the cache is a URL)."""
        from transformers import AutoTokenizer

        prefix = S.TOKENIZER_DIR + "/"
        files = [rel for rel in self.manifest["assets"] if rel.startswith(prefix)]
        if not files:
            raise CacheError(f"{self.location}: the manifest lists no {S.TOKENIZER_DIR}/ files; the cache is damaged")
        with tempfile.TemporaryDirectory(prefix="c2kd-tokenizer-") as tmp:
            for rel in files:
                target = Path(tmp) / rel[len(prefix) :]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(self._asset_bytes(rel))
            return AutoTokenizer.from_pretrained(tmp)

    # --- random access ------------------------------------------------------------------------
    def shards_of(self, example_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The shard each of these examples is stored in (what a shard-aware read order groups by)."""
        return self._col["shard"][self._rows(np.asarray(example_ids, dtype=np.int64))]

    def _rows(self, example_ids: np.ndarray) -> np.ndarray:
        """Index rows of these example ids (CacheError naming the ones not cached)."""
        n = len(self._sorted_ids)
        if len(example_ids) == 0:
            return np.zeros(0, dtype=np.int64)
        if n:
            pos = np.clip(np.searchsorted(self._sorted_ids, example_ids), 0, n - 1)
            found = self._sorted_ids[pos] == example_ids
            if found.all():
                return self._order[pos]
            example_ids = example_ids[~found]
        raise CacheError(f"{self.location}: example id(s) {example_ids[:5].tolist()} are not in the cache")

    def _array(self, shard: int, name: str) -> Any:
        if self._handles_pid != os.getpid():  # a forked/spawned worker: open our own handles
            self._handles, self._checked, self._handles_pid = {}, set(), os.getpid()
        key = (shard, name)
        if key not in self._handles:
            rel = S.shard_path(shard)
            entry = self._shard_entries[shard]
            if shard not in self._checked:
                self._checked.add(shard)
                self._check_shard(shard, entry)
            try:
                arr = open_array(self.location.zarr_store(rel, files=entry["files"]), name)
            except _DECODE_ERRORS as e:
                raise CacheError(f"{self.location}/{rel}: array {name} cannot be opened ({e}); run `c2kd cache verify`") from e
            rows = {"tokens": entry["tokens"], "answers": entry["answers"], "examples": entry["examples"]}
            expected = rows[self.layout[name]["rows"]]
            if arr.shape[0] != expected:
                raise CacheError(f"{self.location}/{rel}: array {name} has {arr.shape[0]} rows, manifest says {expected}")
            check_array(self.location, self.spec, shard, entry, name, arr.shape)  # its width, its files' sha256
            self._handles[key] = arr
        return self._handles[key]

    def _check_shard(self, shard: int, entry: dict) -> None:
        """First touch of a shard: its files are there with their sizes (local caches), its small
        metadata files match their checksums, and its examples/* arrays agree with the index."""
        root = S.shard_path(shard)
        for rel, size, sha in entry["files"]:
            where = f"{self.location}/{root}/{rel}"
            if self.location.is_local:
                path = self.location.local_root / root / rel
                if not path.is_file() or path.stat().st_size != size:
                    raise CacheError(f"{where}: missing or of the wrong size; run `c2kd cache verify`")
            if rel.endswith("zarr.json"):
                try:
                    data = self.location.read_bytes(f"{root}/{rel}")
                except FileNotFoundError:
                    raise CacheError(f"{where}: missing; run `c2kd cache verify`") from None
                if bytes_digest([data]) != sha:
                    raise CacheError(f"{where}: checksum does not match the manifest (corrupted); run `c2kd cache verify`")
        # numpy only: polars is not fork-safe, and DataLoader workers are forked readers
        rows = np.nonzero(self._col["shard"] == shard)[0]
        for a in S.array_defs(self.spec):
            if a.rows != "examples":
                continue
            stored = self._fetch_all(shard, a.name)
            expected = self._col[a.field][rows]
            if a.columns == ("*",):  # zero-padded lists: the shard pads to its own longest
                width = stored.shape[1] if stored.ndim == 2 else 0
                same = np.array_equal(expected[:, :width], stored) and not expected[:, width:].any()
            else:
                same = np.array_equal(expected, stored)
            if not same:
                raise CacheError(f"{self.location}/{root}/{a.name}: differs from the {S.INDEX} rows of this shard; "
                                 "run `c2kd cache verify`")

    def _fetch_all(self, shard: int, name: str) -> np.ndarray:
        arr = self._array(shard, name)
        try:
            return np.asarray(arr[...])
        except _DECODE_ERRORS as e:
            raise CacheError(f"{self.location}/{S.shard_path(shard)}: array {name} is corrupted ({e}); "
                             "run `c2kd cache verify`") from e

    def _fetch(self, shard: int, name: str, offsets: np.ndarray, lengths: np.ndarray, whole: bool) -> np.ndarray:
        """The rows [offset, offset + length) of each example, concatenated; `whole`: from the shard's
        array decoded whole and kept (get_batches' whole_shards)."""
        if whole and self._decoded_capacity:
            return self._decoded_array(shard, name)[_concat_ranges(offsets, lengths)]
        arr = self._array(shard, name)
        total = int(lengths.sum())
        try:
            if total == 0:
                return np.zeros((0, *arr.shape[1:]), dtype=arr.dtype)
            lo, hi = int(offsets.min()), int((offsets + lengths).max())
            if 2 * total >= hi - lo:  # dense enough: one contiguous read, then pick rows
                return read_rows(arr, slice(lo, hi))[_concat_ranges(offsets - lo, lengths)]
            return read_rows(arr, _concat_ranges(offsets, lengths))
        except _DECODE_ERRORS as e:
            raise CacheError(
                f"{self.location}/{S.shard_path(shard)}: array {name} is corrupted ({e}); run `c2kd cache verify`"
            ) from e

    def _decoded_array(self, shard: int, name: str) -> np.ndarray:
        """The whole array `name` of `shard`, decoded once while the shard stays among the last read."""
        with self._decoded_lock:
            arrays = self._decoded.get(shard)
            if arrays is not None:
                self._decoded.move_to_end(shard)
                if name in arrays:
                    return arrays[name]
        data = self._fetch_all(shard, name)
        with self._decoded_lock:
            arrays = self._decoded.setdefault(shard, {})
            arrays[name] = data
            self._decoded.move_to_end(shard)
            dropped = self._drop_decoded()
        if dropped:  # a shard's arrays freed: give their pages back, or RSS grows with the cache (c2kd.heap)
            trim()
        return data

    def _drop_decoded(self) -> int:
        """Drop the oldest decoded shards beyond the capacity (the lock held); how many."""
        dropped = 0
        while len(self._decoded) > self._decoded_capacity:
            self._decoded.popitem(last=False)
            dropped += 1
        return dropped

    def get(
        self,
        example_ids: Sequence[int] | np.ndarray | torch.Tensor,
        *,
        layers: Sequence[int] | None = None,
        final_hidden: bool = True,
        logits: bool = True,
        whole_shards: bool = False,
    ) -> CachedBatch:
        """The cached tensors of these examples, in this order (see CachedBatch for the shapes)."""
        return self.get_batches([example_ids], layers=layers, final_hidden=final_hidden, logits=logits,
                                whole_shards=whole_shards)[0]

    def get_batches(
        self,
        groups: Sequence[Sequence[int] | np.ndarray | torch.Tensor],
        *,
        layers: Sequence[int] | None = None,
        final_hidden: bool = True,
        logits: bool = True,
        whole_shards: bool = False,
    ) -> list[CachedBatch]:
        """One CachedBatch per group of example ids, each padded to its own longest example, read
        together: a read costs about the same for 16 or 128 examples (the cost is per shard and
        array touched), so a caller wanting several batches asks for them at once.

        `whole_shards`: decode each touched shard's arrays whole and keep the last `keep_decoded`
        shards (for an order that comes back to a shard over several reads); otherwise only the
        chunks these examples lie in are read, and a sparse read (a held-out subset) stays cheap."""
        spec = self.spec
        layers = spec.layers if layers is None else tuple(int(x) for x in layers)
        lacking = sorted(set(layers) - set(spec.layers))
        if lacking:
            raise CacheError(f"{self.location}: layers {lacking} are not cached (cached: {list(spec.layers)})")
        ids_per_group = [np.asarray(torch.as_tensor(g).cpu().numpy() if isinstance(g, torch.Tensor) else g,
                                    dtype=np.int64).reshape(-1) for g in groups]
        ids = np.concatenate(ids_per_group) if ids_per_group else np.zeros(0, dtype=np.int64)
        rows = self._rows(ids)
        names = [S.INPUT_IDS, S.SLOT_ITEMS, S.LABELS, S.ANSWER_POSITIONS, *self._output_names(layers, final_hidden, logits)]
        per_example = self._read_examples(rows, names, whole_shards)
        out, start = [], 0
        for g in ids_per_group:
            out.append(self._batch(g, rows[start : start + len(g)], {n: v[start : start + len(g)] for n, v in per_example.items()}))
            start += len(g)
        return out

    def _output_names(self, layers: Sequence[int], final_hidden: bool, logits: bool) -> list[str]:
        """The teacher outputs a read asks for: hidden states of `layers` (in that order), then the
        others in schema order, less the groups left out (an output of another group is always read)."""
        left_out = {S.FINAL_HIDDEN_GROUP: not final_hidden, S.LOGITS_GROUP: not logits}
        others = [a.name for a in S.output_defs(self.spec) if a.output != S.HIDDEN_GROUP and not left_out.get(a.output)]
        hidden = [S.hidden_array(l) for l in layers]
        if self.spec.quantized:  # each float8 array is read with its scales
            hidden = [n for name in hidden for n in (name, self._defs[name].scale)]
        return hidden + others

    def _read_examples(self, rows: np.ndarray, names: Sequence[str], whole: bool) -> dict[str, list[np.ndarray]]:
        """For each array name, each example's rows (in the order of `rows`), read shard by shard."""
        c = self._col
        out: dict[str, list] = {name: [None] * len(rows) for name in names}
        shards = c["shard"][rows]
        for shard in np.unique(shards):
            js = np.nonzero(shards == shard)[0]
            r = rows[js]
            for name in names:
                kind = self.layout[name]["rows"]
                offsets, lengths = (c["token_offset"][r], c["token_length"][r]) if kind == "tokens" else \
                    (c["answer_offset"][r], c["answer_length"][r])
                data = self._fetch(int(shard), name, offsets, lengths, whole)
                start = 0
                for j, n in zip(js, lengths):
                    out[name][j] = data[start : start + n]
                    start += n
        return out

    def _batch(self, ids: np.ndarray, rows: np.ndarray, data: dict[str, list[np.ndarray]]) -> CachedBatch:
        """Pad one group's examples into a CachedBatch (ints as int64, floats in the logical dtype,
        float8 hidden states decoded to the cache's other float dtype)."""
        c, spec = self._col, self.spec
        tok_len, ans_len = c["token_length"][rows], c["answer_length"][rows]
        t_max, a_max = int(tok_len.max(initial=0)), int(ans_len.max(initial=0))

        def padded(name: str, dtype: np.dtype, fill: int = 0) -> np.ndarray:
            parts, a = data[name], self._defs[name]
            width = t_max if a.rows == "tokens" else a_max
            out = np.full((len(parts), width, *a.columns), fill, dtype=dtype)
            for j, part in enumerate(parts):
                out[j, : len(part)] = part
            return out

        def pad(name: str, fill: int = 0) -> torch.Tensor:
            a = self._defs[name]
            if a.is_quantized:  # padding rows: byte 0 and scale 0, i.e. 0.0 like the other arrays' padding
                return dequantize_e4m3(padded(name, np.dtype(np.uint8)), padded(a.scale, np.dtype(np.float32)),
                                       TORCH_DTYPES[spec.float_dtype])
            if a.is_float:
                return from_storage(padded(name, np.dtype(spec.storage_dtype)), spec.float_dtype)
            return torch.from_numpy(padded(name, np.dtype(np.int64), fill))

        attention = (np.arange(t_max)[None, :] < tok_len[:, None]).astype(np.int64)
        return CachedBatch(
            positions=spec.positions,
            logits_policy=spec.logits,
            vocab_size=spec.vocab_size,
            example_ids=torch.from_numpy(ids.copy()),
            users=torch.from_numpy(c["user"][rows].astype(np.int64)),
            targets=torch.from_numpy(c["target"][rows].astype(np.int64)),
            candidates=torch.from_numpy(self._col["candidates"][rows]),
            history=torch.from_numpy(self._col["history"][rows]),
            input_ids=pad(S.INPUT_IDS, int(spec.pad_token_id)),
            attention_mask=torch.from_numpy(attention),
            slot_items=pad(S.SLOT_ITEMS),
            labels=pad(S.LABELS, S.IGNORE_INDEX),
            answer_positions=pad(S.ANSWER_POSITIONS),
            answer_mask=torch.from_numpy(np.arange(a_max)[None, :] < ans_len[:, None]),
            outputs={name: pad(name) for name in data if self._defs[name].is_output},
        )


def _pad_lists(rows: list[list[int]]) -> np.ndarray:
    """Zero-padded [n, longest] int64 array of int lists (item 0 is padding)."""
    width = max((len(r) for r in rows), default=0)
    out = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def content_digest(cache_or_path: TeacherCache | str | os.PathLike, batch_size: int = 64) -> str:
    """sha256 of the per-example content (in example-id order), independent of sharding and codecs.

    Two caches of the same examples with the same dtype and policies have equal digests exactly
    when every example's tokens, positions, hidden states and logits are bit-identical.
    """
    import hashlib

    cache = cache_or_path if isinstance(cache_or_path, TeacherCache) else TeacherCache.open(cache_or_path)
    h = hashlib.sha256()
    h.update(S.canonical_json({k: v for k, v in cache.spec.to_dict().items()
                               if k not in ("compression", "examples_per_shard", "part")}).encode())
    ids = np.sort(cache.index["example_id"].to_numpy())
    split_of = dict(zip(cache.index["example_id"].to_list(), cache.index["split"].to_list()))
    for start in range(0, len(ids), batch_size):
        batch = cache.get(ids[start : start + batch_size])
        for b, example_id in enumerate(batch.example_ids.tolist()):
            t, a = int(batch.attention_mask[b].sum()), int(batch.answer_mask[b].sum())
            parts = [
                np.int64(example_id).tobytes(), split_of[example_id].encode(),
                batch.users[b].numpy().tobytes(), batch.targets[b].numpy().tobytes(),
                batch.history[b].numpy().tobytes(), batch.candidates[b].numpy().tobytes(),
                batch.input_ids[b, :t].numpy().tobytes(), batch.slot_items[b, :t].numpy().tobytes(),
                batch.labels[b, :t].numpy().tobytes(), batch.answer_positions[b, :a].numpy().tobytes(),
            ]
            # every teacher output, in schema order
            tensors = [batch.outputs[o.name][b, : (t if o.rows == "tokens" else a)] for o in S.output_defs(cache.spec)]
            for x in tensors:
                parts.append(x.contiguous().view(torch.uint8).numpy().tobytes() if x.numel() else b"")
            for p in parts:
                h.update(len(p).to_bytes(8, "little") + p)
    return h.hexdigest()
