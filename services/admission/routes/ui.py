"""The page for tenants and finance, read-only: `GET /ui` shows the account tree with this month's
chargeback rolled up it (by tenant without an account tree), each budget's burn-down across its
current window, and the recent decisions; `GET /ui/decisions/{run_id}` explains one decision;
`GET /ui/chargeback.csv` downloads the month's chargeback.

A browser signs in by pasting its API token or OIDC token into `/ui/sign-in`; it is kept in an
HttpOnly, SameSite=Strict cookie and checked on every request by the same Gate as the API
(budgetgate.edge.auth), so it stands for the same Principal, with the same role (read) and the
same namespace and tenant limits. `Authorization: Bearer` works too. The only POSTs are sign-in
and sign-out, behind a double-submit CSRF token (services/admission/pages.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from budgetgate.core.accounts import attached_to
from budgetgate.access.tokens import PREFIX
from budgetgate.core.principals import Action, Forbidden, Principal, Unauthenticated
from budgetgate.decisions.explain import explanation, recompute
from budgetgate.edge.auth import CheckUnavailable, RateLimited, gate_of
from budgetgate.ledger.archive import archived_decision
from budgetgate.ledger.queries import owned_by
from budgetgate.reports.budgets import readings
from budgetgate.reports.burndown import burn_downs
from budgetgate.reports.chargeback import ReportError, ReportRequest, as_csv, chargeback
from budgetgate.reports.recent import recent_decisions
from budgetgate.reports.usage import UserSettings
from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.services.admission import pages
from budgetgate.services.admission.access import archived_problem, require_submission, sees_budget
from budgetgate.services.admission.pages import TOKEN_COOKIE, BadForm

sql = owned_by("budgetgate.services.admission")

router = APIRouter(include_in_schema=False)

RECENT = 50
_MONTH = re.compile(r"([0-9]{4})-([0-9]{2})")


class Shown(Exception):
    """A page answered instead of the one asked for (sign-in, a refusal, an error)."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def _error(request: Request, status: int, title: str, message: str, *, principal: Principal | None = None, headers: dict[str, str] | None = None) -> Shown:
    response = pages.render(request, "error.html", status=status, title=title, message=message, principal=principal)
    response.headers.update(headers or {})
    return Shown(response)


def _to_sign_in(request: Request, *, notice: str | None = None, clear: bool = False) -> Shown:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    location = f"/ui/sign-in?next={quote(pages.next_path(target), safe='/')}" + (f"&notice={notice}" if notice else "")
    response = RedirectResponse(location, status_code=303, headers=pages.page_headers())
    if clear:
        pages.clear_cookie(request, response, TOKEN_COOKIE)
    return Shown(response)


async def _check(request: Request, headers: list[tuple[bytes, bytes]]) -> Principal:
    """The principal of `headers`' credential, allowed to read; raises Shown for 403, 429 and 503."""
    if getattr(request.app.state, "gate", None) is None:  # not a bad credential: the service is starting
        raise _error(request, 503, "Unavailable", "the service is starting; credentials cannot be checked yet", headers={"Retry-After": "1"})
    try:
        return await gate_of(request.app).check(headers, Action.READ, scope=request.scope)
    except Forbidden as exc:
        raise _error(request, 403, "Not allowed", str(exc)) from None
    except RateLimited as exc:
        raise _error(request, 429, "Too many requests", str(exc), headers={"Retry-After": str(exc.retry_after)}) from None
    except CheckUnavailable as exc:
        raise _error(request, 503, "Unavailable", str(exc), headers={"Retry-After": "1"}) from None


async def _reader(request: Request) -> Principal:
    """The reader: from `Authorization: Bearer` when sent, else from the page's cookie. An
    anonymous reader is sent to sign in; a cookie no longer valid is cleared on the way."""
    if "authorization" in request.headers:
        try:
            return await _check(request, list(request.scope["headers"]))
        except Unauthenticated as exc:
            raise _error(request, 401, "Not signed in", str(exc), headers={"WWW-Authenticate": 'Bearer realm="budgetgate"'}) from None
    kept = request.cookies.get(TOKEN_COOKIE)
    if not kept:
        raise _to_sign_in(request)
    try:
        secret = pages.credential(kept)
        return await _check(request, [(b"authorization", f"Bearer {secret}".encode("ascii"))])
    except (BadForm, Unauthenticated):
        raise _to_sign_in(request, notice="expired", clear=True) from None


def _rt(request: Request) -> Any:
    rt = request.app.state.rt
    if rt.policies.current is None:
        raise _error(request, 503, "Unavailable", "no policy bundle has been applied yet", headers={"Retry-After": "1"})
    return rt


