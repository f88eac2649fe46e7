"""Stage one (`cache-teacher`): fidelity to the live teacher, kill -9 + resume, 2-rank torchrun."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_two_nodes, save_random_teacher
import torch
from typer.testing import CliRunner

from c2kd.cache_schema import CacheWriter, TeacherCache, content_digest, fingerprint_tokenizer, verify_cache
from c2kd.cache_schema.merge import merge_caches
from c2kd.cli import app
from c2kd.errors import C2KDError, CacheError
from c2kd.pipeline.cache_teacher import CacheTeacherSettings, TeacherRunner, build_spec, cache_teacher, length_buckets
from c2kd.pipeline.shard_writers import ShardJob, ShardWriterProcess, start_shard_writer
from c2kd.data.examples import load_examples
from c2kd.recmodel.layers import late_layers
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.prompts import PromptEncoder, collate

# The logit error of exact mode comes only from rounding final_hidden to the cache dtype.
# Bounds relative to the largest |logit|: float32 is exact up to float rounding.
EXACT_LOGIT_TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def examples(tiny_examples_dir):
    return load_examples(tiny_examples_dir)


@pytest.fixture(scope="module")
def teacher_dir(examples, tmp_path_factory) -> Path:
    return save_random_teacher(examples, tmp_path_factory.mktemp("teacher"), seed=5)


def _live(teacher: RecLM, examples, ids):
    """The live teacher on these examples, unbatched-equivalent: collate + one forward."""
    enc = PromptEncoder(teacher.tokenizer, teacher.spec.format, examples.titles())
    rows = {r["example_id"]: r for s in ("train", "validation", "test") for r in examples.split(s).iter_rows(named=True)}
    encoded = [enc.encode(i, rows[i]["history"], rows[i]["candidates"], rows[i]["target"]) for i in ids]
    tokens = collate(encoded, enc.pad_id)
    with torch.no_grad():
        out = teacher(tokens["input_ids"], tokens["attention_mask"], tokens["slot_items"], output_hidden_states=True)
    return tokens, out


def test_length_buckets_respect_the_token_budget():
    lengths = [5, 30, 7, 31, 6, 29, 40]
    batches = length_buckets(lengths, max_tokens=64)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 64 or len(b) == 1 for b in batches)
    assert set(batches[0]) == {0, 2, 4}  # the short prompts share a batch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_teacher_equals_live_teacher(teacher_dir, examples, tmp_path, dtype):
    out = tmp_path / "cache"
    settings = CacheTeacherSettings(splits=("validation", "test"), dtype=dtype, logits="full", examples_per_shard=16,
                                    max_tokens_per_batch=1024, progress=False)
    summary = cache_teacher(teacher_dir, examples, out, settings)
    assert summary["shards_written"] == summary["shards_planned"] == 4  # 30 + 30 examples, 16 per shard
    teacher = RecLM.load(teacher_dir).eval()
    cache = TeacherCache.open(
        out, expect={"tokenizer_fingerprint": fingerprint_tokenizer(teacher.tokenizer), "layers": late_layers(6),
                     "data_fingerprint": examples.fingerprint, "logits": "full"},
    )
    assert cache.layers == (2, 3, 4, 5) and len(cache) == 60
    assert torch.equal(cache.head_weight(), teacher.effective_head_weight())
    assert torch.equal(cache.item_embeddings(), teacher.item_embeddings)
    assert cache.tokenizer().get_vocab() == teacher.tokenizer.get_vocab()
    ids = cache.index["example_id"].to_list()[::3]  # across all shards and both splits
    batch = cache.get(ids)
    tokens, live = _live(teacher, examples, ids)
    for name in ("input_ids", "attention_mask", "slot_items", "labels"):
        assert torch.equal(getattr(batch, name), tokens[name]), name
    live_logits = batch.at_answers(live.logits)[batch.answer_mask]
    exact = (batch.final_hidden.float() @ cache.head_weight().float().T)[batch.answer_mask]
    err = (exact - live_logits).abs().max().item()
    scale = live_logits.abs().max().item()
    assert err <= EXACT_LOGIT_TOLERANCE[dtype] * scale, f"{dtype}: max |exact - live| = {err:.3g} (|logit| <= {scale:.3g})"
    assert torch.allclose(batch.full_logits[batch.answer_mask].float(), live_logits, atol=EXACT_LOGIT_TOLERANCE[dtype] * scale)
    mask = batch.attention_mask.bool()
    for layer in cache.layers:
        ref = live.hidden_states[layer][mask]
        assert torch.allclose(batch.hidden[layer][mask].float(), ref, atol=1e-4 + 8e-3 * (dtype != "float32") * ref.abs().max().item())


def test_cli_answer_positions_topk_and_rerun_is_a_no_op(teacher_dir, tiny_examples_dir, tmp_path):
    out = tmp_path / "cache"
    args = ["cache-teacher", "--teacher", str(teacher_dir), "--data", str(tiny_examples_dir), "--out", str(out),
            "--splits", "validation,test", "--layers", "5,6", "--positions", "answer", "--logits", "topk:4",
            "--examples-per-shard", "16", "--no-progress"]
    runner = CliRunner()
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "cached 60 examples" in first.output
    cache = TeacherCache.open(out, expect={"positions": "answer", "logits": "topk", "splits": ["validation", "test"]})
    assert cache.layers == (5, 6) and verify_cache(out).ok
    teacher = RecLM.load(teacher_dir).eval()
    ids = cache.split_ids("test")[:5].tolist()
    batch = cache.get(ids)
    _, live = _live(teacher, examples=load_examples(tiny_examples_dir), ids=ids)
    live_top = batch.at_answers(live.logits)[batch.answer_mask].topk(4)
    assert torch.equal(batch.topk_indices[batch.answer_mask], live_top.indices)
    # HF's last hidden state is the final-normed one: layer 6 at the answers equals final_hidden
    assert torch.equal(batch.hidden[6], batch.final_hidden)
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and "already a complete cache" in again.output
    other = runner.invoke(app, [*args[:-2], "8", "--no-progress"])  # another shard size
    assert other.exit_code == 1 and "other settings" in other.output


def test_refusals_before_any_work(teacher_dir, tiny_examples_dir, tmp_path):
    with pytest.raises(C2KDError, match="the teacher has layers 1..6"):
        cache_teacher(teacher_dir, tiny_examples_dir, tmp_path / "a", CacheTeacherSettings(layers=(6, 7), progress=False))
    with pytest.raises(C2KDError, match="--splits 'dev'"):
        cache_teacher(teacher_dir, tiny_examples_dir, tmp_path / "b", CacheTeacherSettings(splits=("dev",), progress=False))
    with pytest.raises(C2KDError, match="positions"):
        cache_teacher(teacher_dir, tiny_examples_dir, tmp_path / "c", CacheTeacherSettings(positions="some", progress=False))
    with pytest.raises(C2KDError, match="--writer 'fork'"):
        cache_teacher(teacher_dir, tiny_examples_dir, tmp_path / "e", CacheTeacherSettings(writer="fork", progress=False))
    result = CliRunner().invoke(app, ["cache-teacher", "--teacher", str(tmp_path), "--data", str(tiny_examples_dir),
                                      "--out", str(tmp_path / "d")])
    assert result.exit_code == 1 and "not a saved recommender" in result.output
    # a head with a bias cannot be rebuilt from the stored weight: refused before any forward
    model = RecLM.load(teacher_dir)
    head = model.base_lm().get_output_embeddings()
    model.base_lm().set_output_embeddings(torch.nn.Linear(head.in_features, head.out_features, bias=True))
    examples = load_examples(tiny_examples_dir)
    encoder = PromptEncoder(model.tokenizer, "ids", examples.titles())
    spec = build_spec(model, examples, teacher_dir, CacheTeacherSettings(), encoder.pad_id)
    with pytest.raises(CacheError, match="bias"):
        TeacherRunner(model, encoder, spec, torch.device("cpu"), 512)


# ---------------------------------------------------------------- the background writers


def test_process_and_thread_writers_write_the_same_cache(teacher_dir, examples, tmp_path):
    caches = {}
    for kind in ("process", "thread"):
        settings = CacheTeacherSettings(splits=("validation",), examples_per_shard=8, max_tokens_per_batch=256,
                                        writer=kind, progress=False)
        summary = cache_teacher(teacher_dir, examples, tmp_path / kind, settings)
        assert summary["shards_written"] == 4 and summary["bytes_written"] > 0
        caches[kind] = content_digest(tmp_path / kind)
    assert caches["process"] == caches["thread"]


def _one_shard_job(teacher_dir, examples, root: Path):
    """A CacheWriter at `root` and the job of its first shard (8 validation examples)."""
    model = RecLM.load(teacher_dir).eval()
    encoder = PromptEncoder(model.tokenizer, "ids", examples.titles())
    settings = CacheTeacherSettings(splits=("validation",), examples_per_shard=8)
    spec = build_spec(model, examples, teacher_dir, settings, encoder.pad_id)
    rows = examples.split("validation").head(8).to_dicts()
    outputs = TeacherRunner(model, encoder, spec, torch.device("cpu"), 256).shard_outputs(rows)
    return CacheWriter(root, spec), ShardJob(0, "validation", rows, outputs, spec)


def test_a_failing_writer_process_is_reported_in_the_parent(teacher_dir, examples, tmp_path):
    writer, job = _one_shard_job(teacher_dir, examples, tmp_path / "cache")
    shutil.rmtree(tmp_path / "cache" / "shards")
    (tmp_path / "cache" / "shards").write_text("not a folder")  # every shard write now fails
    background = ShardWriterProcess(max_pending=1)
    background.attach(writer)
    background.put(job)
    with pytest.raises(CacheError, match="failed on shard 0"):
        background.close()
    assert not background.process.is_alive()


def test_a_killed_writer_process_is_reported_not_waited_for(teacher_dir, examples, tmp_path):
    writer, job = _one_shard_job(teacher_dir, examples, tmp_path / "cache")
    background = ShardWriterProcess(max_pending=1)
    background.attach(writer)
    background.process.kill()
    background.process.join(timeout=30)
    with pytest.raises(CacheError, match="writer process died"):
        for _ in range(3):  # the first puts may still fit in the queue
            background.put(job)
        background.close()


def test_a_dead_writer_process_does_not_keep_its_parent_from_exiting():
    script = (
        "from c2kd.errors import CacheError\n"
        "from c2kd.pipeline.shard_writers import ShardWriterProcess\n"
        "bg = ShardWriterProcess(max_pending=1)\n"
        "bg.process.kill(); bg.process.join()\n"
        "bg.attached = True\n"
        "try:\n"
        "    for _ in range(4):\n"
        "        bg.put(b'x' * 10_000_000)  # more than the pipe holds: the queue's feeder thread blocks\n"
        "except CacheError as e:\n"
        "    print('refused:', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "writer process died" in done.stdout


def test_shards_are_refused_before_a_cache_writer_is_attached():
    for kind in ("thread", "process"):
        background = start_shard_writer(kind, max_pending=1)
        with pytest.raises(CacheError, match="attach a CacheWriter"):
            background.put(None)
        background.discard()


# ---------------------------------------------------------------- processes: kill -9, torchrun

ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # torchrun's default too


def _cli(teacher_dir, data_dir, out):
    return ["-m", "c2kd.cli", "cache-teacher", "--teacher", str(teacher_dir), "--data", str(data_dir), "--out", str(out),
            "--splits", "validation,test", "--examples-per-shard", "8", "--max-tokens-per-batch", "256", "--no-progress"]


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan may wait a moment to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _journal_lines(root: Path) -> int:
    folder = root / "journal"
    return sum(len(p.read_text().splitlines()) for p in folder.glob("rank-*.jsonl")) if folder.is_dir() else 0


def _shard_checksums(root: Path) -> list[str]:
    return [s["sha256"] for s in json.loads((root / "manifest.json").read_text())["shards"]]


@pytest.fixture(scope="module")
def reference(teacher_dir, tiny_examples_dir, tmp_path_factory):
    """An uninterrupted single-process cache (one thread, like each torchrun rank)."""
    out = tmp_path_factory.mktemp("reference") / "cache"
    done = subprocess.run([sys.executable, *_cli(teacher_dir, tiny_examples_dir, out)], env=ONE_THREAD,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, content_digest(out), _shard_checksums(out)


@pytest.mark.slow
def test_kill_9_at_several_points_then_resume_equals_uninterrupted(teacher_dir, tiny_examples_dir, tmp_path, reference):
    out = tmp_path / "cache"
    for kill_after in (1, 4):  # shards journaled (of 8) before the kill
        proc = subprocess.Popen([sys.executable, *_cli(teacher_dir, tiny_examples_dir, out)], env=ONE_THREAD,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 300
            while _journal_lines(out) < kill_after and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert proc.poll() is None, f"finished before the kill: {proc.stderr.read().decode()[-2000:]}"
            children = _children(proc.pid)
            assert children, "the cache writer process is missing"
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_running(pid) for pid in children), "the writer process outlived the killed run"
        with pytest.raises(Exception, match="incomplete"):
            TeacherCache.open(out)
    done = subprocess.run([sys.executable, *_cli(teacher_dir, tiny_examples_dir, out)], env=ONE_THREAD,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "already done" in done.stdout
    ref_out, ref_digest, ref_sums = reference
    assert content_digest(out) == ref_digest
    assert _shard_checksums(out) == ref_sums


@pytest.mark.slow
def test_two_nodes_each_write_their_part_and_the_merge_equals_one_process(teacher_dir, tiny_examples_dir, tmp_path,
                                                                          reference):
    # `torchrun --nnodes 2` with c10d rendezvous, each node its own --out (no shared disk): --part node
    outs = [tmp_path / "node-a", tmp_path / "node-b"]
    done = run_two_nodes([[*_cli(teacher_dir, tiny_examples_dir, out), "--part", "node"] for out in outs], ONE_THREAD)
    assert all(code == 0 for code, _ in done), [text[-3000:] for _, text in done]
    parts = sorted(TeacherCache.open(out).spec.part for out in outs)
    assert parts == ["1/2", "2/2"]
    merge_caches(outs, tmp_path / "merged")
    ref_out, ref_digest, ref_sums = reference
    assert content_digest(tmp_path / "merged") == ref_digest
    assert _shard_checksums(tmp_path / "merged") == ref_sums  # every shard's files, byte for byte
    merged, single = TeacherCache.open(tmp_path / "merged"), TeacherCache.open(ref_out)
    ids = single.index["example_id"].to_list()
    a, b = merged.get(ids), single.get(ids)
    for name in single.layout:  # array by array
        if name in a.outputs:
            assert torch.equal(a.outputs[name], b.outputs[name]), name
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)


def test_part_node_without_torchrun_nodes_is_one_clear_line(teacher_dir, tiny_examples_dir, tmp_path):
    for env in ({}, {"WORLD_SIZE": "1"}):  # no launcher, or one that does not say which node this is
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            with pytest.raises(C2KDError, match="--part node needs torchrun"):
                cache_teacher(teacher_dir, load_examples(tiny_examples_dir), tmp_path / "c", CacheTeacherSettings(part="node"))
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_torchrun_two_ranks_equal_one_rank(teacher_dir, tiny_examples_dir, tmp_path, reference):
    out = tmp_path / "cache"
    # `torchrun ... -m c2kd.cli cache-teacher ...`: -m runs the script as a module in each rank
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           *_cli(teacher_dir, tiny_examples_dir, out)]
    done = subprocess.run(cmd, env=ONE_THREAD, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert {s["rank"] for s in manifest["shards"]} == {0, 1}
    ref_out, ref_digest, ref_sums = reference
    assert content_digest(out) == ref_digest
    assert _shard_checksums(out) == ref_sums
