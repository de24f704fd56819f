import datetime

from budgetgate.v1 import common_pb2 as _common_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Reconciliation(_message.Message):
    __slots__ = ("event_id", "event_time", "run_id", "decision_id", "final_state", "provisional", "projected_gpu_milli_hours", "actual_gpu_milli_hours", "error_gpu_milli_hours", "charges", "job", "policy_bundle_sha", "wall_milli_hours", "over_running", "released")
    class WindowCharge(_message.Message):
        __slots__ = ("ledger_key", "scope_id", "policy_id", "window_start", "window_end", "amount", "unit")
        LEDGER_KEY_FIELD_NUMBER: _ClassVar[int]
        SCOPE_ID_FIELD_NUMBER: _ClassVar[int]
        POLICY_ID_FIELD_NUMBER: _ClassVar[int]
        WINDOW_START_FIELD_NUMBER: _ClassVar[int]
        WINDOW_END_FIELD_NUMBER: _ClassVar[int]
        AMOUNT_FIELD_NUMBER: _ClassVar[int]
        UNIT_FIELD_NUMBER: _ClassVar[int]
        ledger_key: str
        scope_id: str
        policy_id: str
        window_start: _timestamp_pb2.Timestamp
        window_end: _timestamp_pb2.Timestamp
        amount: int
        unit: str
        def __init__(self, ledger_key: _Optional[str] = ..., scope_id: _Optional[str] = ..., policy_id: _Optional[str] = ..., window_start: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., window_end: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., amount: _Optional[int] = ..., unit: _Optional[str] = ...) -> None: ...
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    FINAL_STATE_FIELD_NUMBER: _ClassVar[int]
    PROVISIONAL_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_GPU_MILLI_HOURS_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_GPU_MILLI_HOURS_FIELD_NUMBER: _ClassVar[int]
    ERROR_GPU_MILLI_HOURS_FIELD_NUMBER: _ClassVar[int]
    CHARGES_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    POLICY_BUNDLE_SHA_FIELD_NUMBER: _ClassVar[int]
    WALL_MILLI_HOURS_FIELD_NUMBER: _ClassVar[int]
    OVER_RUNNING_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    event_time: _timestamp_pb2.Timestamp
    run_id: str
    decision_id: str
    final_state: str
    provisional: bool
    projected_gpu_milli_hours: int
    actual_gpu_milli_hours: int
    error_gpu_milli_hours: int
    charges: _containers.RepeatedCompositeFieldContainer[Reconciliation.WindowCharge]
    job: _common_pb2.Job
    policy_bundle_sha: str
    wall_milli_hours: int
    over_running: bool
    released: bool
    def __init__(self, event_id: _Optional[str] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., run_id: _Optional[str] = ..., decision_id: _Optional[str] = ..., final_state: _Optional[str] = ..., provisional: _Optional[bool] = ..., projected_gpu_milli_hours: _Optional[int] = ..., actual_gpu_milli_hours: _Optional[int] = ..., error_gpu_milli_hours: _Optional[int] = ..., charges: _Optional[_Iterable[_Union[Reconciliation.WindowCharge, _Mapping]]] = ..., job: _Optional[_Union[_common_pb2.Job, _Mapping]] = ..., policy_bundle_sha: _Optional[str] = ..., wall_milli_hours: _Optional[int] = ..., over_running: _Optional[bool] = ..., released: _Optional[bool] = ...) -> None: ...
