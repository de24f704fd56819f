from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    ALLOW: _ClassVar[Outcome]
    DENY: _ClassVar[Outcome]
    DELAY: _ClassVar[Outcome]
OUTCOME_UNSPECIFIED: Outcome
ALLOW: Outcome
DENY: Outcome
DELAY: Outcome

class Job(_message.Message):
    __slots__ = ("namespace", "name")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Resources(_message.Message):
    __slots__ = ("gpus", "nodes", "flavor", "region")
    GPUS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    FLAVOR_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    gpus: int
    nodes: int
    flavor: str
    region: str
    def __init__(self, gpus: _Optional[int] = ..., nodes: _Optional[int] = ..., flavor: _Optional[str] = ..., region: _Optional[str] = ...) -> None: ...
