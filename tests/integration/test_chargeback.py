"""Chargeback reports (`budgetgate report`, `GET /v1/reports/chargeback`) over a known ledger in
a real Postgres: exact figures, totals that reconcile with the ledger's rows to its unit in every
grouping and period, CSV and JSON alike, a limited reader's rows, and bad input refused."""

from __future__ import annotations

import asyncio
import csv
import io
import itertools
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from click.testing import CliRunner

from budgetgate.cli.main import cli
from budgetgate.core.principals import Role
from budgetgate.core.units import MICROS_PER_UNIT, MILLI_PER_HOUR
from budgetgate.reports.chargeback import AMOUNTS, GROUP_KEYS, PERIODS
from tests.support.accounts import account_tree
from tests.support.admission import apply_policies
from tests.support.principals import bearer, issue

H = MILLI_PER_HOUR
RATES = """apiVersion: budgetgate/v1
kind: RateCard
metadata: {id: rates/test}
spec:
  currency: USD
  rates:
    - {flavor: h100, rate_per_gpu_hour: 2.5}
    - {flavor: h100, region: eu, rate_per_gpu_hour: 3}
    - {flavor: a100, rate_per_gpu_hour: 1}
    - {flavor: a100, rate_per_gpu_hour: 1.2, effective_from: "2026-11-15T12:00:00Z"}
"""
NOVEMBER = ("2026-11-01", "2026-12-01")
# The account tree over the runs below: alice's runs in vision-prod are hers, the rest of
# vision-prod the team's; nlp-prod is nlp's (alice's run there included).
ACCOUNTS = account_tree(vision="vision-prod", nlp="nlp-prod")


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


# run: namespace, tenant, user, flavor, region, budgets reserved on, decided_at, projected GPU-hours, held
RUNS: dict[str, tuple[Any, ...]] = {
    "v1": ("vision-prod", "vision", "alice", "h100", None, ["gpu/vision", "cost/cc"], "2026-10-31T20:00:00", 10, False),
    "v2": ("vision-prod", "vision", "bob", "h100", "eu", ["gpu/vision"], "2026-11-19T00:00:00", 4, False),
    "n1": ("nlp-prod", "nlp", "alice", "a100", None, ["gpu/nlp"], "2026-11-14T00:00:00", 20, False),
    "x1": ("vision-prod", "vision", "carol", "mi300", None, [], "2026-11-09T00:00:00", 1, False),
    "r1": ("vision-prod", "vision", "alice", "h100", None, ["gpu/vision"], "2026-11-25T00:00:00", 8, True),
    "r0": ("vision-prod", "vision", "alice", "h100", None, ["gpu/vision"], "2026-10-28T00:00:00", 6, True),
}
# run, observed_at, GPU-hours the sample raised the run's mark by (0: a late sample), node-hours likewise
SAMPLES = [
    ("v1", "2026-10-31T23:00:00", 1, 0.25),  # before the period
    ("v1", "2026-11-02T10:00:00", 2, 0.5),
    ("v1", "2026-11-02T20:00:00", 0, 0),  # arrived after the next one: raised nothing
    ("v1", "2026-11-03T10:00:00", 3, 0.75),
    ("v2", "2026-11-20T08:00:00", 4, 1),
    ("n1", "2026-11-15T06:00:00", 10, 2.5),  # at 1.00 USD
    ("n1", "2026-11-16T06:00:00", 5, 1.25),  # at 1.20 USD, in effect from the 15th at noon
    ("x1", "2026-11-10T00:00:00", 1, 0.25),  # no rate card prices mi300
    ("r1", "2026-11-25T06:00:00", 3, 0.75),
    ("n1", "2026-12-01T00:00:00", 7, 1),  # the end is excluded
]


