"""The account tree, written in Git beside the budgets (kind: Account): organisations, their
departments and teams, and users under a team, each account mapped to the runs it covers.

An account's scope is its own scope laid over its parent's: the namespaces it names (else its
parent's), and its parent's labels with its own added. A user is then written as little as
`scope: {labels: {user: alice}}` under a team. An account without a scope of its own (an
organisation, a department) covers what the accounts below it cover.

A budget attached to an account (`account:` instead of `scope:`) covers every run of that
account or of any account below it, so a run charges its own account's budget and the budget of
every ancestor that has one, all or none, as scope budgets do. Its ledger is filed under
`account=<id>`. Scope-only policies keep working unchanged beside the tree.

Validation refuses a parent that does not exist, a cycle, a level under one it cannot sit under,
a scope claimed by two accounts, an account that covers nothing, and a budget giving a child
more than a budget of its parent's in the same unit and window (unless the parent declares
`overcommit: true`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

from budgetgate.core.scopes import Scope
from budgetgate.core.sources import PolicyError, Source

# The scope id of a budget attached to an account: `account=<id>`.
ACCOUNT_PREFIX = "account="
# From the top of the tree down: a parent's level comes before its child's.
LEVELS = ("organisation", "department", "team", "user")


@dataclass(frozen=True, slots=True)
class Account:
    id: str
    level: str
    parent: str | None
    own_scope: Scope | None  # as written
    overcommit: bool
    source: Source
    # Its own scope laid over its parent's (None: it covers what the accounts below it cover).
    scope: Scope | None = None


@dataclass(frozen=True, slots=True)
class AccountScope:
    """The scope of a budget attached to an account: every run that falls under the scope of
    the account or of an account below it. It answers as `Scope` does, so the evaluation,
    explain and what-if treat both alike."""

    account: str
    members: tuple[Scope, ...]
    namespaces: frozenset[str] = field(init=False)
    labels: Mapping[str, str] = field(init=False)
    scope_id: str = field(init=False)

    def __post_init__(self) -> None:
        # Every namespace a member names; none (any namespace) when a member names none.
        any_namespace = any(not m.namespaces for m in self.members)
        object.__setattr__(self, "namespaces", frozenset() if any_namespace else frozenset().union(*(m.namespaces for m in self.members)))
        object.__setattr__(self, "labels", {})
        object.__setattr__(self, "scope_id", f"{ACCOUNT_PREFIX}{self.account}")

    def covers_namespace(self, namespace: str) -> bool:
        return any(m.covers_namespace(namespace) for m in self.members)

    def missing_labels(self, labels: Mapping[str, str]) -> tuple[str, ...]:
        """None: a run without an account's labels is simply not the account's."""
        return ()

    def matches(self, namespace: str, labels: Mapping[str, str]) -> bool:
        return any(m.matches(namespace, labels) for m in self.members)


@dataclass(frozen=True)
class AccountTree:
    """The accounts of a bundle, by id (empty when the repository declares none)."""

    accounts: Mapping[str, Account] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.accounts)

    def children(self, account_id: str) -> list[Account]:
        return sorted((a for a in self.accounts.values() if a.parent == account_id), key=lambda a: a.id)

    def roots(self) -> list[Account]:
        return sorted((a for a in self.accounts.values() if a.parent is None), key=lambda a: a.id)

    def subtree(self, account_id: str) -> Iterator[Account]:
        """The account and every account below it, parents first."""
        yield self.accounts[account_id]
        for child in self.children(account_id):
            yield from self.subtree(child.id)

    def ancestors(self, account_id: str) -> list[str]:
        """The account's parent, its parent's parent, … up to its root."""
        found = []
        parent = self.accounts[account_id].parent
        while parent is not None and parent in self.accounts and parent not in found:
            found.append(parent)
            parent = self.accounts[parent].parent
        return found

    def depth(self, account_id: str) -> int:
        return len(self.ancestors(account_id))

    def scope_of(self, account_id: str) -> AccountScope:
        """The scope of a budget attached to `account_id`."""
        return AccountScope(account_id, tuple(a.scope for a in self.subtree(account_id) if a.scope is not None))

    def account_of(self, namespace: str, labels: Mapping[str, str]) -> str | None:
        """The deepest account whose scope the run falls under (ties: the first id), or None."""
        best: tuple[int, str] | None = None
        for account in self.accounts.values():
            if account.scope is not None and account.scope.matches(namespace, labels):
                key = (-self.depth(account.id), account.id)
                if best is None or key < best:
                    best = key
        return best[1] if best is not None else None

    def walk(self) -> Iterator[tuple[Account, int]]:
        """Every account with its depth, parents first, children by id: the order the tree is
        shown in (`policy validate`, the demo, the page)."""

        def below(account: Account, depth: int) -> Iterator[tuple[Account, int]]:
            yield account, depth
            for child in self.children(account.id):
                yield from below(child, depth + 1)

        for root in self.roots():
            yield from below(root, 0)

    def lines(self) -> list[str]:
        """The tree as `policy validate` prints it, one account a line, indented by depth."""
        return [f"{'  ' * depth}{describe(account)}" for account, depth in self.walk()]


def describe(account: Account) -> str:
    """An account as the tree shows it: id, level, and the scope it covers."""
    what = account.scope.scope_id if account.own_scope is not None and account.scope is not None else "what the accounts below it cover"
    return f"{account.id} ({account.level}{', overcommit' if account.overcommit else ''}): {what}"


def attached_to(scope_id: str) -> str | None:
    """The account a budget's scope id names (`account=<id>`, AccountScope), or None."""
    return scope_id.removeprefix(ACCOUNT_PREFIX) if scope_id.startswith(ACCOUNT_PREFIX) else None


