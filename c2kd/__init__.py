"""c2kd: distil an LLM recommender into a small on-device one with C2KD."""

__version__ = "0.1.0"
