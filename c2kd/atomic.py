"""Write-then-rename: a file or folder that other code reads appears whole or not at all.

Everything c2kd publishes (model folders, checkpoints, prepared data, cache shards and assets,
JSON records) is written under a temp name beside its final place and renamed into it. With
`durable=True` the bytes are fsync'd before the rename and the parent folder after it, so a
crash (power loss included) never leaves a published name pointing at lost data.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from c2kd.errors import C2KDError

TMP_PREFIX = ".tmp-"  # names being written; readers and listings skip them


def temp_sibling(path: Path, tag: str = "") -> Path:
    """A fresh temp name next to `path` (same file system, so the final rename is atomic)."""
    return path.parent / f"{TMP_PREFIX}{path.name}{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file, then every folder bottom-up, so a later rename publishes durable bytes."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def check_destination(path: Path) -> None:
    """Refuse, before any work, a destination that cannot be created: a file in the way, or a nearest
    existing folder that takes no new entries (read-only, /proc, no permission). The test is a
    probe file created and removed at once, because permission bits do not say it (root, /proc)."""
    for ancestor in Path(path).absolute().parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise C2KDError(f"{path}: cannot be created, {ancestor} is a file, not a folder")
            try:
                fd, probe = tempfile.mkstemp(prefix=f"{TMP_PREFIX}probe-", dir=ancestor)
                os.close(fd)
                os.unlink(probe)
            except OSError as e:
                raise C2KDError(f"{path}: cannot be created, nothing can be written in {ancestor} "
                                f"({e.strerror or type(e).__name__})") from None
            return


def publish_dir(staged: Path, final: Path, replace: bool = False, durable: bool = False) -> None:
    """Rename the finished folder `staged` to `final`; an existing `final` is replaced only when
    `replace` (an empty folder is always replaced)."""
    if durable:
        fsync_tree(staged)
    if final.exists() and replace:
        old = temp_sibling(final, ".old")
        os.replace(final, old)
        os.replace(staged, final)
        shutil.rmtree(old)
    else:
        os.replace(staged, final)
    if durable:
        fsync_dir(final.parent)


@contextmanager
def staged_dir(final: Path, replace: bool = False, durable: bool = False) -> Iterator[Path]:
    """A fresh temp folder beside `final` that becomes `final` when the block ends without an
    error (see `publish_dir`); on an error it is deleted and `final` is left as it was."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(final)
    tmp.mkdir()
    try:
        yield tmp
        publish_dir(tmp, final, replace=replace, durable=durable)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def write_bytes(path: Path, data: bytes, durable: bool = False) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        fsync_dir(path.parent)


def write_json(path: Path, obj: object, durable: bool = False) -> None:
    write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode(), durable=durable)
