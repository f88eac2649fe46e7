"""What a consumer (stage two) needs from a cache, and the refusal when the cache does not fit."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from c2kd.cache_schema.schema import CacheSpec, LogitsPolicy
from c2kd.errors import CacheError


@dataclass(frozen=True)
class CacheExpectation:
    """Each field left None is not checked.

    layers: must all be cached (a subset of the cache's layers). logits: "exact", "full",
    "topk" (any K) or "topk:K". splits: must all be cached. The rest must be equal.
    """

    tokenizer_fingerprint: str | None = None
    layers: Sequence[int] | None = None
    positions: str | None = None
    logits: str | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    prompt_format: str | None = None
    data_fingerprint: str | None = None
    teacher_fingerprint: str | None = None
    splits: Sequence[str] | None = None

    @staticmethod
    def coerce(expect: CacheExpectation | Mapping | None) -> CacheExpectation:
        if expect is None or isinstance(expect, CacheExpectation):
            return expect or CacheExpectation()
        known = {f.name for f in fields(CacheExpectation)}
        unknown = set(expect) - known
        if unknown:
            raise CacheError(f"unknown cache expectation(s) {sorted(unknown)}; known: {sorted(known)}")
        return CacheExpectation(**dict(expect))


def mismatches(spec: CacheSpec, expect: CacheExpectation) -> list[str]:
    """Human-readable reasons the cache does not fit `expect` (empty when it fits)."""
    out = []
    for name in ("tokenizer_fingerprint", "data_fingerprint", "teacher_fingerprint"):
        want = getattr(expect, name)
        if want is not None and want != getattr(spec, name):
            out.append(f"{name.replace('_', ' ')} {getattr(spec, name)[:16]}… != expected {want[:16]}…")
    for name in ("positions", "hidden_size", "vocab_size", "prompt_format"):
        want = getattr(expect, name)
        if want is not None and want != getattr(spec, name):
            out.append(f"{name.replace('_', ' ')} is {getattr(spec, name)!r}, expected {want!r}")
    if expect.layers is not None:
        lacking = sorted(set(int(x) for x in expect.layers) - set(spec.layers))
        if lacking:
            out.append(f"teacher layers {lacking} are not cached (cached: {list(spec.layers)})")
    if expect.splits is not None:
        lacking = [s for s in expect.splits if s not in spec.splits]
        if lacking:
            out.append(f"splits {lacking} are not cached (cached: {list(spec.splits)})")
    if expect.logits is not None:
        have = spec.logits
        want = expect.logits.strip().lower()
        fits = want == "topk" and have.kind == "topk" or (want != "topk" and LogitsPolicy.parse(want) == have)
        if not fits:
            out.append(f"logits policy is {str(have)!r}, expected {expect.logits!r}")
    return out


def check_expectation(spec: CacheSpec, expect: CacheExpectation | Mapping | None, where: str) -> None:
    problems = mismatches(spec, CacheExpectation.coerce(expect))
    if problems:
        raise CacheError(f"{where}: cache does not fit: " + "; ".join(problems))
