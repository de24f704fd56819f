import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UsageRecord(_message.Message):
    __slots__ = ("event_id", "event_time", "run_id", "sample_id", "observed_at", "gpu_milli_hours_cumulative", "node_milli_hours_cumulative", "gpu_milli_hours_delta", "node_milli_hours_delta", "gpu_milli_hours_observed", "node_milli_hours_observed")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_AT_FIELD_NUMBER: _ClassVar[int]
    GPU_MILLI_HOURS_CUMULATIVE_FIELD_NUMBER: _ClassVar[int]
    NODE_MILLI_HOURS_CUMULATIVE_FIELD_NUMBER: _ClassVar[int]
    GPU_MILLI_HOURS_DELTA_FIELD_NUMBER: _ClassVar[int]
    NODE_MILLI_HOURS_DELTA_FIELD_NUMBER: _ClassVar[int]
    GPU_MILLI_HOURS_OBSERVED_FIELD_NUMBER: _ClassVar[int]
    NODE_MILLI_HOURS_OBSERVED_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    event_time: _timestamp_pb2.Timestamp
    run_id: str
    sample_id: str
    observed_at: _timestamp_pb2.Timestamp
    gpu_milli_hours_cumulative: int
    node_milli_hours_cumulative: int
    gpu_milli_hours_delta: int
    node_milli_hours_delta: int
    gpu_milli_hours_observed: int
    node_milli_hours_observed: int
    def __init__(self, event_id: _Optional[str] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., run_id: _Optional[str] = ..., sample_id: _Optional[str] = ..., observed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., gpu_milli_hours_cumulative: _Optional[int] = ..., node_milli_hours_cumulative: _Optional[int] = ..., gpu_milli_hours_delta: _Optional[int] = ..., node_milli_hours_delta: _Optional[int] = ..., gpu_milli_hours_observed: _Optional[int] = ..., node_milli_hours_observed: _Optional[int] = ...) -> None: ...
