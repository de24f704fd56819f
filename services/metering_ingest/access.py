"""Which runs an exporter may report: a principal limited to namespaces or tenants posts samples
and lifecycle events only of runs whose decision is within them (the decision's namespace, and
its label BUDGETGATE_TENANT_LABEL as the tenant, as admission checked its submitter).

Both routes look up the owners of every run a request names in one query, before anything is
recorded; one item of a run outside the limits refuses the whole request (403, each such item
under `errors`), so a request is never half applied. A principal without limits is not looked
up at all. A run without a decision yet cannot be checked: its samples are kept pending with the
sender's limits and judged when the decision comes (ingest.py); its lifecycle events, which
cannot wait, are refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import asyncpg
from fastapi.responses import JSONResponse

from budgetgate.core.principals import Principal
from budgetgate.edge.problems import offending
from budgetgate.services.metering_ingest.store import Owner, run_owners


async def owners(conn: asyncpg.Connection, principal: Principal, run_ids: Sequence[str], *, tenant_label: str) -> Mapping[str, Owner] | None:
    """The owners of the runs that have a decision, for a limited principal; None (nothing
    looked up) for one without limits, which may report any run."""
    if principal.unscoped:
        return None
    return await run_owners(conn, run_ids, tenant_label=tenant_label)


def outside(principal: Principal, run_ids: Sequence[str], owners: Mapping[str, Owner], *, field: str, undecided: bool) -> list[dict[str, object]]:
    """The offending items (`run_ids` in the order of the request's list `field`): those of runs
    outside the principal's limits, and with `undecided`, those of runs with no decision yet."""
    found = []
    for index, run_id in enumerate(run_ids):
        owner = owners.get(run_id)
        if owner is not None and not principal.covers(owner.namespace, owner.tenant):
            found.append(_item(field, index, f"run {run_id!r} is not within {principal.limits}", "out_of_scope"))
        elif owner is None and undecided:
            msg = f"run {run_id!r} has no decision yet, so it cannot be shown to be within {principal.limits}; send its events once it is admitted"
            found.append(_item(field, index, msg, "undecided_run"))
    return found


def forbidden(principal: Principal, field: str, items: list[dict[str, object]]) -> JSONResponse:
    """The 403 of a request with `items` outside the principal's limits."""
    detail = (
        f"{principal.name!r} is limited to {principal.limits} and reports only runs within them; "
        f"{len(items)} of the {field} {'is' if len(items) == 1 else 'are'} not (listed under errors), so nothing of this request was recorded"
    )
    return JSONResponse({"detail": detail, "errors": items}, status_code=403)


def _item(field: str, index: int, msg: str, kind: str) -> dict[str, object]:
    return offending({"loc": ["body", field, index, "runId"], "msg": msg, "type": kind})
