"""The admission HTTP API's request and response bodies (published as OpenAPI).

Numbers in requests are strict: `"gpus": true` or `"gpus": "8"` is a 422, never 1 or 8.
Every model and field carries a description and every model an example, so the published
contract documents itself; `OPERATIONS` names each endpoint for generated clients.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StringConstraints, field_validator

from budgetgate.core.documents import LabelKey, LabelValue, Namespace
from budgetgate.contracts.operations import Operation

MAX_RUNTIME_HOURS = 8784.0  # a leap year: anything longer is a unit mistake, not a plan
RunId = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]
Name = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=r"^[\x21-\x7e]+$")]
Flavor = Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9._-]+$")]
Outcome = Literal["ALLOW", "DENY", "DELAY"]
UnitName = Literal["gpu_hours", "node_hours", "wall_hours", "cost"]
EnforcementName = Literal["hard", "soft", "dry-run"]
OnExhaustedName = Literal["deny", "delay", "hold", "hold-and-drain"]
PoolStatusName = Literal["Granted", "Exhausted", "NamespaceQuotaExceeded"]
# Free text a caller sends and Postgres stores: no control characters but tab and newline (a NUL
# cannot be stored at all, and the others are a bug upstream).
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _no_control(text: str) -> str:
    if found := _CONTROL.search(text):
        character, at = ord(found.group()), found.start()
        raise ValueError(f"holds the control character U+{character:04X} at position {at}; only tab, newline and carriage return may appear in text")
    return text


Text = Annotated[str, AfterValidator(_no_control)]

_EXAMPLE_WINDOW = {"window_start": "2026-07-01T00:00:00Z", "window_end": "2026-08-01T00:00:00Z"}


def _example(example: dict) -> ConfigDict:
    return ConfigDict(json_schema_extra={"examples": [example]})


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResourcesIn(_Body):
    """What the workload asks for."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"gpus": 8, "nodes": 1, "flavor": "h100", "region": "us-east-1"}]})

    gpus: StrictInt = Field(
        ge=0, le=1_000_000, description="GPUs the workload asks for; 0 for CPU-only work (charged on node-hour, wall-hour and cost budgets)"
    )
    nodes: StrictInt = Field(default=1, ge=1, le=100_000, description="nodes the workload asks for (at least 1)")
    flavor: Flavor | None = Field(default=None, description="resource flavor the rate card prices, e.g. h100")
    region: Flavor | None = Field(default=None, description="region, for rate cards with regional prices")


class JobIn(_Body):
    """The job the run belongs to, as OpenLineage names it."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"namespace": "vision-prod", "name": "train-resnet"}]})

    namespace: Name = Field(description="OpenLineage job namespace")
    name: Name = Field(description="OpenLineage job name")


class PoolConstraintsIn(_Body):
    """Caps tighter than the pool's own; the tighter of the two applies."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"project": 10, "namespace": 50}]})

    project: StrictInt | None = Field(default=None, ge=0, description="most tokens one project may hold in the pool")
    namespace: StrictInt | None = Field(default=None, ge=0, description="most tokens one sub-namespace may hold")


PoolNamespace = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}(:[a-z0-9][a-z0-9_.-]{0,62}){0,7}$")]
Token = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]
# A submission's pool token is this prefix and its run id; the allocation API refuses the prefix.
RUN_TOKEN_PREFIX = "run:"
Project = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=r"^[\x21-\x7e]+$")]


class PoolTokenIn(_Body):
    """A token toward an external service, granted together with the GPU reservation or not at all."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"namespace": "snowflake:wh-1", "project": "vision"}]})

    namespace: PoolNamespace = Field(description="the declared pool, e.g. snowflake:wh-1 (counts against its ancestors too)")
    project: Project | None = Field(default=None, description="project the token is held for")
    sub_namespace: Project | None = Field(default=None, description="sub-namespace the token is held for")
    constraints: PoolConstraintsIn | None = Field(default=None, description="caps tighter than the pool's")
    lease_seconds: StrictInt | None = Field(default=None, ge=1, le=30 * 86400, description="lease length; the pool's default when absent")


class AllocationIn(_Body):
    """A request for one token of a pool; asking again with the same token renews its lease."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"token": "job-42", "project": "vision", "lease_seconds": 600}]})

    token: Token = Field(
        description=f"the caller's id of the allocation; the idempotency key ({RUN_TOKEN_PREFIX!r} starts the tokens submissions take: refused here)"
    )
    project: Project | None = Field(default=None, description="project the token is held for; a renewal keeps it (another one is a 409)")
    sub_namespace: Project | None = Field(default=None, description="sub-namespace the token is held for; a renewal keeps it (another one is a 409)")
    constraints: PoolConstraintsIn | None = Field(default=None, description="caps tighter than the pool's")
    lease_seconds: StrictInt | None = Field(default=None, ge=1, le=30 * 86400, description="lease length; the pool's default when absent")

    @field_validator("token")
    @classmethod
    def _not_a_run_token(cls, token: str) -> str:
        # A submission's token is RUN_TOKEN_PREFIX + its run id: one taken here would be found
        # held (or leave a row) when that run is submitted with a pool_token.
        if token.startswith(RUN_TOKEN_PREFIX):
            raise ValueError(f"tokens starting with {RUN_TOKEN_PREFIX!r} are reserved for the tokens submissions take (a pool_token); choose another id")
        return token


