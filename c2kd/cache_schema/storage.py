"""Where a cache lives: a local directory (read/write) or a URL read through fsspec (read-only)."""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.storage import FsspecStore, LocalStore, WrapperStore

from c2kd.atomic import write_bytes
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
    whole once and every later read, ranged or not, is served from the local copy, so training
    over many epochs downloads the cache once. The copies live in a subfolder named after the
    cache's digest (`use_digest`, once the manifest, which is always read fresh, is known), so a
    cache replaced at the same URL is never mixed with the old one; each copy is checked like a
    local file (sizes and checksums on first touch, crc32c on every chunk).
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
        self._fs_root = ""
        self._fs_pid = -1

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_fs"], state["_fs_pid"] = None, -1
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
        return self._fs, self._fs_root

    def use_digest(self, digest: str) -> None:
        """Keep fetched files under read_cache/<digest> (a no-op without a read cache)."""
        self._digest = digest

    @property
    def _cache_root(self) -> Path | None:
        """Where fetched files are kept: read_cache/<digest>, once the digest is known."""
        if self.local_root is not None or self.read_cache is None or self._digest is None:
            return None
        return self.read_cache / self._digest

    def _remote(self, rel: str) -> tuple[Any, str]:
        fs, root = self._filesystem()
        return fs, f"{root.rstrip('/')}/{rel}"

    def _fetch(self, rel: str) -> bytes:
        fs, path = self._remote(rel)
        try:
            return fs.cat_file(path)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise CacheError(f"{self.url}/{rel}: cannot be read ({e})") from None

    def kept(self, rel: str, size: int | None = None, sha256: str | None = None) -> Path:
        """The local copy of a remote file in the read cache, fetched whole the first time and then
        checked against `sha256` (the manifest's), so a file is checked once, as it arrives."""
        path = self._cache_root / rel
        if not (path.is_file() and (size is None or path.stat().st_size == size)):
            data = self._fetch(rel)
            if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
                raise CacheError(f"{self.url}/{rel}: checksum does not match the manifest (corrupted, or the manifest "
                                 "was edited); run `c2kd cache verify`")
            write_bytes(path, data)
        return path

    def read_bytes(self, rel: str) -> bytes:
        """The whole file at `rel` (raises FileNotFoundError when absent); the manifest is always
        read fresh, other files of a remote cache through the read cache when there is one."""
        if self.local_root is not None:
            try:
                return (self.local_root / rel).read_bytes()
            except (NotADirectoryError, IsADirectoryError):
                raise CacheError(self._not_a_folder(rel)) from None
        if self._cache_root is not None and rel != MANIFEST:
            return self.kept(rel).read_bytes()
        return self._fetch(rel)

    def _not_a_folder(self, rel: str) -> str:
        """The message for a path whose parent is a file: the root itself, or a part inside it."""
        if self.local_root.exists() and not self.local_root.is_dir():
            return f"{self.local_root}: a file, not a cache folder (a cache is a folder or a URL)"
        return f"{self.local_root}/{rel}: a file or folder is in the way of another; run `c2kd cache verify`"

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

    def zarr_store(self, rel: str, files: list | None = None) -> Any:
        """A read-only Zarr store rooted at the folder `rel`. For a remote cache with a read cache
        and the folder's `files` ([path, size, ...] entries), the files are fetched whole once and
        read locally from then on."""
        if self.local_root is not None:
            return LocalStore(self.local_root / rel, read_only=True)
        if self._cache_root is not None and files is not None:
            for frel, size, *sha in files:
                self.kept(f"{rel}/{frel}", int(size), sha[0] if sha else None)
            return LocalStore(self._cache_root / rel, read_only=True)
        try:
            inner = FsspecStore.from_url(f"{self.url}/{rel}", storage_options=self.storage_options, read_only=True)
        except (ImportError, ValueError) as e:
            raise CacheError(f"{self.url}: cannot read this URL scheme ({e})") from None
        return RangeSafeStore(inner)
