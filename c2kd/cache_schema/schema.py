"""The one definition of the teacher-cache layout (schema version 1); SCHEMA.md describes it in prose.

Every file name, array name, dtype rule and policy string of the cache lives here, so the writer,
the reader and the verifier cannot drift apart.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields

from c2kd.errors import CacheError

FORMAT = "c2kd-teacher-cache"
SCHEMA_VERSION = 1
KNOWN_SCHEMA_VERSIONS = (1,)

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
TMP_PREFIX = ".tmp-"  # temp folders/files being written; never part of the cache

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
# token-major: one row per token of every example of the shard, examples concatenated
INPUT_IDS = "input_ids"
SLOT_ITEMS = "slot_items"
LABELS = "labels"
TOKEN_ARRAYS = (INPUT_IDS, SLOT_ITEMS, LABELS)
# answer-major: one row per answer position (p with labels[p+1] != -100), examples concatenated
ANSWER_POSITIONS = "answer_positions"
FINAL_HIDDEN = "final_hidden"
TOPK_VALUES = "topk_values"
TOPK_INDICES = "topk_indices"
FULL_LOGITS = "full_logits"
# example-major: one row per example, in storage order
EXAMPLE_ID = "examples/example_id"
EXAMPLE_USER = "examples/user"
EXAMPLE_TARGET = "examples/target"
EXAMPLE_HISTORY = "examples/history"  # [E, H] zero-padded (item 0 is padding)
EXAMPLE_CANDIDATES = "examples/candidates"  # [E, C] zero-padded
EXAMPLE_TOKEN_OFFSET = "examples/token_offset"
EXAMPLE_TOKEN_LENGTH = "examples/token_length"
EXAMPLE_ANSWER_OFFSET = "examples/answer_offset"
EXAMPLE_ANSWER_LENGTH = "examples/answer_length"


def hidden_array(layer: int) -> str:
    return f"hidden/layer_{layer}"


IGNORE_INDEX = -100  # labels value of non-answer tokens (Hugging Face convention)

# --- dtypes -----------------------------------------------------------------------------------
# logical dtype -> numpy dtype the bytes are stored as (Zarr has no bfloat16: keep its bits)
STORAGE_DTYPES = {"bfloat16": "uint16", "float16": "float16", "float32": "float32"}
LOGICAL_DTYPE_ATTR = "c2kd_logical_dtype"

POSITIONS = ("all", "answer")
COMPRESSORS = ("zstd", "none")
DEFAULT_ZSTD_LEVEL = 3
CHUNK_TARGET_BYTES = 256 * 1024  # uncompressed inner-chunk size aimed at (random access granularity)

INDEX_COLUMNS = (
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
    """Which teacher logits the cache holds: `exact` (recompute head(final_hidden)), `topk:K`, `full`."""

    kind: str
    k: int = 0

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
    logits: str = "exact"
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
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        object.__setattr__(self, "splits", tuple(self.splits))
        # normalise the policy strings so equal settings give equal spec hashes
        object.__setattr__(self, "logits", str(LogitsPolicy.parse(self.logits)))
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
        if self.dtype not in STORAGE_DTYPES:
            raise CacheError(f"cache spec: dtype {self.dtype!r}, expected one of {', '.join(STORAGE_DTYPES)}")
        if self.positions not in POSITIONS:
            raise CacheError(f"cache spec: positions {self.positions!r}, expected 'all' or 'answer'")
        if self.hidden_size <= 0 or self.vocab_size <= 0 or self.examples_per_shard <= 0:
            raise CacheError("cache spec: hidden_size, vocab_size and examples_per_shard must be positive")

    @property
    def logits_policy(self) -> LogitsPolicy:
        return LogitsPolicy.parse(self.logits)

    @property
    def compression_codec(self) -> Compression:
        return Compression.parse(self.compression)

    @property
    def storage_dtype(self) -> str:
        return STORAGE_DTYPES[self.dtype]

    def to_dict(self) -> dict:
        d = asdict(self)
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

    def array_names(self) -> list[str]:
        """Data arrays a shard of this spec holds (the examples/* arrays come on top)."""
        names = [*TOKEN_ARRAYS, ANSWER_POSITIONS, *(hidden_array(layer) for layer in self.layers), FINAL_HIDDEN]
        policy = self.logits_policy
        if policy.kind == "topk":
            names += [TOPK_VALUES, TOPK_INDICES]
        elif policy.kind == "full":
            names.append(FULL_LOGITS)
        return names


def canonical_json(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def check_manifest(manifest: object, where: str) -> dict:
    """Refuse a manifest that is not a complete cache of a schema version this code reads."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CacheError(f"{where}: not a c2kd teacher cache (manifest format is not {FORMAT!r})")
    version = manifest.get("schema_version")
    if version not in KNOWN_SCHEMA_VERSIONS:
        raise CacheError(
            f"{where}: cache schema version {version!r}; this c2kd reads version(s) "
            f"{', '.join(map(str, KNOWN_SCHEMA_VERSIONS))} — rebuild the cache or use a matching c2kd"
        )
    if manifest.get("complete") is not True:
        raise CacheError(
            f"{where}: cache is incomplete (still being written, or its writer stopped); "
            "rerun the same `c2kd cache-teacher` command to finish it"
        )
    for key in ("spec", "shards", "index", "assets", "totals"):
        if key not in manifest:
            raise CacheError(f"{where}: manifest field {key!r} is missing")
    return manifest


def array_layout(spec: CacheSpec) -> dict[str, dict]:
    """Name -> {rows, columns, dtype, storage_dtype} of every array a shard of `spec` holds."""
    d, v = spec.hidden_size, spec.vocab_size
    float_dtype = {"dtype": spec.dtype, "storage_dtype": spec.storage_dtype}
    hidden_rows = "tokens" if spec.positions == "all" else "answers"
    layout = {
        EXAMPLE_ID: {"rows": "examples", "columns": [], "dtype": "int64"},
        EXAMPLE_USER: {"rows": "examples", "columns": [], "dtype": "int32"},
        EXAMPLE_TARGET: {"rows": "examples", "columns": [], "dtype": "int32"},
        EXAMPLE_HISTORY: {"rows": "examples", "columns": ["max_history"], "dtype": "int32"},
        EXAMPLE_CANDIDATES: {"rows": "examples", "columns": ["max_candidates"], "dtype": "int32"},
        EXAMPLE_TOKEN_OFFSET: {"rows": "examples", "columns": [], "dtype": "int64"},
        EXAMPLE_TOKEN_LENGTH: {"rows": "examples", "columns": [], "dtype": "int32"},
        EXAMPLE_ANSWER_OFFSET: {"rows": "examples", "columns": [], "dtype": "int64"},
        EXAMPLE_ANSWER_LENGTH: {"rows": "examples", "columns": [], "dtype": "int32"},
        INPUT_IDS: {"rows": "tokens", "columns": [], "dtype": "int32"},
        SLOT_ITEMS: {"rows": "tokens", "columns": [], "dtype": "int32"},
        LABELS: {"rows": "tokens", "columns": [], "dtype": "int32"},
        ANSWER_POSITIONS: {"rows": "answers", "columns": [], "dtype": "int32"},
        FINAL_HIDDEN: {"rows": "answers", "columns": [d], **float_dtype},
    }
    for layer in spec.layers:
        layout[hidden_array(layer)] = {"rows": hidden_rows, "columns": [d], **float_dtype}
    policy = spec.logits_policy
    if policy.kind == "topk":
        layout[TOPK_VALUES] = {"rows": "answers", "columns": [policy.k], **float_dtype}
        layout[TOPK_INDICES] = {"rows": "answers", "columns": [policy.k], "dtype": "int32"}
    elif policy.kind == "full":
        layout[FULL_LOGITS] = {"rows": "answers", "columns": [v], **float_dtype}
    return layout
