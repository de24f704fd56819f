"""The page for tenants and finance over plain HTTP, on a known ledger in a real Postgres and
Redis: an anonymous reader is sent to sign in, a bad token is refused, a limited reader sees only
its own, the CSV is this month's chargeback, sign-out forgets the token, a form without its CSRF
token changes nothing, and a label made of HTML is shown as text."""

from __future__ import annotations

import csv
import html
import io
import re

import httpx
import pytest

from budgetgate.core.principals import Role
from budgetgate.reports.chargeback import AMOUNTS
from tests.support.oidc import AUDIENCE, ISSUER, Issuer
from tests.support.known_ledger import ACCOUNTS, BUDGETS, EVIL, write_known_ledger
from tests.support.principals import bearer, issue, ledger_state

TOKEN_COOKIE = "budgetgate_ui_token"


@pytest.fixture
async def ui(admission_factory, pg_dsn):  # type: ignore[no-untyped-def]
    await write_known_ledger(pg_dsn)
    server = await admission_factory()
    await server.wait_ready()
    return server


def browser(server) -> httpx.AsyncClient:  # type: ignore[no-untyped-def]
    """A client like a browser's: no Authorization header, cookies kept, redirects not followed."""
    return httpx.AsyncClient(base_url=server.url, timeout=30)


async def sign_in(client: httpx.AsyncClient, token: str) -> None:
    """Sign in as a browser does: the form's page (and its CSRF cookie), then the form."""
    form = await client.get("/ui/sign-in")
    assert form.status_code == 200
    csrf = re.search(r'name="csrf" value="([^"]+)"', form.text)[1]  # type: ignore[index]
    answer = await client.post("/ui/sign-in", data={"csrf": csrf, "token": token, "next": "/ui"})
    assert answer.status_code == 303 and answer.headers["location"] == "/ui", answer.text
    cookie = answer.headers["set-cookie"]
    assert TOKEN_COOKIE in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie, cookie