async def known_ledger(dsn: str) -> None:
    """The runs above as admission and metering-ingest would have left them."""
    await apply_policies(dsn, {"rates.yaml": RATES, "accounts.yaml": ACCOUNTS}, sha="c" * 40)
    conn = await asyncpg.connect(dsn)
    try:
        for policy in ("gpu/vision", "cost/cc", "gpu/nlp"):
            await conn.execute(
                "INSERT INTO ledger_entries (ledger_key, scope_id, unit, window_key, policy_id, policy_git_sha, limit_amount) "
                "VALUES ($1, $2, 'gpu_hours', '2026-11', $2, $3, $4)",
                f"{policy}|2026-11",
                policy,
                "c" * 40,
                1000 * H,
            )
        for run_id, (namespace, tenant, user, flavor, region, budgets, decided, projected, held) in RUNS.items():
            decision_id = uuid.uuid4()
            labels = json.dumps({"team": tenant, "user": user})
            await conn.execute(
                "INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, projected_gpu, request, response, "
                "decided_at, flavor, region) VALUES ($1, $2, 1, 'ALLOW', 'fits', $3, $4, $5, '{}', '{}', $6, $7, $8)",
                decision_id, run_id, namespace, labels, projected * H, at(decided), flavor, region,
            )  # fmt: skip
            for policy in budgets:
                await conn.execute(
                    "INSERT INTO reservations (run_id, ledger_key, decision_id, amount, state, expected_end) VALUES ($1, $2, $3, $4, $5, $6)",
                    run_id, f"{policy}|2026-11", decision_id, projected * H, "held" if held else "reconciled", at(decided) + timedelta(hours=1),
                )  # fmt: skip
        marks: dict[str, tuple[int, int]] = {}
        for n, (run_id, observed, gpu, node) in enumerate(SAMPLES):
            high_gpu, high_node = marks.get(run_id, (0, 0))
            gpu_delta, node_delta = int(gpu * H), int(node * H)
            marks[run_id] = (high_gpu + gpu_delta, high_node + node_delta)
            counters = (high_gpu // 2, high_node // 2) if gpu_delta == 0 else marks[run_id]
            await conn.execute(
                "INSERT INTO usage_records (run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours, gpu_milli_hours_cumulative, "
                "node_milli_hours_cumulative, gpu_milli_hours_delta, node_milli_hours_delta, late, exporter, source, event_id) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 'test', 'http', $2)",
                run_id, f"s{n}", at(observed), *counters, *marks[run_id], gpu_delta, node_delta, gpu_delta == 0,
            )  # fmt: skip
        for run_id, (gpu, node) in marks.items():
            await conn.execute(
                "INSERT INTO usage_runs (run_id, gpu_milli_hours_cumulative, node_milli_hours_cumulative) VALUES ($1, $2, $3)", run_id, gpu, node
            )
    finally:
        await conn.close()


def run_cli(dsn: str, *args: str) -> Any:
    return CliRunner().invoke(cli, ["report", *args], env={"BUDGETGATE_POSTGRES_DSN": dsn})


def report_json(dsn: str, *args: str) -> dict[str, Any]:
    result = run_cli(dsn, "--from", NOVEMBER[0], "--to", NOVEMBER[1], "--format", "json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def figures(gpu: float, node: float, cost: float, unpriced: float = 0, reserved_gpu: float = 0, reserved_cost: float = 0) -> dict[str, Any]:
    amounts = [
        round(gpu * H),
        round(node * H),
        round(cost * MICROS_PER_UNIT),
        round(unpriced * H),
        round(reserved_gpu * H),
        round(reserved_cost * MICROS_PER_UNIT),
    ]
    shown = {
        "gpu_hours": gpu,
        "node_hours": node,
        "cost": cost,
        "unpriced_gpu_hours": unpriced,
        "reserved_gpu_hours": reserved_gpu,
        "reserved_cost": reserved_cost,
    }
    return {**shown, **dict(zip(AMOUNTS, amounts, strict=True))}


async def test_a_known_ledger_gives_exact_figures(pg_dsn) -> None:
    await known_ledger(pg_dsn)
    report = await asyncio.to_thread(report_json, pg_dsn, "--group-by", "tenant")
    assert report["currency"] == "USD" and report["from"] == "2026-11-01T00:00:00Z" and report["to"] == "2026-12-01T00:00:00Z"
    # nlp: 10 GPU-hours at 1.00 before the rate change, 5 at 1.20 after it.
    # vision: v1 5 at 2.50, v2 4 at 3.00 (region eu), r1 3 at 2.50 metered, 5 more reserved; x1 1 unpriced.
    assert report["rows"] == [
        {"tenant": "nlp", **figures(15, 3.75, 16.0)},
        {"tenant": "vision", **figures(13, 3.25, 32.0, unpriced=1, reserved_gpu=5, reserved_cost=12.5)},
    ]
    assert report["total"] == figures(28, 7, 48.0, unpriced=1, reserved_gpu=5, reserved_cost=12.5)

    by_budget = await asyncio.to_thread(report_json, pg_dsn, "--group-by", "budget,user", "--period", "week")
    rows = {(r["period_start"][:10], r["budget"], r["user"]): r["gpu_hours"] for r in by_budget["rows"]}
    assert rows == {
        ("2026-11-02", "cost/cc", "alice"): 5.0,  # ISO weeks from Monday; 1 November 2026 is a Sunday
        ("2026-11-02", "gpu/vision", "alice"): 5.0,
        ("2026-11-09", None, "carol"): 1.0,
        ("2026-11-09", "gpu/nlp", "alice"): 10.0,
        ("2026-11-16", "gpu/nlp", "alice"): 5.0,
        ("2026-11-16", "gpu/vision", "bob"): 4.0,
        ("2026-11-23", "gpu/vision", "alice"): 3.0,
    }
    # A run on two budgets counts under each, and once in the total.
    assert by_budget["total"] == report["total"]

    # A narrower period: only what was observed in it, and r1's reservation (decided the 25th) not at all.
    narrow = await asyncio.to_thread(run_cli, pg_dsn, "--from", "2026-11-15T12:00:00Z", "--to", "2026-11-20T08:00:00+00:00", "--format", "json")
    assert json.loads(narrow.stdout)["total"] == figures(5, 1.25, 6.0)


async def test_every_grouping_and_period_reconciles_with_the_ledger(pg_dsn) -> None:
    await known_ledger(pg_dsn)
    conn = await asyncpg.connect(pg_dsn)
    try:
        gpu, node = await conn.fetchrow(
            "SELECT sum(gpu_milli_hours_delta), sum(node_milli_hours_delta) FROM usage_records WHERE observed_at >= $1 AND observed_at < $2",
            at("2026-11-01T00:00:00"),
            at("2026-12-01T00:00:00"),
        )
        reserved = await conn.fetchval(
            "SELECT sum(GREATEST(d.projected_gpu - COALESCE(u.gpu_milli_hours_cumulative, 0), 0)) FROM decisions d "
            "LEFT JOIN usage_runs u USING (run_id) WHERE d.decided_at >= $1 AND d.decided_at < $2 "
            "AND EXISTS (SELECT 1 FROM reservations r WHERE r.run_id = d.run_id AND r.state = 'held')",
            at("2026-11-01T00:00:00"),
            at("2026-12-01T00:00:00"),
        )
        per_budget = {
            r["policy_id"]: r["gpu"]
            for r in await conn.fetch(
                "SELECT e.policy_id, sum(u.gpu_milli_hours_delta) AS gpu FROM usage_records u "
                "JOIN (SELECT DISTINCT run_id, ledger_key FROM reservations) r USING (run_id) JOIN ledger_entries e USING (ledger_key) "
                "WHERE u.observed_at >= $1 AND u.observed_at < $2 GROUP BY 1",
                at("2026-11-01T00:00:00"),
                at("2026-12-01T00:00:00"),
            )
        }
    finally:
        await conn.close()
    assert (gpu, node, reserved) == (28 * H, 7 * H, 5 * H)
    totals = None
    groupings = [list(keys) for n in range(len(GROUP_KEYS) + 1) for keys in itertools.combinations(GROUP_KEYS, n) if n <= 2]
    for keys, period in itertools.product(groupings, PERIODS):
        args = ["--period", period, *(["--group-by", ",".join(keys)] if keys else [])]
        report = await asyncio.to_thread(report_json, pg_dsn, *args)
        assert report["group_by"] == (keys or ["tenant"]), args
        total = report["total"]
        assert (total["gpu_milli_hours"], total["node_milli_hours"], total["reserved_gpu_milli_hours"]) == (gpu, node, reserved), args
        totals = totals or total
        assert total == totals, args  # the cost too: priced at one grain whatever the grouping
        # By account a run counts under every account above it: the roots' rows (and the runs
        # no account covers) hold each run once.
        rows = [r for r in report["rows"] if r["account"] in ("acme", None)] if "account" in report["group_by"] else report["rows"]
        summed = {name: sum(row[name] for row in rows) for name in AMOUNTS}
        if "budget" in report["group_by"]:
            budgets: dict[str | None, int] = {}
            for row in rows:
                budgets[row["budget"]] = budgets.get(row["budget"], 0) + row["gpu_milli_hours"]
            assert budgets == {**per_budget, None: 1 * H}, args  # x1 reserved on no budget
        else:
            assert summed == {name: total[name] for name in AMOUNTS}, args


async def test_by_account_each_row_is_the_accounts_whole_subtree(pg_dsn) -> None:
    await known_ledger(pg_dsn)
    report = await asyncio.to_thread(report_json, pg_dsn, "--group-by", "account")
    by_account = {row["account"]: row["gpu_milli_hours"] for row in report["rows"]}
    # v1 and r1 are alice's (5 + 3); v2 (bob) and x1 (carol) the team's own (4 + 1); n1 nlp's.
    assert by_account == {"acme": 28 * H, "research": 28 * H, "vision": 13 * H, "alice": 8 * H, "nlp": 15 * H}
    assert report["total"]["gpu_milli_hours"] == 28 * H
    # r1 is still held: 8 projected less 3 metered, reserved apart on alice and everything above her.
    reserved = {row["account"]: row["reserved_gpu_milli_hours"] for row in report["rows"]}
    assert reserved == {"acme": 5 * H, "research": 5 * H, "vision": 5 * H, "alice": 5 * H, "nlp": 0}


async def test_csv_and_json_carry_the_same_numbers(pg_dsn) -> None:
    await known_ledger(pg_dsn)
    args = ["--from", NOVEMBER[0], "--to", NOVEMBER[1], "--group-by", "tenant", "--group-by", "flavor,region", "--period", "day"]
    as_json = json.loads((await asyncio.to_thread(run_cli, pg_dsn, *args, "--format", "json")).stdout)
    as_csv = list(csv.DictReader(io.StringIO((await asyncio.to_thread(run_cli, pg_dsn, *args, "--format", "csv")).stdout)))
    assert len(as_csv) == len(as_json["rows"]) == 7
    for line, row in zip(as_csv, as_json["rows"], strict=True):
        assert list(line) == list(row)
        assert {k: (v or None) if k in ("period_start", *GROUP_KEYS) else float(v) for k, v in line.items()} == row
    table = await asyncio.to_thread(run_cli, pg_dsn, *args)
    assert table.exit_code == 0 and "2026-11-16  nlp     a100    -" in table.output and table.output.rstrip().splitlines()[-1].startswith("total")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--from", "2026-12-01", "--to", "2026-11-01"], "--to: 'to' (2026-11-01T00:00:00Z) must be after 'from'"),
        (["--from", "2026-11-01", "--to", "2026-11-01"], "must be after 'from'"),
        (["--from", "1 November", "--to", "2026-12-01"], "--from: from '1 November' is neither a date"),
        (["--from", "2026-11-01T00:00:00", "--to", "2026-12-01"], "needs a time zone"),
        (["--from", "2026-11-01", "--to", "2026-12-01", "--group-by", "tenant,project"], "--group-by: unknown group key 'project'"),
        (["--from", "2026-11-01", "--to", "2026-12-01", "--group-by", "account"], "needs Account documents in the active policy bundle"),
        (["--from", "2026-11-01", "--to", "2026-12-01", "--period", "quarter"], "--period: unknown period 'quarter'"),
    ],
)
def test_bad_input_is_a_usage_error(pg_dsn, args: list[str], message: str) -> None:
    result = run_cli(pg_dsn, *args)
    assert result.exit_code == 2 and message in result.output, result.output


