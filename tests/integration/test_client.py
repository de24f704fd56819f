"""budgetgate.client against a real admission service (Postgres, Redis, Kafka): typed answers,
errors as exceptions, resends that keep the run id and attempt, the bearer token, pool tokens
that are always given back."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from budgetgate.client import AsyncClient, BudgetgateError, Client, Conflict, InvalidRequest, NotGranted, RetryPolicy, Unauthorized, Unavailable
from budgetgate.contracts.admission import AdmissionResponse, BudgetList, ScopeUsage, TenantUsage
from tests.support.admission import apply_policies, example_policies, submission

POOLS = """apiVersion: budgetgate/v1
kind: ResourcePool
metadata: {id: warehouse}
spec: {namespace: "snowflake:wh-1", quota: 1}
"""
FAST = RetryPolicy(attempts=4, initial=0.05, max_wait=0.2, deadline=10)
from tests.support.principals import token_in_env  # noqa: F401 - a fixture, used by name

pytestmark = pytest.mark.usefixtures("token_in_env")


class Recorder(httpx.AsyncBaseTransport):
    """The real network transport, remembering every request it sent; the first `refuse`
    connections fail as a server that is not listening yet would make them fail."""

    def __init__(self, *, refuse: int = 0) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.refuse = refuse
        self.requests: list[httpx.Request] = []
        self.first = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.first.set()
        if self.refuse > 0:
            self.refuse -= 1
            raise httpx.ConnectError("connection refused", request=request)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_submit_lookup_and_replay_are_typed(admission) -> None:
    async with AsyncClient(admission.url) as client:
        first = await client.submit(submission(run_id="client/typed"))
        assert isinstance(first, AdmissionResponse)
        assert (first.decision, first.replayed, first.projected_gpu_hours, first.showback_cost) == ("ALLOW", False, 48.0, 188.78)
        again = await client.submit(submission(run_id="client/typed"))
        assert again.replayed is True and again.decision_id == first.decision_id
        found = await client.lookup("client/typed")
        assert found is not None and found.decision_id == first.decision_id
        assert await client.lookup("client/never-submitted") is None


async def test_usage_budgets_and_tenants(admission) -> None:
    async with AsyncClient(admission.url) as client:
        await client.submit(submission(run_id="client/usage"))
        listed = await client.budgets()
        assert isinstance(listed, BudgetList) and listed.policy_bundle_sha == "e" * 40
        vision = next(b for b in listed.budgets if b.policy_id == "gpu-budget/team-vision-prod")
        assert vision.reserved == 48.0
        scope = await client.scope_usage("ns=vision-prod;cost-center=1042;team=vision")
        assert isinstance(scope, ScopeUsage) and [b.reserved for b in scope.budgets if b.unit == "gpu_hours"] == [48.0]
        tenant = await client.tenant_usage("vision", days=7)
        assert isinstance(tenant, TenantUsage) and tenant.days == 7 and tenant.runs.admitted == 1


async def test_errors_are_exceptions_and_are_not_resent(admission) -> None:
    recorder = Recorder()
    async with AsyncClient(admission.url, transport=recorder, retry=FAST) as client:
        await client.submit(submission(run_id="client/conflict"))
        with pytest.raises(Conflict) as conflict:
            await client.submit(submission(run_id="client/conflict", resources={"gpus": 4, "nodes": 1, "flavor": "h100", "region": "us-east-1"}))
        assert "resources.gpus" in json.dumps(conflict.value.fields) and conflict.value.status == 409
        with pytest.raises(InvalidRequest) as invalid:
            await client.submit(submission(run_id="client/unpriced", resources={"gpus": 1, "nodes": 1, "flavor": "no-such-flavor"}))
        assert invalid.value.errors and invalid.value.status == 422
    assert len(recorder.requests) == 3  # one each: neither a 409 nor a 422 is sent again
    unsent = Recorder()
    async with AsyncClient(admission.url, transport=unsent) as client:
        # The server's own model checks the request before it leaves: the same error as its 422.
        with pytest.raises(BudgetgateError) as local:
            await client.submit(submission(run_id="client/bad", projected_runtime_hours=-1.0))
    assert isinstance(local.value, InvalidRequest) and local.value.fields == ["projected_runtime_hours"] and not local.value.sent
    assert unsent.requests == []
    served = await admission.client.post("/v1/admissions", json=submission(run_id="client/bad", projected_runtime_hours=-1.0))
    assert served.status_code == 422 and served.json()["detail"] == local.value.detail


async def test_a_refused_connection_is_retried_with_the_same_run_id_and_attempt(admission, pg_dsn) -> None:
    recorder = Recorder(refuse=2)
    async with AsyncClient(admission.url, transport=recorder, retry=FAST) as client:
        answer = await client.submit(submission(run_id="client/retried", attempt=3))
    assert answer.decision == "ALLOW" and answer.attempt == 3 and answer.replayed is False
    bodies = [json.loads(r.content) for r in recorder.requests]
    assert len(bodies) == 3 and all((b["run_id"], b["attempt"]) == ("client/retried", 3) for b in bodies)


async def test_a_503_is_retried_until_admission_can_answer(admission_factory, pg_dsn) -> None:
    server = await admission_factory()  # no policy bundle yet: usage answers 503
    recorder = Recorder()
    async with AsyncClient(server.url, transport=recorder, retry=RetryPolicy(attempts=100, initial=0.05, max_wait=0.2, deadline=30)) as client:
        asked = asyncio.create_task(client.scope_usage("ns=vision-prod;cost-center=1042;team=vision"))
        await recorder.first.wait()
        await apply_policies(pg_dsn, example_policies(), sha="e" * 40)
        usage = await asked
    assert usage.budgets and len(recorder.requests) >= 2


async def test_503_after_the_retries_is_raised(admission_factory) -> None:
    server = await admission_factory()
    recorder = Recorder()
    async with AsyncClient(server.url, transport=recorder, retry=RetryPolicy(attempts=3, initial=0.01, max_wait=0.05)) as client:
        with pytest.raises(Unavailable) as unavailable:
            await client.scope_usage("ns=x")
    assert unavailable.value.status == 503 and "no policy bundle" in unavailable.value.detail
    assert len(recorder.requests) == 3


async def test_bearer_token_from_the_environment_or_the_argument(admission, monkeypatch) -> None:
    monkeypatch.setenv("BUDGETGATE_TOKEN", "from-env")
    recorder = Recorder()
    # None of these is a token admission knows: each is sent as said, and refused.
    async with AsyncClient(admission.url, transport=recorder) as client:
        with pytest.raises(Unauthorized):
            await client.lookup("client/any")
    async with AsyncClient(admission.url, transport=recorder, token="from-argument") as client:
        with pytest.raises(Unauthorized):
            await client.lookup("client/any")
    monkeypatch.delenv("BUDGETGATE_TOKEN")
    async with AsyncClient(admission.url, transport=recorder) as client:
        with pytest.raises(Unauthorized):
            await client.lookup("client/any")
    assert [r.headers.get("authorization") for r in recorder.requests] == ["Bearer from-env", "Bearer from-argument", None]


async def test_pool_token_is_released_however_the_block_ends(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"p.yaml": POOLS, **example_policies()}, sha="f" * 40)
    server = await admission_factory()
    await server.wait_ready()
    async with AsyncClient(server.url) as client:
        with pytest.raises(RuntimeError, match="work failed"):
            async with client.pool_token("snowflake:wh-1", "job-1", project="vision") as held:
                assert held.status == "Granted" and (await client.pool("snowflake:wh-1")).used == 1
                with pytest.raises(NotGranted) as full:  # the pool holds one token
                    async with client.pool_token("snowflake:wh-1", "job-2"):
                        pass
                assert full.value.answer.status == "Exhausted"
                raise RuntimeError("work failed")
        status = await client.pool("snowflake:wh-1")
        assert status.used == 0 and status.holders == []


async def test_the_sync_client_does_the_same(admission) -> None:
    def work() -> tuple[str, bool, str | None, int]:
        with Client(admission.url) as client:
            first = client.submit(submission(run_id="client/sync"))
            again = client.submit(submission(run_id="client/sync"))
            found = client.lookup("client/sync")
            return first.decision, again.replayed, found.decision_id if found else None, len(client.budgets().budgets)

    # The server runs on this test's event loop; the blocking client runs beside it.
    decision, replayed, decision_id, budgets = await asyncio.to_thread(work)
    assert (decision, replayed, budgets > 0) == ("ALLOW", True, True) and decision_id
