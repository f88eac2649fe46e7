"""Stage two's batch source: cached examples in the trainer's order, read ahead in a background thread.

The order is the trainer's own (`epoch_batches` over the cached train ids), shard-aware: with
`block` > 0 and more train examples than that, the epoch shuffles shards, then the examples within
blocks of whole shards holding >= `block` examples, so a read of 8 micro-batches touches about
block / examples_per_shard shards whatever the cache's size (a full shuffle over 373 shards touched
up to 256 of them per read and ran 3x slower at 20x the data). Data no larger than a block gets the
full shuffle, the same batches a run over in-memory examples would see. `group` micro-batches are
read with one cache read (`TeacherCache.get_batches`) while the student trains on the previous
ones; a resumed run simply starts at its position. All reads go through one thread, so the cache
is never read concurrently.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from c2kd import distributed
from c2kd.cache_schema import CachedBatch, TeacherCache
from c2kd.training import epoch_batches


class CacheBatches:
    """Micro-batches (CachedBatch) of the cached examples `example_ids`; see the module docstring.

    `get_kwargs` say what to read (layers, final_hidden, logits): stage 1 and each method read only
    what they use."""

    def __init__(self, cache: TeacherCache, example_ids: Sequence[int], batch_size: int, seed: int,
                 group: int = 8, ahead: int = 2, block: int = 0, **get_kwargs):
        self.cache, self.example_ids = cache, np.asarray(example_ids, dtype=np.int64)
        self.batch_size, self.seed, self.group, self.ahead = batch_size, seed, max(1, group), max(1, ahead)
        self.shards, self.block = cache.shards_of(self.example_ids), block
        self.get_kwargs = get_kwargs
        self.num_examples = len(self.example_ids)
        decoded = self._decoded_shards()
        self.whole_shards = decoded > 0
        cache.keep_decoded(decoded)
        self.rank, self.world = distributed.dist_env()[:2]

    def _decoded_shards(self) -> int:
        """How many shards to keep decoded: a block's (each shard then decoded once an epoch) when
        the examples fill their shards densely and a block is bounded; else none (sparse reads)."""
        in_use = len(np.unique(self.shards))
        per_shard = self.num_examples / max(in_use, 1)
        if self.block <= 0 or per_shard < self.cache.spec.examples_per_shard / 2:
            return 0
        return min(in_use, int(np.ceil(self.block / per_shard)) + 2)

    def _epoch(self, epoch: int) -> list[np.ndarray]:
        return epoch_batches(self.num_examples, self.batch_size, self.seed, epoch, self.world, self.shards, self.block)

    def __len__(self) -> int:
        return len(self._epoch(0))

    def _ids(self, epoch: int, start: int) -> list[np.ndarray]:
        """This rank's example ids of micro-batches start, start + 1, ... of the epoch."""
        order = self._epoch(epoch)[start:]
        return [self.example_ids[idx[self.rank :: self.world]] for idx in order]

    def batches(self, epoch: int, start: int = 0) -> Iterator[CachedBatch]:
        micro = self._ids(epoch, start)
        groups = [micro[i : i + self.group] for i in range(0, len(micro), self.group)]
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="c2kd-cache-read") as pool:
            pending: deque = deque()
            try:
                for g in groups:
                    pending.append(pool.submit(self.cache.get_batches, g, whole_shards=self.whole_shards,
                                               **self.get_kwargs))
                    if len(pending) > self.ahead:
                        yield from pending.popleft().result()
                while pending:
                    yield from pending.popleft().result()
            finally:  # closed early (end of training, an error): drop reads not yet started
                for future in pending:
                    future.cancel()
