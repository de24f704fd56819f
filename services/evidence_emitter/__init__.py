"""The evidence_emitter service (not built yet: see the project's issues)."""
