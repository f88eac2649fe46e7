"""A cache's two identities, caches shared through a folder, and manifests edited with their digest
recomputed.

- The content identity names what was computed from what: two runs of one teacher on the same
  data (one of them interrupted and resumed, at another time, from another copy of the teacher)
  share it, while their manifest digests differ; `cache pull --expect` takes either, and a student
  records it.
- `cache push` to a folder (file:// or a plain path, as on a shared NFS mount) and `cache pull`
  back give the same cache.
- Whoever edits a manifest can recompute its digest: verify catches each such edit below, and
  distill refuses it (leaving no run folder) instead of training on it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import save_random_teacher
from synthetic_cache import synthetic_examples, synthetic_spec, write_synthetic_cache

from c2kd.cache_schema import TeacherCache, cache_info, content_digest, plan_shards, verify_cache
from c2kd.cache_schema import writer as writer_module
from c2kd.cache_schema.identity import content_identity
from c2kd.cache_schema.schema import CacheSpec, array_layout, manifest_digest
from c2kd.cache_schema.transfer import pull
from c2kd.cache_schema.writer import CacheWriter
from c2kd.cli import main
from c2kd.data.examples import load_examples
from c2kd.errors import C2KDError, CacheError
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, cache_teacher
from c2kd.student.distill import DistillRecipe, distill

SETTINGS = CacheTeacherSettings(splits=("train",), examples_per_shard=64, writer="thread", progress=False)


@pytest.fixture(scope="module")
def examples(tiny_examples_dir):
    return load_examples(tiny_examples_dir)


@pytest.fixture(scope="module")
def two_runs(examples, tmp_path_factory) -> tuple[Path, Path]:
    """One teacher cached twice: once straight through; once from a copy of the teacher in another
    folder, interrupted after its first shard and resumed at another time."""
    root = tmp_path_factory.mktemp("identity")
    teacher = save_random_teacher(examples, root, seed=3)
    copy = root / "elsewhere" / "teacher"
    shutil.copytree(teacher, copy)
    cache_teacher(teacher, examples, root / "a", SETTINGS)

    monkeypatch = pytest.MonkeyPatch()
    real_write = CacheWriter.write_shard

    def dies_after_one_shard(self, shard_id, records):
        if self.done_shards():
            raise KeyboardInterrupt  # as a kill mid-run: this shard never lands
        return real_write(self, shard_id, records)

    monkeypatch.setattr(CacheWriter, "write_shard", dies_after_one_shard)
    with pytest.raises(BaseException):  # noqa: B017 - the interruption, however the writer thread reports it
        cache_teacher(copy, examples, root / "b", SETTINGS)
    monkeypatch.undo()
    assert json.loads((root / "b" / "manifest.json").read_text())["complete"] is False
    monkeypatch.setattr(writer_module, "_now", lambda: "2031-01-02T03:04:05+00:00")  # resumed another day
    cache_teacher(copy, examples, root / "b", SETTINGS)
    monkeypatch.undo()
    return root / "a", root / "b"


def test_two_runs_share_the_content_identity_not_the_digest(two_runs):
    a, b = (TeacherCache.open(p) for p in two_runs)
    assert a.digest != b.digest  # the times and the teacher's path are in the manifest
    assert a.content_id == b.content_id
    assert content_digest(a) == content_digest(b)  # it is the same content, example by example
    assert cache_info(two_runs[1])["content_id"] == a.content_id
    assert verify_cache(two_runs[1]).content_id == a.content_id
    other = json.loads((two_runs[0] / "manifest.json").read_text())
    other["spec"]["teacher_fingerprint"] = "0" * 64  # another teacher: another identity
    assert content_identity(other) != a.content_id


def test_pull_expects_either_identity(two_runs, tmp_path, capsys):
    a, b = two_runs
    content_id = TeacherCache.open(a).content_id
    assert pull(str(b), tmp_path / "by-content", expect=content_id[:12])["content_id"] == content_id
    assert pull(str(b), tmp_path / "by-digest", expect=TeacherCache.open(b).digest[:12])["already_there"] is False
    with pytest.raises(CacheError, match="not the expected"):
        pull(str(b), tmp_path / "wrong", expect=TeacherCache.open(a).digest[:12])  # a's digest is not b's
    assert not (tmp_path / "wrong").exists()
    assert main(["cache", "pull", str(b), str(tmp_path / "short"), "--expect", "abc"]) == 1
    assert "8 to 64 hex digits" in capsys.readouterr().err
    assert not (tmp_path / "short").exists()
    assert main(["cache", "info", "--json", str(b)]) == 0
    assert json.loads(capsys.readouterr().out)["content_id"] == content_id


def test_a_student_records_the_content_identity(two_runs, examples, tmp_path):
    record = distill(two_runs[1], examples, tmp_path / "student", DistillRecipe(student="micro", max_val=4),
                     {"max_steps": 1, "batch_size": 32, "progress": False})
    saved = json.loads((tmp_path / "student" / "distill.json").read_text())
    assert record["cache"]["content_id"] == saved["cache"]["content_id"] == TeacherCache.open(two_runs[0]).content_id


# --- a folder as the place caches are shared ---------------------------------------------------


@pytest.mark.parametrize("form", ["file-url", "plain-path"])
def test_push_to_a_folder_and_pull_back(form, tmp_path, capsys):
    spec = synthetic_spec(examples_per_shard=4)
    cache = tmp_path / "cache"
    write_synthetic_cache(cache, spec, plan_shards(synthetic_examples(12, spec.splits), 4))
    shared = tmp_path / "nfs" / "team" / "caches" / "c1"  # none of these folders exists yet
    url = f"file://{shared}" if form == "file-url" else str(shared)
    assert main(["cache", "push", str(cache), url]) == 0, capsys.readouterr().err
    assert verify_cache(shared).ok
    assert (shared / "manifest.json").read_bytes() == (cache / "manifest.json").read_bytes()
    # a cut push (a shard file and the manifest never arrived, a file damaged at its full size) is
    # finished by pushing again
    (shared / "manifest.json").unlink()
    next(shared.glob("shards/shard-00001/*/c.*")).unlink()
    damaged = next(shared.glob("shards/shard-00002/*/c.*"))
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert main(["cache", "push", str(cache), url]) == 0
    assert "2 files" in capsys.readouterr().out and verify_cache(shared).ok
    assert main(["cache", "push", str(cache), url]) == 0
    assert "already holds this cache" in capsys.readouterr().out
    back = tmp_path / "back"
    assert main(["cache", "pull", url, str(back), "--expect", TeacherCache.open(cache).content_id[:16]]) == 0
    assert content_digest(back) == content_digest(cache) and verify_cache(back).ok


def test_push_to_a_folder_that_cannot_be_one_leaves_nothing(tmp_path, capsys):
    spec = synthetic_spec(examples_per_shard=4)
    cache = tmp_path / "cache"
    write_synthetic_cache(cache, spec, plan_shards(synthetic_examples(8, spec.splits), 4))
    (tmp_path / "a-file").write_text("x")
    for target in (f"file://{tmp_path}/a-file", str(tmp_path / "a-file" / "sub"), "/proc/c2kd-cache", str(cache / "copy")):
        assert main(["cache", "push", str(cache), target]) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert (tmp_path / "a-file").read_text() == "x" and not (cache / "copy").exists()


# --- manifests edited, their digest recomputed ----------------------------------------------


def _zero_a_chunk_checksum(m: dict) -> None:
    entry = next(f for f in m["shards"][0]["files"] if "/c." in f[0])
    entry[2] = "0" * 64


def _swap_chunk_checksums(m: dict) -> None:
    chunks = [f for f in m["shards"][0]["files"] if "/c." in f[0]]
    chunks[0][2], chunks[1][2] = chunks[1][2], chunks[0][2]


def _num_items(m: dict) -> None:
    m["spec"]["extra"]["num_items"] += 5


def _a_shards_split(m: dict) -> None:
    m["shards"][0]["split"] = "validation"
    m["totals"]["splits"] = {"train": m["totals"]["splits"]["train"] - m["shards"][0]["examples"],
                             "validation": m["shards"][0]["examples"]}


def _hidden_size(m: dict) -> None:
    m["spec"]["hidden_size"] *= 2


def _a_shards_examples(m: dict) -> None:
    m["shards"][0]["examples"] -= 1
    m["totals"]["examples"] -= 1
    m["totals"]["splits"]["train"] -= 1


EDITS = [_zero_a_chunk_checksum, _swap_chunk_checksums, _num_items, _a_shards_split, _hidden_size, _a_shards_examples]


@pytest.fixture(scope="module")
def real_cache(examples, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("edited")
    teacher = save_random_teacher(examples, root, seed=4)
    cache_teacher(teacher, examples, root / "cache", SETTINGS)
    return root / "cache"


def _edited(cache: Path, tmp: Path, edit) -> Path:
    """A copy whose manifest was edited, with every field that follows from others recomputed."""
    copy = tmp / "cache"
    shutil.copytree(cache, copy)
    m = json.loads((copy / "manifest.json").read_text())
    edit(m)
    spec = CacheSpec.from_dict(m["spec"])
    m["spec_hash"], m["arrays"] = spec.spec_hash, array_layout(spec)
    m["digest"] = manifest_digest(m)
    (copy / "manifest.json").write_text(json.dumps(m, indent=1))
    return copy


@pytest.mark.parametrize("edit", EDITS, ids=[e.__name__.strip("_") for e in EDITS])
def test_an_edit_with_its_digest_recomputed_is_caught(edit, real_cache, examples, tmp_path):
    copy = _edited(real_cache, tmp_path, edit)
    assert not verify_cache(copy).ok
    out = tmp_path / "student"
    with pytest.raises(C2KDError):
        distill(copy, examples, out, DistillRecipe(student="micro", max_val=4),
                {"max_steps": 1, "batch_size": 32, "progress": False})
    assert not out.exists() and not (tmp_path / "student.partial").exists()
