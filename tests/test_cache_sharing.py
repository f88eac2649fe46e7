"""Sharing caches: push and pull over a real S3-compatible server (moto, on 127.0.0.1), cut
transfers resumed, training from s3:// through a read cache, refusals, and part caches merged
into the cache a single run writes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import save_random_teacher

from c2kd.cache_schema import TeacherCache, cache_info, content_digest, verify_cache
from c2kd.cache_schema.transfer import pull, push
from c2kd.cli import main
from c2kd.errors import CacheError
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, cache_teacher
from c2kd.data.examples import load_examples
from c2kd.student.distill import DistillRecipe, distill

pytestmark = pytest.mark.slow
BUCKET = "c2kd-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """An S3-compatible server (moto) on 127.0.0.1 with one bucket; fsspec/s3fs pointed at it."""
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "server.log"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=open(log, "w"), stderr=subprocess.STDOUT)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec.config

    fsspec.config.set_conf_env(fsspec.config.conf)  # fsspec reads FSSPEC_* at import: read them again
    try:
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError(f"moto server did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.2)
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        fs = s3fs.S3FileSystem()
        fs.mkdir(BUCKET)
        yield {"port": port, "env": env, "fs": fs}
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        fsspec.config.conf.pop("s3", None)


@pytest.fixture(scope="module")
def examples(tiny_examples_dir):
    return load_examples(tiny_examples_dir)


@pytest.fixture(scope="module")
def teacher(examples, tmp_path_factory):
    return save_random_teacher(examples, tmp_path_factory.mktemp("sharing-teacher"), seed=4)


def _train_and_validation_cache(teacher: Path, examples, out: Path, examples_per_shard: int) -> Path:
    cache_teacher(teacher, examples, out, CacheTeacherSettings(splits=("train", "validation"),
                                                               examples_per_shard=examples_per_shard, progress=False))
    return out


@pytest.fixture(scope="module")
def cache(teacher, examples, tmp_path_factory) -> Path:
    """Many small files, so that a transfer takes long enough to be cut."""
    return _train_and_validation_cache(teacher, examples, tmp_path_factory.mktemp("sharing") / "cache", 16)


@pytest.fixture(scope="module")
def small_cache(teacher, examples, tmp_path_factory) -> Path:
    """The same examples in a quarter as many files: for the tests that need no transfer cut short
    (every S3 request costs time)."""
    return _train_and_validation_cache(teacher, examples, tmp_path_factory.mktemp("sharing-small") / "cache", 64)


def _cli(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "c2kd.cli", *args], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_push_pull_verify_identity(s3, small_cache, tmp_path):
    cache = small_cache
    url = f"s3://{BUCKET}/round-trip"
    digest = TeacherCache.open(cache).digest
    first = push(cache, url)
    assert first["digest"] == digest and first["files_sent"] > 0 and not first["already_there"]
    assert push(cache, url)["already_there"]
    info = cache_info(url)
    assert info["digest"] == digest and info["complete"]
    assert verify_cache(url).ok
    got = pull(url, tmp_path / "pulled", expect=digest[:12])
    assert got["digest"] == digest and got["content_id"] == first["content_id"] == TeacherCache.open(cache).content_id
    assert verify_cache(tmp_path / "pulled").ok
    assert content_digest(tmp_path / "pulled") == content_digest(cache)
    assert pull(url, tmp_path / "pulled")["already_there"]
    with pytest.raises(CacheError, match="not the expected"):
        pull(url, tmp_path / "other", expect="0123456789abcdef")
    assert not (tmp_path / "other").exists()


def test_a_killed_push_and_a_killed_pull_resume_to_the_same_cache(s3, cache, tmp_path):
    url = f"s3://{BUCKET}/killed"
    fs = s3["fs"]
    proc = _cli(["cache", "push", str(cache), url], s3["env"])
    deadline = time.time() + 120
    while time.time() < deadline and len(fs.find(f"{BUCKET}/killed", refresh=True)) < 30:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not fs.exists(f"{BUCKET}/killed/manifest.json"), "the push finished before it could be cut"
    with pytest.raises(CacheError, match="no manifest.json"):
        TeacherCache.open(url)  # a half-pushed cache is never taken for a complete one
    resumed = push(cache, url)
    assert resumed["files_skipped"] > 0 and resumed["files_sent"] > 0

    out = tmp_path / "pulled"
    proc = _cli(["cache", "pull", url, str(out)], s3["env"])
    while time.time() < deadline and not (out / "shards").is_dir() or len(list((out / "shards").glob("shard-*"))) < 3:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists(), "the pull finished before it could be cut"
    again = pull(url, out)
    assert again["files_skipped"] > 0
    assert verify_cache(out).ok and content_digest(out) == content_digest(cache)


def test_distill_from_s3_reads_each_file_once(s3, small_cache, examples, tmp_path):
    cache = small_cache
    url = f"s3://{BUCKET}/train-from"
    push(cache, url)
    record = distill(url, examples.root, tmp_path / "student", DistillRecipe(student="micro", max_val=8),
                     {"epochs": 2, "batch_size": 16, "progress": False}, read_cache=tmp_path / "read-cache")
    assert record["final_step"] > 0 and record["cache"]["digest"] == TeacherCache.open(cache).digest
    kept = list((tmp_path / "read-cache" / record["cache"]["digest"]).iterdir())
    assert kept  # fetched once into the read cache, read from there afterwards


def test_refusals(s3, small_cache, tmp_path, teacher, examples):
    cache = small_cache
    # an incomplete cache is not pushed
    partial = tmp_path / "partial"
    import shutil

    shutil.copytree(cache, partial)
    (partial / "manifest.json").unlink()
    with pytest.raises(CacheError, match="no manifest.json"):
        push(partial, f"s3://{BUCKET}/partial")
    # a URL with nothing there
    with pytest.raises(CacheError, match="no manifest.json"):
        pull(f"s3://{BUCKET}/nothing-here", tmp_path / "x")
    # pulling into a folder holding another cache
    url = f"s3://{BUCKET}/refusals"
    push(cache, url)
    other = tmp_path / "other-cache"
    cache_teacher(teacher, examples, other, CacheTeacherSettings(splits=("test",), progress=False))
    with pytest.raises(CacheError, match="holds another cache"):
        pull(url, other)
    # a damaged object arrives: named, nothing published
    fs = s3["fs"]
    victim = sorted(f for f in fs.find(f"{BUCKET}/refusals/shards/shard-00002") if f.endswith("c.0"))[0]
    data = bytearray(fs.cat_file(victim))
    data[len(data) // 2] ^= 1
    fs.pipe_file(victim, bytes(data))
    with pytest.raises(CacheError, match="shard-00002.*another checksum"):
        pull(url, tmp_path / "damaged")
    assert not (tmp_path / "damaged" / "manifest.json").exists() and not (tmp_path / "damaged" / "shards" / "shard-00002").exists()


def test_missing_credentials_are_one_clear_line(s3, small_cache):
    cache = small_cache
    env = {**s3["env"], "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
           "AWS_CONFIG_FILE": "/nonexistent"}
    env = {k: v for k, v in env.items() if v}
    proc = subprocess.run([sys.executable, "-m", "c2kd.cli", "cache", "push", str(cache), f"s3://{BUCKET}/nocreds"],
                          env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | env,
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and "credentials" in lines[0], proc.stderr


def test_parts_merge_into_the_single_run_cache(teacher, examples, tmp_path, cache):
    single = cache  # train + validation, 16 examples per shard
    args = ["cache-teacher", "--teacher", str(teacher), "--data", str(examples.root), "--splits", "train,validation",
            "--examples-per-shard", "16", "--no-progress"]
    procs = [subprocess.Popen([sys.executable, "-m", "c2kd.cli", *args, "--out", str(tmp_path / f"part{i}"),
                               "--part", f"{i}/2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in (1, 2)]
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out
    parts = [TeacherCache.open(tmp_path / f"part{i}") for i in (1, 2)]
    assert parts[0].spec.part == "1/2" and all(e["shard"] % 2 == 0 for e in parts[0].manifest["shards"])
    assert verify_cache(tmp_path / "part2").ok
    assert main(["cache", "merge", str(tmp_path / "part1"), str(tmp_path / "part2"), "--out", str(tmp_path / "merged")]) == 0
    assert verify_cache(tmp_path / "merged").ok
    assert content_digest(tmp_path / "merged") == content_digest(single)
    merged = TeacherCache.open(tmp_path / "merged").manifest
    reference = TeacherCache.open(single).manifest
    assert [s["sha256"] for s in merged["shards"]] == [s["sha256"] for s in reference["shards"]]  # the same shards
    # merged on another day from caches written elsewhere: the single run's content identity, not its digest
    assert TeacherCache.open(tmp_path / "merged").content_id == TeacherCache.open(single).content_id
    assert merged["digest"] != reference["digest"]
    # refusals: one part alone, the same part twice, a part of another cache
    with pytest.raises(CacheError, match="at least two"):
        from c2kd.cache_schema.merge import merge_caches

        merge_caches([tmp_path / "part1"], tmp_path / "m1")
    with pytest.raises(CacheError, match="each of the parts"):
        merge_caches([tmp_path / "part1", tmp_path / "part1"], tmp_path / "m2")
    with pytest.raises(CacheError, match="not a part cache"):
        merge_caches([tmp_path / "part1", single], tmp_path / "m3")
