"""CachedBatch.teacher_logits: the teacher's logits decoded from each --logits policy of a cache."""

from __future__ import annotations

import pytest
import torch

from c2kd.cache_schema import TeacherCache, plan_shards
from c2kd.cache_schema.schema import FULL_LOGITS, TOPK_INDICES, TOPK_VALUES, LogitsPolicy
from synthetic_cache import synthetic_examples, synthetic_spec, write_synthetic_cache

IDS = [0, 3, 5, 9, 13]  # example 3 has no answer


def _cache(root, logits: str) -> TeacherCache:
    spec = synthetic_spec(logits=logits, dtype="float32")
    write_synthetic_cache(root, spec, plan_shards(synthetic_examples(14, spec.splits), spec.examples_per_shard))
    return TeacherCache.open(root)


def _support(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Some answer rows and vocabulary columns, as a KD support would pick them."""
    n = int(batch.answer_mask.sum())
    return torch.arange(n) % 2 == 0, torch.tensor([7, 1, 30, 12])


def test_exact_logits_are_the_head_applied_to_the_final_states(tmp_path):
    cache = _cache(tmp_path / "c", "exact")
    batch = cache.get(IDS)
    head = cache.head_weight()
    assert batch.logits_policy == LogitsPolicy("exact") and batch.vocab_size == head.shape[0]
    expected = batch.final_hidden[batch.answer_mask].float() @ head.float().T
    z = batch.teacher_logits(head)
    assert z.dtype == torch.float32 and z.shape == (int(batch.answer_mask.sum()), head.shape[0])
    torch.testing.assert_close(z, expected, rtol=0, atol=1e-5)
    rows, columns = _support(batch)
    torch.testing.assert_close(batch.teacher_logits(head, rows, columns), expected[rows][:, columns], rtol=0, atol=1e-5)
    torch.testing.assert_close(batch.teacher_logits(head, rows), expected[rows], rtol=0, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the decode is float32 whatever the caller's autocast
        assert torch.equal(batch.teacher_logits(head), z)


def test_topk_logits_are_minus_infinity_off_the_cached_tokens(tmp_path):
    cache = _cache(tmp_path / "c", "topk:3")
    batch = cache.get(IDS)
    head = cache.head_weight()
    z = batch.teacher_logits(head)
    values, indices = batch.outputs[TOPK_VALUES][batch.answer_mask], batch.outputs[TOPK_INDICES][batch.answer_mask]
    assert z.shape == (values.shape[0], cache.spec.vocab_size)
    assert torch.equal(z.gather(1, indices), values.float())
    kept = torch.zeros_like(z, dtype=torch.bool).scatter(1, indices, True)
    assert torch.isneginf(z[~kept]).all() and kept.sum(1).eq(3).all()
    rows, columns = _support(batch)
    assert torch.equal(batch.teacher_logits(head, rows, columns), z[rows][:, columns])


def test_full_logits_are_the_stored_ones(tmp_path):
    cache = _cache(tmp_path / "c", "full")
    batch = cache.get(IDS)
    head = cache.head_weight()
    stored = batch.outputs[FULL_LOGITS][batch.answer_mask].float()
    assert torch.equal(batch.teacher_logits(head), stored)
    rows, columns = _support(batch)
    assert torch.equal(batch.teacher_logits(head, rows, columns), stored[rows][:, columns])


def test_a_batch_read_without_its_logits_says_so(tmp_path):
    cache = _cache(tmp_path / "c", "full")
    with pytest.raises(ValueError, match="without its logits"):
        cache.get(IDS, logits=False).teacher_logits(cache.head_weight())
