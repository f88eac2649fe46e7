"""Which teacher layers C2KD considers (DESIGN §3: late layers)."""

from __future__ import annotations

from c2kd.errors import C2KDError


def late_layers(num_layers: int) -> list[int]:
    """The four layers L-s, L-2s, L-3s, L-4s with s = max(1, L // 16), those >= 1, ascending.

    For 32 layers this is 24, 26, 28, 30 (the authors' choice). Layer numbers are 1-indexed as in
    the Hugging Face `hidden_states` tuple (index 0 is the embedding output).
    """
    if num_layers < 1:
        raise C2KDError(f"a model needs at least one layer, got {num_layers}")
    step = max(1, num_layers // 16)
    return sorted(layer for layer in (num_layers - k * step for k in (1, 2, 3, 4)) if layer >= 1)
