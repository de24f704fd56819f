import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LifecycleType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LIFECYCLE_TYPE_UNSPECIFIED: _ClassVar[LifecycleType]
    STARTED: _ClassVar[LifecycleType]
    COMPLETED: _ClassVar[LifecycleType]
    FAILED: _ClassVar[LifecycleType]
    CANCELLED: _ClassVar[LifecycleType]
    EVICTED: _ClassVar[LifecycleType]
    READMITTED: _ClassVar[LifecycleType]
    STORED: _ClassVar[LifecycleType]
LIFECYCLE_TYPE_UNSPECIFIED: LifecycleType
STARTED: LifecycleType
COMPLETED: LifecycleType
FAILED: LifecycleType
CANCELLED: LifecycleType
EVICTED: LifecycleType
READMITTED: LifecycleType
STORED: LifecycleType

class LifecycleEvent(_message.Message):
    __slots__ = ("event_id", "event_time", "run_id", "type", "gpus", "nodes", "flavor", "region", "reason")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    FLAVOR_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    event_time: _timestamp_pb2.Timestamp
    run_id: str
    type: LifecycleType
    gpus: int
    nodes: int
    flavor: str
    region: str
    reason: str
    def __init__(self, event_id: _Optional[str] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., run_id: _Optional[str] = ..., type: _Optional[_Union[LifecycleType, str]] = ..., gpus: _Optional[int] = ..., nodes: _Optional[int] = ..., flavor: _Optional[str] = ..., region: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
