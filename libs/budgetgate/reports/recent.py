"""The most recent decisions a reader may see, newest first (the page for tenants and finance).

A reader limited to tenants has them picked in Postgres by the tenant label; one limited to
namespaces (globs) has each decision's namespace matched as the API matches it
(`Principal.covers`), reading back in pages until enough are found or `scan` decisions were
looked at, so a narrow reader of a busy ledger costs a bounded amount."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from budgetgate.core.units import hours
from budgetgate.core.windows import rfc3339
from budgetgate.ledger.queries import owned_by

sql = owned_by("budgetgate.reports")

PAGE = 500


async def recent_decisions(
    conn: Any,
    *,
    limit: int,
    tenant_label: str,
    tenants: tuple[str, ...] = (),
    sees: Callable[[str, str | None], bool] | None = None,
    scan: int = 10_000,
) -> tuple[list[dict[str, Any]], bool]:
    """Up to `limit` decisions, newest first, of `tenants` (empty: any) that `sees(namespace,
    tenant)` keeps; and whether the search stopped at `scan` decisions before finding `limit`."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    found: list[dict[str, Any]] = []
    after: tuple[Any, Any] = (None, None)
    looked = 0
    while len(found) < limit:
        page = min(PAGE if sees is not None else limit - len(found), scan - looked)
        if page <= 0:
            return found, True
        rows = await conn.fetch(sql("recent_decisions"), after[0], after[1], page, list(tenants) or None, tenant_label)
        looked += len(rows)
        for row in rows:
            if sees is None or sees(row["namespace"], row["tenant"]):
                found.append(_shown(row))
                if len(found) == limit:
                    break
        if len(rows) < page:
            break
        after = (rows[-1]["decided_at"], rows[-1]["decision_id"])
    return found, False


def _shown(row: Any) -> dict[str, Any]:
    return {
        "run_id": row["run_id"],
        "attempt": row["attempt"],
        "decision": row["outcome"],
        "reason": row["reason"],
        "namespace": row["namespace"],
        "tenant": row["tenant"],
        "decided_at": rfc3339(row["decided_at"]),
        "projected_gpu_hours": hours(row["projected_gpu"]),
        "policy_bundle_sha": row["policy_bundle_sha"],
    }
