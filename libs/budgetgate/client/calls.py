"""Each admission API operation as a value: method, path, body and how its answer is read.

Client and AsyncClient send the same Calls, so the API's shape is written once; only how
bytes travel differs between them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from pydantic import BaseModel, ValidationError

from budgetgate.contracts.admission import (
    AdmissionRequest,
    AdmissionResponse,
    AdmissionStatus,
    AllocationIn,
    AllocationOut,
    BudgetList,
    ChargebackReport,
    PoolStatus,
    ReleaseOut,
    ScopeUsage,
    TenantUsage,
    UserUsage,
)
from budgetgate.client.errors import InvalidRequest
from budgetgate.contracts.tenants import TenantSettingsIn, TenantSettingsOut
from budgetgate.contracts.budget_grants import GrantIn, GrantList
from budgetgate.contracts.admission import GrantOut

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request and the reader of its successful answer's JSON; `not_found_is_none`: a 404
    is an answer (None), not an error (the lookup of a run without a decision)."""

    method: str
    path: str
    read: Callable[[Any], T]
    json: Any = None
    params: Mapping[str, Any] = field(default_factory=dict)
    not_found_is_none: bool = False


def _model(cls: type[M]) -> Callable[[Any], M]:
    return cls.model_validate


def invalid(exc: ValidationError) -> InvalidRequest:
    """A pydantic ValidationError of a request model as the InvalidRequest the service would
    answer: each offending field by its dotted path in the body."""
    return InvalidRequest.unsent([
        {"field": ".".join(str(p) for p in e["loc"]), "loc": ["body", *e["loc"]], "msg": e["msg"], "type": e["type"]} for e in exc.errors()
    ])  # fmt: skip


def validated(model: type[M], given: Any) -> M:
    """`given` (a `model`, or a mapping of its fields) checked with `model`, the service's own
    request model; InvalidRequest (nothing sent) naming each offending field when it fails."""
    if isinstance(given, model):
        return given
    if not isinstance(given, Mapping):
        raise InvalidRequest.unsent([{"field": "", "msg": f"a {model.__name__} or a mapping of its fields is required, not {type(given).__name__}"}])
    try:
        return model.model_validate(dict(given))
    except ValidationError as exc:
        raise invalid(exc) from None


def _body(model: BaseModel) -> dict[str, Any]:
    # Fields left at their defaults are not sent: the server fills them the same way, and a
    # request looks like what the user wrote (the same run id and attempt on every retry).
    return model.model_dump(mode="json", exclude_unset=True)


def readiness() -> Call[dict[str, str]]:
    """GET /readyz: the checks, all "ok" (a 503 names the failing ones)."""
    return Call("GET", "/readyz", lambda body: dict(body.get("checks", {})))


def submit(request: AdmissionRequest | Mapping[str, Any]) -> Call[AdmissionResponse]:
    """POST /v1/admissions (validated here first, with the server's own model)."""
    body = validated(AdmissionRequest, request)
    return Call("POST", "/v1/admissions", _model(AdmissionResponse), json=_body(body))


def lookup(run_id: str) -> Call[AdmissionStatus | None]:
    """GET /v1/admissions/{run_id} (with `waiting` for a run refused for now); None when the run has no decision."""
    return Call("GET", f"/v1/admissions/{quote(run_id, safe='/')}", _model(AdmissionStatus), not_found_is_none=True)


def budgets() -> Call[BudgetList]:
    """GET /v1/budgets."""
    return Call("GET", "/v1/budgets", _model(BudgetList))


def scope_usage(scope_id: str) -> Call[ScopeUsage]:
    """GET /v1/scopes/{scope_id}/usage."""
    return Call("GET", f"/v1/scopes/{quote(scope_id, safe='')}/usage", _model(ScopeUsage))


def tenant_usage(tenant: str, *, days: int = 90) -> Call[TenantUsage]:
    """GET /v1/tenants/{tenant}/usage?days=N."""
    return Call("GET", f"/v1/tenants/{quote(tenant, safe='')}/usage", _model(TenantUsage), params={"days": days})


def chargeback(start: str, to: str, *, group_by: tuple[str, ...] = ("tenant",), period: str = "none") -> Call[ChargebackReport]:
    """GET /v1/reports/chargeback?from&to&group_by&period (JSON)."""
    params = {"from": start, "to": to, "group_by": ",".join(group_by), "period": period, "format": "json"}
    return Call("GET", "/v1/reports/chargeback", _model(ChargebackReport), params=params)


def tenant(name: str) -> Call[TenantSettingsOut]:
    """GET /v1/tenants/{tenant}: its quotas and budgets in force, each with its source."""
    return Call("GET", f"/v1/tenants/{quote(name, safe='')}", _model(TenantSettingsOut))


def update_tenant(name: str, changes: TenantSettingsIn | Mapping[str, Any], *, create: bool = False) -> Call[TenantSettingsOut]:
    """PUT /v1/tenants/{tenant}: override the settings named (None: back to Git's value); a tenant
    neither Git nor an override names is a NotFound unless `create`."""
    body = validated(TenantSettingsIn, changes)
    params = {"create": "true"} if create else {}
    return Call("PUT", f"/v1/tenants/{quote(name, safe='')}", _model(TenantSettingsOut), json=_body(body), params=params)


def grant_budget(policy_id: str, grant: GrantIn | Mapping[str, Any]) -> Call[GrantOut]:
    """POST /v1/budgets/{policy_id}/grants: add `amount` (in the budget's unit; negative takes
    away) to the budget's limit in its current window or the one named, with a reason."""
    body = validated(GrantIn, grant)
    return Call("POST", f"/v1/budgets/{quote(policy_id, safe='/')}/grants", _model(GrantOut), json=_body(body))


def budget_grants(policy_id: str, *, window: str | None = None) -> Call[GrantList]:
    """GET /v1/budgets/{policy_id}/grants[?window=...]: the grants made to a budget, oldest first."""
    params = {"window": window} if window is not None else {}
    return Call("GET", f"/v1/budgets/{quote(policy_id, safe='/')}/grants", _model(GrantList), params=params)


def user_usage(user: str, *, days: int = 90) -> Call[UserUsage]:
    """GET /v1/users/{user}/usage?days=N."""
    return Call("GET", f"/v1/users/{quote(user, safe='')}/usage", _model(UserUsage), params={"days": days})


def allocate(namespace: str, request: AllocationIn | Mapping[str, Any]) -> Call[AllocationOut]:
    """POST /v1/pools/{namespace}/allocations (idempotent per token: renews the lease)."""
    body = validated(AllocationIn, request)
    return Call("POST", f"/v1/pools/{quote(namespace, safe=':')}/allocations", _model(AllocationOut), json=_body(body))


def release(namespace: str, token: str) -> Call[ReleaseOut]:
    """DELETE /v1/pools/{namespace}/allocations/{token} (idempotent)."""
    return Call("DELETE", f"/v1/pools/{quote(namespace, safe=':')}/allocations/{quote(token, safe='/')}", _model(ReleaseOut))


def pool(namespace: str) -> Call[PoolStatus]:
    """GET /v1/pools/{namespace}."""
    return Call("GET", f"/v1/pools/{quote(namespace, safe=':')}", _model(PoolStatus))
