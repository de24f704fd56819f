"""The reconciler is served as the other services are: `python -m budgetgate.services.reconciler`
runs uvicorn (stopped by its signals), with /healthz, /readyz (503 until Postgres, Redis and its
Kafka consumer are up, then 200) and /metrics on its port, and the operator's routes of the
settlements it dead-lettered, for an operator without limits only, with bad input named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from budgetgate.core.principals import Role
from tests.support.metering import fetchval, metric
from tests.support.waiting import wait_for
from tests.support.principals import bearer, issue
from tests.support.reconciler import reconciler_server_factory  # noqa: F401 - fixture
from tests.support.servers import free_port

PROBLEM = "application/problem+json"
DEAD_LETTERS = "/v1/settlements/dead-letters"


async def test_it_is_alive_at_once_and_ready_once_it_consumes(reconciler_server_factory, killable_kafka) -> None:  # noqa: F811
    killable_kafka.stop()  # no broker yet: the consumer cannot start
    server = await reconciler_server_factory(kafka_bootstrap=killable_kafka.url)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as anonymous:
        health = await anonymous.get("/healthz")
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        unready = await anonymous.get("/readyz")
        assert unready.status_code == 503 and unready.headers["content-type"] == PROBLEM, unready.text
        assert unready.json()["checks"] == {"postgres": "ok", "redis": "ok", "kafka_consumer": "not consuming yet"}
        assert "kafka_consumer: not consuming yet" in unready.json()["detail"]
        metrics = await anonymous.get("/metrics")  # open, as the other services' (BUDGETGATE_METRICS_REQUIRE_AUTH)
        assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain"), metrics.text
        assert metric(metrics.text, "budgetgate_reconciler_dead_lettered") == 0

        killable_kafka.start()
        await server.wait_ready(timeout=90)
        ready = await anonymous.get("/readyz")
        assert (ready.status_code, ready.json()) == (200, {"ready": True, "checks": {"postgres": "ok", "redis": "ok", "kafka_consumer": "ok"}})


async def test_only_an_operator_without_limits_reaches_the_dead_letters(reconciler_server_factory, pg_dsn) -> None:  # noqa: F811
    server = await reconciler_server_factory()
    resolve = "/v1/settlements/flyte/vision/exec-1/n0/resolve"
    body = {"action": "release", "reason": "cleanup"}
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as anonymous:
        for method, path in (("GET", DEAD_LETTERS), ("POST", resolve)):
            refused = await anonymous.request(method, path, json=body if method == "POST" else None)
            assert refused.status_code == 401 and refused.headers["content-type"] == PROBLEM, (path, refused.text)
        reader = bearer(await issue(pg_dsn, Role.READER, Role.AUDITOR))
        limited = bearer(await issue(pg_dsn, Role.OPERATOR, tenants=["vision"]))
        for headers, why in ((reader, "needs role operator"), (limited, "need a token without limits")):
            for method, path in (("GET", DEAD_LETTERS), ("POST", resolve)):
                refused = await anonymous.request(method, path, json=body if method == "POST" else None, headers=headers)
                assert refused.status_code == 403 and why in refused.json()["detail"], (path, refused.text)

    operator = bearer(await issue(pg_dsn, Role.OPERATOR, name="ops-on-call"))
    listed = await server.client.get(DEAD_LETTERS, headers=operator)
    assert (listed.status_code, listed.json()) == (200, {"dead_letters": []})

    unknown = await server.client.post(resolve, json=body, headers=operator)
    assert unknown.status_code == 404 and unknown.headers["content-type"] == PROBLEM, unknown.text
    assert "no run 'flyte/vision/exec-1/n0' is known" in unknown.json()["detail"] and "nothing changed" in unknown.json()["detail"]
    for bad, field, said in (
        ({"action": "drop", "reason": "x"}, "action", "'release' or 'settle'"),
        ({"action": "release", "reason": "  \n "}, "reason", "say why, for the admin log"),
        ({"action": "settle"}, "reason", "Field required"),
        ({"action": "settle", "reason": "a\x00b"}, "reason", "control character"),
        ({"action": "settle", "reason": "ok", "force": True}, "force", "Extra inputs"),
    ):
        invalid = await server.client.post(resolve, json=bad, headers=operator)
        assert invalid.status_code == 422 and invalid.headers["content-type"] == PROBLEM, invalid.text
        [error] = invalid.json()["errors"]
        assert error["field"] == field and said in error["msg"], invalid.text
    assert await fetchval(pg_dsn, "SELECT count(*) FROM admin_log WHERE action LIKE 'settlement.%'") == 0


async def test_python_m_serves_it_on_its_port_and_sigterm_stops_it(settings, tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUDGETGATE_")}
    env |= {f"BUDGETGATE_{k.upper()}": str(v) for k, v in settings.model_dump().items() if v is not None and isinstance(v, str | int | float)}
    # The variable deployments set before the reconciler served more than metrics still names its port.
    env |= {"BUDGETGATE_METRICS_PORT": str(port), "BUDGETGATE_TICK_SECONDS": "0.2"}
    log = tmp_path / "reconciler.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "budgetgate.services.reconciler"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:

            async def ready() -> bool:
                assert proc.poll() is None, f"the reconciler exited with {proc.returncode}:\n{log.read_text()}"
                try:
                    return (await client.get("/readyz")).status_code == 200
                except httpx.TransportError:
                    return False

            await wait_for(ready, timeout=90, what="the reconciler ready on its port")
            assert json.loads((await client.get("/readyz")).text)["checks"]["kafka_consumer"] == "ok"
            assert "budgetgate_reconciler_dead_lettered" in (await client.get("/metrics")).text
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts the app down, then raises the signal it caught again: the exit a SIGTERM
        # makes, reached cleanly (every client closed in time, nothing raised).
        assert proc.wait(timeout=30) == -signal.SIGTERM, log.read_text()
        said = log.read_text()
        assert not any(trouble in said for trouble in ("Traceback", "ERROR", "did not close cleanly", "did not stop within")), said
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