async def test_the_api_scopes_formats_and_refuses(admission_factory, pg_dsn) -> None:
    await known_ledger(pg_dsn)
    server = await admission_factory()
    await server.wait_ready()
    url = "/v1/reports/chargeback"
    everything = await server.client.get(url, params={"from": "2026-11-01", "to": "2026-12-01", "group_by": ["tenant", "flavor"]})
    assert everything.status_code == 200, everything.text
    body = everything.json()
    assert body["total"] == figures(28, 7, 48.0, unpriced=1, reserved_gpu=5, reserved_cost=12.5)
    assert body == await asyncio.to_thread(report_json, pg_dsn, "--group-by", "tenant,flavor")

    as_csv = await server.client.get(url, params={"from": "2026-11-01", "to": "2026-12-01", "group_by": "tenant,flavor"}, headers={"Accept": "text/csv"})
    assert as_csv.headers["content-type"].startswith("text/csv")
    lines = list(csv.DictReader(io.StringIO(as_csv.text)))
    assert [float(line["cost_micros"]) for line in lines] == [row["cost_micros"] for row in body["rows"]]
    by_parameter = await server.client.get(url, params={"from": "2026-11-01", "to": "2026-12-01", "group_by": "tenant,flavor", "format": "csv"})
    assert by_parameter.text == as_csv.text

    for limits, tenants in (({"namespaces": ["nlp-*"]}, ["nlp"]), ({"tenants": ["vision"]}, ["vision"]), ({"namespaces": ["other-*"]}, [])):
        token = await issue(pg_dsn, Role.READER, **limits)
        seen = (await server.client.get(url, params={"from": "2026-11-01", "to": "2026-12-01"}, headers=bearer(token))).json()
        assert [r["tenant"] for r in seen["rows"]] == tenants, limits
        assert seen["total"]["gpu_milli_hours"] == sum(r["gpu_milli_hours"] for r in seen["rows"])
    submitter = await issue(pg_dsn, Role.SUBMITTER)
    assert (await server.client.get(url, params={"from": "2026-11-01", "to": "2026-12-01"}, headers=bearer(submitter))).status_code == 403

    before = await _ledger(pg_dsn)
    for params, field in (
        ({"from": "2026-12-01", "to": "2026-11-01"}, "to"),
        ({"from": "yesterday", "to": "2026-11-01"}, "from"),
        ({"from": "2026-11-01", "to": "2026-12-01", "group_by": "cluster"}, "group_by"),
        ({"from": "2026-11-01", "to": "2026-12-01", "period": "fortnight"}, "period"),
        ({"from": "2026-11-01", "to": "2026-12-01", "format": "xml"}, "format"),
        ({"to": "2026-12-01"}, "from"),
    ):
        refused = await server.client.get(url, params=params)
        assert refused.status_code == 422, (params, refused.text)
        problem = refused.json()
        assert [e["field"] for e in problem["errors"]] == [field] and field in problem["detail"], problem
    assert await _ledger(pg_dsn) == before


async def _ledger(dsn: str) -> list[Any]:
    conn = await asyncpg.connect(dsn)
    try:
        return [sorted(map(tuple, await conn.fetch(f"SELECT * FROM {table}"))) for table in ("decisions", "reservations", "usage_records", "ledger_entries")]  # noqa: S608
    finally:
        await conn.close()
