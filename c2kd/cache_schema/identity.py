"""A cache's content identity: what was computed, from what — nothing about when, where or by whom.

The manifest digest (schema.manifest_digest) protects every manifest field, the times it was
started and sealed and the teacher's path included: it detects tampering, but two caches of the
same teacher on the same data never share it. The content identity is the sha256 of the canonical
JSON of

    {"format": "c2kd-teacher-cache-content", "schema_version": ..., "spec": the spec,
     "teacher_config": the manifest's copy without "_name_or_path" keys,
     "assets": {path: sha256} but assets/teacher_config.json (it holds the teacher's path),
     "index": the index's sha256, "shards": [[shard, split, sha256], ...]}

so it names the teacher, tokenizer and data (their fingerprints are in the spec), the settings,
and every array's bytes (the shard checksums). Equal identities mean equal content; it is
derived from a sealed manifest, whose digest protects each of its inputs.
"""

from __future__ import annotations

import hashlib
from typing import Any

from c2kd.cache_schema import schema as S
from c2kd.errors import CacheError

CONTENT_FORMAT = "c2kd-teacher-cache-content"
_PATH_KEYS = ("_name_or_path",)  # where a Hugging Face config keeps the folder it was loaded from


def _without_paths(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_paths(v) for k, v in value.items() if k not in _PATH_KEYS}
    if isinstance(value, list):
        return [_without_paths(v) for v in value]
    return value


def content_identity(manifest: dict) -> str:
    """The content identity of a sealed cache (see the module docstring)."""
    body = {
        "format": CONTENT_FORMAT,
        "schema_version": manifest["schema_version"],
        "spec": manifest["spec"],
        "teacher_config": _without_paths(manifest.get("teacher_config", {})),
        "assets": {rel: entry["sha256"] for rel, entry in sorted(manifest["assets"].items())
                   if rel != S.TEACHER_CONFIG_FILE},
        "index": manifest["index"]["sha256"],
        "shards": [[int(s["shard"]), s["split"], s["sha256"]] for s in manifest["shards"]],
    }
    return hashlib.sha256(S.canonical_json(body).encode()).hexdigest()


def matches(expect: str, digest: str, content_id: str) -> bool:
    """Whether `expect` (a prefix of at least 8 hex digits) names this cache by either identity."""
    want = expect.strip().lower()
    return digest.startswith(want) or content_id.startswith(want)


def check_identity_prefix(expect: str, option: str = "--expect") -> str:
    """`expect` as given to --expect: at least 8 hex digits (a prefix of a digest or content identity)."""
    want = expect.strip().lower()
    if len(want) < 8 or len(want) > 64 or any(c not in "0123456789abcdef" for c in want):
        raise CacheError(f"{option} {expect!r}: expected 8 to 64 hex digits of the cache's digest or content identity "
                         "(`c2kd cache info` shows both)")
    return want