def csrf_of(page: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', page)[1]  # type: ignore[index]


def figure(page: str, policy: str, name: str) -> float:
    article = page.split(f'id="budget-{policy}"', 1)[1].split("</article>", 1)[0]
    return float(re.search(rf'data-figure="{name}">([0-9.,]+)<', article)[1].replace(",", ""))  # type: ignore[index]


def account_row(page: str, account: str) -> list[float]:
    row = page.split(f'data-account="{account}"', 1)[1].split("</tr>", 1)[0]
    return [float(v.replace(",", "")) for v in re.findall(r'<td class="num">([0-9.,]+)</td>', row)]


async def test_an_anonymous_reader_is_sent_to_sign_in(ui) -> None:
    async with browser(ui) as client:
        for path in ("/ui", "/ui/chargeback.csv", "/ui/decisions/ui/vision-1"):
            answer = await client.get(path)
            assert answer.status_code == 303, (path, answer.text)
            assert answer.headers["location"].startswith("/ui/sign-in?next=" + path.split("?")[0]), answer.headers["location"]
        form = await client.get(answer.headers["location"])
        assert form.status_code == 200 and 'action="/ui/sign-in"' in form.text and 'type="password"' in form.text
        assert "script-src" not in form.headers["content-security-policy"] and "default-src 'none'" in form.headers["content-security-policy"]


async def test_a_bad_token_is_refused_and_sets_nothing(ui, pg_dsn) -> None:
    async with browser(ui) as client:
        csrf = csrf_of((await client.get("/ui/sign-in")).text)
        answer = await client.post("/ui/sign-in", data={"csrf": csrf, "token": "bg_not-a-real-token"})
        assert answer.status_code == 401 and "token: API token not accepted" in answer.text, answer.text
        assert TOKEN_COOKIE not in answer.headers.get("set-cookie", "")
        assert (await client.get("/ui")).status_code == 303
        empty = await client.post("/ui/sign-in", data={"csrf": csrf, "token": "  "})
        assert empty.status_code == 400 and "token: paste an API token" in empty.text
        # A token without the read role: a 403, named.
        submitter = await issue(pg_dsn, Role.SUBMITTER)
        refused = await client.post("/ui/sign-in", data={"csrf": csrf, "token": submitter})
        assert refused.status_code == 403 and "may not read budgets and usage" in refused.text
        assert TOKEN_COOKIE not in refused.headers.get("set-cookie", "")
    # A stale cookie is dropped on the way to sign-in; a bad bearer header is a 401 page.
    async with httpx.AsyncClient(base_url=ui.url, cookies={TOKEN_COOKIE: "bg_revoked"}) as client:
        stale = await client.get("/ui")
        assert stale.status_code == 303 and "notice=expired" in stale.headers["location"] and f'{TOKEN_COOKIE}=""' in stale.headers["set-cookie"]
    async with httpx.AsyncClient(base_url=ui.url, headers=bearer("bg_nope")) as client:
        assert (await client.get("/ui")).status_code == 401


async def test_the_page_shows_the_known_ledger(ui, pg_dsn) -> None:
    reader = await issue(pg_dsn, Role.READER)
    async with browser(ui) as client:
        await sign_in(client, reader)
        page = await client.get("/ui")
        assert page.status_code == 200, page.text
        for policy, (consumed, limit, reserved) in BUDGETS.items():
            shown = tuple(figure(page.text, policy, name) for name in ("consumed", "limit", "reserved"))
            assert shown == (consumed, limit, reserved), policy
            assert f"Used {consumed:,.3f} of {limit:,.3f} GPU-hours" in page.text
        for account, figures in ACCOUNTS.items():
            gpu, cost, reserved = figures
            assert account_row(page.text, account)[:3] == [gpu, cost, reserved], account
        research = page.text.split('data-account="research"', 1)[1].split("</tr>", 1)[0]
        assert '<a href="#budget-gpu/research">gpu/research</a>' in research  # the budget attached to it
        assert page.text.count('href="/ui/decisions/') == 3
        detail = await client.get("/ui/decisions/ui%2Fvision-1")
        assert detail.status_code == 200 and "Decision of run ui/vision-1" in detail.text and 'id="explanation"' in detail.text, detail.text
    # The same reader by its bearer header, without a cookie.
    async with httpx.AsyncClient(base_url=ui.url, headers=bearer(reader)) as client:
        assert figure((await client.get("/ui")).text, "gpu/nlp", "consumed") == BUDGETS["gpu/nlp"][0]


async def test_a_limited_reader_sees_only_its_own(ui, pg_dsn) -> None:
    nlp = await issue(pg_dsn, Role.READER, tenants=["nlp"])
    async with browser(ui) as client:
        await sign_in(client, nlp)
        page = (await client.get("/ui")).text
        assert 'id="budget-gpu/nlp"' in page and 'id="budget-gpu/vision"' not in page
        assert 'id="budget-gpu/research"' not in page  # a budget over two tenants' runs, as GET /v1/budgets
        assert 'data-account="nlp"' in page and 'data-account="vision"' not in page
        assert account_row(page, "research")[:3] == list(ACCOUNTS["nlp"])  # its rows only, rolled up
        assert "ui/vision-1" not in page and "ui/nlp-1" in page
        refused = await client.get("/ui/decisions/ui/vision-1")
        assert refused.status_code == 403 and "is not allowed tenant &#39;vision&#39;" in refused.text, refused.text
        assert (await client.get("/ui", params={"tenant": "vision"})).status_code == 403
        assert (await client.get("/ui", params={"tenant": "nlp"})).status_code == 200
        csv_text = (await client.get("/ui/chargeback.csv")).text
        assert [row["account"] for row in csv.DictReader(io.StringIO(csv_text))] == ["acme", "nlp", "research"]
        for month in ("2026-13", "9999-12", "0000-01", "2026-1", "２０２６-11"):
            bad = await client.get("/ui", params={"month": month})
            assert bad.status_code == 400 and "month: " in bad.text, month
        october = await client.get("/ui/chargeback.csv", params={"month": "2026-10"})
        assert october.status_code == 200 and 'filename="chargeback-2026-10.csv"' in october.headers["content-disposition"]


async def test_the_csv_is_this_months_chargeback(ui, pg_dsn) -> None:
    async with browser(ui) as client:
        await sign_in(client, await issue(pg_dsn, Role.READER))
        answer = await client.get("/ui/chargeback.csv")
        params = {"from": answer_month(answer), "to": next_month(answer), "group_by": "account", "format": "csv"}
        api = await ui.client.get("/v1/reports/chargeback", params=params)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/csv")
    assert answer.headers["content-disposition"].startswith('attachment; filename="chargeback-')
    assert answer.text == api.text
    rows = {row["account"]: row for row in csv.DictReader(io.StringIO(answer.text))}
    for account, (gpu, cost, reserved) in ACCOUNTS.items():
        assert (float(rows[account]["gpu_hours"]), float(rows[account]["cost"]), float(rows[account]["reserved_gpu_hours"])) == (gpu, cost, reserved)
    assert set(AMOUNTS) <= set(rows["acme"])


def answer_month(answer: httpx.Response) -> str:
    return re.search(r"chargeback-(\d{4}-\d{2})", answer.headers["content-disposition"])[1] + "-01"  # type: ignore[index]


def next_month(answer: httpx.Response) -> str:
    year, month = (int(v) for v in answer_month(answer)[:7].split("-"))
    return f"{year + month // 12:04d}-{month % 12 + 1:02d}-01"


async def test_sign_out_forgets_the_token(ui, pg_dsn) -> None:
    async with browser(ui) as client:
        await sign_in(client, await issue(pg_dsn, Role.READER))
        page = await client.get("/ui")
        out = await client.post("/ui/sign-out", data={"csrf": csrf_of(page.text)})
        assert out.status_code == 303 and out.headers["location"] == "/ui/sign-in?notice=out"
        assert f'{TOKEN_COOKIE}=""' in out.headers["set-cookie"] and "Max-Age=0" in out.headers["set-cookie"]
        assert TOKEN_COOKIE not in client.cookies
        assert (await client.get("/ui")).status_code == 303
        assert "You are signed out." in (await client.get(out.headers["location"])).text


async def test_forms_without_their_csrf_token_change_nothing(ui, pg_dsn, settings) -> None:
    reader = await issue(pg_dsn, Role.READER)
    before = await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix)
    async with browser(ui) as client:
        await sign_in(client, reader)
        csrf = csrf_of((await client.get("/ui")).text)
        for data, headers in (({"next": "/ui"}, {}), ({"csrf": "forged"}, {}), ({"csrf": csrf}, {"Origin": "https://elsewhere.example"})):
            out = await client.post("/ui/sign-out", data=data, headers=headers)
            assert out.status_code == 403 and out.headers["content-type"].startswith("text/html") and "csrf" in out.text.lower(), (data, headers)
            assert (await client.get("/ui")).status_code == 200  # still signed in
    async with browser(ui) as fresh:  # no CSRF cookie: sign-in is refused and sets no token
        answer = await fresh.post("/ui/sign-in", data={"csrf": "anything", "token": reader})
        assert answer.status_code == 403 and TOKEN_COOKIE not in answer.headers.get("set-cookie", "")
        json_body = await fresh.post("/ui/sign-in", json={"token": reader})
        assert json_body.status_code == 400 and "application/x-www-form-urlencoded" in json_body.text
    assert await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix) == before


