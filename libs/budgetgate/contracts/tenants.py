"""The bodies of `GET` and `PUT /v1/tenants/{tenant}`: a tenant's quotas and budgets, each with
where its value comes from (the Git bundle or an override), and an update of some of them."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StrictFloat, StrictInt, StringConstraints, model_validator
from fastapi import Path
from pydantic import BaseModel

from budgetgate.core.documents import MAX_AMOUNT, MAX_COUNT
from budgetgate.core.overrides import FIELDS
from budgetgate.core.units import MILLI_PER_HOUR
from budgetgate.contracts.operations import Operation
from budgetgate.contracts.admission import Text

# A value of the tenant label, as a Kubernetes label value (never the "*" of policy scopes).
TENANT_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$"


def label_value_path(label: str) -> Any:
    """A path parameter that is a value of `label` (a tenant, a user), held to that rule: anything
    else (a NUL, a space) names no one and is a 422, not a query that fails."""
    return Path(pattern=TENANT_PATTERN, max_length=63, description=f"a value of the {label} label")


_MOST_HOURS = float(Decimal(MAX_AMOUNT) / MILLI_PER_HOUR)

Count = Annotated[StrictInt, Field(ge=0, le=MAX_COUNT)]
Hours = Annotated[StrictFloat, Field(gt=0, le=_MOST_HOURS, allow_inf_nan=False)]

# What each setting is, for the update's fields and the answer's alike.
MEANING = {
    "max_nodes": "hard quota: most nodes the tenant's running work may hold",
    "max_gpus": "hard quota: most GPUs the tenant's running work may hold",
    "max_concurrent_allocations": "hard quota: most runs the tenant may have admitted at once",
    "gpu_hours_budget": "soft: the limit of the tenant's soft GPU-hour budget, in GPU-hours",
    "node_hours_budget": "soft: the limit of the tenant's soft node-hour budget, in node-hours",
    "fair_share_target": "soft: the tenant's share of the cluster's GPUs",
    "burst_allowance": "soft: burst limit = target × this",
}

_UPDATE_EXAMPLE = {"max_nodes": 250, "gpu_hours_budget": 12000.0, "reason": "grant 2026-17 approved"}


class TenantSettingsIn(BaseModel):
    """Settings of a tenant to override: each one named is set (null: back to the Git bundle's
    value); those not named keep whatever they have."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [_UPDATE_EXAMPLE]})

    max_nodes: Count | None = Field(default=None, description=MEANING["max_nodes"])
    max_gpus: Count | None = Field(default=None, description=MEANING["max_gpus"])
    max_concurrent_allocations: Count | None = Field(default=None, description=MEANING["max_concurrent_allocations"])
    gpu_hours_budget: Hours | None = Field(default=None, description=MEANING["gpu_hours_budget"])
    node_hours_budget: Hours | None = Field(default=None, description=MEANING["node_hours_budget"])
    fair_share_target: StrictFloat | None = Field(default=None, gt=0, le=1, allow_inf_nan=False, description=MEANING["fair_share_target"])
    burst_allowance: StrictFloat | None = Field(default=None, ge=1, le=100, allow_inf_nan=False, description=MEANING["burst_allowance"])
    reason: Annotated[Text, StringConstraints(max_length=500)] | None = Field(
        default=None, description="why, for the admin log (text, no control characters but tab and newline)"
    )

    @model_validator(mode="after")
    def _names_a_setting(self) -> TenantSettingsIn:
        if not set(FIELDS) & self.model_fields_set:
            raise ValueError(f"name at least one of {', '.join(FIELDS)} (null puts it back to the Git bundle's value)")
        return self

    def changes(self) -> dict[str, Any]:
        """The settings named, with their new values (None: clear the override)."""
        return {name: getattr(self, name) for name in FIELDS if name in self.model_fields_set}


class TenantSetting(BaseModel):
    """One setting of a tenant, as in force, and where it comes from."""

    value: float | None = Field(description="the value in force (null: not set, no limit)")
    source: Literal["git", "override", "unset"] = Field(description="git: the policy bundle's document; override: set over the API; unset: neither")
    git: float | None = Field(description="the Git bundle's value (what an override replaces)")
    policy_id: str | None = Field(default=None, description="for a budget: the soft BudgetPolicy whose limit it is")


class TenantSettingValues(BaseModel):
    """Every setting an override can change."""

    max_nodes: TenantSetting = Field(description=MEANING["max_nodes"])
    max_gpus: TenantSetting = Field(description=MEANING["max_gpus"])
    max_concurrent_allocations: TenantSetting = Field(description=MEANING["max_concurrent_allocations"])
    gpu_hours_budget: TenantSetting = Field(description=MEANING["gpu_hours_budget"])
    node_hours_budget: TenantSetting = Field(description=MEANING["node_hours_budget"])
    fair_share_target: TenantSetting = Field(description=MEANING["fair_share_target"])
    burst_allowance: TenantSetting = Field(description=MEANING["burst_allowance"])


_SETTING = {"value": 250, "source": "override", "git": 200, "policy_id": None}
_UNSET = {"value": None, "source": "unset", "git": None, "policy_id": None}


class TenantSettingsOut(BaseModel):
    """A tenant's quotas and budgets in force: the Git bundle's, with its overrides on top."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "tenant": "physics",
                    "label": "team",
                    "policy_bundle_sha": "e" * 40,
                    "override_revision": 12,
                    "revision": 12,
                    "changed_by": "token:ops",
                    "changed_at": "2026-07-14T09:30:00Z",
                    "settings": {
                        "max_nodes": _SETTING,
                        "max_gpus": {"value": 1600, "source": "git", "git": 1600, "policy_id": None},
                        "max_concurrent_allocations": {"value": 50, "source": "git", "git": 50, "policy_id": None},
                        "gpu_hours_budget": {"value": 12000.0, "source": "override", "git": 10000.0, "policy_id": "gpu-soft/physics"},
                        "node_hours_budget": _UNSET,
                        "fair_share_target": {"value": 0.25, "source": "git", "git": 0.25, "policy_id": None},
                        "burst_allowance": {"value": 1.5, "source": "git", "git": 1.5, "policy_id": None},
                    },
                }
            ]
        }
    )

    tenant: str = Field(description="the tenant (a value of the tenant label)")
    label: str = Field(description="the tenant label")
    policy_bundle_sha: str = Field(description="the active Git bundle the overrides apply on top of")
    override_revision: int = Field(description="the latest override revision of any tenant (what the next decision is made under)")
    revision: int | None = Field(description="the revision that last changed this tenant's overrides; null when it has none")
    changed_by: str | None = Field(description="who made that change")
    changed_at: datetime | None = Field(description="when")
    settings: TenantSettingValues = Field(description="each setting in force and its source")


OPERATIONS: dict[str, Operation] = {
    "GET /v1/tenants/{tenant}": Operation("getTenant", answer=TenantSettingsOut, parameters={"tenant": "a value of the tenant label"}),
    "PUT /v1/tenants/{tenant}": Operation("updateTenant", answer=TenantSettingsOut, parameters={"tenant": "a value of the tenant label"}),
}
