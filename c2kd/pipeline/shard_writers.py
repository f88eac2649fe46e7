"""Writing finished shards off the teacher's critical path, in a background process or thread.

The teacher forward runs on the main thread. Everything after it — slicing batch outputs into
per-example records, assembling arrays, zstd, checksums, fsync, the journal — runs elsewhere, and
the forward waits only when `max_pending` finished shards are already queued.

A process is the default: that work holds the GIL for long stretches, and as a thread it slowed a
one-thread CPU forward even with a spare core (benchmarks/stage_one.py; docs/RESULTS.md). Tensors reach the process as pickled bytes
through a pipe, one copy. The process dies with its parent (kill -9 included), so
an interrupted run never leaves a second writer behind to race the resumed one.

Starting the process costs seconds (it imports torch and zarr), so `cache-teacher` starts it
before it loads the teacher and hands it the CacheWriter (`attach`) once the cache spec is known.
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from c2kd.cache_schema import CacheSpec, CacheWriter, ExampleRecord
from c2kd.cache_schema.schema import output_defs
from c2kd.errors import CacheError
from c2kd.recmodel.prompts import EncodedExample

WRITERS = ("process", "thread")


@dataclass
class BatchOutputs:
    """One batch's teacher outputs on the CPU, by cache array name (`schema.output_defs`):
    token-major ones right-padded [B, T, ...], answer-major ones [N, ...] (`counts` answers per
    example, batch-major)."""

    examples: list[EncodedExample]
    indices: list[int]  # positions of the examples in their shard
    answers: list
    counts: list[int]
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class ShardJob:
    """What the writer needs to turn one shard's batch outputs into its cache records."""

    shard_id: int
    split: str
    rows: list[dict]  # the shard's example rows, in shard order
    outputs: list[BatchOutputs]
    spec: CacheSpec

    def records(self) -> list[ExampleRecord]:
        return to_records(self.outputs, self.split, self.rows, self.spec)


def to_records(outputs: Sequence[BatchOutputs], split: str, rows: Sequence[dict], spec: CacheSpec) -> list[ExampleRecord]:
    """Per-example cache records (in shard order) from batch outputs."""
    row_kind = {a.name: a.rows for a in output_defs(spec)}
    records: list[ExampleRecord | None] = [None] * len(rows)
    for o in outputs:
        per_example = {  # name -> one tensor per example of the batch
            name: [x[b, : len(e)] for b, e in enumerate(o.examples)] if row_kind[name] == "tokens" else x.split(o.counts)
            for name, x in o.outputs.items()
        }
        for b, (e, i) in enumerate(zip(o.examples, o.indices)):
            r = rows[i]
            records[i] = ExampleRecord(
                example_id=e.example_id, split=split, user=int(r["user"]), target=int(r["target"]),
                history=r["history"], candidates=r["candidates"],
                input_ids=torch.tensor(e.input_ids), slot_items=torch.tensor(e.slot_items), labels=torch.tensor(e.labels),
                outputs={name: xs[b] for name, xs in per_example.items()}, _answers=o.answers[b],
            )
    return records  # type: ignore[return-value]


class ShardWriterThread:
    """Writes queued shards on a background thread; `put` blocks only when the queue is full."""

    def __init__(self, max_pending: int):
        self.writer: CacheWriter | None = None
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, max_pending))
        self.error: BaseException | None = None
        self.bytes_written = 0
        self.shards_written = 0
        self.write_seconds = 0.0
        self.thread = threading.Thread(target=self._run, name="c2kd-cache-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            if self.error is not None:
                continue  # drain after a failure; the error is raised in the main thread
            try:
                start = time.perf_counter()
                entry = self.writer.write_shard(job.shard_id, job.records())
                self.write_seconds += time.perf_counter() - start
                self.bytes_written += entry["bytes"]
                self.shards_written += 1
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, which re-raises it
                self.error = e

    def attach(self, writer: CacheWriter) -> None:
        """The CacheWriter that writes every job put after this."""
        self.writer = writer

    def wait_ready(self) -> None:
        """A thread is ready as soon as it is started."""

    def put(self, job: ShardJob) -> None:
        if self.writer is None:
            raise CacheError("attach a CacheWriter before putting shards")
        if self.error is not None:
            raise self.error
        self.queue.put(job)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error

    def discard(self) -> None:
        """Stop without raising (nothing was attached, or the run is already over)."""
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit now if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)


