"""The one definition of the teacher-cache layout (schema versions 2 and 3); SCHEMA.md describes it in prose.

Every file name, array name, dtype rule and policy string of the cache lives here, so the writer,
the reader and the verifier cannot drift apart.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import polars as pl

from c2kd.atomic import TMP_PREFIX  # noqa: F401  (temp names being written are never part of the cache)
from c2kd.errors import CacheError

FORMAT = "c2kd-teacher-cache"
SCHEMA_VERSION = 3  # the newest this code writes; see `schema_version` for which a cache gets
KNOWN_SCHEMA_VERSIONS = (2, 3)  # 2: per-file checksums and the manifest digest; 3: float8 hidden states

# --- files and folders, relative to the cache root ---------------------------------------------
MANIFEST = "manifest.json"
INDEX = "index.parquet"
ASSETS = "assets"
TOKENIZER_DIR = "assets/tokenizer"
HEAD_FILE = "assets/teacher_head.safetensors"
HEAD_TENSOR = "weight"
ITEM_EMBEDDINGS_FILE = "assets/item_embeddings.safetensors"
ITEM_EMBEDDINGS_TENSOR = "item_embeddings"
TEACHER_CONFIG_FILE = "assets/teacher_config.json"
SHARDS = "shards"
JOURNAL = "journal"

_SHARD_RE = re.compile(r"^shard-(\d{5,})$")


def shard_name(shard_id: int) -> str:
    return f"shard-{shard_id:05d}"


def shard_path(shard_id: int) -> str:
    return f"{SHARDS}/{shard_name(shard_id)}"


def parse_shard_name(name: str) -> int | None:
    m = _SHARD_RE.match(name)
    return int(m.group(1)) if m else None


def journal_name(rank: int) -> str:
    return f"{JOURNAL}/rank-{rank}.jsonl"


# --- arrays inside one shard (a Zarr v3 group) ------------------------------------------------
# Names; everything else about an array (rows, columns, dtype, index column) is in `array_defs`.
EXAMPLE_ID = "examples/example_id"
EXAMPLE_USER = "examples/user"
EXAMPLE_TARGET = "examples/target"
EXAMPLE_HISTORY = "examples/history"
EXAMPLE_CANDIDATES = "examples/candidates"
EXAMPLE_TOKEN_OFFSET = "examples/token_offset"
EXAMPLE_TOKEN_LENGTH = "examples/token_length"
EXAMPLE_ANSWER_OFFSET = "examples/answer_offset"
EXAMPLE_ANSWER_LENGTH = "examples/answer_length"
INPUT_IDS = "input_ids"
SLOT_ITEMS = "slot_items"
LABELS = "labels"
ANSWER_POSITIONS = "answer_positions"
FINAL_HIDDEN = "final_hidden"
TOPK_VALUES = "topk_values"
TOPK_INDICES = "topk_indices"
FULL_LOGITS = "full_logits"

_HIDDEN_RE = re.compile(r"^hidden/layer_(\d+)$")
SCALE_SUFFIX = ".scale"  # `hidden/layer_L.scale`: the per-row scales of a float8 `hidden/layer_L`


def hidden_array(layer: int) -> str:
    return f"hidden/layer_{layer}"


def scale_array(name: str) -> str:
    return name + SCALE_SUFFIX


def hidden_layer(name: str) -> int | None:
    """The layer of a `hidden/layer_L` array name; None for any other array."""
    m = _HIDDEN_RE.match(name)
    return int(m.group(1)) if m else None


IGNORE_INDEX = -100  # labels value of non-answer tokens (Hugging Face convention)

# --- dtypes -----------------------------------------------------------------------------------
# logical dtype -> numpy dtype the bytes are stored as (Zarr has no bfloat16: keep its bits)
STORAGE_DTYPES = {"bfloat16": "uint16", "float16": "float16", "float32": "float32"}
LOGICAL_DTYPE_ATTR = "c2kd_logical_dtype"
SCALE_ATTR = "c2kd_scale"  # on a float8 array: the name of its scale array
# `dtype: float8`: hidden states as float8 e4m3 bytes with a float32 scale per row (token or answer
# position); every other float array (final_hidden, top-k values) keeps FLOAT8_OTHERS, the precision
# exact logits need (benchmarks/cache_dtype.py measures it).
FLOAT8 = "float8"
FLOAT8_E4M3 = "float8_e4m3fn"  # the logical dtype of a quantised array (torch.float8_e4m3fn, max 448)
FLOAT8_STORAGE = "uint8"
FLOAT8_OTHERS = "bfloat16"
SCALE_DTYPE = "float32"
CACHE_DTYPES = (*STORAGE_DTYPES, FLOAT8)

POSITIONS = ("all", "answer")
COMPRESSORS = ("zstd", "none")
DEFAULT_ZSTD_LEVEL = 3
CHUNK_TARGET_BYTES = 256 * 1024  # uncompressed inner-chunk size aimed at (random access granularity)

INDEX_COLUMNS = (  # index.parquet: one row per example, in shard then storage order
    ("example_id", "int64"),
    ("split", "string"),
    ("user", "int32"),
    ("target", "int32"),
    ("history", "list<int32>"),
    ("candidates", "list<int32>"),
    ("shard", "int32"),
    ("token_offset", "int64"),
    ("token_length", "int32"),
    ("answer_offset", "int64"),
    ("answer_length", "int32"),
)


@dataclass(frozen=True)
class LogitsPolicy:
    """Which teacher logits the cache holds: `exact` (recompute head(final_hidden)), `topk:K`, `full`.

    Parsed once where text comes in (the `--logits` setting, a manifest's spec); everything after
    holds this value. `str()` gives the canonical text the manifest records."""

    kind: str
    k: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("exact", "topk", "full") or (self.k > 0) != (self.kind == "topk"):
            raise CacheError(f"logits policy {self.kind!r} with k={self.k}: expected exact, full, or topk with k > 0")

    @staticmethod
    def parse(text: str) -> LogitsPolicy:
        text = text.strip().lower()
        if text in ("exact", "full"):
            return LogitsPolicy(text)
        m = re.fullmatch(r"topk:(\d+)", text)
        if m and int(m.group(1)) > 0:
            return LogitsPolicy("topk", int(m.group(1)))
        raise CacheError(f"logits policy {text!r}: expected 'exact', 'topk:K' (K > 0) or 'full'")

    def __str__(self) -> str:
        return f"topk:{self.k}" if self.kind == "topk" else self.kind


@dataclass(frozen=True)
class Compression:
    """Byte codec of every chunk: zstd (level 1..22) or none."""

    codec: str
    level: int = 0

    @staticmethod
    def parse(text: str) -> Compression:
        text = text.strip().lower()
        if text == "none":
            return Compression("none")
        m = re.fullmatch(r"zstd(?::(-?\d+))?", text)
        if m:
            level = int(m.group(1)) if m.group(1) is not None else DEFAULT_ZSTD_LEVEL
            if not 1 <= level <= 22:
                raise CacheError(f"compression {text!r}: zstd level must be 1..22")
            return Compression("zstd", level)
        raise CacheError(f"compression {text!r}: expected 'zstd', 'zstd:LEVEL' or 'none'")

    def __str__(self) -> str:
        return "none" if self.codec == "none" else f"zstd:{self.level}"


@dataclass(frozen=True)
class CacheSpec:
    """Everything that decides the bytes of a cache; two runs with equal specs write equal caches."""

    layers: tuple[int, ...]
    hidden_size: int
    vocab_size: int
    dtype: str = "bfloat16"
    positions: str = "all"
    logits: LogitsPolicy = LogitsPolicy("exact")  # text ("topk:8") is parsed on construction
    compression: str = "zstd"
    examples_per_shard: int = 256
    splits: tuple[str, ...] = ("train", "validation", "test")
    teacher_fingerprint: str = ""
    tokenizer_fingerprint: str = ""
    data_fingerprint: str = ""
    teacher_description: str = ""
    teacher_num_layers: int = 0
    prompt_format: str = ""
    pad_token_id: int = 0
    part: str = ""  # "i/n": this cache holds the shards i-1, i-1+n, ... of the full plan (for `cache merge`)
    backend: str = "transformers"  # what ran the teacher: transformers | vllm
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        object.__setattr__(self, "splits", tuple(self.splits))
        # text comes from settings and manifests: parse it once; normalise the compression string so
        # equal settings give equal spec hashes
        if not isinstance(self.logits, LogitsPolicy):
            object.__setattr__(self, "logits", LogitsPolicy.parse(self.logits))
        object.__setattr__(self, "compression", str(Compression.parse(self.compression)))
        self.validate()

    def validate(self) -> None:
        if not self.layers:
            raise CacheError("cache spec: at least one teacher layer is needed")
        if len(set(self.layers)) != len(self.layers) or list(self.layers) != sorted(self.layers):
            raise CacheError(f"cache spec: layers {list(self.layers)} must be ascending and distinct")
        if min(self.layers) < 1 or (self.teacher_num_layers and max(self.layers) > self.teacher_num_layers):
            raise CacheError(
                f"cache spec: layers {list(self.layers)} must lie in 1..{self.teacher_num_layers or 'L'}"
            )
        if self.dtype not in CACHE_DTYPES:
            raise CacheError(f"cache spec: dtype {self.dtype!r}, expected one of {', '.join(CACHE_DTYPES)}")
        if self.dtype == FLOAT8 and self.logits.kind == "full":
            raise CacheError(FLOAT8_FULL_LOGITS)
        if self.positions not in POSITIONS:
            raise CacheError(f"cache spec: positions {self.positions!r}, expected 'all' or 'answer'")
        if self.hidden_size <= 0 or self.vocab_size <= 0 or self.examples_per_shard <= 0:
            raise CacheError("cache spec: hidden_size, vocab_size and examples_per_shard must be positive")
        parse_part(self.part)

    @property
    def compression_codec(self) -> Compression:
        return Compression.parse(self.compression)

    @property
    def float_dtype(self) -> str:
        """The logical dtype of the float arrays that are not quantised (all of them but float8 hidden states)."""
        return FLOAT8_OTHERS if self.dtype == FLOAT8 else self.dtype

    @property
    def storage_dtype(self) -> str:
        """How the float arrays that are not quantised are stored."""
        return STORAGE_DTYPES[self.float_dtype]

    @property
    def quantized(self) -> bool:
        """Whether the hidden states are float8 bytes with per-row scales."""
        return self.dtype == FLOAT8

    @property
    def schema_version(self) -> int:
        """The schema version a cache of this spec is written with: 3 when it needs version 3 (float8
        hidden states, which a version-2 reader would read as bytes), else 2, so the caches version 2
        describes keep their version and content identity, and an older c2kd still reads them."""
        return 3 if self.quantized else 2

    def dtype_field(self) -> dict:
        """The manifest's `dtype` field."""
        if self.quantized:
            return {"logical": FLOAT8, "storage": FLOAT8_STORAGE, "hidden": FLOAT8_E4M3, "scale": SCALE_DTYPE,
                    "others": FLOAT8_OTHERS, "others_storage": self.storage_dtype}
        return {"logical": self.dtype, "storage": self.storage_dtype}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["logits"] = str(self.logits)
        d["layers"] = list(self.layers)
        d["splits"] = list(self.splits)
        return d

    @staticmethod
    def from_dict(d: dict) -> CacheSpec:
        known = {f.name for f in fields(CacheSpec)}
        unknown = set(d) - known
        if unknown:
            raise CacheError(f"cache spec: unknown fields {sorted(unknown)}")
        return CacheSpec(**d)

    @property
    def spec_hash(self) -> str:
        """sha256 of the canonical JSON of the spec: resuming requires the same hash."""
        return hashlib.sha256(canonical_json(self.to_dict()).encode()).hexdigest()

    @property
    def content_hash(self) -> str:
        """The spec hash without `part`: what decides a shard's bytes (its attributes, its journal
        entry), so the shards of part caches are the very shards of a single-run cache."""
        return hashlib.sha256(canonical_json({**self.to_dict(), "part": ""}).encode()).hexdigest()

    def owns(self, shard_id: int) -> bool:
        """Whether a shard of the full plan belongs in this cache (always, but for part caches)."""
        part = parse_part(self.part)
        return part is None or shard_id % part[1] == part[0] - 1


FLOAT8_FULL_LOGITS = ("--dtype float8 with --logits full: float8 shrinks the hidden states only, and full logits "
                      "(every vocabulary entry per answer, kept in bfloat16) would outweigh them; use --logits exact "
                      "(recomputed from the bfloat16 final state) or topk:K")


def parse_part(text: str) -> tuple[int, int] | None:
    """"i/n" -> (i, n) with 1 <= i <= n; "" -> None."""
    if not text:
        return None
    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise CacheError(f"--part {text!r}: expected i/n with 1 <= i <= n, e.g. 1/2")
    return int(m.group(1)), int(m.group(2))


def canonical_json(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def manifest_digest(manifest: dict) -> str:
    """The cache's identity: sha256 of the sealed manifest's canonical JSON without its `digest` field."""
    return hashlib.sha256(canonical_json({k: v for k, v in manifest.items() if k != "digest"}).encode()).hexdigest()


def parse_manifest(raw: bytes, where: str) -> dict:
    """The JSON object of a manifest file (CacheError naming the file otherwise)."""
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CacheError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start}); the manifest is damaged") from None
    except json.JSONDecodeError as e:
        raise CacheError(f"{where}: not valid JSON ({e}); the manifest is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CacheError(f"{where}: not a c2kd teacher cache (manifest format is not {FORMAT!r})")
    return manifest


def check_manifest(manifest: dict, where: str) -> dict:
    """Refuse a manifest that is not a complete, unmodified cache of a schema version this code reads."""
    version = manifest.get("schema_version")
    if version not in KNOWN_SCHEMA_VERSIONS:
        raise CacheError(
            f"{where}: cache schema version {version!r}; this c2kd reads version(s) "
            f"{', '.join(map(str, KNOWN_SCHEMA_VERSIONS))} — rebuild the cache or use a matching c2kd"
        )
    if manifest.get("complete") is not True and ("digest" in manifest or "sealed_at" in manifest):
        raise CacheError(f"{where}: the manifest says complete: {json.dumps(manifest.get('complete'))} but holds a sealed "
                         "cache's digest: it was modified after the cache was sealed; the cache cannot be trusted")
    if manifest.get("complete") is not True:
        raise CacheError(
            f"{where}: cache is incomplete (still being written, or its writer stopped); "
            "rerun the same `c2kd cache-teacher` command to finish it"
        )
    for key in ("spec", "shards", "index", "assets", "totals", "arrays", "digest"):
        if key not in manifest:
            raise CacheError(f"{where}: manifest field {key!r} is missing")
    if manifest["digest"] != manifest_digest(manifest):
        raise CacheError(f"{where}: the manifest was modified after the cache was sealed (its digest does not match); "
                         "the cache cannot be trusted")
    return manifest


# What a reader may leave out of a batch: each teacher output belongs to one group.
HIDDEN_GROUP, FINAL_HIDDEN_GROUP, LOGITS_GROUP = "hidden", "final_hidden", "logits"


@dataclass(frozen=True)
class ArrayDef:
    """One array of a shard: what its rows are, its columns, dtype and where its values come from.

    rows: "examples" (one per example), "tokens" (one per prompt token, examples concatenated) or
    "answers" (one per answer position). dtype: "int32", "int64", "float" (the cache's logical
    float dtype), FLOAT8_E4M3 (float8 bytes; its row scales are the array `scale`, a SCALE_DTYPE
    array whose `scale_of` names it) or SCALE_DTYPE. columns: the sizes after the row dimension ("*" = the longest list of the shard,
    zero-padded). Where the values come from: example-major arrays from the index.parquet column
    `field` (which verify and the reader cross-check); the prompt's token/answer arrays from the
    ExampleRecord attribute `field`; the teacher's outputs (`output` = their group, `field` empty)
    from `ExampleRecord.outputs[name]`, and a reader hands them over as `CachedBatch.outputs[name]`.
    """

    name: str
    rows: str
    dtype: str
    columns: tuple[int | str, ...]
    dims: tuple[str, ...]
    field: str = ""
    layer: int | None = None
    output: str = ""
    scale: str = ""  # a float8 array: the name of its scale array
    scale_of: str = ""  # a scale array: the name of the float8 array it scales (written and read with it)

    @property
    def is_float(self) -> bool:
        """Stored in the cache's (unquantised) float dtype."""
        return self.dtype == "float"

    @property
    def is_quantized(self) -> bool:
        return self.dtype == FLOAT8_E4M3

    @property
    def feature_major(self) -> bool:
        """Chunks stored feature by feature (Zarr `transpose` codec, order [1, 0]): float8 arrays only,
        whose bytes of one feature are alike (outlier features stay large) and compress ~8 % better so;
        the other arrays keep the layout schema version 2 gave them."""
        return self.is_quantized

    @property
    def is_output(self) -> bool:
        """A teacher output (hidden states, final states, logits), not a prompt or example array; a
        scale array is part of its output, not one of its own."""
        return bool(self.output) and not self.scale_of

    def to_json(self, spec: CacheSpec) -> dict:
        info: dict = {"rows": self.rows, "columns": list(self.columns), "dims": list(self.dims)}
        if self.is_float:
            return {**info, "dtype": spec.float_dtype, "storage_dtype": spec.storage_dtype}
        if self.is_quantized:
            return {**info, "dtype": self.dtype, "storage_dtype": FLOAT8_STORAGE, "scale": self.scale}
        if self.scale_of:
            return {**info, "dtype": self.dtype, "scale_of": self.scale_of}
        return {**info, "dtype": self.dtype}


def _output(name: str, rows: str, dtype: str, columns: tuple[int, ...], dims: tuple[str, ...], group: str,
            layer: int | None = None) -> ArrayDef:
    return ArrayDef(name, rows, dtype, columns, dims, layer=layer, output=group)


def array_defs(spec: CacheSpec) -> list[ArrayDef]:
    """Every array a shard of `spec` holds, in writing order: THE layout of a shard.

    A new teacher output is one entry here plus its producer (`TeacherRunner.run_batch`): records,
    shard writers, the writer, verify, the reader and CachedBatch follow this list."""
    d, v = spec.hidden_size, spec.vocab_size
    e, t, a = "example", "token", "answer"
    hidden_rows = "tokens" if spec.positions == "all" else "answers"
    defs = [
        ArrayDef(EXAMPLE_ID, "examples", "int64", (), (e,), "example_id"),
        ArrayDef(EXAMPLE_USER, "examples", "int32", (), (e,), "user"),
        ArrayDef(EXAMPLE_TARGET, "examples", "int32", (), (e,), "target"),
        ArrayDef(EXAMPLE_HISTORY, "examples", "int32", ("*",), (e, "history"), "history"),
        ArrayDef(EXAMPLE_CANDIDATES, "examples", "int32", ("*",), (e, "candidate"), "candidates"),
        ArrayDef(EXAMPLE_TOKEN_OFFSET, "examples", "int64", (), (e,), "token_offset"),
        ArrayDef(EXAMPLE_TOKEN_LENGTH, "examples", "int32", (), (e,), "token_length"),
        ArrayDef(EXAMPLE_ANSWER_OFFSET, "examples", "int64", (), (e,), "answer_offset"),
        ArrayDef(EXAMPLE_ANSWER_LENGTH, "examples", "int32", (), (e,), "answer_length"),
        ArrayDef(INPUT_IDS, "tokens", "int32", (), (t,), "input_ids"),
        ArrayDef(SLOT_ITEMS, "tokens", "int32", (), (t,), "slot_items"),
        ArrayDef(LABELS, "tokens", "int32", (), (t,), "labels"),
        ArrayDef(ANSWER_POSITIONS, "answers", "int32", (), (a,), "answers"),
        *(_hidden(spec, l, hidden_rows) for l in spec.layers),
        _output(FINAL_HIDDEN, "answers", "float", (d,), (a, "feature"), FINAL_HIDDEN_GROUP),
    ]
    policy = spec.logits
    if policy.kind == "topk":
        defs += [_output(TOPK_VALUES, "answers", "float", (policy.k,), (a, "rank"), LOGITS_GROUP),
                 _output(TOPK_INDICES, "answers", "int32", (policy.k,), (a, "rank"), LOGITS_GROUP)]
    elif policy.kind == "full":
        defs.append(_output(FULL_LOGITS, "answers", "float", (v,), (a, "vocab"), LOGITS_GROUP))
    return [a for group in defs for a in (group if isinstance(group, tuple) else (group,))]


def _hidden(spec: CacheSpec, layer: int, rows: str) -> tuple[ArrayDef, ...]:
    """The array(s) of one cached layer: its states, and with float8 their scales right after."""
    name, dims = hidden_array(layer), (rows[:-1], "feature")
    if not spec.quantized:
        return (_output(name, rows, "float", (spec.hidden_size,), dims, HIDDEN_GROUP, layer),)
    return (ArrayDef(name, rows, FLOAT8_E4M3, (spec.hidden_size,), dims, layer=layer, output=HIDDEN_GROUP,
                     scale=scale_array(name)),
            ArrayDef(scale_array(name), rows, SCALE_DTYPE, (), dims[:1], layer=layer, output=HIDDEN_GROUP,
                     scale_of=name))


def output_defs(spec: CacheSpec) -> list[ArrayDef]:
    """The teacher's outputs among `array_defs(spec)`, in the same order (scale arrays are part of
    their float8 output, not listed)."""
    return [a for a in array_defs(spec) if a.is_output]


def array_layout(spec: CacheSpec) -> dict[str, dict]:
    """The layout as the manifest records it: name -> {rows, columns, dims, dtype[, storage_dtype]}."""
    return {a.name: a.to_json(spec) for a in array_defs(spec)}


_POLARS_TYPES = {"int64": pl.Int64, "int32": pl.Int32, "string": pl.String, "list<int32>": pl.List(pl.Int32)}


def index_schema() -> dict[str, pl.DataType]:
    return {name: _POLARS_TYPES[kind] for name, kind in INDEX_COLUMNS}


def index_rows(spec: CacheSpec, example_arrays: dict[str, np.ndarray], split: str, shard: int) -> pl.DataFrame:
    """The index rows of one shard from its example-major arrays (name -> values): the index holds
    the same values, zero-padded lists unpadded (item 0 is padding)."""
    columns: dict = {}
    for a in array_defs(spec):
        if a.rows != "examples":
            continue
        values = example_arrays[a.name]
        columns[a.field] = [r[r != 0].tolist() for r in values] if a.columns == ("*",) else values
    n = len(columns["example_id"])
    columns.update(split=[split] * n, shard=[shard] * n)
    types = index_schema()
    return pl.DataFrame({name: pl.Series(columns[name], dtype=types[name]) for name, _ in INDEX_COLUMNS})


def example_array_names(spec: CacheSpec) -> list[str]:
    return [a.name for a in array_defs(spec) if a.rows == "examples"]
