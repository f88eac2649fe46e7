"""Crash safety and many writers: interrupted, killed and 2-rank writes give the 1-writer cache."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from synthetic_cache import (
    synthetic_examples,
    synthetic_record,
    synthetic_spec,
    write_synthetic_assets,
    write_synthetic_cache,
)

from c2kd.cache_schema import CacheWriter, TeacherCache, content_digest, plan_shards, verify_cache
from c2kd.errors import CacheError

N_EXAMPLES, PER_SHARD = 20, 3
SPEC = synthetic_spec(examples_per_shard=PER_SHARD)
PLAN = plan_shards(synthetic_examples(N_EXAMPLES, SPEC.splits), PER_SHARD)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref") / "cache"
    write_synthetic_cache(root, SPEC, PLAN)
    return root, content_digest(root), _shard_checksums(root)


def _shard_checksums(root) -> list[str]:
    return [s["sha256"] for s in json.loads((root / "manifest.json").read_text())["shards"]]


def _records(shard):
    return [synthetic_record(i, shard.split, SPEC) for i in shard.example_ids]


def _script(out, *extra):
    return [sys.executable, str(Path(__file__).with_name("synthetic_cache.py")), str(out),
            "--examples", str(N_EXAMPLES), "--per-shard", str(PER_SHARD), *extra]


def _journal_lines(root) -> int:
    return sum(len(p.read_text().splitlines()) for p in (root / "journal").glob("rank-*.jsonl")) if (root / "journal").is_dir() else 0


def _partial_cache(root, shards: int) -> CacheWriter:
    """The assets and the first `shards` shards of the plan, written and journaled; not sealed."""
    writer = CacheWriter(root, SPEC)
    write_synthetic_assets(writer)
    for shard in PLAN.shards[:shards]:
        writer.write_shard(shard.shard_id, _records(shard))
    return writer


def test_resume_after_simulated_crash_leftovers(tmp_path, reference):
    root = tmp_path / "cache"
    writer = _partial_cache(root, 2)
    # crash leftovers: a half-written temp folder, a shard renamed but not journaled, a torn journal line
    leftover = root / "shards" / ".tmp-shard-00002-tmp999-1"
    (leftover / "input_ids").mkdir(parents=True)
    (leftover / "input_ids" / "c.0").write_bytes(b"partial")
    writer.write_shard(3, _records(PLAN.shards[3]))
    journal = root / "journal" / "rank-0.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:2]) + lines[2][:40])  # shard 3's line torn mid-append
    (root / "shards" / "shard-00003" / "labels" / "c.0").write_bytes(b"half-written")

    resumed = CacheWriter(root, SPEC)
    assert resumed.done_shards() == {0, 1}
    assert not leftover.exists() and not (root / "shards" / "shard-00003").exists()
    assert journal.read_text().endswith("\n")
    write_synthetic_cache(root, SPEC, PLAN)
    ref_root, ref_digest, ref_sums = reference
    assert content_digest(root) == ref_digest
    assert _shard_checksums(root) == ref_sums  # byte-identical shards
    assert verify_cache(root).ok
    assert TeacherCache.open(root).index["example_id"].sort().to_list() == list(range(N_EXAMPLES))


@pytest.mark.slow
def test_sigkill_at_several_points_then_resume_equals_uninterrupted(tmp_path, reference):
    root = tmp_path / "cache"
    for kill_after in (2, 4):  # journaled shards before the kill; the next shard is mid-write
        proc = subprocess.Popen(_script(root), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120
            while _journal_lines(root) < kill_after and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            assert proc.poll() is None, f"writer ended before the kill: {proc.stderr.read().decode()[-2000:]}"
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        manifest = json.loads((root / "manifest.json").read_text())
        assert manifest["complete"] is False
    done = subprocess.run(_script(root), capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    _, ref_digest, ref_sums = reference
    assert content_digest(root) == ref_digest
    assert _shard_checksums(root) == ref_sums
    assert not list((root / "shards").glob(".tmp-*"))


def test_two_concurrent_writers_then_seal_equal_one_writer(tmp_path, reference):
    root = tmp_path / "cache"
    procs = [subprocess.Popen(_script(root, "--rank", str(r), "--world-size", "2", "--no-seal"), stderr=subprocess.PIPE)
             for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    assert sorted(p.name for p in (root / "journal").iterdir()) == ["rank-0.jsonl", "rank-1.jsonl"]
    CacheWriter(root, SPEC, rank=0, world_size=2).seal(PLAN)
    _, ref_digest, ref_sums = reference
    assert content_digest(root) == ref_digest
    assert _shard_checksums(root) == ref_sums
    ranks = {s["shard"]: s["rank"] for s in json.loads((root / "manifest.json").read_text())["shards"]}
    assert ranks == {s.shard_id: s.shard_id % 2 for s in PLAN.shards}


def test_seal_refuses_missing_shards_and_resume_with_another_world_size(tmp_path, reference):
    root = tmp_path / "cache"
    write_synthetic_cache(root, SPEC, PLAN, rank=0, world_size=2, seal=False)  # only even shards
    with pytest.raises(Exception, match="planned shard\\(s\\) not written .*shard-00001"):
        CacheWriter(root, SPEC, rank=0, world_size=2).seal(PLAN)
    write_synthetic_cache(root, SPEC, PLAN)  # one process finishes the odd shards
    assert content_digest(root) == reference[1]


def test_a_damaged_journal_line_that_is_not_the_torn_last_one_is_an_error(tmp_path):
    root = tmp_path / "c"
    _partial_cache(root, 3)
    journal = root / "journal" / "rank-0.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text(lines[0] + "{not json\n" + "".join(lines[2:]))  # a middle line damaged, ends in a newline
    with pytest.raises(CacheError, match="line 2 is not a journal entry"):
        CacheWriter(root, SPEC)