def build_tree(accounts: list[Account]) -> tuple[AccountTree, list[PolicyError]]:
    """The tree of `accounts` with each one's scope laid over its parent's, and every problem."""
    errors: list[PolicyError] = []
    by_id = {a.id: a for a in accounts}

    def error(account: Account, message: str) -> None:
        errors.append(PolicyError(account.source.file, account.source.line, message))

    broken: set[str] = set()
    for account in accounts:
        if account.parent is None:
            if account.level == "user":
                error(account, f"account {account.id!r} is a user: a user sits under a team (give it a parent)")
            continue
        parent = by_id.get(account.parent)
        if parent is None:
            error(account, f"account {account.id!r} has parent {account.parent!r}, which no Account document defines")
            broken.add(account.id)
            continue
        if LEVELS.index(parent.level) >= LEVELS.index(account.level):
            where = f"{parent.id!r}, a {parent.level}"
            error(account, f"account {account.id!r} is a {account.level} under {where}: a {account.level} sits under {_above(account.level)}")
        if account.level == "user" and parent.level != "team":
            error(account, f"account {account.id!r} is a user under {parent.id!r}, a {parent.level}: a user sits under a team")
    for account in accounts:
        cycle = _cycle(account.id, by_id)
        if cycle is not None and cycle[0] == account.id:
            error(account, f"accounts form a cycle: {' -> '.join([*cycle, cycle[0]])}")
            broken.update(cycle)
    resolved: dict[str, Account] = {}

    def resolve(account: Account) -> Account:
        if account.id in resolved:
            return resolved[account.id]
        parent_scope = None
        if account.parent is not None and account.parent in by_id and account.id not in broken and account.parent not in broken:
            parent_scope = resolve(by_id[account.parent]).scope
        scope = _laid_over(account, parent_scope, error)
        resolved[account.id] = done = replace(account, scope=scope)
        return done

    for account in accounts:
        resolve(account)
    tree = AccountTree(resolved)
    claimed: dict[str, Account] = {}
    for account in accounts:
        scope = resolved[account.id].scope
        if account.own_scope is not None and scope is not None:
            first = claimed.setdefault(scope.scope_id, account)
            if first is not account:
                error(account, f"accounts {first.id!r} ({first.source.file}:{first.source.line}) and {account.id!r} both claim scope {scope.scope_id}")
        if account.id not in broken and not any(a.scope is not None for a in tree.subtree(account.id)):
            error(account, f"account {account.id!r} covers no runs: give it a scope, or accounts below it that have one")
    return tree, errors


def _above(level: str) -> str:
    higher = LEVELS[: LEVELS.index(level)]
    return " or ".join(f"an {h}" if h[0] in "aeiou" else f"a {h}" for h in higher) if higher else "nothing (it is the top)"


def _cycle(start: str, by_id: Mapping[str, Account]) -> list[str] | None:
    """The cycle `start`'s parent chain runs into, from its smallest id, or None."""
    path: list[str] = []
    current: str | None = start
    while current is not None and current in by_id:
        if current in path:
            loop = path[path.index(current) :]
            first = loop.index(min(loop))
            return loop[first:] + loop[:first]
        path.append(current)
        current = by_id[current].parent
    return None


def _laid_over(account: Account, parent: Scope | None, error: Callable[[Account, str], None]) -> Scope | None:
    own = account.own_scope
    if own is None:
        return parent
    if parent is None:
        return own
    for key, value in own.labels.items():
        if key in parent.labels and parent.labels[key] != value:
            error(account, f"account {account.id!r} sets label {key}={value}, but its parent's scope says {key}={parent.labels[key]}")
    if own.namespaces and parent.namespaces and not own.namespaces <= parent.namespaces:
        outside = ", ".join(sorted(own.namespaces - parent.namespaces))
        error(account, f"account {account.id!r} names namespace(s) {outside} outside its parent's ({', '.join(sorted(parent.namespaces))})")
    return Scope(namespaces=own.namespaces or parent.namespaces, labels={**parent.labels, **own.labels})