_SUBMISSION_EXAMPLE = {
    "run_id": "flyte/vision/exec-7f3a/n0",
    "attempt": 1,
    "namespace": "vision-prod",
    "labels": {"cost-center": "1042", "team": "vision", "environment": "prod"},
    "resources": {"gpus": 8, "nodes": 1, "flavor": "h100", "region": "us-east-1"},
    "projected_runtime_hours": 6.0,
    "job": {"namespace": "vision-prod", "name": "train-resnet"},
}


class AdmissionRequest(_Body):
    """May this workload start? One submission, sent again unchanged on every retry."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [_SUBMISSION_EXAMPLE]})

    run_id: RunId = Field(description="stable id of the run, reused on every retry")
    attempt: StrictInt = Field(default=1, ge=1, le=100_000, description="resubmission number; a higher attempt after DELAY is evaluated afresh")
    namespace: Namespace = Field(description="Kubernetes namespace the workload runs in")
    labels: dict[LabelKey, Annotated[str, StringConstraints(max_length=63)]] = Field(
        default_factory=dict, max_length=64, description="Kubernetes labels; budgets and quotas match on them"
    )
    resources: ResourcesIn = Field(description="what the workload asks for")
    projected_runtime_hours: StrictFloat = Field(gt=0, le=MAX_RUNTIME_HOURS, allow_inf_nan=False, description="how long the run is expected to take, in hours")
    job: JobIn | None = Field(default=None, description="the OpenLineage job of the run; else the namespace and run id")
    pool_token: PoolTokenIn | None = Field(default=None, description="a token to take together with the reservation")

    @field_validator("labels")
    @classmethod
    def _label_values(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            if value == "*" or not _LABEL_VALUE.match(value):
                raise ValueError(f"label {key!r} has value {value!r}, which is not a Kubernetes label value")
        return labels


_LABEL_VALUE = re.compile(LabelValue.__metadata__[0].pattern)

_EVALUATION_EXAMPLE = {
    "policy_id": "gpu-budget/team-vision-prod",
    "policy_git_sha": "e" * 40,
    "scope_id": "ns=vision-prod;cost-center=1042;team=vision",
    **_EXAMPLE_WINDOW,
    "unit": "gpu_hours",
    "enforcement": "hard",
    "on_exhausted": "deny",
    "decision": "ALLOW",
    "limit": 500.0,
    "projected": 48.0,
    "remaining": 500.0,
    "admitted": 48.0,
    "projected_gpu_hours": 48.0,
    "remaining_gpu_hours": 500.0,
    "admitted_gpu_hours": 48.0,
    "deficit": None,
    "deficit_gpu_hours": None,
    "next_eligible_time": None,
    "missing_labels": [],
}


class EvaluationOut(BaseModel):
    """How one budget policy judged the submission."""

    model_config = _example(_EVALUATION_EXAMPLE)

    policy_id: str = Field(description="the policy's id in the policy repository")
    policy_git_sha: str = Field(description="Git SHA of the policy bundle the policy came from")
    scope_id: str = Field(description="canonical scope: namespaces, then labels sorted by key")
    window_start: datetime | None = Field(description="start of the budget window (null for a label violation)")
    window_end: datetime | None = Field(description="end of the budget window; for a rolling window, the decision instant")
    unit: UnitName = Field(description="the unit of limit, projected, remaining, admitted and deficit")
    enforcement: EnforcementName = Field(description="hard blocks; soft and dry-run are charged and recorded, never block")
    on_exhausted: OnExhaustedName = Field(description="what an exhausted hard budget answers: deny, or DELAY for the others")
    decision: Outcome = Field(description="this budget's own answer")
    limit: float = Field(description="the budget's limit, in its unit")
    projected: float = Field(description="what this run would use of it, in its unit (rounded up to the ledger unit)")
    remaining: float | None = Field(description="room left before this decision, in the policy's unit")
    admitted: float = Field(description="what was reserved on it by this decision, in its unit")
    projected_gpu_hours: float = Field(description="the run's projected GPU-hours")
    remaining_gpu_hours: float | None = Field(description="room left in GPU-hours; null for budgets in other units")
    admitted_gpu_hours: float = Field(description="GPU-hours reserved by this decision")
    deficit: float | None = Field(default=None, description="DENY/DELAY: how much room was missing, in the budget's unit")
    deficit_gpu_hours: float | None = Field(default=None, description="DENY/DELAY: the deficit in GPU-hours, for GPU-hour budgets")
    next_eligible_time: datetime | None = Field(
        default=None, description="DENY/DELAY: the earliest instant this budget will have room for the run under its own rules; null when no instant will do"
    )
    missing_labels: list[str] = Field(default_factory=list, description="labels the policy requires that the submission lacks")


_ANSWER_EXAMPLE = {
    "run_id": "flyte/vision/exec-7f3a/n0",
    "attempt": 1,
    "decision_id": "0b5e3a4c-6c1f-4a53-9f0e-2f7d1c9a8b11",
    "decision": "ALLOW",
    "reason": "admitted: reserved on 1 budget; tightest is 'gpu-budget/team-vision-prod' with 452 GPU-hours of 500 GPU-hours left after this run",
    "replayed": False,
    "policy_bundle_sha": "e" * 40,
    "override_revision": 0,
    "projected_gpu_hours": 48.0,
    "showback_cost": 188.78,
    "currency": "USD",
    "decided_at": "2026-07-14T09:30:00.123456Z",
    "evaluations": [_EVALUATION_EXAMPLE],
    "tenant": "vision",
    "priority_penalty": 0.0,
    "preemptible": False,
    "fair_share": None,
    "accounting": None,
}


class AccountingOut(BaseModel):
    """Which figure the tenant's soft GPU-hour budget was judged on: the external accounting
    system's remaining budget, or (when it did not answer in time, or answered nonsense) the ledger's."""

    model_config = _example(
        {"policy_id": "gpu-soft/physics", "source": "external", "remaining_gpu_hours": 1200.0, "detail": "remaining_budget from the accounting system"}
    )

    policy_id: str = Field(description="the tenant's soft GPU-hour budget")
    source: Literal["external", "ledger"] = Field(description="external: the accounting system's figure was used; ledger: the internal ledger's")
    remaining_gpu_hours: float | None = Field(description="the accounting system's remaining budget, when used")
    detail: str = Field(description="where the figure came from, or why the accounting system's was not used")


class AdmissionResponse(BaseModel):
    """The decision on a submission, with the numbers behind it; a replay repeats it exactly."""

    model_config = _example(_ANSWER_EXAMPLE)

    run_id: str = Field(description="the submission's run id")
    attempt: int = Field(description="the attempt this decision answers")
    decision_id: str = Field(description="id of the stored decision (UUID)")
    decision: Outcome = Field(description="ALLOW: start now; DENY: do not; DELAY: resubmit at or after next_eligible_time")
    reason: str = Field(description="why, in words a person can act on")
    replayed: bool = Field(description="true when this is the stored answer to an earlier identical submission")
    policy_bundle_sha: str | None = Field(description="Git SHA of the policy bundle that decided")
    override_revision: int | None = Field(
        default=None, description="revision of the tenant overrides (PUT /v1/tenants/{tenant}) applied on top of that bundle; 0 when none was ever made"
    )
    projected_gpu_hours: float = Field(description="gpus × projected runtime hours")
    showback_cost: float | None = Field(description="projected GPU-hours × the flavor's rate, rounded to cents; null when unpriced")
    currency: str | None = Field(description="currency of showback_cost")
    decided_at: datetime = Field(description="when the decision was made (UTC)")
    evaluations: list[EvaluationOut] = Field(description="one entry per matching policy, in the bundle's order")
    tenant: str | None = Field(default=None, description="value of the tenant label")
    priority_penalty: float = Field(default=0.0, description="0..1, from the most used soft budget; see README")
    preemptible: bool = Field(default=False, description="admitted above the tenant's fair-share target, on burst")
    fair_share: dict[str, float] | None = Field(
        default=None,
        description="share and share_after (raw: what the tenant holds), decayed_share and half_life_hours (its past GPU usage, decayed), "
        "target, burst_limit and deficit (target − decayed share) of the tenant's fair share",
    )
    accounting: AccountingOut | None = Field(
        default=None, description="with an external accounting source configured: which figure the tenant's soft GPU-hour budget was judged on"
    )
    warnings: list[str] = Field(
        default_factory=list,
        description="what the decision did not block on but you should know, e.g. a flavor no rate card prices (so no showback cost)",
    )


class LimitingFigure(BaseModel):
    """One limit that refused a waiting run, as it stands now."""

    kind: Literal["budget", "quota", "sensitive_pool"] = Field(description="a hard budget, a tenant quota or the sensitive pool")
    name: str = Field(description="the budget's policy id, or the quota's limit (max_gpus, max_nodes, max_concurrent_allocations, sensitive_pool_size)")
    scope_id: str | None = Field(default=None, description="the budget's scope")
    tenant: str | None = Field(default=None, description="the tenant of a quota")
    unit: str = Field(description="a budget's unit (gpu_hours, …); gpus, nodes or allocations for a quota")
    limit: int | float = Field(description="the limit now (a budget in hours or its currency)")
    used: int | float = Field(description="what is used now: a budget's reserved + consumed in its current window, what the tenant (or sensitive work) holds")
    reserved: float | None = Field(default=None, description="a budget's reservations held now")
    consumed: float | None = Field(default=None, description="a budget's metered consumption in its current window")
    requested: int | float = Field(description="what the run asks of it")
    remaining: int | float = Field(description="limit − used")
    fits: bool = Field(description="whether the run fits under this limit now")


class Waiting(BaseModel):
    """A run refused for now, and how what refused it stands now."""

    state: Literal["waiting for budget", "waiting for quota headroom"] = Field(description="a DELAY waits for budget; a quota rejection for quota headroom")
    since: datetime = Field(description="when the waiting decision was made")
    as_of: datetime = Field(description="when the figures below were read")
    headroom: bool = Field(description="true when the run fits under every limit that refused it: resubmit it with a higher attempt")
    limiting: list[LimitingFigure] = Field(description="each limit that refused it, with its figures now")
    summary: str = Field(description="the same, in words")


class AdmissionStatus(AdmissionResponse):
    """A run's latest decision, as answered, and whether the run is waiting for room."""

    model_config = _example({**_ANSWER_EXAMPLE, "replayed": True, "waiting": None})

    waiting: Waiting | None = Field(default=None, description="for a DELAY or a quota rejection: what it waits for and how it stands now; else null")


