"""`cache push` and `cache pull`: a cache to and from any fsspec URL, file by file, resumable.

Both copy the files the manifest lists (assets, index, every shard file) and the manifest LAST,
so a half-copied cache has no manifest and is never taken for a complete one. Every file is
checked against the manifest's sha256: push checks what it reads before sending it, pull checks
what arrives before publishing it (a shard becomes visible only when all its files passed). A
re-run copies only what is missing: push skips remote files of the right size (an object store
writes an object whole or not at all; a cut local copy is shorter), pull skips local files and
shards that are already in place. Pull can demand a cache identity (`expect`: the manifest
digest) and refuses anything else.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from c2kd.atomic import TMP_PREFIX, check_destination, publish_dir, temp_sibling, write_bytes
from c2kd.cache_schema import schema as S
from c2kd.cache_schema.identity import check_identity_prefix, content_identity, matches
from c2kd.cache_schema.reader import read_manifest
from c2kd.cache_schema.storage import CacheLocation
from c2kd.errors import CacheError

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)
_PULL_MARK = f"{TMP_PREFIX}pull.json"  # in a folder being pulled: which cache it is becoming


class DamagedSource(CacheError):
    """A file at the source is missing or differs from its manifest."""


@dataclass(frozen=True)
class CacheFile:
    rel: str  # path relative to the cache root
    size: int
    sha256: str


def cache_files(manifest: dict) -> list[CacheFile]:
    """Every file a sealed cache consists of, but the manifest: assets, index, shard files."""
    files = [CacheFile(rel, int(e["bytes"]), e["sha256"]) for rel, e in sorted(manifest["assets"].items())]
    files.append(CacheFile(S.INDEX, int(manifest["index"]["bytes"]), manifest["index"]["sha256"]))
    for shard in manifest["shards"]:
        root = S.shard_path(int(shard["shard"]))
        files += [CacheFile(f"{root}/{rel}", int(size), sha) for rel, size, sha in shard["files"]]
    return files


def _remote(url: str, storage_options: dict | None) -> tuple[Any, str]:
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        if _is_local(fs):  # a folder (file:// or a plain path): its sub-folders are made as files go in
            fs, root = fsspec.core.url_to_fs(url, **{"auto_mkdir": True, **(storage_options or {})})
    except (ImportError, ValueError) as e:
        raise CacheError(f"{url}: cannot use this URL ({e})") from None
    return fs, root.rstrip("/")


def _is_local(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))


def _check_local_target(fs: Any, root: str, url: str) -> None:
    """A folder target (file:// or a path, e.g. a shared NFS folder): refused before anything is
    copied when it cannot be created or written (a file in the way, read-only, /proc)."""
    if not _is_local(fs):
        return
    target = Path(root)
    if target.exists() and not target.is_dir():
        raise CacheError(f"{url}: exists and is not a folder; push to a new or empty folder")
    check_destination(target)


def _talk(url: str, what: str, call: Callable[[], Any]) -> Any:
    """A call to remote storage; its failures (no such bucket, no credentials, refused) as one CacheError."""
    try:
        return call()
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - the storage backends raise many kinds; each becomes one line
        name = type(e).__name__
        hint = " (are credentials set? e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)" if "Credential" in name else ""
        raise CacheError(f"{url}: cannot {what}: {name}: {' '.join(str(e).split())}{hint}") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * 1024 * 1024):
            h.update(block)
    return h.hexdigest()


def push(cache: str | os.PathLike, url: str, storage_options: dict | None = None,
         progress: Progress | None = None) -> dict:
    """Copy a complete local cache to `url` (object storage, or a folder: file:// or a path); returns
    {"digest", "content_id", "files_sent", "files_skipped", "bytes_sent"}."""
    local = CacheLocation(cache)
    if not local.is_local:
        raise CacheError(f"{cache}: push copies a local cache folder; pull a remote one first")
    raw = _read_local_manifest(local)
    manifest = read_manifest(local)  # complete, unmodified, of a known schema
    fs, root = _remote(url, storage_options)
    _check_local_target(fs, root, url)
    local_target = _is_local(fs)
    if local_target and local.local_root in Path(root).resolve().parents:
        raise CacheError(f"{url}: inside the cache {local.local_root} itself; push to a folder outside it")
    fs.invalidate_cache()  # listings cached by an earlier call in this process may be stale
    remote_manifest = f"{root}/{S.MANIFEST}"
    content_id = content_identity(manifest)
    if _talk(url, "check the destination", lambda: fs.exists(remote_manifest)):
        there = S.parse_manifest(_talk(url, "read its manifest", lambda: fs.cat_file(remote_manifest)), url)
        if there.get("digest") == manifest["digest"]:
            return {"digest": manifest["digest"], "content_id": content_id, "files_sent": 0,
                    "files_skipped": len(cache_files(manifest)), "bytes_sent": 0, "already_there": True}
        raise CacheError(f"{url}: holds another cache (digest {str(there.get('digest'))[:16]}…); push to another URL")
    files = cache_files(manifest)
    total, done, sent, skipped, sent_bytes = sum(f.size for f in files), 0, 0, 0, 0
    for f in files:
        path, target = local.local_root / f.rel, f"{root}/{f.rel}"
        if not path.is_file() or path.stat().st_size != f.size or _sha256(path) != f.sha256:
            raise CacheError(f"{path}: missing or does not match the manifest's checksum; run `c2kd cache verify`")
        try:
            same = _talk(url, f"look at {f.rel}", lambda: fs.size(target)) == f.size
        except FileNotFoundError:
            same = False
        if same and local_target:  # a folder's file can be cut or damaged at the right size: its bytes decide
            same = _sha256(Path(target)) == f.sha256
        if same:
            skipped += 1
        else:
            _talk(url, f"write {f.rel}", lambda: fs.put_file(str(path), target))
            sent, sent_bytes = sent + 1, sent_bytes + f.size
        done += f.size
        if progress:
            progress(done, total)
    _talk(url, f"write {S.MANIFEST}", lambda: fs.pipe_file(remote_manifest, raw))  # last: now the cache is complete
    return {"digest": manifest["digest"], "content_id": content_id, "files_sent": sent, "files_skipped": skipped,
            "bytes_sent": sent_bytes, "already_there": False}


def _read_local_manifest(local: CacheLocation) -> bytes:
    try:
        return local.read_bytes(S.MANIFEST)
    except FileNotFoundError:
        raise CacheError(f"{local}: no {S.MANIFEST}; push needs a complete cache") from None


def pull(url: str, out: str | os.PathLike, expect: str | None = None, storage_options: dict | None = None,
         progress: Progress | None = None) -> dict:
    """Copy the cache at `url` into the folder `out` (resuming a cut pull); returns
    {"digest", "content_id", "files_fetched", "files_skipped", "bytes_fetched"}. `expect`: a prefix of
    the cache's digest or content identity (8 to 64 hex digits); any other cache is refused."""
    if expect is not None:
        check_identity_prefix(expect)
    check_destination(Path(out))
    fs, root = _remote(url, storage_options)
    try:
        raw = _talk(url, f"read {S.MANIFEST}", lambda: fs.cat_file(f"{root}/{S.MANIFEST}"))
    except FileNotFoundError:
        raise CacheError(f"{url}: no {S.MANIFEST} there — not a cache, or one whose push has not finished") from None
    manifest = S.check_manifest(S.parse_manifest(raw, f"{url}/{S.MANIFEST}"), url)
    digest, content_id = manifest["digest"], content_identity(manifest)
    if expect is not None and not matches(expect, digest, content_id):
        raise CacheError(f"{url}: holds the cache with digest {digest[:16]}… and content identity {content_id[:16]}…, "
                         f"not the expected {expect!r}; nothing was pulled")
    out = Path(out)
    created = not out.exists()
    if _claim_pull_folder(out, digest):
        return {"digest": digest, "content_id": content_id, "files_fetched": 0, "files_skipped": len(cache_files(manifest)),
                "bytes_fetched": 0, "already_there": True}
    try:
        counts = _pull_files(fs, root, url, manifest, out, progress)
    except DamagedSource:
        # a file arrived damaged or is missing: the source is, and resuming cannot mend it (a cut
        # connection can); the folder this call made goes
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    write_bytes(out / S.MANIFEST, raw, durable=True)  # last: now the local cache is complete
    (out / _PULL_MARK).unlink(missing_ok=True)
    return {"digest": digest, "content_id": content_id, **counts, "already_there": False}


def _pull_files(fs: Any, root: str, url: str, manifest: dict, out: Path, progress: Progress | None) -> dict:
    """Every file but the manifest, each checked on arrival; shards published whole."""
    files = cache_files(manifest)
    total, done, fetched, skipped, fetched_bytes = sum(f.size for f in files), 0, 0, 0, 0
    by_shard: dict[str, list[CacheFile]] = {}
    for f in files:
        if f.rel.startswith(S.SHARDS + "/"):
            by_shard.setdefault("/".join(f.rel.split("/")[:2]), []).append(f)
            continue
        target = out / f.rel
        if target.is_file() and target.stat().st_size == f.size and _sha256(target) == f.sha256:
            skipped += 1
        else:
            write_bytes(target, _fetch(fs, root, url, f))
            fetched, fetched_bytes = fetched + 1, fetched_bytes + f.size
        done += f.size
        if progress:
            progress(done, total)
    for shard_rel, shard_files in by_shard.items():
        final = out / shard_rel
        if final.is_dir():  # published only after every file passed its checksum
            skipped += len(shard_files)
        else:
            staging = temp_sibling(final)
            try:
                for f in shard_files:
                    target = staging / f.rel[len(shard_rel) + 1 :]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(_fetch(fs, root, url, f))
                    fetched, fetched_bytes = fetched + 1, fetched_bytes + f.size
                publish_dir(staging, final, durable=True)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        done += sum(f.size for f in shard_files)
        if progress:
            progress(done, total)
    return {"files_fetched": fetched, "files_skipped": skipped, "bytes_fetched": fetched_bytes}


def _fetch(fs: Any, root: str, url: str, f: CacheFile) -> bytes:
    """One file's bytes, refused unless they match the manifest (naming the file)."""
    try:
        data = _talk(url, f"read {f.rel}", lambda: fs.cat_file(f"{root}/{f.rel}"))
    except FileNotFoundError:
        raise DamagedSource(f"{url}/{f.rel}: missing at the source; nothing more was published") from None
    if len(data) != f.size or hashlib.sha256(data).hexdigest() != f.sha256:
        shard = f" (shard {f.rel.split('/')[1]})" if f.rel.startswith(S.SHARDS + "/") else ""
        raise DamagedSource(f"{url}/{f.rel}{shard}: arrived with another checksum than the manifest's; it was not "
                         "published — the source is damaged or changed while pulling")
    return data


def _claim_pull_folder(out: Path, digest: str) -> bool:
    """Make `out` a folder this pull may fill; True when it already holds this complete cache."""
    check_destination(out)
    if out.exists() and not out.is_dir():
        raise CacheError(f"{out}: exists and is not a folder")
    mark = out / _PULL_MARK
    if (out / S.MANIFEST).is_file():
        there = S.parse_manifest((out / S.MANIFEST).read_bytes(), str(out / S.MANIFEST))
        if there.get("digest") == digest:
            return True
        raise CacheError(f"{out}: holds another cache (digest {str(there.get('digest'))[:16]}…); pull into another folder")
    if mark.is_file():
        if mark.read_text().strip() != digest:
            raise CacheError(f"{out}: holds a cut pull of another cache; pull into another folder or delete it")
        for leftover in (out / S.SHARDS).glob(f"{TMP_PREFIX}*") if (out / S.SHARDS).is_dir() else ():
            shutil.rmtree(leftover, ignore_errors=True)  # a shard that was arriving when the pull was cut
        return False
    if out.is_dir() and any(out.iterdir()):
        raise CacheError(f"{out}: not empty and not a cache; pull into an empty or new folder")
    out.mkdir(parents=True, exist_ok=True)
    mark.write_text(digest)
    return False
