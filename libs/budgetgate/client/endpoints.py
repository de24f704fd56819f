"""Where the client finds the services and its token: arguments, then BUDGETGATE_* variables,
then the `.budgetgate/dev.json` of a running `budgetgate dev up` (as every CLI command does)."""

from __future__ import annotations

import json
import os

from budgetgate.runtime.settings import find_dev_state

TOKEN_VARIABLE = "BUDGETGATE_TOKEN"
ADMISSION_VARIABLE = "BUDGETGATE_ADMISSION_URL"
METERING_VARIABLE = "BUDGETGATE_METERING_URL"
RECONCILER_VARIABLE = "BUDGETGATE_RECONCILER_URL"


class NoEndpoint(LookupError):
    """No URL was given for a service, in an argument, a variable or a running local stack."""


def _from_stack(key: str) -> str | None:
    path = find_dev_state()
    if path is None:
        return None
    try:
        value = json.loads(path.read_text()).get("settings", {}).get(key)
    except (OSError, ValueError):
        return None
    return str(value) if value else None


def admission_url(given: str | None = None) -> str:
    """The admission service's base URL."""
    found = given or os.environ.get(ADMISSION_VARIABLE) or _from_stack("admission_url")
    if not found:
        raise NoEndpoint(f"no admission URL: pass one, set {ADMISSION_VARIABLE}, or run `budgetgate dev up` in this folder or a parent")
    return found.rstrip("/")


def metering_url(given: str | None = None) -> str | None:
    """metering-ingest's base URL, when one is known (it takes lifecycle events and samples)."""
    found = given or os.environ.get(METERING_VARIABLE) or _from_stack("metering_url")
    return found.rstrip("/") if found else None


def reconciler_url(given: str | None = None) -> str:
    """The reconciler's base URL (its operator routes: dead-lettered settlements)."""
    found = given or os.environ.get(RECONCILER_VARIABLE) or _from_stack("reconciler_url")
    if not found:
        raise NoEndpoint(f"no reconciler URL: pass one, set {RECONCILER_VARIABLE}, or run `budgetgate dev up` in this folder or a parent")
    return found.rstrip("/")


def token(given: str | None = None) -> str | None:
    """The bearer token to send: the argument, else BUDGETGATE_TOKEN; none when neither is set."""
    return given or os.environ.get(TOKEN_VARIABLE) or None


def resolved(url: str | None, metering: str | None) -> tuple[str | None, str | None]:
    """Admission's URL (None when none is known: fine for a client that only publishes, and said
    when a call needs it) and metering-ingest's, for both clients."""
    try:
        found = admission_url(url)
    except NoEndpoint:
        found = None
    return found, metering_url(metering)