_GRANT_EXAMPLE = {
    "revision": 41, "policy_id": "gpu-budget/team-vision-prod", "scope_id": "ns=vision-prod;cost-center=1042;team=vision", "unit": "gpu_hours",
    "ledger_key": "ns=vision-prod;cost-center=1042;team=vision|2026-07-01T00:00:00Z/2026-08-01T00:00:00Z|gpu_hours",
    "window_start": "2026-07-01T00:00:00Z", "window_end": "2026-08-01T00:00:00Z", "amount": 100.0, "limit_before": 400.0, "limit_after": 500.0,
    "actor": "token:finance", "reason": "allocation committee 2026-17", "granted_at": "2026-07-14T09:30:00Z",
}  # fmt: skip


class GrantOut(BaseModel):
    """One grant to a budget's window as recorded (core/grants.py): an amount added to its limit,
    or taken from it, with who and why."""

    model_config = _example(_GRANT_EXAMPLE)

    revision: int = Field(description="its revision (grants and tenant overrides share one sequence; decisions record it)")
    policy_id: str = Field(description="the budget")
    scope_id: str = Field(description="the budget's scope id")
    unit: str = Field(description="the budget's unit: gpu_hours, node_hours, wall_hours or cost")
    ledger_key: str = Field(description="the ledger key of the window it is for")
    window_start: datetime = Field(description="the window's start")
    window_end: datetime = Field(description="the window's end")
    amount: float = Field(description="what was granted, in the budget's unit (negative: taken away)")
    limit_before: float = Field(description="the window's limit before it (the policy's plus earlier grants)")
    limit_after: float = Field(description="the window's limit after it")
    actor: str = Field(description="who made it")
    reason: str = Field(description="why")
    granted_at: datetime = Field(description="when")


