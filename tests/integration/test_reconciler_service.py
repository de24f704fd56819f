"""The reconciler is served as the other services are: `python -m budgetgate.services.reconciler`
runs uvicorn (stopped by its signals), with /healthz, /readyz (503 until Postgres, Redis and its
Kafka consumer are up, then 200) and /metrics on its port."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.metering import metric, wait_for
from tests.support.reconciler import reconciler_server_factory  # noqa: F401 - fixture
from tests.support.servers import free_port

PROBLEM = "application/problem+json"


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
