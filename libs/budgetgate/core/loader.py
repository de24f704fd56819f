"""Validate policy documents into a PolicyBundle, reporting every error with file and line."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from budgetgate.core.accounts import Account, AccountScope, AccountTree, build_tree
from budgetgate.core.documents import (
    API_VERSION,
    AccountSpec,
    PATTERN_MEANINGS,
    SPEC_MODELS,
    SUPPORTED_KINDS,
    BudgetPolicySpec,
    Document,
    RateCardSpec,
    ScopeDoc,
    did_you_mean,
    kind_problem,
    known_keys,
)
from budgetgate.core.policy import (
    BudgetPolicy,
    Enforcement,
    Limit,
    OnExhausted,
    PolicyBundle,
    Rate,
    RateCard,
    Scope,
    Source,
)
from budgetgate.core.quota_documents import ConcurrencyLimit, concurrency_checks, concurrency_fields, concurrency_limit
from budgetgate.core.policy_plan import limit_text
from budgetgate.core.units import Unit, limit_amount
from budgetgate.core.windows import FISCAL_YEAR, WindowSpec

# Re-exported: callers find the reading side of policies here too.
from budgetgate.core.policy_files import (
    MAX_FILE_BYTES,
    PolicyError,
    PolicyValidationError,
    SourceDocument,
    directory_files,
    parse_files,
    parse_text,
    read_directory,
    unstorable_text,
)

__all__ = [
    "MAX_FILE_BYTES",
    "LoadedPolicies",
    "PolicyError",
    "PolicyValidationError",
    "SkippedDocument",
    "SourceDocument",
    "build_bundle",
    "bundle_from_json",
    "directory_files",
    "documents_to_json",
    "load_directory",
    "load_files",
    "load_path",
    "parse_files",
    "parse_text",
    "read_directory",
    "skipped_documents",
]


@dataclass(frozen=True, slots=True)
class SkippedDocument:
    """A YAML document that is not a budgetgate document (a Kueue queue, a Grafana file)."""

    file: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.what}"


@dataclass(frozen=True, slots=True)
class LoadedPolicies:
    bundle: PolicyBundle
    documents: list[SourceDocument]
    skipped: list[SkippedDocument]


def skip_reason(doc: SourceDocument) -> str | None:
    """Why a document is not a budgetgate document, or None when it is one.

    A policy folder may hold other YAML (Kueue queues, Grafana provisioning): only documents with
    `apiVersion: budgetgate/v1` are read; a budgetgate kind without it is still an error."""
    data = doc.data
    if not isinstance(data, dict):
        return None
    version, kind = data.get("apiVersion"), data.get("kind")
    if version == API_VERSION:
        return None
    if isinstance(version, str) and version.startswith("budgetgate/"):
        return None  # a budgetgate document of another version: validation names the problem
    if version is None and kind in SUPPORTED_KINDS:
        return None
    what = f"apiVersion {version}" if version is not None else "no apiVersion"
    return f"skipped, not a budgetgate/v1 document ({what}" + (f", kind {kind})" if kind is not None else ")")


def skipped_documents(documents: Sequence[SourceDocument]) -> list[SkippedDocument]:
    return [SkippedDocument(d.file, d.line, reason) for d in documents if (reason := skip_reason(d)) is not None]


def budgetgate_documents(documents: Sequence[SourceDocument]) -> list[SourceDocument]:
    return [d for d in documents if skip_reason(d) is None]


def build_bundle(documents: Sequence[SourceDocument], *, git_sha: str, partial: bool = False) -> PolicyBundle:
    """Validate documents into a bundle; raises PolicyValidationError listing every problem.

    Documents that are not budgetgate documents are left out. `partial` (one file of a folder)
    leaves out the checks that need the rest of the folder (a RateCard, a Cluster)."""
    errors: list[PolicyError] = []
    policies: list[BudgetPolicy] = []
    rate_cards: list[RateCard] = []
    limits: list[ConcurrencyLimit] = []
    accounts: list[Account] = []
    budget_specs: list[tuple[str, BudgetPolicySpec, Source]] = []
    seen_ids: dict[tuple[str, str], SourceDocument] = {}
    rates_seen: dict[tuple[str, str, str | None, Any], str] = {}
    # Every document, not only budgetgate's: `POST /v1/policies` stores all it is sent.
    for doc in documents:
        errors.extend(unstorable_text(doc))
    for doc in budgetgate_documents(documents):
        parsed = _validate(doc, errors)
        if parsed is None:
            continue
        envelope, spec = parsed
        key = (envelope.kind, envelope.metadata.id)
        if key in seen_ids:
            first = seen_ids[key]
            errors.append(PolicyError(doc.file, doc.line, f"{envelope.kind} {envelope.metadata.id!r} is already defined at {first.file}:{first.line}"))
            continue
        seen_ids[key] = doc
        source = Source(doc.file, doc.line)
        if isinstance(spec, BudgetPolicySpec):
            budget_specs.append((envelope.metadata.id, spec, source))
        elif isinstance(spec, AccountSpec):
            accounts.append(_account(envelope.metadata.id, spec, source))
        elif isinstance(spec, RateCardSpec):
            errors.extend(_duplicate_rates(doc, spec, rates_seen))
            rate_cards.append(_rate_card(envelope.metadata.id, spec, source))
        else:
            limits.append(concurrency_limit(envelope.metadata.id, spec, source))
    tree, tree_errors = build_tree(accounts)
    errors.extend(tree_errors)
    for policy_id, spec, source in budget_specs:
        if spec.account is not None and spec.account not in tree.accounts:
            if not partial:  # one file of a folder: its accounts may be in another file
                unknown = f"policy {policy_id!r} is attached to account {spec.account!r}, which no Account document defines"
                errors.append(PolicyError(source.file, source.line, unknown))
            policies.append(_policy(policy_id, spec, source, AccountTree()))
        else:
            policies.append(_policy(policy_id, spec, source, tree))
    errors.extend(_cross_checks(policies, rate_cards, partial=partial))
    errors.extend(_account_checks(policies, tree))
    errors.extend(concurrency_checks(limits, partial=partial))
    if errors:
        raise PolicyValidationError(errors)
    return PolicyBundle(git_sha=git_sha, policies=tuple(policies), rate_cards=tuple(rate_cards), accounts=tree, **concurrency_fields(limits))


def _duplicate_rates(doc: SourceDocument, spec: RateCardSpec, seen: dict[tuple[str, str, str | None, Any], str]) -> list[PolicyError]:
    # Two rates for one flavor, region and date leave the price to document order: refuse.
    errors = []
    for i, rate in enumerate(spec.rates):
        key = (spec.currency, rate.flavor, rate.region, rate.effective_from)
        line = doc.line_of(("spec", "rates", i))
        first = seen.setdefault(key, f"{doc.file}:{line}")
        if first != f"{doc.file}:{line}":
            when = f" from {rate.effective_from.isoformat()}" if rate.effective_from else ""
            errors.append(
                PolicyError(
                    doc.file,
                    line,
                    f"a second rate for flavor {rate.flavor!r}" + (f" in region {rate.region!r}" if rate.region else "") + f"{when}; the first is at {first}",
                )
            )
    return errors


def _validate(doc: SourceDocument, errors: list[PolicyError]) -> tuple[Document, BaseModel] | None:
    if not isinstance(doc.data, dict):
        errors.append(PolicyError(doc.file, doc.line, "a policy document must be a mapping with apiVersion, kind, metadata and spec"))
        return None
    try:
        envelope = Document.model_validate(doc.data)
    except ValidationError as exc:
        errors.extend(_errors(doc, exc, (), Document))
        return None
    problem = kind_problem(envelope.kind)
    if problem is not None:
        errors.append(PolicyError(doc.file, doc.line_of(("kind",)), problem))
        return None
    try:
        spec = SPEC_MODELS[envelope.kind].model_validate(envelope.spec)
    except ValidationError as exc:
        errors.extend(_errors(doc, exc, ("spec",), SPEC_MODELS[envelope.kind]))
        return None
    return envelope, spec


def _errors(doc: SourceDocument, exc: ValidationError, prefix: tuple[Any, ...], model: type[BaseModel]) -> list[PolicyError]:
    result = []
    for err in exc.errors():
        loc = tuple(part for part in err["loc"] if not (isinstance(part, str) and part.startswith("function-")))
        path = ".".join(str(p) for p in (*prefix, *loc))
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "string_pattern_mismatch":
            meaning = PATTERN_MEANINGS.get(err.get("ctx", {}).get("pattern", ""), "")
            message = f"{err['input']!r} is not {meaning}" if meaning else message
        elif err["type"] == "extra_forbidden" and loc:
            message = "unknown key" + did_you_mean(str(loc[-1]), known_keys(model, loc[:-1]))
        result.append(PolicyError(doc.file, doc.line_of((*prefix, *loc)), f"{path}: {message}" if path else message))
    return result


def _policy(policy_id: str, spec: BudgetPolicySpec, source: Source, tree: AccountTree) -> BudgetPolicy:
    limit = spec.limit
    unit, value = next((u, getattr(limit, u.value)) for u in Unit if getattr(limit, u.value) is not None)
    if spec.account is not None:
        # An account no document defines (one file checked alone) covers nothing.
        scope: Scope | AccountScope = tree.scope_of(spec.account) if spec.account in tree.accounts else AccountScope(spec.account, ())
    else:
        assert spec.scope is not None  # the spec holds one of them
        scope = _scope(spec.scope)
    return BudgetPolicy(
        id=policy_id,
        scope=scope,
        window=_window(spec),
        limit=Limit(unit=unit, amount=limit_amount(unit, value), currency=limit.currency),
        enforcement=Enforcement(spec.enforcement),
        on_exhausted=OnExhausted(spec.on_exhausted),
        source=source,
    )


def _scope(doc: ScopeDoc) -> Scope:
    return Scope(namespaces=doc.namespace_set(), labels=dict(doc.labels))


def _account(account_id: str, spec: AccountSpec, source: Source) -> Account:
    own = _scope(spec.scope) if spec.scope is not None else None
    return Account(id=account_id, level=spec.level, parent=spec.parent, own_scope=own, overcommit=spec.overcommit, source=source)


def _account_checks(policies: Sequence[BudgetPolicy], tree: AccountTree) -> list[PolicyError]:
    """A budget of an account gives it no more than a budget of any account above it in the
    same unit and window, unless that account declares overcommit."""
    errors = []
    attached = [(p.scope.account, p) for p in policies if isinstance(p.scope, AccountScope) and p.scope.account in tree.accounts]
    by_account: dict[str, list[BudgetPolicy]] = {}
    for account_id, policy in attached:
        by_account.setdefault(account_id, []).append(policy)
    for account_id, policy in attached:
        for above in tree.ancestors(account_id):
            if tree.accounts[above].overcommit:
                continue
            for parent_policy in by_account.get(above, ()):
                same = (parent_policy.limit.unit, parent_policy.limit.currency, _layout(parent_policy.window))
                if same == (policy.limit.unit, policy.limit.currency, _layout(policy.window)) and (policy.limit.amount > parent_policy.limit.amount):
                    errors.append(
                        PolicyError(
                            policy.source.file,
                            policy.source.line,
                            f"policy {policy.id!r} gives account {account_id!r} {limit_text(policy)}, more than {limit_text(parent_policy)} "
                            f"of {parent_policy.id!r} on {above!r} above it; lower it, or declare overcommit: true on {above!r}",
                        )
                    )
    return errors


def _layout(window: WindowSpec) -> tuple[str | None, int | None, int | None]:
    """What makes two windows one ledger's (the time zone aside, as `_cross_checks` says)."""
    return window.calendar, window.rolling_days, window.start_month


