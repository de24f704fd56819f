"""The YAML schema of policy documents (apiVersion budgetgate/v1), validated with pydantic."""

from __future__ import annotations

import re
from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, ClassVar, Literal

import difflib
import types
import typing

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator, model_validator

from budgetgate.core.metering import fold_start, on_fold_boundary
from budgetgate.core.policy_files import NotDecimal
from budgetgate.core.units import Unit, limit_amount, smallest
from budgetgate.core.windows import CALENDARS, zone

API_VERSION = "budgetgate/v1"
SUPPORTED_KINDS = ("BudgetPolicy", "RateCard", "Quota", "Cluster", "ResourcePool", "Account")
# Kinds the project will read once their features exist; named so the error says "not yet".
PLANNED_KINDS: tuple[str, ...] = ()

# Kubernetes label keys and values, and DNS-1123 namespace names.
LabelKey = Annotated[str, StringConstraints(pattern=r"^([a-z0-9.-]{1,253}/)?[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")]
LabelValue = Annotated[str, StringConstraints(pattern=r"^(\*|([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?)$")]
Namespace = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")]
PolicyId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$")]
# An account id, as a policy id is written (a ledger's scope id is `account=<id>`: no `;` or `=`).
AccountId = PolicyId
Currency = Annotated[str, StringConstraints(pattern=r"^[A-Z]{3}$")]
Positive = Annotated[Decimal, Field(gt=0, allow_inf_nan=False)]
# The largest ledger amount: integers stay exact in Redis Lua, whose numbers are doubles.
MAX_AMOUNT = 2**53 - 1
# Counts (GPUs, nodes, tokens) stay far inside the ledger's integers.
MAX_COUNT = 1_000_000_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_decimal(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads True as 1, and YAML 1.1 reads yes/on as True and 010 as 8: a number
        # is refused unless it was written as one, in decimal.
        if (
            (isinstance(value, bool) or isinstance(value, NotDecimal))
            and info.field_name is not None
            and _holds_number(cls.model_fields[info.field_name].annotation)
        ):
            if isinstance(value, NotDecimal):
                raise ValueError(value.problem())
            raise ValueError(f"expected a number, not the boolean {str(value).lower()} (YAML reads true/false, yes/no and on/off as booleans)")
        return value


def _holds_number(annotation: Any) -> bool:
    """Whether a field's type is a number (int, float, Decimal), alone or beside None."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _holds_number(typing.get_args(annotation)[0])
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return any(_holds_number(arg) for arg in typing.get_args(annotation))
    return annotation in (int, float, Decimal)


class Metadata(_Strict):
    """`id`, or `name` as Kubernetes users write it (one of them, or both the same)."""

    KEY_ALIASES: ClassVar[tuple[str, ...]] = ("name",)

    id: PolicyId
    description: str | None = None
    owner: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _name_is_id(cls, data: Any) -> Any:
        if isinstance(data, dict) and "name" in data:
            data = dict(data)
            name = data.pop("name")
            if "id" in data and data["id"] != name:
                raise ValueError(f"metadata.id {data['id']!r} and metadata.name {name!r} differ; give one of them")
            data["id"] = name
        return data


class ScopeDoc(_Strict):
    namespace: Namespace | None = None
    namespaces: list[Namespace] | None = Field(default=None, min_length=1)
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict)

    @field_validator("labels")
    @classmethod
    def _no_ns_label(cls, labels: dict[str, str]) -> dict[str, str]:
        if "ns" in labels:
            raise ValueError("the label key 'ns' is reserved: scope ids use ns= for namespaces; use namespace/namespaces")
        return labels

    @model_validator(mode="after")
    def _one_namespace_form(self) -> ScopeDoc:
        if self.namespace is not None and self.namespaces is not None:
            raise ValueError("give either namespace or namespaces, not both")
        if self.namespace is None and self.namespaces is None and not self.labels:
            raise ValueError("a scope needs a namespace, namespaces or labels")
        return self

    def namespace_set(self) -> frozenset[str]:
        if self.namespace is not None:
            return frozenset({self.namespace})
        return frozenset(self.namespaces or ())


class FiscalYearDoc(_Strict):
    start_month: int = Field(ge=1, le=12)


class WindowDoc(_Strict):
    calendar: Literal["month", "week", "day"] | None = None
    timezone: str = "UTC"
    rolling_days: int | None = Field(default=None, ge=1, le=3660)
    fiscal_year: FiscalYearDoc | None = None

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        zone(value)
        return value

    @model_validator(mode="after")
    def _one_form(self) -> WindowDoc:
        if sum(form is not None for form in (self.calendar, self.rolling_days, self.fiscal_year)) != 1:
            raise ValueError(f"give exactly one of calendar ({'|'.join(CALENDARS)}), rolling_days or fiscal_year ({{start_month: 1-12}})")
        return self


class LimitDoc(_Strict):
    gpu_hours: Positive | None = None
    node_hours: Positive | None = None
    wall_hours: Positive | None = None
    cost: Positive | None = None
    currency: Currency | None = None

    @field_validator("gpu_hours", "node_hours", "wall_hours", "cost")
    @classmethod
    def _fits_the_ledger(cls, value: Decimal | None, info: ValidationInfo) -> Decimal | None:
        # The ledger holds amounts as integers that must stay exact in Redis Lua (doubles).
        unit = Unit(info.field_name)
        most = Decimal(MAX_AMOUNT) / unit.scale
        if value is not None and value > most:
            raise ValueError(f"{value} is more than the ledger can hold; {most:.0f} at most")
        # Limits are rounded down to the ledger's unit: a positive one must not become zero.
        if value is not None and value > 0 and limit_amount(unit, value) == 0:
            raise ValueError(f"{value:f} is less than the ledger's unit ({smallest(unit)}), so it would be a limit of 0")
        return value

    @model_validator(mode="after")
    def _one_unit(self) -> LimitDoc:
        given = [name for name in ("gpu_hours", "node_hours", "wall_hours", "cost") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of gpu_hours, node_hours, wall_hours or cost")
        if self.cost is not None and self.currency is None:
            raise ValueError("a cost limit needs a currency, e.g. currency: USD")
        if self.cost is None and self.currency is not None:
            raise ValueError("currency goes only with a cost limit")
        return self


class BudgetPolicySpec(_Strict):
    # Which runs it covers: a scope, or an account of the tree (and every account below it).
    scope: ScopeDoc | None = None
    account: AccountId | None = None
    window: WindowDoc
    limit: LimitDoc
    enforcement: Literal["hard", "soft", "dry-run"] = "hard"
    on_exhausted: Literal["deny", "delay", "hold", "hold-and-drain"] = "deny"

    @model_validator(mode="after")
    def _scope_or_account(self) -> BudgetPolicySpec:
        if (self.scope is None) == (self.account is None):
            raise ValueError("a budget covers either a scope or an account: give one of scope and account")
        return self

    @field_validator("on_exhausted")
    @classmethod
    def _delay_needs_hard(cls, value: str, info: ValidationInfo) -> str:
        # A soft budget never blocks, so it can never make a run wait.
        if value == "delay" and info.data.get("enforcement") == "soft":
            raise ValueError("a soft budget never blocks, so it cannot delay; use enforcement: hard, or on_exhausted: deny")
        return value


class RateDoc(_Strict):
    flavor: Annotated[str, StringConstraints(min_length=1, max_length=63)]
    region: Annotated[str, StringConstraints(min_length=1, max_length=63)] | None = None
    effective_from: datetime | None = None
    rate_per_gpu_hour: Annotated[Decimal, Field(ge=0, le=1_000_000, allow_inf_nan=False)]

    @field_validator("effective_from")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("effective_from needs a time zone, e.g. 2026-01-01T00:00:00Z")
        if value is not None and not on_fold_boundary(value):
            # Metering keeps a run's usage exactly at quarter hours (budgetgate.core.metering.FOLD):
            # a rate taking effect between two would price usage on either side by the timing of polls.
            raise ValueError(
                f"effective_from {value.isoformat()} is not on a quarter hour (UTC): usage is metered exactly at quarter hours, "
                f"so a rate takes effect at one, e.g. {fold_start(value).strftime('%Y-%m-%dT%H:%M:%SZ')}"
            )
        return value


class RateCardSpec(_Strict):
    currency: Currency
    rates: list[RateDoc] = Field(min_length=1)
    # A submission naming a flavor no card prices: "warn" (admitted, with a warning in its answer
    # and no showback cost) or "reject" (refused with 422 naming resources.flavor).
    unknown_flavor: Literal["warn", "reject"] = "warn"


class Document(_Strict):
    apiVersion: Literal["budgetgate/v1"]  # noqa: N815 - the YAML field name
    kind: str
    metadata: Metadata
    spec: dict[str, Any]


# What each name pattern means, so an error says "a DNS-1123 name" rather than a regex.
PATTERN_MEANINGS = {
    LabelKey.__metadata__[0].pattern: "a Kubernetes label key (letters, digits, '-', '_', '.', optional prefix/)",
    LabelValue.__metadata__[0].pattern: "a Kubernetes label value (up to 63 letters, digits, '-', '_', '.') or \"*\" for any value",
    Namespace.__metadata__[0].pattern: "a Kubernetes namespace name (lowercase letters, digits and '-', up to 63)",
    PolicyId.__metadata__[0].pattern: "an id of letters, digits and . _ / - (up to 200)",
    Currency.__metadata__[0].pattern: "a three-letter ISO 4217 currency code such as USD",
    r"^[a-z0-9][a-z0-9_.-]{0,62}(:[a-z0-9][a-z0-9_.-]{0,62}){0,7}$": "a pool namespace such as snowflake:wh-1 (lowercase parts joined by ':')",
}


class LabelMatch(_Strict):
    key: LabelKey
    value: LabelValue


class QuotaSpec(_Strict):
    """A tenant's hard limits and fair-share terms, or (without tenant) the sensitive pool."""

    tenant: LabelValue | None = None
    max_gpus: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    max_nodes: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    max_concurrent_allocations: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    fair_share_target: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    burst_allowance: float | None = Field(default=None, ge=1, le=100, allow_inf_nan=False)
    sensitive_pool_size: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    sensitive_unit: Literal["gpus", "nodes"] = "gpus"
    sensitive_label: LabelMatch = LabelMatch(key="sensitive", value="true")

    @model_validator(mode="after")
    def _one_kind_of_quota(self) -> QuotaSpec:
        tenant_fields = [
            f for f in ("max_gpus", "max_nodes", "max_concurrent_allocations", "fair_share_target", "burst_allowance") if getattr(self, f) is not None
        ]
        if self.tenant is None:
            if self.sensitive_pool_size is None:
                raise ValueError("a Quota needs a tenant (with max_gpus, max_nodes, max_concurrent_allocations or fair_share_target) or a sensitive_pool_size")
            if tenant_fields:
                raise ValueError(f"{', '.join(tenant_fields)} need a tenant")
        else:
            if self.sensitive_pool_size is not None:
                raise ValueError("sensitive_pool_size is system-wide: put it in a Quota without tenant")
            if not tenant_fields:
                raise ValueError("a tenant Quota needs at least one of max_gpus, max_nodes, max_concurrent_allocations or fair_share_target")
            if self.burst_allowance is not None and self.fair_share_target is None:
                raise ValueError("burst_allowance goes with a fair_share_target")
        return self


class ClusterSpec(_Strict):
    gpus: int = Field(ge=1, le=MAX_COUNT)
    nodes: int | None = Field(default=None, ge=1, le=MAX_COUNT)


PoolNamespace = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}(:[a-z0-9][a-z0-9_.-]{0,62}){0,7}$")]


