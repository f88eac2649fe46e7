"""The teacher-cache format: its one definition, writer and reader (see SCHEMA.md)."""
