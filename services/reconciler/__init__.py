"""The reconciler service (not built yet: see the project's issues)."""
