"""What makes a lifecycle event usable, whichever way it comes in: the reconciler's Kafka
consumer dead-letters an event that breaks these rules, and metering-ingest's
`POST /v1/lifecycle/events` refuses it with a 422 naming the field.
"""

from __future__ import annotations

import re
import uuid

from budgetgate.core.metering import MAX_ID_CHARS as MAX_RUN_ID, is_run_id
from budgetgate.core.reconciliation import LIFECYCLE_KINDS
from budgetgate.contracts.timestamps import time_problem
from budgetgate.v1.lifecycle_pb2 import LifecycleEvent, LifecycleType
from budgetgate.contracts.wire import MAX_EVENT_ID

# What one run may report holding: admission's bounds on a submission's GPUs and nodes.
MAX_GPUS, MAX_NODES = 1_000_000, 100_000
# Text the reconciler stores: Postgres cannot hold a NUL, and other control characters (tab and
# newline aside) are a bug upstream.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_IDS = uuid.uuid5(uuid.NAMESPACE_URL, "https://budgetgate.dev/lifecycle/event-id")


def problems(event: LifecycleEvent) -> list[tuple[str, str]]:
    """Every broken rule of `event`, as (field, what is wrong); the first one is the reason a
    consumer gives when it dead-letters the event."""
    found = []
    if reason := run_id_problem(event.run_id):
        found.append(("run_id", reason))
    kind = LifecycleType.Name(event.type) if event.type in LifecycleType.values() else ""
    if kind not in LIFECYCLE_KINDS:
        found.append(("type", f"lifecycle event {event.event_id} has no known type ({event.type})"))
    if not event.HasField("event_time"):
        found.append(("event_time", f"lifecycle event {event.event_id} has no event_time"))
    elif reason := time_problem(event.event_time, "event_time"):
        found.append(("event_time", f"lifecycle event {event.event_id}: {reason}"))
    for field, most in (("gpus", MAX_GPUS), ("nodes", MAX_NODES)):
        if not 0 <= getattr(event, field) <= most:
            found.append((field, f"lifecycle event {event.event_id} reports {field} outside 0 to {most}"))
    for field in ("flavor", "region", "reason"):
        if control := _CONTROL.search(getattr(event, field)):
            found.append((field, f"lifecycle event {event.event_id}: {field} holds the control character U+{ord(control.group()):04X}, which cannot be stored"))
    return found


def run_id_problem(run_id: str) -> str | None:
    """Why `run_id` can be no run's id, if it cannot (admission's rule)."""
    # Run ids are those admission accepts, else no decision could match.
    if is_run_id(run_id):
        return None
    return f"run_id must be 1 to {MAX_RUN_ID} printable ASCII characters without spaces"


def event_id_problem(event_id: str) -> str | None:
    """Why `event_id` cannot key a consumer's inbox, if it cannot (what wire.decode refuses)."""
    if not event_id:
        return "event_id is missing"
    if len(event_id) > MAX_EVENT_ID or not event_id.isprintable():
        return f"event_id is not up to {MAX_EVENT_ID} printable characters"
    return None


def derived_event_id(event: LifecycleEvent) -> str:
    """A stable event id for an event sent without one: the same run, type and time give the
    same id, so a platform resending the event is deduplicated."""
    return str(uuid.uuid5(_IDS, f"{event.run_id}\x00{event.type}\x00{event.event_time.ToJsonString()}"))
