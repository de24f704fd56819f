"""Shards of the Redis ledger (docs/scale-out.md, "Sharding the ledger by root"): which shard a
root of the account tree belongs to, the hash tag its keys share, and how each shard numbers its
ledger generation so that the numbers of two shards never meet.

With one shard (the default) the tag and the numbering are the ledger's as they always were:
`{prefix}`, a sequence advancing by 1. With N shards, shard *i*'s keys share the tag
`{prefix:i}` and its sequence advances by SEQ_STEP from a value whose residue modulo SEQ_STEP is
*i*: every number shard *i* hands out is ≡ i, so `decision_keys.ledger_seq` stays unique across
shards, and Postgres finds the highest number a shard committed as the highest of its residue
(`budgetgate_committed_ledger_seq(shard, shards)`, migration 0043).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from budgetgate.core.accounts import AccountTree
from budgetgate.core.escrow import lease_of
from budgetgate.core.ledger_key import LedgerKey
from budgetgate.core.policy import ANY_VALUE, BudgetPolicy

# The step of every shard's ledger sequence when there are several, hence the most shards.
SEQ_STEP = 64
MAX_SHARDS = SEQ_STEP


@dataclass(frozen=True, slots=True)
class Shards:
    """N shards of the ledger under one prefix; `roots` places tenants under the organisations
    of the account tree (`ledger_roots`, pinned by `budgetgate ledger roots`): a tenant it names
    lives on its organisation's shard, any other on its own."""

    prefix: str
    count: int = 1
    roots: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_SHARDS:
            raise ValueError(f"the Redis ledger has 1 to {MAX_SHARDS} shards, not {self.count}")

    def of_root(self, tenant: str) -> int:
        """The shard of a tenant's keys ("" for what no tenant owns), for as long as the count
        and the pinned roots stay: CRC-32 of its root's name (its organisation when the pinned
        roots name one, else the tenant itself), modulo the count."""
        return zlib.crc32(self.roots.get(tenant, tenant).encode()) % self.count

    def tag(self, shard: int) -> str:
        """The hash tag every key of `shard` shares: one Redis Cluster slot per shard."""
        self._check(shard)
        return "{" + self.prefix + "}" if self.count == 1 else "{" + f"{self.prefix}:{shard}" + "}"

    @property
    def step(self) -> int:
        """What each reservation advances a shard's ledger sequence by."""
        return 1 if self.count == 1 else SEQ_STEP

    def start(self, shard: int, committed: int) -> int:
        """Where a rebuilt shard's sequence restarts: the highest number Postgres committed of
        it, or, for a shard that has none yet, its residue (so its first number is ≡ shard)."""
        self._check(shard)
        if self.count > 1 and committed % SEQ_STEP != shard and committed != 0:
            raise ValueError(f"ledger sequence {committed} is not shard {shard}'s (≡ {shard} mod {SEQ_STEP})")
        return committed if committed or self.count == 1 else shard

    def _check(self, shard: int) -> None:
        if not 0 <= shard < self.count:
            raise ValueError(f"shard {shard} of a ledger of {self.count}")


class RootConflict(ValueError):
    """The account tree places one tenant under two organisations."""


def organisations(tree: AccountTree, tenant_label: str) -> dict[str, str]:
    """Tenant -> organisation, from an account tree: every tenant an account's scope names (a
    concrete value of `tenant_label` in its labels, its parent's laid under its own) belongs to
    the organisation at the top of that account's branch. Accounts scoped by namespace alone
    name no tenant; their runs' tenants stay their own roots. Raises RootConflict naming every
    tenant two organisations claim (each lives on one shard)."""
    found: dict[str, set[str]] = {}
    for account in tree.accounts.values():
        tenant = account.scope.labels.get(tenant_label) if account.scope is not None else None
        if tenant is None or tenant == ANY_VALUE:
            continue
        found.setdefault(tenant, set()).add((tree.ancestors(account.id) or [account.id])[-1])  # the top of its branch
    torn = {tenant: sorted(orgs) for tenant, orgs in found.items() if len(orgs) > 1}
    if torn:
        raise RootConflict(
            "the account tree places tenants under two organisations (each tenant's keys live on one shard): "
            + "; ".join(f"{tenant_label}={tenant} under {' and '.join(orgs)}" for tenant, orgs in sorted(torn.items()))
        )
    return {tenant: next(iter(orgs)) for tenant, orgs in sorted(found.items())}


def run_root(labels: Mapping[str, str], tenant_label: str) -> str:
    """The root of a run: its tenant, the value of its tenant label ("" for a run without one)."""
    return labels.get(tenant_label, "")


def key_root(ledger_key: str, tenant_label: str) -> str:
    """The root whose shard holds a ledger key: an escrow lease's root, or the tenant a budget's
    scope names (`<tenant_label>=<tenant>` in its scope id), "" for a budget that names none (on
    several shards such a budget is charged through its tenants' leases: its own key holds the
    limit they are carved from)."""
    lease = lease_of(ledger_key)
    if lease is not None:
        return lease[1]
    wanted = tenant_label + "="  # (a tenant label named `ns` or `account` would read a scope's namespaces or account)
    for part in LedgerKey.parse(ledger_key).scope_id.split(";"):
        if part.startswith(wanted):
            return part[len(wanted) :]
    return ""


def shared(policy: BudgetPolicy, tenant_label: str) -> bool:
    """Whether a budget covers runs of several tenants (its scope names no single tenant): on a
    ledger of several shards each tenant reserves on its own escrow lease of it. A budget attached
    to an account is one (an `AccountScope` names no labels): an account's runs are those of
    every tenant its subtree covers."""
    tenant = policy.scope.labels.get(tenant_label)
    return tenant is None or tenant == ANY_VALUE
