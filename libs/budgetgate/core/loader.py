"""Read a directory of policy YAML into a PolicyBundle, reporting every error with file and line."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from pydantic import BaseModel, ValidationError

from budgetgate.core.documents import PATTERN_MEANINGS, SPEC_MODELS, BudgetPolicySpec, Document, RateCardSpec, kind_problem
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
from budgetgate.core.units import Unit, to_amount
from budgetgate.core.windows import WindowSpec

MAX_FILE_BYTES = 1 << 20
# Keys whose values are names, not numbers: `cost-center: 1042` means the string "1042".
_RAW_SCALAR_PARENTS = frozenset({"labels", "id", "namespace", "namespaces", "flavor", "region"})


@dataclass(frozen=True, slots=True)
class PolicyError:
    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


class PolicyValidationError(ValueError):
    """One or more policy documents are invalid; `errors` lists each with file and line."""

    def __init__(self, errors: Sequence[PolicyError]) -> None:
        self.errors = tuple(sorted(errors, key=lambda e: (e.file, e.line, e.message)))
        super().__init__("\n".join(str(e) for e in self.errors))


@dataclass(frozen=True, slots=True)
class SourceDocument:
    """One YAML document as read, with a map from field paths to lines for error messages."""

    file: str
    line: int
    data: Any
    lines: dict[tuple[Any, ...], int]

    def line_of(self, path: Iterable[Any]) -> int:
        path = tuple(path)
        while path and path not in self.lines:
            path = path[:-1]
        return self.lines.get(path, self.line)


def read_directory(directory: Path) -> list[SourceDocument]:
    """Every document of every *.yaml / *.yml file below `directory`, in path order."""
    documents, errors = _read_directory(directory)
    if errors:
        raise PolicyValidationError(errors)
    return documents


def _read_directory(directory: Path) -> tuple[list[SourceDocument], list[PolicyError]]:
    # Documents of the readable files and the errors of the others, so that a syntax error in
    # one file does not hide what is wrong with the rest.
    if not directory.is_dir():
        raise PolicyValidationError([PolicyError(str(directory), 0, "not a directory")])
    documents: list[SourceDocument] = []
    errors: list[PolicyError] = []
    files = sorted(p for p in directory.rglob("*") if p.suffix in (".yaml", ".yml") and ".git" not in p.parts)
    for path in files:
        name = path.relative_to(directory).as_posix()
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                errors.append(PolicyError(name, 0, f"file is larger than {MAX_FILE_BYTES} bytes"))
                continue
            documents.extend(parse_text(path.read_text(encoding="utf-8"), name))
        except PolicyValidationError as exc:
            errors.extend(exc.errors)
        except (OSError, UnicodeDecodeError) as exc:
            errors.append(PolicyError(name, 0, f"cannot read file: {exc}"))
    return documents, errors


def parse_text(text: str, file: str) -> list[SourceDocument]:
    """The documents of one YAML text; YAML syntax errors carry their line."""
    try:
        nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 0
        raise PolicyValidationError([PolicyError(file, line, f"invalid YAML: {getattr(exc, 'problem', exc)}")]) from exc
    documents = []
    for node in nodes:
        if node is None:
            continue
        lines: dict[tuple[Any, ...], int] = {}
        data = _to_python(node, (), lines, raw=False)
        documents.append(SourceDocument(file, node.start_mark.line + 1, data, lines))
    return documents


def _to_python(node: yaml.Node, path: tuple[Any, ...], lines: dict[tuple[Any, ...], int], *, raw: bool) -> Any:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        result: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            result[key] = _to_python(value_node, (*path, key), lines, raw=raw or key in _RAW_SCALAR_PARENTS)
            lines[(*path, key)] = key_node.start_mark.line + 1
        return result
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(item, (*path, i), lines, raw=raw) for i, item in enumerate(node.value)]
    if raw and node.tag != "tag:yaml.org,2002:null":
        return node.value
    if node.tag == "tag:yaml.org,2002:float":
        # Limits and rates are exact decimals; going through float would round 3.933.
        try:
            return Decimal(node.value.replace("_", ""))
        except ArithmeticError:
            pass  # .inf / .nan: let validation reject them by name
    return SafeConstructor().construct_object(node, deep=True)


def build_bundle(documents: Sequence[SourceDocument], *, git_sha: str) -> PolicyBundle:
    """Validate documents into a bundle; raises PolicyValidationError listing every problem."""
    errors: list[PolicyError] = []
    policies: list[BudgetPolicy] = []
    rate_cards: list[RateCard] = []
    limits: list[ConcurrencyLimit] = []
    seen_ids: dict[tuple[str, str], SourceDocument] = {}
    for doc in documents:
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
            policies.append(_policy(envelope.metadata.id, spec, source))
        elif isinstance(spec, RateCardSpec):
            rate_cards.append(_rate_card(envelope.metadata.id, spec, source))
        else:
            limits.append(concurrency_limit(envelope.metadata.id, spec, source))
    errors.extend(_cross_checks(policies, rate_cards))
    errors.extend(concurrency_checks(limits))
    if errors:
        raise PolicyValidationError(errors)
    return PolicyBundle(git_sha=git_sha, policies=tuple(policies), rate_cards=tuple(rate_cards), **concurrency_fields(limits))


def _validate(doc: SourceDocument, errors: list[PolicyError]) -> tuple[Document, BaseModel] | None:
    if not isinstance(doc.data, dict):
        errors.append(PolicyError(doc.file, doc.line, "a policy document must be a mapping with apiVersion, kind, metadata and spec"))
        return None
    try:
        envelope = Document.model_validate(doc.data)
    except ValidationError as exc:
        errors.extend(_errors(doc, exc, ()))
        return None
    problem = kind_problem(envelope.kind)
    if problem is not None:
        errors.append(PolicyError(doc.file, doc.line_of(("kind",)), problem))
        return None
    try:
        spec = SPEC_MODELS[envelope.kind].model_validate(envelope.spec)
    except ValidationError as exc:
        errors.extend(_errors(doc, exc, ("spec",)))
        return None
    return envelope, spec


def _errors(doc: SourceDocument, exc: ValidationError, prefix: tuple[Any, ...]) -> list[PolicyError]:
    result = []
    for err in exc.errors():
        loc = tuple(part for part in err["loc"] if not (isinstance(part, str) and part.startswith("function-")))
        path = ".".join(str(p) for p in (*prefix, *loc))
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "string_pattern_mismatch":
            meaning = PATTERN_MEANINGS.get(err.get("ctx", {}).get("pattern", ""), "")
            message = f"{err['input']!r} is not {meaning}" if meaning else message
        result.append(PolicyError(doc.file, doc.line_of((*prefix, *loc)), f"{path}: {message}" if path else message))
    return result


def _policy(policy_id: str, spec: BudgetPolicySpec, source: Source) -> BudgetPolicy:
    limit = spec.limit
    unit, value = next((u, getattr(limit, u.value)) for u in Unit if getattr(limit, u.value) is not None)
    return BudgetPolicy(
        id=policy_id,
        scope=Scope(namespaces=spec.scope.namespace_set(), labels=dict(spec.scope.labels)),
        window=WindowSpec(calendar=spec.window.calendar, timezone=spec.window.timezone, rolling_days=spec.window.rolling_days),
        limit=Limit(unit=unit, amount=to_amount(unit, value), currency=limit.currency),
        enforcement=Enforcement(spec.enforcement),
        on_exhausted=OnExhausted(spec.on_exhausted),
        source=source,
    )


def _rate_card(card_id: str, spec: RateCardSpec, source: Source) -> RateCard:
    rates = tuple(Rate(r.flavor, r.rate_per_gpu_hour, r.region, r.effective_from) for r in spec.rates)
    return RateCard(id=card_id, currency=spec.currency, rates=rates, source=source)


def _cross_checks(policies: Sequence[BudgetPolicy], rate_cards: Sequence[RateCard]) -> list[PolicyError]:
    errors = []
    ledgers: dict[tuple[str, str | None, int | None, Unit], BudgetPolicy] = {}
    for policy in policies:
        # One ledger per scope, window and unit: two policies on it would fight over its limit.
        # The time zone is left out on purpose: `UTC` and `Etc/UTC` (or London in winter) lay
        # out the same windows, and two calendars of one kind in different zones on one scope
        # are a mistake either way.
        identity = (policy.scope.scope_id, policy.window.calendar, policy.window.rolling_days, policy.limit.unit)
        other = ledgers.setdefault(identity, policy)
        if other is not policy:
            errors.append(PolicyError(policy.source.file, policy.source.line, f"policy {policy.id!r} budgets the same scope, window and unit as {other.id!r} ({other.source.file}:{other.source.line}); merge them"))
        if policy.limit.unit is Unit.COST and not any(card.currency == policy.limit.currency for card in rate_cards):
            errors.append(PolicyError(policy.source.file, policy.source.line, f"policy {policy.id!r} limits cost in {policy.limit.currency} but no RateCard is in {policy.limit.currency}"))
    currencies = {card.currency for card in rate_cards}
    if len(currencies) > 1:
        for card in rate_cards:
            errors.append(PolicyError(card.source.file, card.source.line, f"rate cards use several currencies ({', '.join(sorted(currencies))}); use one"))
    return errors


def load_directory(directory: Path, *, git_sha: str) -> tuple[PolicyBundle, list[SourceDocument]]:
    """Read and validate a policy directory; raises PolicyValidationError listing every problem
    of every file at once."""
    documents, errors = _read_directory(directory)
    try:
        bundle = build_bundle(documents, git_sha=git_sha)
    except PolicyValidationError as exc:
        errors.extend(exc.errors)
    if errors:
        raise PolicyValidationError(errors)
    return bundle, documents


def documents_to_json(documents: Sequence[SourceDocument]) -> str:
    """The documents as stored in Postgres and published on budget.policies.v1."""
    return json.dumps([{"file": d.file, "line": d.line, "data": d.data} for d in documents], default=str, sort_keys=True)


def bundle_from_json(text: str, *, git_sha: str) -> PolicyBundle:
    """A bundle rebuilt from stored documents, through the same validation as a directory."""
    docs = [SourceDocument(d["file"], d["line"], d["data"], {}) for d in json.loads(text)]
    return build_bundle(docs, git_sha=git_sha)
