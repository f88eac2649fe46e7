"""Reading a cache read-only from URLs: a local `python -m http.server` and an fsspec memory store."""

from __future__ import annotations

import re
import select
import shutil
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch
from typer.testing import CliRunner

from c2kd.cache_schema import TeacherCache, cache_info, content_digest, plan_shards, verify_cache
from synthetic_cache import synthetic_examples, synthetic_spec, write_synthetic_cache
from c2kd.cli import app
from c2kd.errors import CacheError


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A sealed cache (and a corrupted copy) behind http.server on a free port of 127.0.0.1."""
    base = tmp_path_factory.mktemp("www")
    spec = synthetic_spec(logits="topk:4", examples_per_shard=4)
    plan = plan_shards(synthetic_examples(12, spec.splits), spec.examples_per_shard)
    write_synthetic_cache(base / "cache", spec, plan)
    shutil.copytree(base / "cache", base / "bad")
    chunk = base / "bad" / "shards" / "shard-00002" / "final_hidden" / "c.0.0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    server = subprocess.Popen(
        [sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", str(base)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        ready, _, _ = select.select([server.stdout], [], [], 30)
        assert ready, "http.server did not start"
        port = int(re.search(r"port (\d+)", server.stdout.readline()).group(1))
        yield base, f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait(timeout=10)


def test_https_style_reading_equals_local(served):
    base, url = served
    local, remote = TeacherCache.open(base / "cache"), TeacherCache.open(f"{url}/cache")
    ids = [11, 0, 6, 3]
    a, b = local.get(ids), remote.get(ids)
    for name in ("input_ids", "labels", "slot_items", "answer_positions", "final_hidden", "topk_values", "topk_indices"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert all(torch.equal(a.hidden[k].view(torch.int16), b.hidden[k].view(torch.int16)) for k in a.hidden)
    assert torch.equal(local.head_weight(), remote.head_weight())
    assert torch.equal(local.item_embeddings(), remote.item_embeddings())
    assert remote.tokenizer()("w5 w7")["input_ids"] == [5, 7]
    assert cache_info(f"{url}/cache")["bytes"] == cache_info(base / "cache")["bytes"]
    assert content_digest(remote) == content_digest(local)


def test_verify_over_http_names_the_bad_shard(served):
    base, url = served
    assert verify_cache(f"{url}/cache").ok
    report = verify_cache(f"{url}/bad")
    assert report.bad_shards == ["shard-00002"]
    result = CliRunner().invoke(app, ["cache", "verify", f"{url}/bad"])
    assert result.exit_code == 1 and "shard-00002" in result.output
    with pytest.raises(CacheError, match="no manifest.json"):
        TeacherCache.open(f"{url}/missing")


def test_fsspec_memory_store_and_unknown_scheme(served, tmp_path):
    base, _ = served
    fs = fsspec.filesystem("memory")
    root = Path(base / "cache")
    for path in root.rglob("*"):
        if path.is_file():
            fs.pipe(f"/c2kd-test-cache/{path.relative_to(root).as_posix()}", path.read_bytes())
    try:
        remote = TeacherCache.open("memory://c2kd-test-cache", expect={"logits": "topk"})
        assert torch.equal(remote.get([5]).topk_values, TeacherCache.open(root).get([5]).topk_values)
        assert verify_cache("memory://c2kd-test-cache").ok
    finally:
        fs.rm("/c2kd-test-cache", recursive=True)
    assert len(TeacherCache.open(f"file://{root}")) == 12
    with pytest.raises(CacheError, match="cannot read this URL scheme"):
        TeacherCache.open("nosuchscheme://bucket/cache")
