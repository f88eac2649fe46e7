"""Content fingerprints recorded in the manifest and checked by readers (teacher, tokenizer)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def fingerprint_files(paths: Iterable[str | os.PathLike]) -> str:
    """sha256 over the files (by base name, sorted): name, zero byte, size, bytes — e.g. safetensors weights."""
    h = hashlib.sha256()
    for path in sorted((Path(p) for p in paths), key=lambda p: p.name):
        h.update(path.name.encode() + b"\0" + path.stat().st_size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            while block := f.read(8 * 1024 * 1024):
                h.update(block)
    return h.hexdigest()


def fingerprint_tokenizer(tokenizer: Any) -> str:
    """sha256 of what decides the token ids: the fast tokenizer's full definition + special tokens.

    Accepts a tokenizer object or a saved tokenizer folder; the same tokenizer gives the same
    fingerprint whether freshly built or saved and reloaded (JSON canonicalised, keys sorted).
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__}: a fast (tokenizers-backed) tokenizer is needed")
    definition = json.loads(backend.to_str())
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    blob = json.dumps({"tokenizer": definition, "special_tokens": special}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()
