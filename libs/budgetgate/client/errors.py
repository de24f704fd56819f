"""What a budgetgate service answered when it did not answer what was asked, as exceptions."""

from __future__ import annotations

from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx


class BudgetgateError(Exception):
    """An error answer of a budgetgate service; `problem` is its RFC 9457 body."""

    def __init__(self, status: int, problem: dict[str, Any], *, retry_after: float | None = None) -> None:
        self.status = status
        self.problem = problem
        self.retry_after = retry_after  # seconds the service asked to wait (its Retry-After header)
        super().__init__(f"{status} {problem.get('title', '')}: {problem.get('detail', '')}".strip())

    @property
    def detail(self) -> str:
        return str(self.problem.get("detail", ""))


class InvalidRequest(BudgetgateError, ValueError):
    """422: the request has bad fields, listed in `errors` (`field`, `msg`, ...), as the service
    answered, or as the client found before sending it (`sent` is false): the client checks a
    request with the service's own models, so the fields and messages are the ones the service
    would have answered. Also a ValueError, as pydantic's ValidationError is."""

    @classmethod
    def unsent(cls, errors: list[dict[str, Any]]) -> InvalidRequest:
        """The error for a request refused before sending; `errors` each have `field` and `msg`."""
        listed = [
            {"field": str(e.get("field") or ""), "loc": list(e.get("loc") or []), "msg": str(e.get("msg", "")), "type": str(e.get("type", "value_error"))}
            for e in errors
        ]
        detail = "invalid " + "; ".join(f"{e['field'] or 'body'}: {e['msg']}" for e in listed)
        problem = {
            "type": "about:blank",
            "title": "Unprocessable Content (found before sending)",
            "status": 422,
            "detail": detail,
            "errors": listed,
            "sent": False,
        }
        return cls(422, problem)

    @property
    def errors(self) -> list[dict[str, Any]]:
        return list(self.problem.get("errors") or [])

    @property
    def fields(self) -> list[str]:
        """The offending fields, as dotted paths ("resources.gpus"; "" for the whole body)."""
        return [str(e.get("field") or "") for e in self.errors]

    @property
    def sent(self) -> bool:
        """False when the client refused the request itself: nothing reached the service."""
        return self.problem.get("sent", True) is not False


class Conflict(BudgetgateError):
    """409: the run id was decided before for another request (`changes`: each field's value
    then and now), or is another namespace's or tenant's; nothing was decided. `next_attempt`:
    the attempt that would decide the new request afresh (the run was refused, so holds
    nothing), or None: submit under a new run id."""

    @property
    def fields(self) -> list[str]:
        return list(self.problem.get("fields") or [])

    @property
    def changes(self) -> list[dict[str, Any]]:
        return list(self.problem.get("changes") or [])

    @property
    def next_attempt(self) -> int | None:
        found = self.problem.get("next_attempt")
        return found if isinstance(found, int) and not isinstance(found, bool) else None


class NotFound(BudgetgateError):
    """404."""


class Archived(BudgetgateError):
    """410: the run's latest decision is archived (moved out of the ledger's database, past its
    retention, by `budgetgate ledger archive`): no resend, lookup or explanation is answered from
    it; submit under a new run id. `archive` names the archive when the answer does."""

    @property
    def archive(self) -> str | None:
        found = self.problem.get("archive")
        return found if isinstance(found, str) else None


class Unauthorized(BudgetgateError):
    """401 or 403: no token, a bad token, or a principal without the role."""


class RateLimited(BudgetgateError):
    """429: the caller is over its rate limit and nothing was done; retried after `retry_after`, then raised."""


class Unavailable(BudgetgateError):
    """503: the service cannot decide now (its ledger is down); retried, then raised."""


class NotGranted(Exception):
    """A pool token was asked for in a `with` block and not granted (`answer.status` says why)."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        super().__init__(f"pool {answer.namespace!r} did not grant token {answer.token!r}: {answer.status}")


_BY_STATUS: dict[int, type[BudgetgateError]] = {
    401: Unauthorized, 403: Unauthorized, 404: NotFound, 409: Conflict, 410: Archived, 422: InvalidRequest, 429: RateLimited, 503: Unavailable,
}  # fmt: skip


def retry_after(raw: str, *, now: datetime | None = None) -> float | None:
    """Seconds a Retry-After header asks to wait: delay-seconds, or an HTTP-date (RFC 9110 §10.2.3)."""
    raw = raw.strip()
    if not raw:
        return None
    if raw.replace(".", "", 1).isdigit():  # delay-seconds (a fraction tolerated)
        return float(raw)
    try:
        when = parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def error_of(response: httpx.Response) -> BudgetgateError:
    """The exception for an error answer (problem details, or whatever body it had)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    problem = dict(body) if isinstance(body, dict) else {"detail": response.text.strip() or response.reason_phrase}
    problem.setdefault("title", response.reason_phrase)
    asked = retry_after(response.headers.get("retry-after", ""))
    return _BY_STATUS.get(response.status_code, BudgetgateError)(response.status_code, problem, retry_after=asked)
