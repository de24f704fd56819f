"""The evidence-emitter SIGKILLed mid-delivery: after a restart every event arrives, and at most
the one in flight arrives twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx

from budgetgate.messaging.topic_admin import ensure_topics
from tests.support.marquez import decision, publish, wait_evidence_settled
from tests.support.marquez import marquez  # noqa: F401 - pytest fixtures
from tests.support.servers import free_port
from tests.support.waiting import wait_for

EVENTS = 100


def start_emitter(settings, url: str, cwd: Path) -> tuple[subprocess.Popen[bytes], str]:  # type: ignore[no-untyped-def]
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OPENLINEAGE")},
        "BUDGETGATE_POSTGRES_DSN": settings.postgres_dsn,
        "BUDGETGATE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "BUDGETGATE_TOPIC_PREFIX": settings.topic_prefix,
        "BUDGETGATE_EVIDENCE_IDLE_SECONDS": "0.1",
        "BUDGETGATE_EVIDENCE_INITIAL_BACKOFF_SECONDS": "0.1",
        "BUDGETGATE_EVIDENCE_MAX_BACKOFF_SECONDS": "1",
        "OPENLINEAGE_URL": url,
    }
    with open(cwd / f"emitter-{port}.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "budgetgate.services.evidence_emitter", "--port", str(port)], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    return proc, f"http://127.0.0.1:{port}"


async def test_killed_mid_delivery_resends_at_most_the_one_in_flight(settings, marquez, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    sent = [decision(f"kill/{i}") for i in range(EVENTS)]
    await publish(settings, *sent)
    marquez.delay = 0.05  # slow enough that the kill lands mid-delivery
    procs = []
    try:
        first, _ = start_emitter(settings, marquez.url, tmp_path)
        procs.append(first)
        await marquez.wait_for(20, timeout=90)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        at_kill = len(marquez.received())
        assert at_kill < EVENTS, "the kill came after everything was delivered; nothing was tested"

        second, url = start_emitter(settings, marquez.url, tmp_path)
        procs.append(second)
        await marquez.wait_for(EVENTS, timeout=120)
        async with httpx.AsyncClient() as client:
            await wait_for(lambda: _backlog_empty(client, url), timeout=60, what="the restarted emitter to drain its backlog")
        await wait_evidence_settled(settings)  # after this, no late duplicate can arrive
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=20)
    received = marquez.received()
    counts = Counter(e["run"]["facets"]["budget"]["decision_id"] for e in received)
    assert set(counts) == {m.decision_id for m in sent}, "every event arrives"
    assert sum(n - 1 for n in counts.values()) <= 1, f"at most the one in flight twice: {[(d, n) for d, n in counts.items() if n > 1]}"


async def _backlog_empty(client: httpx.AsyncClient, url: str) -> bool:
    try:
        body = (await client.get(f"{url}/readyz")).json()
    except (httpx.HTTPError, ValueError):
        return False
    return body.get("ready") is True and body["delivery"]["backlog"] == 0
