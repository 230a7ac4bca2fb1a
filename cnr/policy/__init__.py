"""Decisions: full or incremental, the bit-width, retention, per-table plans."""
