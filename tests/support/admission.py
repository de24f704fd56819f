"""Admission service harness: a real uvicorn server on a free port, wired to the test's own
Postgres database, Redis prefix and Kafka topic prefix."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any
from pathlib import Path

import asyncpg
import httpx
import pytest

from budgetgate.core.loader import build_bundle, parse_text
from budgetgate.policies.repository import apply_bundle
from budgetgate.services.admission.app import create_app
from budgetgate.contracts.admission import AdmissionRequest
from budgetgate.services.admission.settings import AdmissionSettings
from tests.support.kafka import drain
from tests.support.servers import InProcessServer, started_servers
from tests.support.waiting import wait_for

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "policies"
GPU_HOUR = 3_600_000  # a GPU-hour in the ledger's unit (GPU-milliseconds)


class AdmissionServer(InProcessServer):
    """A running admission service and an HTTP client for it."""

    name = "admission"

    def __init__(self, settings: AdmissionSettings) -> None:
        self.settings = settings
        super().__init__(create_app(settings), port=settings.port, dsn=settings.postgres_dsn)

    async def submit(self, **overrides: object) -> httpx.Response:
        return await self.client.post("/v1/admissions", json=submission(**overrides))


def decision_of(answer: httpx.Response) -> str:
    """The decision of a submission's answer, which must be a decision (200): otherwise the
    assertion names the status and the body, where reading the field would only say it is missing."""
    assert answer.status_code == 200, f"{answer.request.method} {answer.request.url.path} answered {answer.status_code}: {answer.text}"
    return answer.json()["decision"]


async def one_batch(server, bodies: list[dict[str, Any]]) -> list[Any]:  # type: ignore[no-untyped-def]
    """Decide `bodies` as ONE batch of the server's admitter (deterministically, not by timing);
    returns each answer, or the exception it was answered with."""
    admitter = server.rt.admitter
    pending = [admitter._prepare(AdmissionRequest.model_validate(b), datetime.now(UTC)) for b in bodies]
    await admitter._commit(pending)
    return list(await asyncio.gather(*(p.answer for p in pending), return_exceptions=True))


async def held_in_postgres(dsn: str) -> dict[str, int]:
    """The reservations Postgres holds, summed by ledger key (ledger units)."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT ledger_key, sum(amount)::bigint AS held FROM reservations WHERE state = 'held' GROUP BY ledger_key")
        return {r["ledger_key"]: r["held"] for r in rows}
    finally:
        await conn.close()


async def reserved_in_redis(server) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """What the server's Redis ledger holds reserved, by ledger key (ledger units), every shard's."""
    found: dict[str, int] = {}
    for ledger in server.rt.ledgers:
        keys = [k.decode().split(":l:", 1)[1] async for k in ledger.client.scan_iter(match=f"{ledger.tag}:l:*")]
        found |= {k: reserved for k, (reserved, _consumed) in (await ledger.readings(keys)).items()}
    return found


async def restart_from_snapshot(redis_server, *servers) -> None:  # type: ignore[no-untyped-def]
    """Kill Redis and start it with the same arguments: it loads the dump.rdb of its last SAVE.
    The services' connections are then closed quietly, as after a failover behind a proxy: had
    their next call found a dead connection, the failure alone would invalidate the ledger (a
    failed ledger transaction does), hiding whether the restored one is caught for what it is."""
    redis_server.stop()
    redis_server.start()
    for server in servers:
        for ledger in server.rt.ledgers:
            await ledger.client.connection_pool.disconnect()


def submission(**overrides: object) -> dict[str, object]:
    body: dict[str, object] = {
        "run_id": "flyte/vision/exec-7f3a/n0",
        "attempt": 1,
        "namespace": "vision-prod",
        "labels": {"cost-center": "1042", "team": "vision", "environment": "prod"},
        "resources": {"gpus": 8, "nodes": 1, "flavor": "h100", "region": "us-east-1"},
        "projected_runtime_hours": 6.0,
        "job": {"namespace": "vision-prod", "name": "train-resnet"},
    }
    body.update(overrides)
    return body


