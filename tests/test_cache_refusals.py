"""Readers refuse, before any training, caches that are incomplete, foreign, corrupted or unfit."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from c2kd.cache_schema import CacheExpectation, CacheWriter, TeacherCache, cache_info, plan_shards, verify_cache
from synthetic_cache import synthetic_examples, synthetic_record, synthetic_spec, write_synthetic_cache
from c2kd.cli import app
from c2kd.errors import CacheError


@pytest.fixture(scope="module")
def sealed(tmp_path_factory):
    root = tmp_path_factory.mktemp("sealed") / "cache"
    spec = synthetic_spec(examples_per_shard=4, compression="none")
    plan = plan_shards(synthetic_examples(12, spec.splits), spec.examples_per_shard)
    write_synthetic_cache(root, spec, plan)
    return root, spec, plan


@pytest.fixture
def copy(sealed, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(sealed[0], root)
    return root


def _flip_byte(path, offset=None):
    data = bytearray(path.read_bytes())
    k = len(data) // 2 if offset is None else offset
    data[k] ^= 0x01
    path.write_bytes(bytes(data))


def test_missing_manifest_and_incomplete_cache_are_refused(tmp_path):
    with pytest.raises(CacheError, match="no manifest.json"):
        TeacherCache.open(tmp_path)
    spec = synthetic_spec()
    plan = plan_shards(synthetic_examples(8, spec.splits), spec.examples_per_shard)
    write_synthetic_cache(tmp_path / "c", spec, plan, seal=False)
    with pytest.raises(CacheError, match="incomplete"):
        TeacherCache.open(tmp_path / "c")
    report = verify_cache(tmp_path / "c")
    assert not report.ok and "incomplete" in report.problems[0]
    info = cache_info(tmp_path / "c")
    assert info["complete"] is False and info["shards_written"] == len(plan)


def test_other_schema_version_and_foreign_manifest_are_refused(copy):
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 1}))
    with pytest.raises(CacheError, match="schema version 1"):
        TeacherCache.open(copy)
    (copy / "manifest.json").write_text(json.dumps({**manifest, "format": "something-else"}))
    with pytest.raises(CacheError, match="not a c2kd teacher cache"):
        TeacherCache.open(copy)


def test_expectations_refuse_mismatches_and_accept_fits(sealed):
    root, spec, _ = sealed
    fits = TeacherCache.open(
        root,
        expect=CacheExpectation(
            tokenizer_fingerprint=spec.tokenizer_fingerprint, layers=[3], positions="all", logits="exact",
            hidden_size=spec.hidden_size, prompt_format="ids", splits=["train"],
        ),
    )
    assert fits.layers == (2, 3)
    cases = {
        "tokenizer fingerprint": {"tokenizer_fingerprint": "0" * 64},
        r"teacher layers \[4\] are not cached": {"layers": [3, 4]},
        "positions is 'all', expected 'answer'": {"positions": "answer"},
        "logits policy is 'exact'": {"logits": "topk"},
        "hidden size is 16, expected 32": {"hidden_size": 32},
        r"splits \['test'\] are not cached": {"splits": ["test"]},
    }
    for message, expect in cases.items():
        with pytest.raises(CacheError, match=message):
            TeacherCache.open(root, expect=expect)
    with pytest.raises(CacheError, match="unknown cache expectation"):
        TeacherCache.open(root, expect={"layer": [3]})


def test_flipped_byte_in_a_shard_is_caught_and_named(copy):
    target = copy / "shards" / "shard-00001" / "hidden" / "layer_2" / "c.0.0"
    _flip_byte(target)
    report = verify_cache(copy)
    assert not report.ok and report.bad_shards == ["shard-00001"]
    assert report.problems == ["shards/shard-00001/hidden/layer_2/c.0.0: checksum mismatch (corrupted)"]
    # the cache opens, but reading the damaged chunk fails loudly (crc32c)
    cache = TeacherCache.open(copy)
    cache.get([0])  # shard 0 is intact
    with pytest.raises(CacheError, match="shard-00001.*corrupted"):
        cache.get([4])
    result = CliRunner().invoke(app, ["cache", "verify", str(copy)])
    assert result.exit_code == 1 and "shard-00001" in result.output


def test_truncated_missing_and_extra_files_are_caught(copy):
    target = copy / "shards" / "shard-00002" / "input_ids" / "c.0"
    target.write_bytes(target.read_bytes()[:-3])
    (copy / "shards" / "shard-00000" / "labels" / "c.0").unlink()
    (copy / "shards" / "shard-00001" / "stray.bin").write_bytes(b"x")
    report = verify_cache(copy)
    assert sorted(report.bad_shards) == ["shard-00000", "shard-00001", "shard-00002"]
    cache = TeacherCache.open(copy)
    for example_id in (8, 0):  # shard 2 (truncated file), shard 0 (missing file)
        with pytest.raises(CacheError, match="missing or of the wrong size"):
            cache.get([example_id])


def test_corrupted_index_and_assets_are_refused(copy):
    _flip_byte(copy / "assets" / "teacher_head.safetensors", offset=-5)
    cache = TeacherCache.open(copy)
    with pytest.raises(CacheError, match="teacher_head.safetensors: checksum"):
        cache.head_weight()
    assert not verify_cache(copy).ok
    _flip_byte(copy / "index.parquet")
    with pytest.raises(CacheError, match="index.parquet: checksum"):
        TeacherCache.open(copy)


def test_cli_verify_ok_and_info(sealed):
    root = sealed[0]
    runner = CliRunner()
    ok = runner.invoke(app, ["cache", "verify", str(root)])
    assert ok.exit_code == 0 and "ok" in ok.output
    info = runner.invoke(app, ["cache", "info", str(root), "--json"])
    assert info.exit_code == 0 and json.loads(info.output)["examples"] == 12
    table = runner.invoke(app, ["cache", "info", str(root)])
    assert table.exit_code == 0 and "bytes / token" in table.output
    missing = runner.invoke(app, ["cache", "info", str(root / "nope")])
    assert missing.exit_code == 1 and "not a teacher cache" in missing.output


def test_writer_refuses_foreign_folders_and_other_settings(sealed, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CacheError, match="not empty and not a teacher cache"):
        CacheWriter(tmp_path, synthetic_spec())
    with pytest.raises(CacheError, match="made with other settings"):
        CacheWriter(sealed[0], synthetic_spec(examples_per_shard=4, compression="zstd"))
    done = CacheWriter(sealed[0], sealed[1])
    assert done.already_complete
    with pytest.raises(CacheError, match="sealed"):
        done.write_shard(0, [synthetic_record(0, "train", sealed[1])])
    manifest = json.loads((sealed[0] / "manifest.json").read_text())
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "manifest.json").write_text(json.dumps({**manifest, "complete": False, "schema_version": 0}))
    with pytest.raises(CacheError, match="schema version 0"):
        CacheWriter(tmp_path / "old", sealed[1])


def test_writer_never_touches_a_sealed_cache_even_without_its_journal(sealed, copy):
    shutil.rmtree(copy / "journal")  # e.g. a copy made of manifest, index, assets and shards only
    writer = CacheWriter(copy, sealed[1])
    assert writer.already_complete
    assert verify_cache(copy).ok


def test_a_stray_shard_folder_is_named_by_verify_and_refused_by_readers(copy):
    shutil.copytree(copy / "shards" / "shard-00000", copy / "shards" / "shard-00099")
    report = verify_cache(copy)
    assert not report.ok and any("shard-00099" in p and "not listed" in p for p in report.problems)
    with pytest.raises(CacheError, match="shard-00099 not listed in the manifest"):
        TeacherCache.open(copy)
