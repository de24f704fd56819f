"""Machinery behind the shared fixtures in tests/conftest.py: where servers come from, per-test
databases, and the killable servers of the fault tests."""
