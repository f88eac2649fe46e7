"""Named model sizes for models built offline from a config with random weights."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import LlamaConfig

from c2kd.errors import C2KDError


@dataclass(frozen=True)
class ModelPreset:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int = 1024

    def llama_config(self, vocab_size: int, pad_id: int, bos_id: int | None, eos_id: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_positions,
            tie_word_embeddings=True,
            pad_token_id=pad_id,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
        )


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("tiny-teacher", hidden_size=128, num_layers=6, num_heads=4, intermediate_size=512),
        # >= 8x fewer non-embedding parameters than tiny-teacher (about 12x).
        ModelPreset("tiny-student", hidden_size=64, num_layers=2, num_heads=2, intermediate_size=256),
        ModelPreset("micro", hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=512),
    )
}


def get_preset(name: str) -> ModelPreset:
    if name not in PRESETS:
        raise C2KDError(f"unknown model preset {name!r}; expected one of {', '.join(PRESETS)}")
    return PRESETS[name]

