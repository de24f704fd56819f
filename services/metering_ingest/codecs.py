"""Metering samples and usage records on the wire, to and from the metering core's types."""

from __future__ import annotations

import re
import sys
from datetime import datetime
from typing import Any

from google.protobuf import json_format
from google.protobuf.timestamp_pb2 import Timestamp

from budgetgate.contracts.lifecycle_rules import event_id_problem
from budgetgate.contracts.timestamps import accepted_time, fill, time_problem, timestamp
from budgetgate.core.metering import Accepted, Problem, RawSample, Rejected, Rejection, Sample, sample_event_id, usage_event_id
from budgetgate.v1.metering_pb2 import MeteringSample
from budgetgate.v1.usage_pb2 import UsageRecord

# json_format names the field it failed on by its JSON name (or by the name it was given).
_FAILED_FIELD = re.compile(r"Failed to parse (\w+) field")
_FIELD_NAMES = {name: f.name for f in MeteringSample.DESCRIPTOR.fields for name in (f.name, f.json_name)}


def raw_sample(message: MeteringSample) -> RawSample:
    """The core's view of a sample message; Rejected if its observed_at is no time budgetgate takes."""
    observed_at = None
    if message.HasField("observed_at"):
        observed_at = accepted_time(message.observed_at)
        if observed_at is None:
            raise Rejected(Problem(Rejection.INVALID_FIELD, "observed_at", time_problem(message.observed_at, "observed_at")))
    return RawSample(message.run_id, message.sample_id, observed_at, message.gpu_seconds, message.node_seconds, message.exporter)


def from_json(data: Any) -> MeteringSample:
    """A sample given in the canonical protobuf JSON mapping (an HTTP batch entry).

    Unknown fields are skipped, as on Kafka; a sample without an event_id gets one derived
    from its run and sample id, so a resend carries the same one.
    """
    if not isinstance(data, dict):
        raise Rejected(Problem(Rejection.UNPARSEABLE, None, f"a sample must be a JSON object, not {type(data).__name__}"))
    message = MeteringSample()
    try:
        json_format.ParseDict(data, message, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        found = _FAILED_FIELD.search(str(exc))
        field = _FIELD_NAMES.get(found.group(1)) if found else None
        raise Rejected(Problem(Rejection.UNPARSEABLE, field, str(exc))) from exc
    except (OverflowError, TypeError, ValueError) as exc:  # raised past the parser: a JSON number no float holds
        field = next((_FIELD_NAMES.get(k) for k, v in data.items() if isinstance(v, int) and not isinstance(v, bool) and abs(v) > sys.float_info.max), None)
        raise Rejected(Problem(Rejection.UNPARSEABLE, field, f"{field or 'a field'} is not a number a sample can hold ({exc})")) from exc
    if not message.event_id and message.run_id and message.sample_id:
        message.event_id = sample_event_id(message.run_id, message.sample_id)
    elif message.event_id and (reason := event_id_problem(message.event_id)):
        # What a consumer's inbox refuses: kept pending, such a sample would be dead-lettered later.
        raise Rejected(Problem(Rejection.INVALID_FIELD, "event_id", reason))
    return message


def usage_record(accepted: Accepted, *, recorded_at: datetime | Timestamp, event_id: str | None = None) -> UsageRecord:
    """The usage.records.v1 message of an accepted sample (its event id is derived, stable;
    `event_id` when the caller derived it already)."""
    return with_run_figures(usage_draft(accepted.sample, recorded_at=recorded_at, event_id=event_id), accepted)


def usage_draft(sample: Sample, *, recorded_at: datetime | Timestamp, event_id: str | None = None) -> UsageRecord:
    """The usage record of `sample` without the run's figures, which only judging it gives."""
    record = UsageRecord(
        event_id=event_id or usage_event_id(sample.run_id, sample.sample_id),
        run_id=sample.run_id,
        sample_id=sample.sample_id,
        # The sample's own counters: below the cumulative for a late sample, which the reader
        # needs to attribute usage to windows by observed_at.
        gpu_milli_hours_observed=sample.counters.gpu,
        node_milli_hours_observed=sample.counters.node,
    )
    # Filled in place: a Timestamp given to the constructor is made and then copied (per sample).
    record.event_time.CopyFrom(recorded_at if isinstance(recorded_at, Timestamp) else timestamp(recorded_at))
    fill(record.observed_at, sample.observed_at)
    return record


def with_run_figures(draft: UsageRecord, accepted: Accepted) -> UsageRecord:
    """`draft` (of `accepted`'s sample) with the run's cumulative after it and its delta."""
    draft.gpu_milli_hours_cumulative = accepted.cumulative.gpu
    draft.node_milli_hours_cumulative = accepted.cumulative.node
    draft.gpu_milli_hours_delta = accepted.delta.gpu
    draft.node_milli_hours_delta = accepted.delta.node
    return draft