class BudgetUsage(BaseModel):
    """One budget of a scope in its current window."""

    model_config = _example({
        "policy_id": "gpu-budget/team-vision-prod", "policy_git_sha": "e" * 40, "unit": "gpu_hours", "currency": None, "enforcement": "hard",
        **_EXAMPLE_WINDOW, "limit": 500.0, "policy_limit": 400.0, "granted": 100.0, "grants": [_GRANT_EXAMPLE],
        "reserved": 48.0, "consumed": 120.5, "remaining": 331.5, "utilization": 0.337,
    })  # fmt: skip

    policy_id: str = Field(description="the policy's id")
    policy_git_sha: str = Field(description="Git SHA of the active policy bundle")
    unit: UnitName = Field(description="unit of limit, reserved, consumed and remaining")
    currency: str | None = Field(description="currency of a cost budget")
    enforcement: EnforcementName = Field(description="hard, soft or dry-run")
    window_start: datetime = Field(description="start of the current window")
    window_end: datetime = Field(description="end of the current window")
    limit: float = Field(description="the budget's limit in this window: the policy's plus the window's grants")
    policy_limit: float = Field(description="the policy's limit (with a tenant override, if any)")
    granted: float = Field(description="the sum of the window's grants (negative: taken away)")
    grants: list[GrantOut] = Field(description="the window's grants, oldest first")
    reserved: float = Field(description="held by admitted runs not yet reconciled")
    consumed: float = Field(description="metered actuals")
    remaining: float = Field(description="limit − reserved − consumed")
    utilization: float | None = Field(description="(reserved + consumed) / limit")


