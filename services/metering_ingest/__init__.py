"""The metering_ingest service (not built yet: see the project's issues)."""