async def test_an_oidc_token_signs_in_as_it_calls_the_api(admission_factory, pg_dsn) -> None:
    await write_known_ledger(pg_dsn)
    issuer = Issuer()
    try:
        server = await admission_factory(oidc_issuer=ISSUER, oidc_audience=AUDIENCE, oidc_jwks_url=issuer.jwks_url)
        await server.wait_ready()
        async with browser(server) as client:
            await sign_in(client, issuer.token(budgetgate_roles=["reader"], budgetgate_tenants=["nlp"]))
            page = (await client.get("/ui")).text
            assert figure(page, "gpu/nlp", "consumed") == BUDGETS["gpu/nlp"][0] and 'id="budget-gpu/vision"' not in page
            assert "Signed in as <strong>jwt:system:serviceaccount:flyte:flyte-admin</strong> (limited to tenants nlp)" in page
            assert (await client.get("/ui/decisions/ui/vision-1")).status_code == 403
        async with browser(server) as client:
            csrf = csrf_of((await client.get("/ui/sign-in")).text)
            expired = issuer.token(budgetgate_roles=["reader"], exp=0)
            assert (await client.post("/ui/sign-in", data={"csrf": csrf, "token": expired})).status_code == 401
    finally:
        issuer.pages.close()


async def test_a_label_made_of_html_is_shown_as_text(ui, pg_dsn) -> None:
    async with browser(ui) as client:
        await sign_in(client, await issue(pg_dsn, Role.READER))
        page = (await client.get("/ui")).text
        detail = (await client.get("/ui/decisions/ui/evil-1")).text
    for text in (page, detail):
        assert EVIL not in text and "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in text


async def test_a_decision_admission_made_is_explained_as_the_api_explains_it(ui, pg_dsn) -> None:
    submitted = await ui.submit(run_id="ui/real-1")
    assert submitted.status_code == 200 and submitted.json()["decision"] == "ALLOW", submitted.text
    explained = (await ui.client.get("/v1/admissions/ui/real-1/explain")).json()
    async with browser(ui) as client:
        await sign_in(client, await issue(pg_dsn, Role.READER))
        page = (await client.get("/ui")).text
        assert '<a href="/ui/decisions/ui%2Freal-1">ui/real-1</a>' in page
        detail = await client.get("/ui/decisions/ui%2Freal-1")
    assert detail.status_code == 200
    steps = re.findall(r"<li>(.*?)</li>", detail.text.split('id="explanation"', 1)[1].split("</ol>", 1)[0], re.S)
    assert [html.unescape(step) for step in steps] == explained["account"]
    assert "comes out identical" in detail.text
    assert len(explained["readings"]) == 2  # gpu/vision and gpu/research, the account budget above it
    for reading in explained["readings"]:
        assert f'<th scope="row">{reading["ledger_key"]}</th><td class="num">{reading["limit"]}</td>' in detail.text
