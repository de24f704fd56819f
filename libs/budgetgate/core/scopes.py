"""Which submissions a budget covers: namespaces and required labels (`Scope`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

ANY_VALUE = "*"


@dataclass(frozen=True, slots=True)
class Scope:
    """Which submissions a policy covers: namespaces (none = any) and required labels."""

    namespaces: frozenset[str] = frozenset()
    labels: Mapping[str, str] = field(default_factory=dict)
    # Canonical, stable id from the fixed predicates, e.g. `ns=vision-prod;cost-center=1042`;
    # made once (every charge of every decision files under it).
    scope_id: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = [f"ns={','.join(sorted(self.namespaces))}"] if self.namespaces else []
        parts += [f"{key}={self.labels[key]}" for key in sorted(self.labels)]
        object.__setattr__(self, "scope_id", ";".join(parts) if parts else "all")

    def covers_namespace(self, namespace: str) -> bool:
        return not self.namespaces or namespace in self.namespaces

    def missing_labels(self, labels: Mapping[str, str]) -> tuple[str, ...]:
        """Required labels the submission does not carry at all (a policy violation)."""
        return tuple(sorted(key for key in self.labels if key not in labels))

    def matches(self, namespace: str, labels: Mapping[str, str]) -> bool:
        """Whether a submission with these labels falls under this scope."""
        if not self.covers_namespace(namespace):
            return False
        return all(key in labels and (want == ANY_VALUE or labels[key] == want) for key, want in self.labels.items())
