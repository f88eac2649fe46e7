"""The feature-KD baseline's layer map: which teacher layer each student layer imitates."""

from __future__ import annotations

from collections.abc import Sequence

from c2kd.errors import C2KDError


def uniform_layer_map(num_student_layers: int, num_teacher_layers: int, available_teacher_layers: Sequence[int]) -> dict[int, int]:
    """SLMRec-style uniform layer map for the feature-KD baseline: {student layer: teacher layer}.

    Rule: student layer i (1-indexed, i = 1 .. L_s - 1) is paired with teacher layer
    round(i * L_t / L_s). The student's last layer is left out: its output is the final-normed
    state that the LM loss trains directly, and no cache stores the teacher's counterpart as a
    plain layer output. Pairs whose teacher layer is not in the cache are dropped (a cache holds
    late layers only); if none is left, the error names the layers that would be needed.
    """
    if num_student_layers < 2:
        raise C2KDError(f"feature-KD needs a student with at least 2 layers (got {num_student_layers})")
    available = {int(l) for l in available_teacher_layers}
    wanted = {i: round(i * num_teacher_layers / num_student_layers) for i in range(1, num_student_layers)}
    kept = {i: t for i, t in wanted.items() if t in available}
    if not kept:
        missing = sorted(set(wanted.values()) - available)
        raise C2KDError(
            f"feature-KD uniform layer map needs teacher layers {missing} (student {num_student_layers} layers, "
            f"teacher {num_teacher_layers}); the cache holds {sorted(available)}. "
            "Re-run cache-teacher with those layers, or use --method c2kd."
        )
    return kept