class ScopeUsage(BaseModel):
    """Every budget of a scope in its current window."""

    model_config = _example(
        {"scope_id": "ns=vision-prod;cost-center=1042;team=vision", "budgets": [BudgetUsage.model_config["json_schema_extra"]["examples"][0]]}
    )  # type: ignore[index]

    scope_id: str = Field(description="the canonical scope id")
    budgets: list[BudgetUsage] = Field(description="its budgets")


class PoolLevel(BaseModel):
    """One declared pool an allocation counts against."""

    namespace: str = Field(description="the pool's namespace")
    quota: int = Field(description="tokens the pool holds")
    used: int = Field(description="tokens held, this one included when granted")
    project_cap: int | None = Field(description="most tokens one project may hold")
    namespace_cap: int | None = Field(description="most tokens one sub-namespace may hold")


class AllocationOut(BaseModel):
    """The answer to a token request."""

    model_config = _example({
        "status": "Granted", "namespace": "snowflake:wh-1", "token": "job-42", "renewed": False, "lease_expires_at": "2026-07-14T09:40:00Z",
        "levels": [{"namespace": "snowflake:wh-1", "quota": 50, "used": 7, "project_cap": 10, "namespace_cap": 50}],
    })  # fmt: skip

    status: PoolStatusName = Field(description="Granted; Exhausted (the pool or an ancestor is full); NamespaceQuotaExceeded (a project or sub-namespace cap)")
    namespace: str = Field(description="the pool asked")
    token: str = Field(description="the token asked")
    renewed: bool = Field(description="the token was held already and its lease was renewed")
    lease_expires_at: datetime | None = Field(description="when the lease runs out unless renewed; null when not granted")
    levels: list[PoolLevel] = Field(description="the pool and its declared ancestors, most specific first")


class ReleaseOut(BaseModel):
    """The answer to giving a token back."""

    model_config = _example({"namespace": "snowflake:wh-1", "token": "job-42", "released": True})

    namespace: str = Field(description="the pool")
    token: str = Field(description="the token")
    released: bool = Field(description="false when the token was not held (releasing is idempotent)")


class PoolHolder(BaseModel):
    """A token held in a pool."""

    token: str = Field(description="the token")
    project: str | None = Field(description="project it is held for")
    sub_namespace: str | None = Field(description="sub-namespace it is held for")
    lease_expires_at: datetime = Field(description="when its lease runs out")


class PoolStatus(BaseModel):
    """A declared pool: quota, use and holders (leases that ran out are not counted)."""

    model_config = _example({
        "namespace": "snowflake:wh-1", "quota": 50, "used": 1, "project_cap": 10, "namespace_cap": 50,
        "holders": [{"token": "job-42", "project": "vision", "sub_namespace": None, "lease_expires_at": "2026-07-14T09:40:00Z"}],
    })  # fmt: skip

    namespace: str = Field(description="the pool's namespace")
    quota: int = Field(description="tokens the pool holds")
    used: int = Field(description="tokens held now")
    project_cap: int | None = Field(description="most tokens one project may hold")
    namespace_cap: int | None = Field(description="most tokens one sub-namespace may hold")
    holders: list[PoolHolder] = Field(description="who holds them")


class TenantRuns(BaseModel):
    """The runs of a tenant (or a user) over the period."""

    runs: int = Field(description="runs decided")
    admitted: int = Field(description="runs admitted")
    reserved_gpu_hours: float = Field(description="GPU-hours held by reservations not yet reconciled")
    consumed_gpu_hours: float = Field(description="GPU-hours metered")
    consumed_node_hours: float = Field(description="node-hours metered")


class TenantBudget(BudgetUsage):
    """One budget of the tenant (or the user) in its current window, with its scope."""

    scope_id: str = Field(description="the budget's scope")


