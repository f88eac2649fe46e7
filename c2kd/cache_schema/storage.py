"""Where a cache lives: a local directory (read/write) or a URL read through fsspec (read-only)."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.storage import FsspecStore, LocalStore, WrapperStore

from c2kd.cache_schema.schema import MANIFEST
from c2kd.errors import CacheError

READ_BLOCK = 8 * 1024 * 1024


# --- local files ------------------------------------------------------------------------------
def list_local_files(root: Path) -> list[tuple[str, int]]:
    """(posix path relative to root, size) of every file under root, sorted by path."""
    out = []
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            full = Path(dirpath) / name
            out.append((full.relative_to(root).as_posix(), full.stat().st_size))
    return sorted(out)


# --- reading from a directory or a URL --------------------------------------------------------
class RangeSafeStore(WrapperStore):
    """A read-only store that gets byte ranges right even from servers that ignore `Range`.

    Plain static servers (e.g. `python -m http.server`) answer a ranged GET with the whole file;
    Zarr's shard reader would then decode the wrong bytes. When more bytes come back than were
    asked for, they are the whole object: slice it here and keep it for the next ranges.
    """

    def __init__(self, store: Any, keep_objects: int = 4) -> None:
        super().__init__(store)
        self._keep = keep_objects
        self._whole: OrderedDict[str, bytes] = OrderedDict()

    def _with_store(self, store: Any) -> RangeSafeStore:
        return type(self)(store, self._keep)

    @staticmethod
    def _slice(data: bytes, byte_range: Any) -> bytes:
        if isinstance(byte_range, RangeByteRequest):
            return data[byte_range.start : byte_range.end]
        if isinstance(byte_range, OffsetByteRequest):
            return data[byte_range.offset :]
        if isinstance(byte_range, SuffixByteRequest):
            return data[-byte_range.suffix :] if byte_range.suffix else b""
        raise ValueError(f"unexpected byte range {byte_range!r}")

    def _remember(self, key: str, data: bytes) -> None:
        self._whole[key] = data
        self._whole.move_to_end(key)
        while len(self._whole) > self._keep:
            self._whole.popitem(last=False)

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        if byte_range is None:
            return await self._store.get(key, prototype)
        if key in self._whole:
            return prototype.buffer.from_bytes(self._slice(self._whole[key], byte_range))
        if isinstance(byte_range, OffsetByteRequest):
            # the expected length is unknown without the size: fetch the object and slice it
            buf = await self._store.get(key, prototype)
            if buf is None:
                return None
            return prototype.buffer.from_bytes(self._slice(buf.to_bytes(), byte_range))
        buf = await self._store.get(key, prototype, byte_range)
        if buf is None:
            return None
        asked = (
            byte_range.end - byte_range.start if isinstance(byte_range, RangeByteRequest) else byte_range.suffix
        )
        if len(buf) <= asked:
            return buf
        whole = buf.to_bytes()  # the server ignored Range and sent the whole object
        self._remember(key, whole)
        return prototype.buffer.from_bytes(self._slice(whole, byte_range))


def _is_url(path_or_url: str | os.PathLike) -> bool:
    return isinstance(path_or_url, str) and "://" in path_or_url


class CacheLocation:
    """The root of a cache: file reads, shard stores and (for local roots) the path itself.

    A URL is read through fsspec; with `read_cache` (a local folder) each remote file is fetched
    whole once and every later read, ranged or not, is served from the local copy (fsspec's
    file cache), so training over many epochs downloads the cache once. The copies live in a
    subfolder named after the cache's digest (`use_digest`, once the manifest, which is always
    read fresh, is known), so a cache replaced at the same URL is never mixed with the old one.
    Nothing is ever written to the remote. Holds no open handles when pickled, so it can travel
    to DataLoader workers.
    """

    def __init__(self, path_or_url: str | os.PathLike, storage_options: dict | None = None,
                 read_cache: str | os.PathLike | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        self.read_cache = Path(read_cache).expanduser() if read_cache is not None else None
        self._digest: str | None = None
        text = os.fspath(path_or_url)
        if _is_url(text) and text.startswith("file://"):
            text = text[len("file://") :]
        if _is_url(text):
            self.url = text.rstrip("/")
            self.local_root: Path | None = None
        else:
            self.local_root = Path(text).expanduser().resolve()
            self.url = str(self.local_root)
        self._fs: Any = None
        self._cached_fs: Any = None
        self._fs_root = ""
        self._fs_pid = -1

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_fs"], state["_fs_pid"], state["_cached_fs"] = None, -1, None
        return state

    def __str__(self) -> str:
        return self.url

    @property
    def is_local(self) -> bool:
        return self.local_root is not None

    def _filesystem(self) -> tuple[Any, str]:
        if self._fs is None or self._fs_pid != os.getpid():
            try:
                fs, self._fs_root = fsspec.core.url_to_fs(self.url, **self.storage_options)
            except (ImportError, ValueError) as e:  # unknown protocol, or its fsspec backend not installed
                raise CacheError(f"{self.url}: cannot read this URL scheme ({e})") from None
            self._fs, self._fs_pid = fs, os.getpid()
            self._cached_fs = None
        return self._fs, self._fs_root

    def use_digest(self, digest: str) -> None:
        """Keep fetched files under read_cache/<digest> (a no-op without a read cache)."""
        self._digest, self._cached_fs = digest, None

    def _reading_fs(self, rel: str) -> Any:
        """The file cache for a remote cache's files once its digest is known; else the remote."""
        fs, _ = self._filesystem()
        if self.read_cache is None or self._digest is None or rel == MANIFEST:  # the manifest: always fresh
            return fs
        if self._cached_fs is None:
            folder = self.read_cache / self._digest
            folder.mkdir(parents=True, exist_ok=True)
            protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
            self._cached_fs = fsspec.filesystem("filecache", target_protocol=protocol,
                                                target_options=self.storage_options, cache_storage=str(folder),
                                                check_files=False, expiry_time=False, skip_instance_cache=True)
        return self._cached_fs

    def _remote(self, rel: str) -> tuple[Any, str]:
        _, root = self._filesystem()
        return self._reading_fs(rel), f"{root.rstrip('/')}/{rel}"

    def read_bytes(self, rel: str) -> bytes:
        """The whole file at `rel` (raises FileNotFoundError when absent)."""
        if self.local_root is not None:
            return (self.local_root / rel).read_bytes()
        fs, path = self._remote(rel)
        try:
            return fs.cat_file(path)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise CacheError(f"{self.url}/{rel}: cannot be read ({e})") from None

    def iter_bytes(self, rel: str) -> Iterator[bytes]:
        """The file at `rel` in blocks (whole-object GETs for URLs: not every server honours Range)."""
        if self.local_root is not None:
            with open(self.local_root / rel, "rb") as f:
                while block := f.read(READ_BLOCK):
                    yield block
        else:
            yield self.read_bytes(rel)

    def size(self, rel: str) -> int:
        if self.local_root is not None:
            return (self.local_root / rel).stat().st_size
        fs, path = self._remote(rel)
        return int(fs.size(path))

    def zarr_store(self, rel: str) -> Any:
        """A read-only Zarr store rooted at the folder `rel`."""
        if self.local_root is not None:
            return LocalStore(self.local_root / rel, read_only=True)
        if self.read_cache is not None and self._digest is not None:
            from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

            fs, path = self._remote(rel)
            return FsspecStore(AsyncFileSystemWrapper(fs), read_only=True, path=path)
        try:
            inner = FsspecStore.from_url(f"{self.url}/{rel}", storage_options=self.storage_options, read_only=True)
        except (ImportError, ValueError) as e:
            raise CacheError(f"{self.url}: cannot read this URL scheme ({e})") from None
        return RangeSafeStore(inner)
