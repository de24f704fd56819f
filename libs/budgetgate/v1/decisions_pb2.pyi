import datetime

from budgetgate.v1 import common_pb2 as _common_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Decision(_message.Message):
    __slots__ = ("event_id", "event_time", "decision_id", "run_id", "attempt", "outcome", "reason", "policy_bundle_sha", "namespace", "labels", "job", "resources", "projected_runtime_hours", "projected_gpu_milli_hours", "showback_cost_micros", "currency", "evaluations", "tenant", "priority_penalty", "preemptible", "deciding_evaluation", "override_revision", "accounting")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class Accounting(_message.Message):
        __slots__ = ("policy_id", "source", "remaining_amount", "detail")
        POLICY_ID_FIELD_NUMBER: _ClassVar[int]
        SOURCE_FIELD_NUMBER: _ClassVar[int]
        REMAINING_AMOUNT_FIELD_NUMBER: _ClassVar[int]
        DETAIL_FIELD_NUMBER: _ClassVar[int]
        policy_id: str
        source: str
        remaining_amount: int
        detail: str
        def __init__(self, policy_id: _Optional[str] = ..., source: _Optional[str] = ..., remaining_amount: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...
    class Evaluation(_message.Message):
        __slots__ = ("policy_id", "policy_git_sha", "scope_id", "ledger_key", "window_start", "window_end", "unit", "enforcement", "on_exhausted", "limit_amount", "projected_amount", "remaining_amount", "admitted_amount", "deficit_amount", "outcome", "next_eligible_time", "missing_labels", "reserved_amount", "consumed_amount", "policy_limit_amount", "grants")
        POLICY_ID_FIELD_NUMBER: _ClassVar[int]
        POLICY_GIT_SHA_FIELD_NUMBER: _ClassVar[int]
        SCOPE_ID_FIELD_NUMBER: _ClassVar[int]
        LEDGER_KEY_FIELD_NUMBER: _ClassVar[int]
        WINDOW_START_FIELD_NUMBER: _ClassVar[int]
        WINDOW_END_FIELD_NUMBER: _ClassVar[int]
        UNIT_FIELD_NUMBER: _ClassVar[int]
        ENFORCEMENT_FIELD_NUMBER: _ClassVar[int]
        ON_EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
        LIMIT_AMOUNT_FIELD_NUMBER: _ClassVar[int]
        PROJECTED_AMOUNT_FIELD_NUMBER: _ClassVar[int]
        REMAINING_AMOUNT_FIELD_NUMBER: _ClassVar[int]
        ADMITTED_AMOUNT_FIELD_NUMBER: _ClassVar[int]
        DEFICIT_AMOUNT_FIELD_NUMBER: _ClassVar[int]
        OUTCOME_FIELD_NUMBER: _ClassVar[int]
        NEXT_ELIGIBLE_TIME_FIELD_NUMBER: _ClassVar[int]
        MISSING_LABELS_FIELD_NUMBER: _ClassVar[int]
        RESERVED_AMOUNT_FIELD_NUMBER: _ClassVar[int]
        CONSUMED_AMOUNT_FIELD_NUMBER: _ClassVar[int]
        POLICY_LIMIT_AMOUNT_FIELD_NUMBER: _ClassVar[int]
        GRANTS_FIELD_NUMBER: _ClassVar[int]
        policy_id: str
        policy_git_sha: str
        scope_id: str
        ledger_key: str
        window_start: _timestamp_pb2.Timestamp
        window_end: _timestamp_pb2.Timestamp
        unit: str
        enforcement: str
        on_exhausted: str
        limit_amount: int
        projected_amount: int
        remaining_amount: int
        admitted_amount: int
        deficit_amount: int
        outcome: _common_pb2.Outcome
        next_eligible_time: _timestamp_pb2.Timestamp
        missing_labels: _containers.RepeatedScalarFieldContainer[str]
        reserved_amount: int
        consumed_amount: int
        policy_limit_amount: int
        grants: _containers.RepeatedCompositeFieldContainer[Decision.Grant]
        def __init__(self, policy_id: _Optional[str] = ..., policy_git_sha: _Optional[str] = ..., scope_id: _Optional[str] = ..., ledger_key: _Optional[str] = ..., window_start: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., window_end: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., unit: _Optional[str] = ..., enforcement: _Optional[str] = ..., on_exhausted: _Optional[str] = ..., limit_amount: _Optional[int] = ..., projected_amount: _Optional[int] = ..., remaining_amount: _Optional[int] = ..., admitted_amount: _Optional[int] = ..., deficit_amount: _Optional[int] = ..., outcome: _Optional[_Union[_common_pb2.Outcome, str]] = ..., next_eligible_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., missing_labels: _Optional[_Iterable[str]] = ..., reserved_amount: _Optional[int] = ..., consumed_amount: _Optional[int] = ..., policy_limit_amount: _Optional[int] = ..., grants: _Optional[_Iterable[_Union[Decision.Grant, _Mapping]]] = ...) -> None: ...
    class Grant(_message.Message):
        __slots__ = ("revision", "amount", "actor", "reason")
        REVISION_FIELD_NUMBER: _ClassVar[int]
        AMOUNT_FIELD_NUMBER: _ClassVar[int]
        ACTOR_FIELD_NUMBER: _ClassVar[int]
        REASON_FIELD_NUMBER: _ClassVar[int]
        revision: int
        amount: int
        actor: str
        reason: str
        def __init__(self, revision: _Optional[int] = ..., amount: _Optional[int] = ..., actor: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_BUNDLE_SHA_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_RUNTIME_HOURS_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_GPU_MILLI_HOURS_FIELD_NUMBER: _ClassVar[int]
    SHOWBACK_COST_MICROS_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    EVALUATIONS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIBLE_FIELD_NUMBER: _ClassVar[int]
    DECIDING_EVALUATION_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_REVISION_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTING_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    event_time: _timestamp_pb2.Timestamp
    decision_id: str
    run_id: str
    attempt: int
    outcome: _common_pb2.Outcome
    reason: str
    policy_bundle_sha: str
    namespace: str
    labels: _containers.ScalarMap[str, str]
    job: _common_pb2.Job
    resources: _common_pb2.Resources
    projected_runtime_hours: float
    projected_gpu_milli_hours: int
    showback_cost_micros: int
    currency: str
    evaluations: _containers.RepeatedCompositeFieldContainer[Decision.Evaluation]
    tenant: str
    priority_penalty: float
    preemptible: bool
    deciding_evaluation: int
    override_revision: int
    accounting: Decision.Accounting
    def __init__(self, event_id: _Optional[str] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., decision_id: _Optional[str] = ..., run_id: _Optional[str] = ..., attempt: _Optional[int] = ..., outcome: _Optional[_Union[_common_pb2.Outcome, str]] = ..., reason: _Optional[str] = ..., policy_bundle_sha: _Optional[str] = ..., namespace: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., job: _Optional[_Union[_common_pb2.Job, _Mapping]] = ..., resources: _Optional[_Union[_common_pb2.Resources, _Mapping]] = ..., projected_runtime_hours: _Optional[float] = ..., projected_gpu_milli_hours: _Optional[int] = ..., showback_cost_micros: _Optional[int] = ..., currency: _Optional[str] = ..., evaluations: _Optional[_Iterable[_Union[Decision.Evaluation, _Mapping]]] = ..., tenant: _Optional[str] = ..., priority_penalty: _Optional[float] = ..., preemptible: _Optional[bool] = ..., deciding_evaluation: _Optional[int] = ..., override_revision: _Optional[int] = ..., accounting: _Optional[_Union[Decision.Accounting, _Mapping]] = ...) -> None: ...