class TenantUsage(BaseModel):
    """A tenant's budgets in their current windows and its runs' usage over the last days."""

    model_config = _example({
        "tenant": "vision", "label": "team", "days": 90, "since": "2026-04-15T09:30:00Z", "policy_bundle_sha": "e" * 40, "budgets": [],
        "runs": {"runs": 12, "admitted": 10, "reserved_gpu_hours": 48.0, "consumed_gpu_hours": 310.25, "consumed_node_hours": 40.0},
    })  # fmt: skip

    tenant: str = Field(description="the tenant (a value of the tenant label)")
    label: str = Field(description="the tenant label")
    days: int = Field(description="the period, in days")
    since: datetime = Field(description="start of the period")
    policy_bundle_sha: str | None = Field(description="the active policy bundle")
    budgets: list[TenantBudget] = Field(description="budgets whose scope requires this tenant")
    runs: TenantRuns = Field(description="its runs over the period")


class UserUsage(BaseModel):
    """A user's budgets in their current windows and its runs' usage over the last days, read
    by the rules of a tenant's."""

    model_config = _example({
        "user": "alice", "label": "user", "days": 90, "since": "2026-04-15T09:30:00Z", "policy_bundle_sha": "e" * 40, "budgets": [],
        "runs": {"runs": 3, "admitted": 3, "reserved_gpu_hours": 8.0, "consumed_gpu_hours": 42.5, "consumed_node_hours": 6.0},
    })  # fmt: skip

    user: str = Field(description="the user (a value of the user label)")
    label: str = Field(description="the user label")
    days: int = Field(description="the period, in days")
    since: datetime = Field(description="start of the period")
    policy_bundle_sha: str | None = Field(description="the active policy bundle")
    budgets: list[TenantBudget] = Field(description="budgets whose scope requires this user")
    runs: TenantRuns = Field(description="the user's runs over the period")


class BudgetLine(BaseModel):
    """One budget of the active bundle in its current window, in human units."""

    policy_id: str = Field(description="the policy's id")
    scope_id: str = Field(description="the budget's canonical scope id")
    window_key: str = Field(description="the current window, e.g. 2026-07 or rolling-30d")
    window_start: datetime = Field(description="start of the current window")
    window_end: datetime = Field(description="end of the current window")
    unit: str = Field(description="gpu_hours, node_hours, wall_hours or cost")
    currency: str | None = Field(description="the currency of a cost budget")
    enforcement: str = Field(description="hard, soft or dry-run")
    limit: float = Field(description="the limit in this window, in hours or the currency: the policy's plus the window's grants")
    policy_limit: float = Field(description="the policy's limit (with a tenant override, if any)")
    granted: float = Field(description="the sum of the window's grants (negative: taken away)")
    grants: list[GrantOut] = Field(description="the window's grants, oldest first")
    reserved: float = Field(description="held by admitted runs not yet reconciled")
    consumed: float = Field(description="metered actuals")
    remaining: float = Field(description="limit - reserved - consumed")
    committed: float = Field(description="reserved + consumed: what the budget has promised in this window")
    committed_percent: float = Field(description="committed / limit, in percent")
    committed_ratio: float = Field(description="committed / limit (the gauge budgetgate_budget_committed_ratio)")
    consumed_percent: float = Field(description="consumed / limit, in percent")
    consumed_ratio: float = Field(description="consumed / limit (the gauge budgetgate_budget_consumed_ratio)")
    alerts: list[str] = Field(
        description="the thresholds each measure has reached in this window, e.g. ['committed 80%', 'committed 100%', 'consumed 80%']: "
        "the THRESHOLD_ALERT actions the reconciler sends, once each"
    )
    used_percent: float = Field(description="committed_percent under its first name", deprecated=True)
    used_ratio: float = Field(description="committed_ratio under its first name", deprecated=True)
    state: Literal["ok", "alerting", "full", "exhausted", "held"] = Field(
        description="held while a hold is in force; exhausted when consumed reaches the limit; full when committed does (new work does not fit); "
        "alerting from 80 % committed; else ok"
    )


class BudgetList(BaseModel):
    """Every budget of the active policy bundle in its current window."""

    model_config = _example({
        "policy_bundle_sha": "e" * 40,
        "budgets": [{
            "policy_id": "gpu-budget/team-vision-prod", "scope_id": "ns=vision-prod;cost-center=1042;team=vision", "window_key": "2026-07",
            "window_start": "2026-07-01T00:00:00Z", "window_end": "2026-08-01T00:00:00Z", "unit": "gpu_hours", "currency": None,
            "enforcement": "hard", "limit": 500.0, "policy_limit": 500.0, "granted": 0.0, "grants": [],
            "reserved": 48.0, "consumed": 310.25, "remaining": 141.75, "committed": 358.25,
            "committed_percent": 71.7, "committed_ratio": 0.7165, "consumed_percent": 62.1, "consumed_ratio": 0.6205, "alerts": [],
            "used_percent": 71.7, "used_ratio": 0.7165, "state": "ok",
        }],
    })  # fmt: skip

    policy_bundle_sha: str = Field(description="the active policy bundle's Git SHA")
    budgets: list[BudgetLine] = Field(description="one line per budget")


