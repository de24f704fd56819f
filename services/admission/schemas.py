"""The admission HTTP API's request and response bodies (published as OpenAPI)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from budgetgate.core.documents import LabelKey, LabelValue, Namespace

MAX_RUNTIME_HOURS = 8784.0  # a leap year: anything longer is a unit mistake, not a plan
RunId = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]
Name = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=r"^[\x21-\x7e]+$")]
Flavor = Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9._-]+$")]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResourcesIn(_Body):
    gpus: int = Field(ge=1, le=1_000_000, description="GPUs the workload asks for")
    nodes: int = Field(default=1, ge=1, le=100_000)
    flavor: Flavor | None = Field(default=None, description="resource flavor the rate card prices, e.g. h100")
    region: Flavor | None = None


class JobIn(_Body):
    namespace: Name
    name: Name


class PoolConstraintsIn(_Body):
    project: int | None = Field(default=None, ge=0, description="most tokens one project may hold in the pool")
    namespace: int | None = Field(default=None, ge=0, description="most tokens one sub-namespace may hold")


PoolNamespace = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}(:[a-z0-9][a-z0-9_.-]{0,62}){0,7}$")]
Token = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]
Project = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=r"^[\x21-\x7e]+$")]


class PoolTokenIn(_Body):
    """A token toward an external service, granted together with the GPU reservation or not at all."""

    namespace: PoolNamespace
    project: Project | None = None
    sub_namespace: Project | None = None
    constraints: PoolConstraintsIn | None = None
    lease_seconds: int | None = Field(default=None, ge=1, le=30 * 86400)


class AllocationIn(_Body):
    token: Token
    project: Project | None = None
    sub_namespace: Project | None = None
    constraints: PoolConstraintsIn | None = None
    lease_seconds: int | None = Field(default=None, ge=1, le=30 * 86400)


class AdmissionRequest(_Body):
    run_id: RunId = Field(description="stable id of the run, reused on every retry")
    attempt: int = Field(default=1, ge=1, le=100_000)
    namespace: Namespace
    labels: dict[LabelKey, Annotated[str, StringConstraints(max_length=63)]] = Field(default_factory=dict, max_length=64)
    resources: ResourcesIn
    projected_runtime_hours: float = Field(gt=0, le=MAX_RUNTIME_HOURS, allow_inf_nan=False)
    job: JobIn | None = None
    pool_token: PoolTokenIn | None = None

    @field_validator("labels")
    @classmethod
    def _label_values(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            if value == "*" or not _LABEL_VALUE.match(value):
                raise ValueError(f"label {key!r} has value {value!r}, which is not a Kubernetes label value")
        return labels


_LABEL_VALUE = re.compile(LabelValue.__metadata__[0].pattern)


class EvaluationOut(BaseModel):
    policy_id: str
    policy_git_sha: str
    scope_id: str
    window_start: datetime | None
    window_end: datetime | None
    unit: str
    enforcement: str
    on_exhausted: str
    decision: str
    limit: float
    projected: float
    remaining: float | None = Field(description="room left before this decision, in the policy's unit")
    admitted: float
    projected_gpu_hours: float
    remaining_gpu_hours: float | None
    admitted_gpu_hours: float
    deficit: float | None = None
    deficit_gpu_hours: float | None = None
    next_eligible_time: datetime | None = None
    missing_labels: list[str] = Field(default_factory=list)


class AdmissionResponse(BaseModel):
    run_id: str
    attempt: int
    decision_id: str
    decision: str = Field(description="ALLOW | DENY | DELAY")
    reason: str
    replayed: bool
    policy_bundle_sha: str | None
    projected_gpu_hours: float
    showback_cost: float | None
    currency: str | None
    decided_at: datetime
    evaluations: list[EvaluationOut]
    tenant: str | None = Field(default=None, description="value of the tenant label")
    priority_penalty: float = Field(default=0.0, description="0..1, from the most used soft budget; see README")
    preemptible: bool = Field(default=False, description="admitted above the tenant's fair-share target, on burst")
    fair_share: dict[str, float] | None = None


class BudgetUsage(BaseModel):
    policy_id: str
    policy_git_sha: str
    unit: str
    currency: str | None
    enforcement: str
    window_start: datetime
    window_end: datetime
    limit: float
    reserved: float
    consumed: float
    remaining: float
    utilization: float | None = Field(description="(reserved + consumed) / limit")


class ScopeUsage(BaseModel):
    scope_id: str
    budgets: list[BudgetUsage]


class Problem(BaseModel):
    detail: str
