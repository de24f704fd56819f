"""Who is calling and what they may do: roles, the principal a credential stands for, and the
checks every HTTP service applies (pure; no I/O)."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase


class Role(enum.StrEnum):
    SUBMITTER = "submitter"
    EXPORTER = "exporter"
    READER = "reader"
    OPERATOR = "operator"
    AUDITOR = "auditor"
    # An accounting system's service token: it reads budgets and usage, changes tenants' quotas
    # and budgets, and grants hours to budgets (or takes them away).
    ACCOUNTING = "accounting"


class Action(enum.StrEnum):
    """What a route does, and so which roles may call it."""

    SUBMIT = "submit"
    LOOKUP = "look up decisions"
    READ = "read budgets and usage"
    ALLOCATE = "allocate pool tokens"
    RELEASE = "release pool tokens"
    INGEST = "post metering samples and lifecycle events"
    ADMINISTER = "administer"
    OVERRIDE = "update tenant quotas and budgets"
    GRANT = "grant hours to budgets or take them away"
    METRICS = "read metrics"


ALLOWED: Mapping[Action, frozenset[Role]] = {
    Action.SUBMIT: frozenset({Role.SUBMITTER}),
    Action.LOOKUP: frozenset({Role.SUBMITTER, Role.READER, Role.OPERATOR, Role.AUDITOR}),
    Action.READ: frozenset({Role.READER, Role.OPERATOR, Role.AUDITOR, Role.ACCOUNTING}),
    Action.ALLOCATE: frozenset({Role.SUBMITTER}),
    Action.RELEASE: frozenset({Role.SUBMITTER, Role.OPERATOR}),
    Action.INGEST: frozenset({Role.EXPORTER}),
    Action.ADMINISTER: frozenset({Role.OPERATOR}),
    Action.OVERRIDE: frozenset({Role.OPERATOR, Role.ACCOUNTING}),
    Action.GRANT: frozenset({Role.OPERATOR, Role.ACCOUNTING}),
    Action.METRICS: frozenset({Role.READER, Role.OPERATOR, Role.AUDITOR}),
}


class Unauthenticated(Exception):
    """No credential, or one that is unknown, revoked, expired or does not verify (401)."""


class Forbidden(Exception):
    """A known principal asking for what its role or scope does not cover (403); the message
    names what is missing."""


@dataclass(frozen=True)
class Principal:
    """A caller: its name, roles, and the namespaces (globs) and tenants it is limited to
    (empty: not limited)."""

    name: str
    roles: frozenset[Role]
    namespaces: tuple[str, ...] = ()
    tenants: tuple[str, ...] = ()

    @classmethod
    def of(cls, name: str, roles: Iterable[str], *, namespaces: Iterable[str] = (), tenants: Iterable[str] = ()) -> Principal:
        """A principal from stored or claimed values; unknown role names raise ValueError."""
        return cls(name=name, roles=frozenset(Role(r) for r in roles), namespaces=tuple(namespaces), tenants=tuple(tenants))

    def may(self, action: Action) -> bool:
        return bool(self.roles & ALLOWED[action])

    def require(self, action: Action) -> None:
        """Raises Forbidden naming the roles that `action` needs."""
        if not self.may(action):
            needed = " or ".join(sorted(ALLOWED[action]))
            raise Forbidden(f"{self.name!r} may not {action}: needs role {needed} (has {', '.join(sorted(self.roles)) or 'none'})")

    def covers_namespace(self, namespace: str) -> bool:
        return not self.namespaces or any(fnmatchcase(namespace, glob) for glob in self.namespaces)

    def covers_tenant(self, tenant: str | None) -> bool:
        return not self.tenants or (tenant is not None and tenant in self.tenants)

    def covers(self, namespace: str, tenant: str | None) -> bool:
        """Whether what is in `namespace` and of `tenant` (None: of no tenant) is within this principal's limits."""
        return self.covers_namespace(namespace) and self.covers_tenant(tenant)

    def require_namespace(self, namespace: str) -> None:
        if not self.covers_namespace(namespace):
            raise Forbidden(f"{self.name!r} is not allowed namespace {namespace!r} (allowed: {', '.join(self.namespaces)})")

    def require_tenant(self, tenant: str | None) -> None:
        if not self.covers_tenant(tenant):
            what = f"tenant {tenant!r}" if tenant is not None else "what belongs to no tenant"
            raise Forbidden(f"{self.name!r} is not allowed {what} (allowed tenants: {', '.join(self.tenants)})")

    def require_scope(self, *, namespaces: Iterable[str], tenant: str | None) -> None:
        """Every namespace and the tenant must be within this principal's limits."""
        for namespace in namespaces:
            self.require_namespace(namespace)
        self.require_tenant(tenant)

    @property
    def unscoped(self) -> bool:
        return not self.namespaces and not self.tenants

    @property
    def limits(self) -> str:
        """The limits in words, e.g. "namespaces vision-*, nlp-* and tenants vision" ("" when not limited)."""
        return " and ".join(f"{what} {', '.join(values)}" for what, values in (("namespaces", self.namespaces), ("tenants", self.tenants)) if values)
