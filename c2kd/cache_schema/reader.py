"""Reading a teacher cache (directory or URL, read-only): refusals, random access, batch order.

`TeacherCache.open` refuses before any training a cache that is missing, incomplete, of an
unknown schema version, corrupted (index checksum; every checksum with verify=True) or that does
not fit the caller's expectation. Zarr arrays are opened lazily per process, so the object can be
pickled into DataLoader workers.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
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
from c2kd.cache_schema.dtypes import from_storage
from c2kd.cache_schema.expect import CacheExpectation, check_expectation
from c2kd.cache_schema.storage import CacheLocation
from c2kd.cache_schema.zarr_io import open_array, read_rows
from c2kd.errors import CacheError

_DECODE_ERRORS = (ValueError, RuntimeError, OSError, KeyError)


def read_manifest(location: CacheLocation) -> dict:
    """The manifest of a complete cache of a known schema (CacheError otherwise)."""
    try:
        raw = location.read_bytes(S.MANIFEST)
    except FileNotFoundError:
        raise CacheError(
            f"{location}: no {S.MANIFEST} — not a teacher cache, or one whose writing has not started"
        ) from None
    try:
        manifest = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CacheError(f"{location}/{S.MANIFEST}: not valid JSON ({e})") from None
    return S.check_manifest(manifest, str(location))


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
        self.index = index
        self._shard_entries = {int(s["shard"]): s for s in manifest["shards"]}
        ids = index["example_id"].to_numpy()
        self._order = np.argsort(ids, kind="stable")
        self._sorted_ids = ids[self._order]
        self._col = {
            name: index[name].to_numpy()
            for name in ("shard", "token_offset", "token_length", "answer_offset", "answer_length", "user", "target")
        }
        self._candidates = _pad_lists(index["candidates"].to_list())
        self._history = _pad_lists(index["history"].to_list())
        self._handles: dict[tuple[int, str], Any] = {}  # per process: zarr arrays opened so far
        self._checked: set[int] = set()  # shards whose files were checked against the manifest
        self._handles_pid = os.getpid()

    # --- opening ------------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        path_or_url: str | os.PathLike,
        expect: CacheExpectation | Mapping | None = None,
        *,
        verify: bool = False,
        storage_options: dict | None = None,
    ) -> TeacherCache:
        """Open a cache read-only; verify=True also recomputes every checksum first (reads it all)."""
        location = CacheLocation(path_or_url, storage_options)
        manifest = read_manifest(location)
        spec = S.CacheSpec.from_dict(manifest["spec"])
        check_expectation(spec, expect, str(location))
        if verify:
            from c2kd.cache_schema.verify import verify_cache

            report = verify_cache(location)
            if not report.ok:
                raise CacheError(f"{location}: cache failed verification: " + "; ".join(report.problems[:5]))
        raw = location.read_bytes(S.INDEX)
        if bytes_digest([raw]) != manifest["index"]["sha256"]:
            raise CacheError(f"{location}/{S.INDEX}: checksum does not match the manifest (corrupted or replaced)")
        index = pl.read_parquet(io.BytesIO(raw))
        if index.height != manifest["totals"]["examples"]:
            raise CacheError(f"{location}/{S.INDEX}: {index.height} rows, manifest says {manifest['totals']['examples']}")
        return cls(location, manifest, index)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handles"], state["_checked"] = {}, set()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._handles_pid = -1

    # --- metadata -----------------------------------------------------------------------------
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
        data = self.location.read_bytes(rel)
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
        with tempfile.TemporaryDirectory(prefix="c2kd-tokenizer-") as tmp:
            for rel in files:
                target = Path(tmp) / rel[len(prefix) :]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(self._asset_bytes(rel))
            return AutoTokenizer.from_pretrained(tmp)

    # --- random access ------------------------------------------------------------------------
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
            if shard not in self._checked and self.location.is_local:
                self._check_local_files(shard, entry)
                self._checked.add(shard)
            try:
                arr = open_array(self.location.zarr_store(rel), name)
            except _DECODE_ERRORS as e:
                raise CacheError(f"{self.location}/{rel}: array {name} cannot be opened ({e}); run `c2kd cache verify`") from e
            rows = {"tokens": entry["tokens"], "answers": entry["answers"], "examples": entry["examples"]}
            expected = rows[self.manifest["arrays"][name]["rows"]]
            if arr.shape[0] != expected:
                raise CacheError(f"{self.location}/{rel}: array {name} has {arr.shape[0]} rows, manifest says {expected}")
            self._handles[key] = arr
        return self._handles[key]

    def _check_local_files(self, shard: int, entry: dict) -> None:
        root = self.location.local_root / S.shard_path(shard)
        for rel, size in entry["files"]:
            path = root / rel
            if not path.is_file() or path.stat().st_size != size:
                raise CacheError(f"{root}: file {rel} is missing or has the wrong size; run `c2kd cache verify`")

    def _fetch(self, shard: int, name: str, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The rows [offset, offset + length) of each example, concatenated."""
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

    def get(
        self,
        example_ids: Sequence[int] | np.ndarray | torch.Tensor,
        *,
        layers: Sequence[int] | None = None,
        final_hidden: bool = True,
        logits: bool = True,
    ) -> CachedBatch:
        """The cached tensors of these examples, in this order (see CachedBatch for the shapes)."""
        if isinstance(example_ids, torch.Tensor):
            example_ids = example_ids.cpu().numpy()
        ids = np.asarray(example_ids, dtype=np.int64).reshape(-1)
        layers = self.spec.layers if layers is None else tuple(int(x) for x in layers)
        lacking = sorted(set(layers) - set(self.spec.layers))
        if lacking:
            raise CacheError(f"{self.location}: layers {lacking} are not cached (cached: {list(self.spec.layers)})")
        rows = self._rows(ids)
        c = self._col
        b = len(ids)
        tok_len, ans_len = c["token_length"][rows], c["answer_length"][rows]
        t_max, a_max = int(tok_len.max(initial=0)), int(ans_len.max(initial=0))
        d, spec = self.spec.hidden_size, self.spec
        policy = spec.logits_policy
        pad_id = int(spec.pad_token_id)

        ints = {
            S.INPUT_IDS: np.full((b, t_max), pad_id, dtype=np.int64),
            S.SLOT_ITEMS: np.zeros((b, t_max), dtype=np.int64),
            S.LABELS: np.full((b, t_max), S.IGNORE_INDEX, dtype=np.int64),
            S.ANSWER_POSITIONS: np.zeros((b, a_max), dtype=np.int64),
        }
        store_dt = np.dtype(spec.storage_dtype)
        hid_rows = t_max if spec.positions == "all" else a_max
        floats: dict[str, np.ndarray] = {S.hidden_array(layer): np.zeros((b, hid_rows, d), store_dt) for layer in layers}
        if final_hidden:
            floats[S.FINAL_HIDDEN] = np.zeros((b, a_max, d), store_dt)
        if logits and policy.kind == "topk":
            floats[S.TOPK_VALUES] = np.zeros((b, a_max, policy.k), store_dt)
            ints[S.TOPK_INDICES] = np.zeros((b, a_max, policy.k), dtype=np.int64)
        if logits and policy.kind == "full":
            floats[S.FULL_LOGITS] = np.zeros((b, a_max, spec.vocab_size), store_dt)

        token_major = {S.INPUT_IDS, S.SLOT_ITEMS, S.LABELS}
        if spec.positions == "all":
            token_major |= {S.hidden_array(layer) for layer in layers}
        shards = c["shard"][rows]
        for shard in np.unique(shards):
            js = np.nonzero(shards == shard)[0]
            r = rows[js]
            for name, out in (*ints.items(), *floats.items()):
                if name in token_major:
                    offsets, lengths = c["token_offset"][r], c["token_length"][r]
                else:
                    offsets, lengths = c["answer_offset"][r], c["answer_length"][r]
                data = self._fetch(int(shard), name, offsets, lengths)
                start = 0
                for j, n in zip(js, lengths):
                    out[j, :n] = data[start : start + n]
                    start += n

        attention = (np.arange(t_max)[None, :] < tok_len[:, None]).astype(np.int64)
        answer_mask = np.arange(a_max)[None, :] < ans_len[:, None]
        to_float = lambda name: from_storage(floats[name], spec.dtype) if name in floats else None  # noqa: E731
        return CachedBatch(
            positions=spec.positions,
            example_ids=torch.from_numpy(ids.copy()),
            users=torch.from_numpy(c["user"][rows].astype(np.int64)),
            targets=torch.from_numpy(c["target"][rows].astype(np.int64)),
            candidates=torch.from_numpy(self._candidates[rows]),
            history=torch.from_numpy(self._history[rows]),
            input_ids=torch.from_numpy(ints[S.INPUT_IDS]),
            attention_mask=torch.from_numpy(attention),
            slot_items=torch.from_numpy(ints[S.SLOT_ITEMS]),
            labels=torch.from_numpy(ints[S.LABELS]),
            answer_positions=torch.from_numpy(ints[S.ANSWER_POSITIONS]),
            answer_mask=torch.from_numpy(answer_mask),
            hidden={layer: from_storage(floats[S.hidden_array(layer)], spec.dtype) for layer in layers},
            final_hidden=to_float(S.FINAL_HIDDEN),
            topk_values=to_float(S.TOPK_VALUES),
            topk_indices=torch.from_numpy(ints[S.TOPK_INDICES]) if S.TOPK_INDICES in ints else None,
            full_logits=to_float(S.FULL_LOGITS),
        )

    # --- iteration order ----------------------------------------------------------------------
    def batch_order(
        self,
        split: str,
        batch_size: int,
        seed: int,
        epoch: int,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ) -> list[list[int]]:
        """This rank's batches (lists of example ids) for one epoch, shuffled shard-locally.

        The shard order and the example order inside each shard are shuffled with (seed, epoch);
        batches are then cut from that sequence, so each batch reads one or two shards. Batch k
        goes to rank k % world_size; when the batch count is not a multiple of world_size, the
        first batches are repeated so every rank takes the same number of steps.
        """
        if batch_size <= 0 or world_size < 1 or not 0 <= rank < world_size:
            raise CacheError(f"batch_order: bad batch_size {batch_size} / rank {rank} / world_size {world_size}")
        if split not in self.spec.splits:
            self.split_ids(split)  # raises the clear error
        in_split = (self.index["split"] == split).to_numpy()
        ids, shards = self.index["example_id"].to_numpy()[in_split], self._col["shard"][in_split]
        by_shard = np.argsort(shards, kind="stable")
        ids, shards = ids[by_shard], shards[by_shard]
        starts = np.flatnonzero(np.r_[True, shards[1:] != shards[:-1]]) if len(shards) else np.zeros(0, dtype=np.int64)
        ends = np.r_[starts[1:], len(shards)].astype(np.int64)
        rng = np.random.default_rng([int(seed), int(epoch)])
        sequence = [rng.permutation(ids[starts[k] : ends[k]]) for k in rng.permutation(len(starts))]
        order = np.concatenate(sequence) if sequence else ids[:0]
        batches = [order[i : i + batch_size].tolist() for i in range(0, len(order), batch_size)]
        if drop_last and batches and len(batches[-1]) < batch_size:
            batches.pop()
        if batches and len(batches) % world_size:
            batches += batches[: world_size - len(batches) % world_size]
        return batches[rank::world_size]


def _pad_lists(rows: list[list[int]]) -> np.ndarray:
    """Zero-padded [n, longest] int64 array of int lists (item 0 is padding)."""
    width = max((len(r) for r in rows), default=0)
    out = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


class CacheBatches(torch.utils.data.Dataset):
    """A Dataset of whole batches: item k = cache.get(batches[k]); use DataLoader(batch_size=None)."""

    def __init__(self, cache: TeacherCache, batches: Sequence[Sequence[int]], **get_kwargs: Any) -> None:
        self.cache, self.batches, self.get_kwargs = cache, list(batches), get_kwargs

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> CachedBatch:
        return self.cache.get(self.batches[k], **self.get_kwargs)
