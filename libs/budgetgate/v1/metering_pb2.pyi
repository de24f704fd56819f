import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MeteringSample(_message.Message):
    __slots__ = ("event_id", "event_time", "sample_id", "run_id", "observed_at", "gpu_seconds", "node_seconds", "exporter")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_AT_FIELD_NUMBER: _ClassVar[int]
    GPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPORTER_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    event_time: _timestamp_pb2.Timestamp
    sample_id: str
    run_id: str
    observed_at: _timestamp_pb2.Timestamp
    gpu_seconds: float
    node_seconds: float
    exporter: str
    def __init__(self, event_id: _Optional[str] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., sample_id: _Optional[str] = ..., run_id: _Optional[str] = ..., observed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., gpu_seconds: _Optional[float] = ..., node_seconds: _Optional[float] = ..., exporter: _Optional[str] = ...) -> None: ...