class Problem(BaseModel):
    """An error (RFC 9457 problem details)."""

    detail: str = Field(description="what went wrong")


# Each endpoint's name for generated clients, and what it answers when FastAPI cannot tell.
# A bundle is a few hundred documents at most; this bounds the JSON parsed (BodyLimit bounds the bytes).
MAX_DOCUMENTS = 5000


class PolicyDocument(BaseModel):
    """One YAML document of the bundle, where it was read."""

    file: Text = Field(max_length=1024, description="the file in the policy repository (no control characters)")
    line: int = Field(ge=0, description="the line the document starts at")
    data: dict[str, Any] = Field(description="the YAML document, as JSON")


class BundleIn(BaseModel):
    """A policy bundle as `budgetgate policy apply --server` sends it."""

    model_config = {
        "json_schema_extra": {
            "examples": [{"git_sha": "4f1c0de" + "0" * 33, "source": "git@example.com:platform/budgets.git", "documents": [], "allow_empty": False}]
        }
    }

    git_sha: Name = Field(min_length=7, max_length=200, description="the Git SHA the documents were read at (printable ASCII, no spaces)")
    source: Text = Field(max_length=1024, description="where the documents come from (a repository, a folder; no control characters)")
    documents: list[PolicyDocument] = Field(max_length=MAX_DOCUMENTS, description="every budgetgate document of the bundle")
    allow_empty: bool = Field(default=False, description="apply even a bundle without documents, or one that removes every budget")


class BundleApplied(BaseModel):
    """The bundle applied, and the plan against the bundle it replaced."""

    model_config = {
        "json_schema_extra": {
            "examples": [
                {
                    "git_sha": "4f1c0de" + "0" * 33,
                    "activation": 7,
                    "applied_by": "token:ci-deployer",
                    "previous_sha": None,
                    "changes": ["+ budget gpu-budget/team-vision-prod: 500 gpu_hours hard"],
                    "budgets": 1,
                }
            ]
        }
    }

    git_sha: str = Field(description="the SHA the bundle was applied at")
    activation: int = Field(description="the activation sequence number")
    applied_by: str = Field(description="the principal that applied it")
    previous_sha: str | None = Field(description="the bundle active before, if any")
    changes: list[str] = Field(description="the plan, one change per line (+ added, - removed, ~ changed)")
    budgets: int = Field(description="how many budgets the bundle has")


class ChargebackFigures(BaseModel):
    """Metered use and its cost, and apart from them what is reserved but not yet metered: the
    ledger's integers (exact) and the same as a person reads them."""

    gpu_hours: float = Field(description="GPU-hours metered in the period")
    node_hours: float = Field(description="node-hours metered in the period")
    cost: float = Field(description="cost of the metered GPU-hours in the report's currency, to the cent")
    unpriced_gpu_hours: float = Field(description="metered GPU-hours no rate card priced (not in cost)")
    reserved_gpu_hours: float = Field(description="GPU-hours reserved by runs decided in the period and not yet metered (not in gpu_hours)")
    reserved_cost: float = Field(description="what the reserved GPU-hours would cost (not in cost)")
    gpu_milli_hours: int = Field(description="gpu_hours in the ledger's unit (a thousandth of a GPU-second)")
    node_milli_hours: int = Field(description="node_hours in the ledger's unit")
    cost_micros: int = Field(description="cost in millionths of the currency")
    unpriced_gpu_milli_hours: int = Field(description="unpriced_gpu_hours in the ledger's unit")
    reserved_gpu_milli_hours: int = Field(description="reserved_gpu_hours in the ledger's unit")
    reserved_cost_micros: int = Field(description="reserved_cost in millionths of the currency")


class ChargebackRow(ChargebackFigures):
    """One row: a period and a value of each group key asked for (a key not asked for is absent;
    a run without that label, flavor, region or budget is null)."""

    period_start: datetime | None = Field(None, description="start of the row's day, ISO week or month (UTC); absent with period none")
    account: str | None = Field(
        None, description="an account of the tree, when grouped by account: its row holds its whole subtree (a run counts under its own and every one above)"
    )
    tenant: str | None = Field(None, description="the tenant label's value, when grouped by tenant")
    user: str | None = Field(None, description="the user label's value, when grouped by user")
    budget: str | None = Field(None, description="a budget's policy id the runs reserved on, when grouped by budget (a run on several counts in each)")
    flavor: str | None = Field(None, description="the GPU flavor, when grouped by flavor")
    region: str | None = Field(None, description="the region, when grouped by region")


