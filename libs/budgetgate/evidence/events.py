"""OpenLineage RunEvents (spec 2-0-2) for decisions and reconciliations, built with
openlineage-python's classes.

The mapping, which the README repeats and the tests hold to:

| source | event type |
|---|---|
| decision ALLOW | START |
| decision DELAY | OTHER |
| decision DENY | ABORT |
| reconciliation of a running run (no final state, RUNNING, STARTED, READMITTED) | RUNNING |
| reconciliation COMPLETED | COMPLETE |
| reconciliation FAILED, EVICTED | FAIL |
| reconciliation CANCELLED, NEVER_STARTED, EXPIRED, RELEASED, RECLAIMED | ABORT |
| a reconciliation after the run's terminal event (corrected actuals) | OTHER |

The run id is a UUIDv5 of the platform's stable run id (RUN_NAMESPACE below), so a retry, a
later attempt and the reconciliation all land on one Marquez run.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime
from importlib import metadata
from typing import Any

import attr
from openlineage.client.event_v2 import Job, Run, RunEvent, RunState
from openlineage.client.generated.base import RunFacet
from openlineage.client.serde import Serde

from budgetgate.evidence.facet import FACET_KEY, SCHEMA_URL, UnusableMessage

# Fixed for good: changing it would split every run's history in Marquez in two.
RUN_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://budgetgate.dev/openlineage/run-id")

DECISION_EVENT_TYPES: Mapping[str, RunState] = {"ALLOW": RunState.START, "DELAY": RunState.OTHER, "DENY": RunState.ABORT}
TERMINAL = frozenset({RunState.COMPLETE, RunState.FAIL, RunState.ABORT})
_RECONCILED_STATES: Mapping[str, RunState] = {
    "": RunState.RUNNING,
    "RUNNING": RunState.RUNNING,
    "STARTED": RunState.RUNNING,
    "READMITTED": RunState.RUNNING,
    "COMPLETED": RunState.COMPLETE,
    "COMPLETE": RunState.COMPLETE,
    "SUCCEEDED": RunState.COMPLETE,
    "FAILED": RunState.FAIL,
    "FAIL": RunState.FAIL,
    "EVICTED": RunState.FAIL,
    "CANCELLED": RunState.ABORT,
    "CANCELED": RunState.ABORT,
    "ABORTED": RunState.ABORT,
    "NEVER_STARTED": RunState.ABORT,
    "EXPIRED": RunState.ABORT,
    "RELEASED": RunState.ABORT,
    "RECLAIMED": RunState.ABORT,
}


def producer_uri() -> str:
    """The `producer` / `_producer` of every event: the evidence-emitter at its released version."""
    try:
        version = metadata.version("budgetgate")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        version = "0"
    return f"https://budgetgate.dev/producers/evidence-emitter/{version}"


def run_uuid(run_id: str) -> uuid.UUID:
    """The OpenLineage runId of a platform run id: the same run id always gives the same UUID."""
    return uuid.uuid5(RUN_NAMESPACE, run_id)


def decision_event_type(decision: str) -> RunState:
    return DECISION_EVENT_TYPES[decision]


def reconciliation_event_type(final_state: str, *, terminal_sent: bool) -> RunState:
    """The event for a reconciliation; OTHER once the run already had its one terminal event
    (OpenLineage allows one COMPLETE/FAIL/ABORT per run, and OTHER for metadata after it)."""
    try:
        state = _RECONCILED_STATES[final_state]
    except KeyError:
        known = ", ".join(sorted(s for s in _RECONCILED_STATES if s))
        raise UnusableMessage(f"unknown final_state {final_state!r} (known: {known})") from None
    if state in TERMINAL and terminal_sent:
        return RunState.OTHER
    if state is RunState.RUNNING and terminal_sent:
        return RunState.OTHER
    return state


@attr.define
class BudgetRunFacet(RunFacet):
    """The `budget` run facet. Its fields (schemas/facets/budget/<version>/) are added per event
    with `with_additional_properties`, so they serialize flat beside `_producer`/`_schemaURL`."""

    @staticmethod
    def _get_schema() -> str:
        return SCHEMA_URL


def budget_facet(fields: Mapping[str, Any], *, producer: str) -> RunFacet:
    """The facet carrying `fields` (as built by budgetgate.evidence.facet)."""
    return BudgetRunFacet(producer=producer).with_additional_properties(**fields)


def run_event(*, event_type: RunState, at: datetime | str, run_id: str, job: tuple[str, str], fields: Mapping[str, Any], producer: str) -> RunEvent:
    """The RunEvent for one transition of the run `run_id`, carrying the budget facet."""
    return RunEvent(
        eventType=event_type,
        eventTime=at if isinstance(at, str) else at.isoformat(),
        run=Run(runId=str(run_uuid(run_id)), facets={FACET_KEY: budget_facet(fields, producer=producer)}),
        job=Job(namespace=job[0], name=job[1]),
        producer=producer,
    )


def to_json(event: RunEvent) -> dict[str, Any]:
    """The event as OpenLineage JSON, exactly as a transport sends it."""
    return Serde.to_dict(event)


def from_json(data: Mapping[str, Any]) -> RunEvent:
    """The RunEvent stored as `data`: to_json(from_json(data)) == data."""
    facet = {k: v for k, v in data["run"]["facets"][FACET_KEY].items() if not k.startswith("_")}
    return RunEvent(
        eventType=RunState(data["eventType"]),
        eventTime=data["eventTime"],
        run=Run(runId=data["run"]["runId"], facets={FACET_KEY: budget_facet(facet, producer=data["run"]["facets"][FACET_KEY]["_producer"])}),
        job=Job(namespace=data["job"]["namespace"], name=data["job"]["name"]),
        producer=data["producer"],
    )