def _month(request: Request, text: str | None, now: datetime) -> tuple[datetime, datetime]:
    """[first of the month, first of the next) in UTC: of `text` (YYYY-MM), else this month."""
    if text is None:
        year, month = now.year, now.month
    else:
        found = _MONTH.fullmatch(text)
        if found is None or not 1 <= int(found[2]) <= 12 or not 1 <= int(found[1]) <= 9998:
            raise _error(request, 400, "Bad request", f"month: {text[:40]!r} is not a month written YYYY-MM, e.g. 2026-11")
        year, month = int(found[1]), int(found[2])
    start = datetime(year, month, 1, tzinfo=UTC)
    end = datetime(year + month // 12, month % 12 + 1, 1, tzinfo=UTC)
    return start, end


def _narrowed(request: Request, principal: Principal, tenant: str | None) -> tuple[Callable[[str, str | None], bool] | None, tuple[str, ...]]:
    """What the reader sees (None: everything) and the tenants it is limited to, narrowed to
    `tenant` when asked; raises Shown (403) when the reader's limits do not cover that tenant."""
    if tenant is None:
        return (None if principal.unscoped else principal.covers), principal.tenants
    if len(tenant) > 200:
        raise _error(request, 400, "Bad request", "tenant: longer than 200 characters", principal=principal)
    if not principal.covers_tenant(tenant):
        raise _error(request, 403, "Not allowed", f"{principal.name!r} may not see tenant {tenant!r} (allowed tenants: {', '.join(principal.tenants)})")
    return (lambda namespace, owner: owner == tenant and principal.covers(namespace, owner)), (tenant,)


async def _report(request: Request, rt: Any, principal: Principal, month: str | None, tenant: str | None) -> dict[str, Any]:
    sees, _ = _narrowed(request, principal, tenant)
    start, end = _month(request, month, datetime.now(UTC))
    bundle = rt.policies.current
    asked = ReportRequest.parse(start.isoformat(), end.isoformat(), ["account"] if bundle.accounts else ["tenant"], "none")
    try:
        return await chargeback(rt.pool, bundle, asked, tenant_label=rt.settings.tenant_label, user_label=_user_label(rt), sees=sees)
    except ReportError as exc:
        raise _error(request, 400, "Bad request", f"{exc.field}: {exc}", principal=principal) from None
    except BACKEND_ERRORS as exc:
        raise _error(request, 503, "Unavailable", f"Postgres unavailable: {exc}", principal=principal, headers={"Retry-After": "1"}) from None


def _user_label(rt: Any) -> str:
    return getattr(rt.settings, "user_label", None) or UserSettings().user_label


def _tree(bundle: Any, report: dict[str, Any], budgets: list[Any], *, everything: bool) -> list[dict[str, Any]]:
    """The account tree, parents first, each account with its roll-up and the budgets attached
    to it; a limited reader sees only the accounts its runs fall under and those above them."""
    tree = bundle.accounts
    rows = {row["account"]: row for row in report["rows"]}
    shown = set(tree.accounts) if everything else {a for a in rows if a is not None}
    for account in list(shown):
        shown.update(tree.ancestors(account))
    attached: dict[str, list[str]] = {}
    for burn in budgets:
        owner = attached_to(burn["scope_id"])
        if owner is not None:
            attached.setdefault(owner, []).append(burn["policy_id"])
    # An account is shown with every account above it, so a walk that skips the ones not shown
    # skips none whose descendants are.
    return [
        {"id": account.id, "level": account.level, "depth": depth, "figures": rows.get(account.id), "budgets": attached.get(account.id, [])}
        for account, depth in tree.walk()
        if account.id in shown
    ]


@router.get("/ui")
async def dashboard(request: Request, month: str | None = None, tenant: str | None = None) -> Response:
    try:
        principal = await _reader(request)
        rt = _rt(request)
        sees, tenants = _narrowed(request, principal, tenant)
        bundle = rt.policies.current
        label = rt.settings.tenant_label
        visible = bundle.restricted_to(
            lambda p: (principal.unscoped or sees_budget(principal, p.scope, tenant_label=label)) and (tenant is None or p.scope.labels.get(label) == tenant)
        )
        report = await _report(request, rt, principal, month, tenant)
        now = datetime.now(UTC)
        try:
            async with rt.pool.acquire() as conn:
                read = await readings(conn, visible, now)
                burns = await burn_downs(conn, read, now)
                decisions, partial = await recent_decisions(conn, limit=RECENT, tenant_label=label, tenants=tenants, sees=sees)
        except BACKEND_ERRORS as exc:
            raise _error(request, 503, "Unavailable", f"Postgres unavailable: {exc}", principal=principal, headers={"Retry-After": "1"}) from None
    except Shown as shown:
        return shown.response
    budgets = []
    for reading, burn in zip(read, burns, strict=True):
        policy = reading.policy
        unit_name = pages.UNIT_NAMES[policy.limit.unit] or (policy.limit.currency or "")
        budgets.append({
            "policy_id": policy.id,
            "scope_id": policy.scope.scope_id,
            "unit": unit_name,
            "window_key": reading.window.key,
            "figures": burn.figures(),
            "shown": {name: pages.number(value, policy.limit.unit) for name, value in burn.figures().items() if isinstance(value, float)},
            "held": reading.held,
            "chart": pages.chart(burn, unit_name),
        })  # fmt: skip
    everything = principal.unscoped and tenant is None
    return pages.render(
        request,
        "dashboard.html",
        principal=principal,
        tenant=tenant,
        month=report["from"][:7],
        report=report,
        by_account=bool(bundle.accounts),
        tree=_tree(bundle, report, budgets, everything=everything) if bundle.accounts else [],
        budgets=budgets,
        decisions=decisions,
        partial=partial,
        recent=RECENT,
        quote=quote,
    )


@router.get("/ui/chargeback.csv")
async def chargeback_csv(request: Request, month: str | None = None, tenant: str | None = None) -> Response:
    try:
        principal = await _reader(request)
        rt = _rt(request)
        report = await _report(request, rt, principal, month, tenant)
    except Shown as shown:
        return shown.response
    name = f"chargeback-{report['from'][:7]}{'-' + re.sub(r'[^A-Za-z0-9._-]', '_', tenant) if tenant else ''}.csv"
    headers = {"Content-Disposition": f'attachment; filename="{name}"', "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}
    return Response(as_csv(report), media_type="text/csv; charset=utf-8", headers=headers)


@router.get("/ui/decisions/{run_id:path}")
async def decision(request: Request, run_id: str) -> Response:
    try:
        principal = await _reader(request)
        rt = _rt(request)
        if not run_id or len(run_id) > 512:
            raise _error(request, 400, "Bad request", "run_id: between 1 and 512 characters", principal=principal)
        try:
            async with rt.pool.acquire() as conn:
                row = await conn.fetchrow(sql("decision_inputs"), run_id)
                bundle = await rt.policies.under(conn, row["policy_bundle_sha"], row["override_revision"]) if row is not None else None
                gone = await archived_decision(conn, run_id) if row is None else None
        except BACKEND_ERRORS as exc:
            raise _error(request, 503, "Unavailable", f"Postgres unavailable: {exc}", principal=principal, headers={"Retry-After": "1"}) from None
        if gone is not None:
            raise _error(request, 410, "Archived", archived_problem(principal, gone)["detail"], principal=principal)
        if row is None:
            raise _error(request, 404, "Not found", f"no decision for run {run_id!r}", principal=principal)
        asked = row["request"] if isinstance(row["request"], dict) else json.loads(row["request"])
        try:
            require_submission(principal, namespace=asked["namespace"], labels=asked.get("labels") or {}, tenant_label=rt.settings.tenant_label)
        except Forbidden as exc:
            raise _error(request, 403, "Not allowed", str(exc), principal=principal) from None
    except Shown as shown:
        return shown.response
    found = explanation(recompute(dict(row), bundle), bundle)
    return pages.render(request, "decision.html", principal=principal, found=found, asked=asked)


@router.get("/ui/sign-in")
async def sign_in_form(request: Request, next: str | None = None, notice: str | None = None) -> Response:  # noqa: A002 - the parameter's public name
    message = {"expired": "Your token is unknown, revoked or expired: sign in again.", "out": "You are signed out."}.get(notice or "")
    return pages.render(request, "sign_in.html", next=pages.next_path(next), notice=message, error=None, principal=None)


@router.post("/ui/sign-in")
async def sign_in(request: Request) -> Response:
    target = "/ui"
    try:
        form = await pages.form_of(request)
        target = pages.next_path(form.get("next"))
        secret = pages.credential(form.get("token"))
        await _check(request, [(b"authorization", f"Bearer {secret}".encode("ascii"))])
    except BadForm as exc:
        status = 403 if exc.field == "csrf" else 400
        return pages.render(request, "sign_in.html", status=status, next=target, notice=None, error=str(exc), principal=None)
    except Unauthenticated as exc:
        kind = "API token" if form.get("token", "").strip().startswith(PREFIX) else "token"
        return pages.render(request, "sign_in.html", status=401, next=target, notice=None, error=f"token: {kind} not accepted: {exc}", principal=None)
    except Shown as shown:
        return shown.response
    response = RedirectResponse(target, status_code=303, headers=pages.page_headers())
    pages.set_cookie(request, response, TOKEN_COOKIE, secret)
    return response


@router.post("/ui/sign-out")
async def sign_out(request: Request) -> Response:
    try:
        await pages.form_of(request)
    except BadForm as exc:
        return _error(request, 403 if exc.field == "csrf" else 400, "Refused", str(exc)).response
    response = RedirectResponse("/ui/sign-in?notice=out", status_code=303, headers=pages.page_headers())
    pages.clear_cookie(request, response, TOKEN_COOKIE)
    return response
