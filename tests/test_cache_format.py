"""Teacher-cache format: write/read round trip, dtypes, policies, index, workers."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import zarr

from c2kd.cache_schema import (
    CacheSpec,
    CacheWriter,
    TeacherCache,
    answer_positions,
    content_digest,
    plan_shards,
)
from synthetic_cache import (
    synthetic_examples,
    synthetic_record,
    synthetic_spec,
    write_synthetic_cache,
)
from c2kd.cache_schema.schema import FINAL_HIDDEN, FULL_LOGITS, TOPK_INDICES, TOPK_VALUES, hidden_array
from c2kd.errors import CacheError

N_EXAMPLES = 14


def _write(root, **spec_overrides):
    spec = synthetic_spec(**spec_overrides)
    plan = plan_shards(synthetic_examples(N_EXAMPLES, spec.splits), spec.examples_per_shard)
    write_synthetic_cache(root, spec, plan)
    return spec, plan


def _as_float(x: torch.Tensor, dtype: str) -> torch.Tensor:
    return torch.as_tensor(x).to({"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype])


@pytest.fixture(scope="module")
def bf16_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache") / "bf16"
    spec, plan = _write(root, examples_per_shard=5)
    return root, spec, plan


def test_answer_positions_predict_answer_tokens():
    labels = torch.tensor([-100, -100, -100, 7, 8, -100])
    assert answer_positions(labels).tolist() == [2, 3]
    assert answer_positions(torch.tensor([-100, -100])).tolist() == []


def test_round_trip_every_field_bit_exact(bf16_cache):
    root, spec, plan = bf16_cache
    cache = TeacherCache.open(root)
    ids = [13, 2, 7, 3, 10, 0]  # several shards and splits, out of order; 3 and 10 have no answer
    batch = cache.get(ids)
    assert batch.example_ids.tolist() == ids
    split_of = {i: s.split for s in plan.shards for i in s.example_ids}
    for b, example_id in enumerate(ids):
        rec = synthetic_record(example_id, split_of[example_id], spec)
        t, a = rec.num_tokens, len(rec.answers)
        assert int(batch.attention_mask[b].sum()) == t and int(batch.answer_mask[b].sum()) == a
        assert batch.input_ids[b, :t].tolist() == list(rec.input_ids)
        assert batch.slot_items[b, :t].tolist() == list(rec.slot_items)
        assert batch.labels[b, :t].tolist() == list(rec.labels)
        assert (batch.input_ids[b, t:] == spec.pad_token_id).all() and (batch.labels[b, t:] == -100).all()
        assert batch.answer_positions[b, :a].tolist() == rec.answers.tolist()
        assert batch.targets[b] == rec.target and batch.users[b] == rec.user
        assert batch.history[b][batch.history[b] > 0].tolist() == list(rec.history)
        assert batch.candidates[b].tolist() == list(rec.candidates)
        for layer in spec.layers:
            got = batch.hidden[layer][b, :t]
            assert got.dtype == torch.bfloat16
            # bit-exact: the stored uint16 bits are the bf16 rounding of the written values
            assert torch.equal(got.view(torch.int16), _as_float(rec.outputs[hidden_array(layer)], "bfloat16").view(torch.int16))
            assert (batch.hidden[layer][b, t:] == 0).all()
        assert torch.equal(batch.final_hidden[b, :a].view(torch.int16), _as_float(rec.outputs[FINAL_HIDDEN], "bfloat16").view(torch.int16))
    # the answer rows of a per-token tensor are the answer positions
    x = torch.arange(batch.input_ids.numel()).view(batch.input_ids.shape).unsqueeze(-1).float()
    rows = batch.at_answers(x)[..., 0]
    assert torch.equal(rows[0, : int(batch.answer_mask[0].sum())], x[0, batch.answer_positions[0][batch.answer_mask[0]], 0])


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_native_float_dtypes_answer_positions_and_topk(tmp_path, dtype):
    spec, plan = _write(tmp_path / "c", dtype=dtype, positions="answer", logits="topk:3", compression="none")
    cache = TeacherCache.open(tmp_path / "c")
    ids = [1, 4, 11]
    batch = cache.get(ids)
    for b, example_id in enumerate(ids):
        split = next(s.split for s in plan.shards if example_id in s.example_ids)
        rec = synthetic_record(example_id, split, spec)
        a = len(rec.answers)
        for layer in spec.layers:
            assert batch.hidden[layer].shape[1] == batch.answer_mask.shape[1]  # answer rows only
            assert torch.equal(batch.hidden[layer][b, :a], _as_float(rec.outputs[hidden_array(layer)], dtype))
        assert batch.hidden_mask.shape == batch.answer_mask.shape
        assert torch.equal(batch.topk_values[b, :a], _as_float(rec.outputs[TOPK_VALUES], dtype))
        assert batch.topk_indices[b, :a].tolist() == rec.outputs[TOPK_INDICES].tolist()
    arr = zarr.open_array(str(tmp_path / "c" / "shards" / "shard-00000"), path="final_hidden", mode="r")
    assert arr.dtype == np.dtype(dtype) and arr.attrs["c2kd_logical_dtype"] == dtype


def test_full_logits_and_selective_reads(tmp_path):
    spec, plan = _write(tmp_path / "c", logits="full", layers=(1, 3))
    cache = TeacherCache.open(tmp_path / "c")
    batch = cache.get([5], layers=[3], final_hidden=False)
    rec = synthetic_record(5, "train", spec)
    assert list(batch.hidden) == [3] and batch.final_hidden is None
    assert batch.full_logits.shape == (1, len(rec.answers), spec.vocab_size)
    assert torch.equal(batch.full_logits[0], _as_float(rec.outputs[FULL_LOGITS], "bfloat16"))
    assert cache.get([5], logits=False).full_logits is None
    with pytest.raises(CacheError, match="layers \\[2\\] are not cached"):
        cache.get([5], layers=[2])
    with pytest.raises(CacheError, match="not in the cache"):
        cache.get([5, 999])


def test_index_and_manifest_readable_without_c2kd(bf16_cache):
    root, spec, plan = bf16_cache
    table = pq.read_table(root / "index.parquet")
    assert table.num_rows == N_EXAMPLES
    assert set(table.column_names) >= {"example_id", "split", "user", "target", "candidates", "shard",
                                        "token_offset", "token_length", "answer_offset", "answer_length"}
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["schema_version"] == 2
    assert manifest["totals"]["examples"] == N_EXAMPLES
    assert [s["examples"] for s in manifest["shards"]] == [len(s.example_ids) for s in plan.shards]
    # a shard's arrays are plain Zarr v3: the token slice of the index row is the example's tokens
    row = table.slice(2, 1).to_pylist()[0]
    ids = zarr.open_array(str(root / "shards" / f"shard-{row['shard']:05d}"), path="input_ids", mode="r")
    rec = synthetic_record(row["example_id"], row["split"], spec)
    assert ids[row["token_offset"] : row["token_offset"] + row["token_length"]].tolist() == list(rec.input_ids)


def test_pickle_and_dataloader_workers_read_the_same(bf16_cache):
    root, _, _ = bf16_cache
    cache = TeacherCache.open(root)
    cache.get([0])  # open some handles in this process first
    clone = pickle.loads(pickle.dumps(cache))
    assert torch.equal(clone.get([4, 9]).hidden[2], cache.get([4, 9]).hidden[2])
    batches = [[0, 4, 9], [1, 2], [5, 8, 3]]

    class Batches(torch.utils.data.Dataset):  # a reader pickled into each worker process
        def __len__(self):
            return len(batches)

        def __getitem__(self, k):
            return cache.get(batches[k])

    loader = torch.utils.data.DataLoader(Batches(), batch_size=None, num_workers=2)
    got = {tuple(b.example_ids.tolist()): b.hidden[3] for b in loader}
    for ids in batches:
        assert torch.equal(got[tuple(ids)], cache.get(ids).hidden[3])


def test_spec_hash_and_content_digest(tmp_path, bf16_cache):
    root, spec, _ = bf16_cache
    assert spec.spec_hash == CacheSpec.from_dict(json.loads(spec_json := json.dumps(spec.to_dict()))).spec_hash
    assert spec_json  # spec survives JSON
    # same examples, other shard size and compression: the same per-example content
    _write(tmp_path / "other", examples_per_shard=3, compression="none")
    assert content_digest(root) == content_digest(tmp_path / "other")
    _write(tmp_path / "f32", examples_per_shard=5, dtype="float32")
    assert content_digest(root) != content_digest(tmp_path / "f32")


def test_writer_refuses_bad_records_and_wrong_rank(tmp_path):
    spec = synthetic_spec()
    writer = CacheWriter(tmp_path / "c", spec, rank=1, world_size=2)
    with pytest.raises(CacheError, match="belongs to rank 0"):
        writer.write_shard(0, [synthetic_record(0, "train", spec)])
    rec = synthetic_record(1, "train", spec)
    del rec.outputs[hidden_array(3)]
    with pytest.raises(CacheError, match=r"example 1: teacher outputs \['hidden/layer_3'\] missing"):
        writer.write_shard(1, [rec])
    rec = synthetic_record(5, "train", spec)
    rec.outputs[FINAL_HIDDEN] = torch.zeros(len(rec.answers) + 1, spec.hidden_size)
    with pytest.raises(CacheError, match="example 5: final_hidden shape"):
        writer.write_shard(1, [rec])
    with pytest.raises(CacheError, match="split 'validation' in a shard planned for split 'train'"):
        writer.write_shard(1, [synthetic_record(5, "train", spec), synthetic_record(6, "validation", spec)])
    with pytest.raises(CacheError, match="logits policy"):
        synthetic_spec(logits="top5")
    with pytest.raises(CacheError, match="ascending"):
        synthetic_spec(layers=(3, 2))