def _window(spec: BudgetPolicySpec) -> WindowSpec:
    fiscal = spec.window.fiscal_year
    if fiscal is not None:
        return WindowSpec(calendar=FISCAL_YEAR, timezone=spec.window.timezone, start_month=fiscal.start_month)
    return WindowSpec(calendar=spec.window.calendar, timezone=spec.window.timezone, rolling_days=spec.window.rolling_days)


def _rate_card(card_id: str, spec: RateCardSpec, source: Source) -> RateCard:
    rates = tuple(Rate(r.flavor, r.rate_per_gpu_hour, r.region, r.effective_from) for r in spec.rates)
    return RateCard(id=card_id, currency=spec.currency, rates=rates, source=source, unknown_flavor=spec.unknown_flavor)


def _cross_checks(policies: Sequence[BudgetPolicy], rate_cards: Sequence[RateCard], *, partial: bool) -> list[PolicyError]:
    errors = []
    ledgers: dict[tuple[str, str | None, int | None, int | None, Unit], BudgetPolicy] = {}
    for policy in policies:
        # One ledger per scope, window and unit: two policies on it would fight over its limit.
        # The time zone is left out on purpose: `UTC` and `Etc/UTC` (or London in winter) lay
        # out the same windows, and two calendars of one kind in different zones on one scope
        # are a mistake either way.
        identity = (policy.scope.scope_id, policy.window.calendar, policy.window.rolling_days, policy.window.start_month, policy.limit.unit)
        other = ledgers.setdefault(identity, policy)
        if other is not policy:
            errors.append(
                PolicyError(
                    policy.source.file,
                    policy.source.line,
                    f"policy {policy.id!r} budgets the same scope, window and unit as {other.id!r} ({other.source.file}:{other.source.line}); merge them",
                )
            )
        if not partial and policy.limit.unit is Unit.COST and not any(card.currency == policy.limit.currency for card in rate_cards):
            errors.append(
                PolicyError(
                    policy.source.file,
                    policy.source.line,
                    f"policy {policy.id!r} limits cost in {policy.limit.currency} but no RateCard is in {policy.limit.currency}",
                )
            )
    currencies = {card.currency for card in rate_cards}
    if len(currencies) > 1:
        for card in rate_cards:
            errors.append(PolicyError(card.source.file, card.source.line, f"rate cards use several currencies ({', '.join(sorted(currencies))}); use one"))
    return errors