class ResourcePoolSpec(_Strict):
    namespace: PoolNamespace
    quota: int = Field(ge=0, le=MAX_COUNT)
    project_cap: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    namespace_cap: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    lease_seconds: int = Field(default=3600, ge=1, le=30 * 86400)


class AccountSpec(_Strict):
    """An account of the tree (core/accounts.py)."""

    level: Literal["organisation", "department", "team", "user"]
    parent: AccountId | None = None
    scope: ScopeDoc | None = None
    # Whether the budgets of the accounts below it may give them more than its own budget has.
    overcommit: bool = False

    @model_validator(mode="after")
    def _user_has_scope(self) -> AccountSpec:
        if self.level == "user" and self.scope is None:
            raise ValueError("a user account needs a scope (the labels that name the user's runs, e.g. {labels: {user: alice}})")
        return self


SPEC_MODELS: dict[str, type[BaseModel]] = {
    "BudgetPolicy": BudgetPolicySpec,
    "RateCard": RateCardSpec,
    "Quota": QuotaSpec,
    "Cluster": ClusterSpec,
    "ResourcePool": ResourcePoolSpec,
    "Account": AccountSpec,
}


def kind_problem(kind: str) -> str | None:
    """Why a document kind cannot be read, or None when it can."""
    if kind in SUPPORTED_KINDS:
        return None
    if kind in PLANNED_KINDS:
        return f"kind {kind} is not supported by this version of budgetgate yet"
    close = difflib.get_close_matches(kind, SUPPORTED_KINDS, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown kind {kind!r}; {hint}expected one of {', '.join(SUPPORTED_KINDS)}"


def id_slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def known_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys a mapping at `loc` inside `model` may have (for "did you mean")."""
    current: type[BaseModel] | None = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = current.model_fields.get(part) if current is not None else None
        current = _model_in(field.annotation) if field is not None else None
        if current is None:
            return []
    return [*current.model_fields, *getattr(current, "KEY_ALIASES", ())] if current is not None else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def did_you_mean(word: str, choices: list[str]) -> str:
    """ "; did you mean 'x'?" for the closest choice, else the list of choices."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; expected one of {', '.join(choices)}" if choices else ""
