"""Audit figures of one scope: from the Postgres audit views, or from Marquez's run history.

Both sources count the same way, so on the same data they agree:

- denial rate per (scope, window): runs, each counted once by its latest decision;
- reservation-to-actual error per (scope, window, policy SHA): each run's latest reconciliation,
  once the run has ended, in exact milli-GPU-seconds.

Windows are named by their ledger window key (`<start>/<end>`, or `rolling-<n>d`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import Any
from urllib.parse import quote

import asyncpg
import httpx

from budgetgate.core.units import MILLI_PER_HOUR, Unit, display
from budgetgate.ledger.queries import owned_by
from budgetgate.evidence import events
from budgetgate.evidence.facet import FACET_KEY, RECONCILIATION

sql = owned_by("budgetgate.evidence")


@dataclass(frozen=True)
class WindowFilter:
    """Which windows to report: those containing `at`, the one named `key`, or all."""

    at: datetime | None = None
    key: str | None = None

    def matches(self, window_key: str | None) -> bool:
        if self.at is None and self.key is None:
            return True
        if self.key is not None and window_key == self.key:
            return True
        start, end = window_bounds(window_key)
        return self.at is not None and start is not None and end is not None and start <= self.at < end


@dataclass(frozen=True)
class DenialRate:
    scope_id: str
    window_key: str | None
    window_start: str | None
    window_end: str | None
    runs: int
    allowed: int
    denied: int
    delayed: int
    denial_rate: float


@dataclass(frozen=True)
class ReservationError:
    scope_id: str
    window_key: str | None
    window_start: str | None
    window_end: str | None
    policy_git_sha: str
    runs: int
    provisional_runs: int
    reserved_gpu_hours: float
    actual_gpu_hours: float
    error_gpu_hours: float
    abs_error_gpu_hours: float
    error_ratio: float | None


def window_bounds(window_key: str | None) -> tuple[datetime | None, datetime | None]:
    """(start, end) of a calendar window key; (None, None) for rolling windows or none."""
    if not window_key or "/" not in window_key:
        return None, None
    start, end = window_key.split("/", 1)
    try:
        return datetime.fromisoformat(start.replace("Z", "+00:00")), datetime.fromisoformat(end.replace("Z", "+00:00"))
    except ValueError:
        return None, None


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _rate(part: int, whole: int) -> float:
    return float((Decimal(part) / Decimal(whole)).quantize(Decimal("0.0001"), ROUND_HALF_UP)) if whole else 0.0


def _hours(milli: int) -> float:
    return float((Decimal(milli) / MILLI_PER_HOUR).quantize(Decimal("0.001"), ROUND_HALF_UP))


def _milli(gpu_hours: float) -> int:
    return round(gpu_hours * MILLI_PER_HOUR)


def denial_rate(scope_id: str, window_key: str | None, *, runs: int, allowed: int, denied: int, delayed: int) -> DenialRate:
    start, end = window_bounds(window_key)
    return DenialRate(scope_id, window_key, _iso(start), _iso(end), runs, allowed, denied, delayed, _rate(denied, runs))


def reservation_error(
    scope_id: str, window_key: str | None, sha: str, *, runs: int, provisional: int, reserved: int, actual: int, abs_error: int
) -> ReservationError:
    start, end = window_bounds(window_key)
    ratio = float((Decimal(actual - reserved) / Decimal(reserved)).quantize(Decimal("0.0001"), ROUND_HALF_UP)) if reserved else None
    return ReservationError(
        scope_id,
        window_key,
        _iso(start),
        _iso(end),
        sha,
        runs,
        provisional,
        _hours(reserved),
        _hours(actual),
        _hours(actual - reserved),
        _hours(abs_error),
        ratio,
    )


# -- from Postgres ------------------------------------------------------------------------------


async def postgres_report(conn: asyncpg.Connection, scope_id: str, window: WindowFilter) -> dict[str, Any]:
    """Every audit figure of `scope_id` from the audit views."""
    args = (scope_id, window.at, window.key)
    denial = [
        denial_rate(r["scope_id"], r["window_key"], runs=r["runs"], allowed=r["allowed"], denied=r["denied"], delayed=r["delayed"])
        for r in await conn.fetch(sql("audit_denial_rate_for_scope"), *args)
    ]
    error = [
        reservation_error(
            r["scope_id"],
            r["window_key"],
            r["policy_git_sha"],
            runs=r["runs"],
            provisional=r["provisional_runs"],
            reserved=r["reserved_gpu"],
            actual=r["actual_gpu"],
            abs_error=r["abs_error_gpu"],
        )
        for r in await conn.fetch(sql("audit_reservation_error_for_scope"), *args)
    ]
    exhaustion = [_exhaustion(dict(r)) for r in await conn.fetch(sql("audit_window_exhaustion_for_scope"), *args)]
    by_sha = [_plain(dict(r)) for r in await conn.fetch(sql("audit_decisions_by_policy_sha_for_scope"), *args)]
    return {
        "scope": scope_id,
        "source": "postgres",
        "known": await conn.fetchval(sql("audit_scope_known"), scope_id),
        "denial_rate": [asdict(d) for d in denial],
        "reservation_error": [asdict(e) for e in error],
        "window_exhaustion": exhaustion,
        "decisions_by_policy_sha": by_sha,
    }


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in row.items()}


def _exhaustion(row: dict[str, Any]) -> dict[str, Any]:
    """A window exhaustion row in human units: hours of the budget's unit, or its currency."""
    unit = Unit(row["unit"])
    human = {"limit": display(unit, row.pop("limit_amount")), "used": display(unit, row["used"])}
    human["remaining"] = round(human["limit"] - human["used"], 6)
    burn = row.pop("burn_per_hour")
    human["burn_per_hour"] = display(unit, burn) if burn is not None else None
    return _plain({**row, **human})


