"""How an endpoint of a budgetgate HTTP API is published: part of the API contract (the
operationIds generated clients are built from), declared beside the API's models."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel


@dataclass(frozen=True)
class Operation:
    """How one endpoint is published: its operationId, the model of its 200 answer when the
    route answers plain JSON, and descriptions of its parameters."""

    operation_id: str
    answer: type[BaseModel] | None = None
    parameters: Mapping[str, str] = field(default_factory=dict)
