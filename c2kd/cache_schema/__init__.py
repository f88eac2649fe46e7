"""The teacher-cache format: its one definition, writer and reader (see SCHEMA.md).

Nothing outside this package knows how arrays are laid out on disk.
"""

from c2kd.cache_schema.batch import CachedBatch
from c2kd.cache_schema.expect import CacheExpectation
from c2kd.cache_schema.fingerprints import fingerprint_files, fingerprint_tokenizer
from c2kd.cache_schema.plan import PlannedShard, ShardPlan, plan_shards
from c2kd.cache_schema.reader import TeacherCache, content_digest
from c2kd.cache_schema.records import ExampleRecord, answer_positions
from c2kd.cache_schema.schema import SCHEMA_VERSION, CacheSpec, Compression, LogitsPolicy
from c2kd.cache_schema.verify import VerifyReport, cache_info, verify_cache
from c2kd.cache_schema.writer import CacheWriter

__all__ = [
    "SCHEMA_VERSION",
    "CacheExpectation",
    "CacheSpec",
    "CacheWriter",
    "CachedBatch",
    "Compression",
    "ExampleRecord",
    "LogitsPolicy",
    "PlannedShard",
    "ShardPlan",
    "TeacherCache",
    "VerifyReport",
    "answer_positions",
    "cache_info",
    "content_digest",
    "fingerprint_files",
    "fingerprint_tokenizer",
    "plan_shards",
    "verify_cache",
]