# -- from Marquez -------------------------------------------------------------------------------


def marquez_runs(base_url: str, *, page: int = 100, timeout: float = 30.0, transport: httpx.BaseTransport | None = None) -> Iterator[dict[str, Any]]:
    """Every run Marquez knows that carries a budget facet, via its namespace, job and run listings,
    each once. The listings page by offset, newest first: a run added or updated while they are
    read shifts the pages, and a run seen twice is counted as its latest reading."""
    latest: dict[str, dict[str, Any]] = {}
    with httpx.Client(base_url=base_url.rstrip("/") + "/api/v1", timeout=timeout, transport=transport) as client:
        for namespace in _pages(client, "/namespaces", "namespaces", page):
            ns = quote(namespace["name"], safe="")
            for job in _pages(client, f"/namespaces/{ns}/jobs", "jobs", page):
                name = quote(job["name"], safe="")
                for run in _pages(client, f"/namespaces/{ns}/jobs/{name}/runs", "runs", page):
                    if FACET_KEY in (run.get("facets") or {}):
                        seen = latest.get(run["id"])
                        if seen is None or _updated(run) >= _updated(seen):
                            latest[run["id"]] = run
    yield from latest.values()


def _updated(run: Mapping[str, Any]) -> datetime:
    try:
        at = datetime.fromisoformat(str(run.get("updatedAt")).replace("Z", "+00:00"))
    except ValueError:
        return datetime.min.replace(tzinfo=UTC)
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def _pages(client: httpx.Client, path: str, key: str, page: int) -> Iterator[dict[str, Any]]:
    offset = 0
    while True:
        response = client.get(path, params={"limit": page, "offset": offset})
        response.raise_for_status()
        items = response.json().get(key) or []
        yield from items
        if len(items) < page:
            return
        offset += page


def marquez_report(runs: Iterable[Mapping[str, Any]], scope_id: str, window: WindowFilter) -> dict[str, Any]:
    """Denial rate and reservation error of `scope_id` from Marquez runs (merged facets)."""
    counts: dict[str | None, Counter] = defaultdict(Counter)
    errors: dict[tuple[str | None, str], Counter] = defaultdict(Counter)
    known = False
    for run in runs:
        budget = run["facets"][FACET_KEY]
        known = known or any(e.get("scope_id") == scope_id for e in budget.get("evaluations", []))
        for key in sorted({e.get("window_key") for e in budget.get("evaluations", []) if e.get("scope_id") == scope_id}, key=str):
            if window.matches(key):
                counts[key]["runs"] += 1
                counts[key][{"ALLOW": "allowed", "DENY": "denied", "DELAY": "delayed"}[budget["decision"]]] += 1
        if budget.get("stage") != RECONCILIATION or not _terminal(budget.get("final_state", "")):
            continue
        reserved, actual = _milli(budget["projected_gpu_hours"]), _milli(budget["actual_gpu_hours"])
        for key in sorted({c.get("window_key") for c in budget.get("charges", []) if c.get("scope_id") == scope_id}, key=str):
            if window.matches(key):
                tally = errors[(key, budget.get("policy_bundle_sha", ""))]
                tally.update(runs=1, provisional=int(bool(budget.get("provisional"))), reserved=reserved, actual=actual, abs_error=abs(actual - reserved))
    denial = [
        denial_rate(scope_id, key, runs=c["runs"], allowed=c["allowed"], denied=c["denied"], delayed=c["delayed"])
        for key, c in sorted(counts.items(), key=_window_order)
    ]
    error = [
        reservation_error(
            scope_id, key, sha, runs=c["runs"], provisional=c["provisional"], reserved=c["reserved"], actual=c["actual"], abs_error=c["abs_error"]
        )
        for (key, sha), c in sorted(errors.items(), key=lambda kv: (*_window_order((kv[0][0], None)), kv[0][1]))
    ]
    return {"scope": scope_id, "source": "marquez", "known": known, "denial_rate": [asdict(d) for d in denial], "reservation_error": [asdict(e) for e in error]}


def _window_order(item: tuple[str | None, Any]) -> tuple[bool, str, bool, str]:
    """As the SQL orders: by window start (rolling and no window last), then by key."""
    key = item[0]
    start, _ = window_bounds(key)
    return (start is None, start.isoformat() if start else "", key is None, key or "")


def _terminal(final_state: str) -> bool:
    try:
        return events.reconciliation_event_type(final_state, terminal_sent=False) in events.TERMINAL
    except ValueError:
        return False
