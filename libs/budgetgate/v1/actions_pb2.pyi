import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ActionType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTION_TYPE_UNSPECIFIED: _ClassVar[ActionType]
    HOLD: _ClassVar[ActionType]
    DRAIN: _ClassVar[ActionType]
    RELEASE_HOLD: _ClassVar[ActionType]
    THRESHOLD_ALERT: _ClassVar[ActionType]
    HEADROOM: _ClassVar[ActionType]
ACTION_TYPE_UNSPECIFIED: ActionType
HOLD: ActionType
DRAIN: ActionType
RELEASE_HOLD: ActionType
THRESHOLD_ALERT: ActionType
HEADROOM: ActionType

class BudgetAction(_message.Message):
    __slots__ = ("event_id", "event_time", "type", "scope_id", "ledger_key", "policy_id", "run_id", "threshold_percent", "message", "attempt", "measure")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SCOPE_ID_FIELD_NUMBER: _ClassVar[int]
    LEDGER_KEY_FIELD_NUMBER: _ClassVar[int]
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    MEASURE_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    event_time: _timestamp_pb2.Timestamp
    type: ActionType
    scope_id: str
    ledger_key: str
    policy_id: str
    run_id: str
    threshold_percent: int
    message: str
    attempt: int
    measure: str
    def __init__(self, event_id: _Optional[str] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., type: _Optional[_Union[ActionType, str]] = ..., scope_id: _Optional[str] = ..., ledger_key: _Optional[str] = ..., policy_id: _Optional[str] = ..., run_id: _Optional[str] = ..., threshold_percent: _Optional[int] = ..., message: _Optional[str] = ..., attempt: _Optional[int] = ..., measure: _Optional[str] = ...) -> None: ...
