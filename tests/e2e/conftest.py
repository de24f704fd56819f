"""Fixtures of this tier: the admission harness from tests/support/admission.py."""

from tests.support.admission import admission, admission_factory  # noqa: F401 - pytest fixtures