class ChargebackReport(BaseModel):
    """Chargeback over [from, to): rows by period and group keys, and the total of distinct use."""

    model_config = _example({
        "from": "2026-11-01T00:00:00Z", "to": "2026-12-01T00:00:00Z", "group_by": ["tenant"], "period": "month", "currency": "USD",
        "policy_bundle_sha": "e" * 40, "tenant_label": "team", "user_label": "user",
        "rows": [{"period_start": "2026-11-01T00:00:00Z", "tenant": "vision", "gpu_hours": 120.5, "node_hours": 15.0, "cost": 301.25,
                  "unpriced_gpu_hours": 0.0, "reserved_gpu_hours": 16.0, "reserved_cost": 40.0, "gpu_milli_hours": 433800000,
                  "node_milli_hours": 54000000, "cost_micros": 301250000, "unpriced_gpu_milli_hours": 0, "reserved_gpu_milli_hours": 57600000,
                  "reserved_cost_micros": 40000000}],
        "total": {"gpu_hours": 120.5, "node_hours": 15.0, "cost": 301.25, "unpriced_gpu_hours": 0.0, "reserved_gpu_hours": 16.0, "reserved_cost": 40.0,
                  "gpu_milli_hours": 433800000, "node_milli_hours": 54000000, "cost_micros": 301250000, "unpriced_gpu_milli_hours": 0,
                  "reserved_gpu_milli_hours": 57600000, "reserved_cost_micros": 40000000},
    })  # fmt: skip

    from_: datetime = Field(alias="from", description="start of the period, included")
    to: datetime = Field(description="end of the period, excluded")
    group_by: list[str] = Field(description="the group keys, in order")
    period: Literal["day", "week", "month", "none"] = Field(description="rows per day, week or month (UTC), or none")
    currency: str | None = Field(description="the rate cards' currency; null when no rate card is active")
    policy_bundle_sha: str | None = Field(description="the active policy bundle, whose rate cards priced the report")
    tenant_label: str = Field(description="the label naming tenants")
    user_label: str = Field(description="the label naming users")
    rows: list[ChargebackRow] = Field(description="one row per period and group values")
    total: ChargebackFigures = Field(description="the period's total; a run on several budgets counts once")


OPERATIONS: dict[str, Operation] = {
    "POST /v1/admissions": Operation("submitAdmission"),
    "GET /v1/admissions/{run_id}": Operation("getAdmission", parameters={"run_id": "the run id (it may contain slashes)"}),
    "GET /v1/scopes/{scope_id}/usage": Operation("getScopeUsage", parameters={"scope_id": "a canonical scope id, e.g. ns=vision-prod;team=vision"}),
    "GET /v1/tenants/{tenant}/usage": Operation(
        "getTenantUsage", answer=TenantUsage, parameters={"tenant": "a value of the tenant label", "days": "the period, in days"}
    ),
    "GET /v1/users/{user}/usage": Operation("getUserUsage", answer=UserUsage, parameters={"user": "a value of the user label", "days": "the period, in days"}),
    "POST /v1/pools/{namespace}/allocations": Operation(
        "allocatePoolToken", answer=AllocationOut, parameters={"namespace": "a declared pool, e.g. snowflake:wh-1"}
    ),
    "DELETE /v1/pools/{namespace}/allocations/{token}": Operation(
        "releasePoolToken", answer=ReleaseOut, parameters={"namespace": "the pool", "token": "the token to give back"}
    ),
    "GET /v1/pools/{namespace}": Operation("getPool", answer=PoolStatus, parameters={"namespace": "a declared pool"}),
    "GET /v1/budgets": Operation("listBudgets", answer=BudgetList),
    "GET /v1/reports/chargeback": Operation(
        "getChargebackReport",
        answer=ChargebackReport,
        parameters={
            "from": "start of the period, included: a date (2026-11-01, midnight UTC) or an RFC 3339 instant",
            "to": "end of the period, excluded: a date or an RFC 3339 instant",
            "group_by": "account (rolled up the tree), tenant, user, budget, flavor or region; repeat it or join keys with commas",
            "period": "rows per day, week (ISO) or month in UTC, or none",
            "format": "json or csv (else the Accept header decides: text/csv gives CSV)",
        },
    ),
    "POST /v1/policies": Operation("applyPolicies", answer=BundleApplied),
}