async def apply_policies(dsn: str, text_by_file: dict[str, str], *, sha: str) -> None:
    """Apply policy documents given as YAML text, at a made-up SHA."""
    documents = [doc for name, text in text_by_file.items() for doc in parse_text(text, name)]
    bundle = build_bundle(documents, git_sha=sha)
    conn = await asyncpg.connect(dsn)
    try:
        await apply_bundle(conn, bundle=bundle, documents=documents, source="test", applied_by="test")
    finally:
        await conn.close()


def example_policies() -> dict[str, str]:
    return {p.relative_to(EXAMPLES).as_posix(): p.read_text() for p in sorted(EXAMPLES.rglob("*.yaml"))}


def budget_yaml(
    policy_id: str,
    *,
    namespace: str = "vision-prod",
    labels: str = "{team: vision}",
    limit: str = "gpu_hours: 100",
    enforcement: str = "hard",
    on_exhausted: str = "deny",
    window: str = "{calendar: month}",
) -> str:
    return f"""apiVersion: budgetgate/v1
kind: BudgetPolicy
metadata: {{id: {policy_id}}}
spec:
  scope: {{namespace: {namespace}, labels: {labels}}}
  window: {window}
  limit: {{{limit}}}
  enforcement: {enforcement}
  on_exhausted: {on_exhausted}
"""


@pytest.fixture
async def admission_factory(settings) -> AsyncIterator:  # type: ignore[no-untyped-def]
    """Start admission servers on the test's backends (several share one ledger)."""
    async with started_servers(settings, lambda values: AdmissionServer(AdmissionSettings(**values)), policy_refresh_seconds=0.2) as start:
        yield start


@pytest.fixture
async def admission(admission_factory, pg_dsn):  # type: ignore[no-untyped-def]
    """One admission service with the example policy repository applied."""
    await apply_policies(pg_dsn, example_policies(), sha="e" * 40)
    server = await admission_factory()
    await server.wait_ready()
    return server


async def published_decisions(settings: Any, run_ids: set[str], *, timeout: float = 30) -> dict[str, Any]:
    """The Decision messages admission published for `run_ids` on the test's budget.decisions.v1
    (the last of each run), read from the beginning; fails the test unless all arrive in time."""
    from budgetgate.contracts.topics import Topics

    return await decisions_on(settings.kafka_bootstrap, Topics(settings.topic_prefix).decisions, run_ids, timeout=timeout)


async def decisions_on(bootstrap: str, topic: str, run_ids: set[str], *, timeout: float = 30) -> dict[str, Any]:
    """The Decision messages for `run_ids` on `topic` (the last of each run), read from the
    beginning; fails the test unless all arrive in time."""
    from budgetgate.contracts import wire
    from budgetgate.v1 import decisions_pb2

    def wanted(record: Any) -> str | None:
        message = wire.decode(decisions_pb2.Decision, record.value, record.headers)
        return message.run_id if message.run_id in run_ids else None

    found = {}
    for record in await drain(bootstrap, topic, len(run_ids), timeout=timeout, distinct=wanted):
        message = wire.decode(decisions_pb2.Decision, record.value, record.headers)
        if message.run_id in run_ids:
            found[message.run_id] = message
    assert set(found) == run_ids, f"decisions of {sorted(run_ids - set(found))} never reached {topic} within {timeout}s"
    return found


async def wait_for_bundle(server: Any, sha: str, *, timeout: float = 30) -> None:
    """Wait until admission `server` decides under the policy bundle `sha` (applied to Postgres:
    the service picks a new bundle up on its own, within its refresh interval)."""

    def loaded() -> bool:
        current = server.rt.policies.current
        return current is not None and current.git_sha == sha

    await wait_for(loaded, timeout=timeout, what=f"admission to load policy bundle {sha[:12]}")
