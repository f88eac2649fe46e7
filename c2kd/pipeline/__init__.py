"""Stage one: running the teacher once and writing its states to a teacher cache (transformers or vLLM)."""