def _writer_process_main(jobs, results, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    torch.set_num_threads(1)  # the teacher owns the cores; this process does one shard at a time
    writer: CacheWriter | None = None
    ready_cpu = time.process_time()
    while True:
        job = jobs.get()
        if isinstance(job, bytes):
            job = pickle.loads(job)
        if job is None:
            results.put(("closed", time.process_time() - ready_cpu))  # CPU spent writing, start-up excluded
            results.close()
            results.join_thread()  # the report is in the pipe
            os._exit(0)  # every shard is fsynced; skipping the interpreter's teardown saves ~1 s
        if isinstance(job, CacheWriter):
            writer = job
            ready_cpu = time.process_time()
            results.put(("ready",))
            continue
        try:
            start = time.perf_counter()
            entry = writer.write_shard(job.shard_id, job.records())
            results.put(("written", job.shard_id, entry["bytes"], time.perf_counter() - start))
        except CacheError as e:
            results.put(("failed", job.shard_id, e))
            return
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
            results.put(("failed", job.shard_id, CacheError(
                f"the cache writer failed on shard {job.shard_id}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
            )))
            return


class ShardWriterProcess:
    """Writes queued shards in a child process; same interface as ShardWriterThread."""

    POLL_S = 0.5  # how often a blocked put/close checks that the child is still alive

    def __init__(self, max_pending: int):
        ctx = mp.get_context("spawn")  # never fork a process that holds OpenMP threads
        self.jobs = ctx.Queue(maxsize=max(1, max_pending))
        # jobs still buffered when the child has died must not keep this process from exiting
        self.jobs.cancel_join_thread()
        self.results = ctx.Queue()
        self.bytes_written = 0
        self.shards_written = 0
        self.write_seconds = 0.0
        self.cpu_seconds = 0.0  # the child's CPU time after `attach`, known after `close`
        self.attached = False
        self.process = ctx.Process(target=_writer_process_main, args=(self.jobs, self.results, os.getpid()),
                                   name="c2kd-cache-writer", daemon=True)
        self.process.start()

    def _collect(self, block: bool) -> str | None:
        """Take one report from the child (its kind; None when none came). Raises the child's failure."""
        try:
            report = self.results.get(block=block, timeout=self.POLL_S if block else None)
        except queue.Empty:
            if not self.process.is_alive() and self.results.empty():
                raise CacheError(
                    f"the cache writer process died (exit code {self.process.exitcode}); rerun the same "
                    "command to continue from the shards already written"
                ) from None
            return None
        if report[0] == "failed":
            self.process.join(timeout=30)
            raise report[2]
        if report[0] == "closed":
            self.cpu_seconds = report[1]
        if report[0] == "written":
            self.bytes_written += report[2]
            self.write_seconds += report[3]
            self.shards_written += 1
        return report[0]

    def _send(self, item: ShardJob | CacheWriter | None) -> None:
        # A job travels as plain pickled bytes through the pipe (one copy), not through torch's
        # shared-memory hand-over, which passes a file descriptor per tensor between the processes.
        payload = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL) if isinstance(item, ShardJob) else item
        while self._collect(block=False):
            pass
        while True:
            try:
                self.jobs.put(payload, timeout=self.POLL_S)
                return
            except queue.Full:
                self._collect(block=not self.process.is_alive())

    def attach(self, writer: CacheWriter) -> None:
        """The CacheWriter that writes every job put after this (sent to the child once)."""
        self._send(writer)
        self.attached = True

    def wait_ready(self) -> None:
        """Block until the child runs and holds the attached writer (benchmarks time from here)."""
        while self._collect(block=True) != "ready":
            pass

    def put(self, job: ShardJob) -> None:
        if not self.attached:
            raise CacheError("attach a CacheWriter before putting shards")
        self._send(job)

    def close(self) -> None:
        """Wait for every queued shard; raises the child's failure, if any."""
        try:
            self._send(None)
            while self._collect(block=True) != "closed":
                pass
        finally:
            self.process.join(timeout=60)
            if self.process.is_alive():
                self.process.kill()

    def discard(self) -> None:
        """Stop at once, without waiting for the child to finish starting (nothing left to write)."""
        self.process.kill()
        self.process.join(timeout=30)


ShardWriter = ShardWriterThread | ShardWriterProcess


def start_shard_writer(kind: str, max_pending: int) -> ShardWriter:
    """A background writer of `kind` ("process" or "thread"); `attach` a CacheWriter before `put`."""
    if kind not in WRITERS:
        raise CacheError(f"writer {kind!r}: expected one of {', '.join(WRITERS)}")
    return (ShardWriterProcess if kind == "process" else ShardWriterThread)(max_pending)
