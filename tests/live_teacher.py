"""The batch a teacher cache would give, computed by running the teacher live.

Stage two never runs a teacher; this exists to check the cache against the teacher it replaces
(tests) and to measure what reading the cache saves (benchmarks/stage_two.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from c2kd.cache_schema import CachedBatch, LogitsPolicy
from c2kd.cache_schema.schema import FINAL_HIDDEN, FULL_LOGITS, hidden_array
from c2kd.recmodel.model import RecLM
from c2kd.recmodel.prompts import answer_index, gather_rows


@torch.no_grad()
def live_teacher_batch(teacher: RecLM, tokens: dict, layers: Sequence[int], positions: str = "all",
                       candidates: torch.Tensor | None = None) -> CachedBatch:
    """`tokens` (a `collate` dict) run through the teacher, laid out as `TeacherCache.get` lays out a batch of a
    `full` cache: the teacher's own float32 logits, so stage two compares against its head, not a stored copy.
    `candidates` [B, C] are the examples' (what --kd-over candidates reads; none when not given)."""
    out = teacher.decode(tokens["input_ids"], tokens["attention_mask"], tokens["slot_items"], output_hidden_states=True)
    answer_positions, mask = answer_index(tokens["labels"])
    final = gather_rows(out.last_hidden_state, answer_positions)
    outputs = {hidden_array(l): out.hidden_states[l] if positions == "all" else gather_rows(out.hidden_states[l], answer_positions)
               for l in layers}
    logits = torch.zeros(*mask.shape, teacher.vocab_size, device=final.device)  # padded answer rows stay 0, as read
    logits[mask] = teacher.head_logits(final[mask]).float()
    outputs.update({FINAL_HIDDEN: final, FULL_LOGITS: logits})
    b = tokens["input_ids"].shape[0]
    empty = torch.zeros(b, 0, dtype=torch.long)
    return CachedBatch(
        positions=positions, logits_policy=LogitsPolicy("full"), vocab_size=teacher.vocab_size,
        example_ids=torch.arange(b), users=torch.zeros(b, dtype=torch.long), targets=torch.zeros(b, dtype=torch.long),
        candidates=empty if candidates is None else candidates, history=empty,
        input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"], slot_items=tokens["slot_items"],
        labels=tokens["labels"], answer_positions=answer_positions, answer_mask=mask, outputs=outputs,
    )
