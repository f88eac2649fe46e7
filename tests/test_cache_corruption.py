"""Damage anywhere in a cache is caught: verify finds 100 % of the damages, and distill refuses
every damage to anything it reads or depends on (before or while training, never silently).

Every file of a real cache (chunks, zarr.json, the index, the manifest, the assets, the
tokenizer) is damaged twice, one copy each: a flipped byte, and a changed digit (or, in a binary
file, a second flipped byte elsewhere). verify runs on every damage; distill runs on the damages
of every file of one shard and of every other file (the other shards' files are the same kinds).
The journal is writer bookkeeping that no reader opens.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from conftest import save_random_teacher

from c2kd.cache_schema import verify_cache
from c2kd.errors import C2KDError
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, cache_teacher
from c2kd.data.examples import load_examples
from c2kd.student.distill import DistillRecipe, distill

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tiny_examples_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corruption")
    examples = load_examples(tiny_examples_dir)
    teacher = save_random_teacher(examples, root, seed=2)
    out = root / "cache"
    cache_teacher(teacher, examples, out, CacheTeacherSettings(splits=("train",), examples_per_shard=128,
                                                               logits="topk:8", progress=False))
    return out


def _files(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file() and "journal" not in p.parts)


def _flip_byte(data: bytes, at: float) -> bytes:
    k = min(len(data) - 1, int(len(data) * at))
    return data[:k] + bytes([data[k] ^ 0x10]) + data[k + 1 :]


def _change_digit(data: bytes) -> bytes:
    """Change the middle digit of a text file (a number in JSON); a binary file gets a second flip."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return _flip_byte(data, 0.77)
    digits = [m.start() for m in re.finditer(r"[0-9]", text)]
    if not digits:
        return _flip_byte(data, 0.77)
    k = digits[len(digits) // 2]
    return (text[:k] + str((int(text[k]) + 1) % 10) + text[k + 1 :]).encode()


DAMAGES = {"byte": lambda d: _flip_byte(d, 0.5), "digit": _change_digit}


def _damaged_copy(cache: Path, tmp: Path, rel: str, how: str) -> Path:
    copy = tmp / f"{rel.replace('/', '_')}-{how}"
    shutil.copytree(cache, copy)
    path = copy / rel
    before = path.read_bytes()
    after = DAMAGES[how](before)
    assert after != before
    path.write_bytes(after)
    return copy


def test_verify_catches_every_damage_to_every_file(cache, tmp_path):
    files = _files(cache)
    kinds = {"manifest.json", "index.parquet", "assets/teacher_head.safetensors", "assets/item_embeddings.safetensors",
             "assets/teacher_config.json"}
    assert kinds <= set(files) and any(f.startswith("assets/tokenizer/") for f in files)
    assert any(f.endswith("zarr.json") for f in files) and any("/c." in f for f in files)
    missed = []
    for rel in files:
        for how in DAMAGES:
            copy = _damaged_copy(cache, tmp_path, rel, how)
            if verify_cache(copy).ok:
                missed.append(f"{rel} ({how})")
            shutil.rmtree(copy)
    assert not missed, f"verify missed {len(missed)} of {2 * len(files)} damages: {missed}"


def test_distill_refuses_every_damage_to_what_it_reads(cache, tmp_path, tiny_examples_dir):
    shard = "shards/shard-00000/"
    files = [f for f in _files(cache) if not f.startswith("shards/") or f.startswith(shard)]
    accepted = []
    for rel in files:
        for how in DAMAGES:
            copy = _damaged_copy(cache, tmp_path, rel, how)
            try:
                distill(copy, tiny_examples_dir, tmp_path / "student", DistillRecipe(student="micro", max_val=4),
                        {"epochs": 1, "batch_size": 128, "progress": False})
                accepted.append(f"{rel} ({how})")
            except C2KDError:
                pass
            shutil.rmtree(copy)
            shutil.rmtree(tmp_path / "student", ignore_errors=True)
            shutil.rmtree(tmp_path / "student.partial", ignore_errors=True)
    assert not accepted, f"distill accepted {len(accepted)} damaged caches: {accepted}"
