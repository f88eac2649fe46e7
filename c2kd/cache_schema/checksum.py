"""Checksums of shards and files, defined so anyone can recompute them without c2kd.

Shard checksum: sha256 over the shard's files in sorted order of their posix paths relative to
the shard folder; per file it hashes `path (utf-8)`, a zero byte, `size` as 8-byte little-endian,
then the file's bytes. Each file's own sha256 is recorded too, so a damaged file can be named.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence


def files_digest(files: Sequence[tuple[str, int]], read: Callable[[str], Iterable[bytes]]) -> tuple[str, dict[str, str]]:
    """The shard checksum of `files` ((relative path, size) pairs) and each file's own sha256;
    `read(path)` yields the bytes.

    Raises ValueError when a file's bytes are not as long as its recorded size.
    """
    h = hashlib.sha256()
    per_file: dict[str, str] = {}
    for rel, size in sorted(files):
        h.update(rel.encode("utf-8") + b"\0" + int(size).to_bytes(8, "little"))
        own = hashlib.sha256()
        seen = 0
        for block in read(rel):
            seen += len(block)
            h.update(block)
            own.update(block)
        if seen != size:
            raise ValueError(f"{rel}: {seen} bytes, expected {size}")
        per_file[rel] = own.hexdigest()
    return h.hexdigest(), per_file


def bytes_digest(blocks: Iterable[bytes]) -> str:
    """Plain sha256 of a file's bytes (assets, index)."""
    h = hashlib.sha256()
    for block in blocks:
        h.update(block)
    return h.hexdigest()
