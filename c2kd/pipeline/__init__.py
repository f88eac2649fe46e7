"""Data preparation, the teacher, and stage one (caching the teacher)."""