def load_files(files: Iterable[tuple[str, bytes | OSError]], *, git_sha: str, partial: bool = False) -> LoadedPolicies:
    """Read and validate policy files; raises PolicyValidationError listing every problem of
    every file at once."""
    documents, errors = parse_files(files)
    bundle = None
    try:
        bundle = build_bundle(documents, git_sha=git_sha, partial=partial)
    except PolicyValidationError as exc:
        errors.extend(exc.errors)
    if errors or bundle is None:
        raise PolicyValidationError(errors)
    return LoadedPolicies(bundle, budgetgate_documents(documents), skipped_documents(documents))


def load_path(path: Path, *, git_sha: str) -> LoadedPolicies:
    """A policy folder as it is on disk, or one file of it (checked on its own)."""
    return load_files(directory_files(path), git_sha=git_sha, partial=path.is_file())


def load_directory(directory: Path, *, git_sha: str) -> tuple[PolicyBundle, list[SourceDocument]]:
    """Read and validate a policy directory (its budgetgate documents)."""
    loaded = load_path(directory, git_sha=git_sha)
    return loaded.bundle, loaded.documents


def documents_to_json(documents: Sequence[SourceDocument]) -> str:
    """The documents as stored in Postgres and published on budget.policies.v1."""
    return json.dumps([{"file": d.file, "line": d.line, "data": d.data} for d in documents], default=str, sort_keys=True)


def bundle_from_json(text: str, *, git_sha: str) -> PolicyBundle:
    """A bundle rebuilt from stored documents, through the same validation as a directory."""
    docs = [SourceDocument(d["file"], d["line"], d["data"], {}) for d in json.loads(text)]
    return build_bundle(docs, git_sha=git_sha)
