"""The evidence-emitter on real Postgres and Kafka, with the real admission service and the Marquez
stand-in: one valid event per transition, a restart that resends nothing, 4xx to the dead-letter
table, and the file and Kafka transports."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncio
import json
from collections import Counter
from pathlib import Path

import asyncpg
import pytest

from budgetgate.messaging.publisher import Publisher
from budgetgate.contracts import wire
from budgetgate.evidence import events
from budgetgate.services.evidence_emitter import transport
from budgetgate.contracts.topics import Topics, dlq
from budgetgate.messaging.topic_admin import ensure_topics
from tests.support.admission import apply_policies, budget_yaml
from tests.support.kafka import drain
from tests.support.marquez import (
    EmitterServer,
    admission_decision,
    decision,
    emitter_settings,
    http_client,
    publish,
    reconciliation,
    require_spec,
    wait_evidence_settled,
)
from tests.support.marquez import marquez  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for

POLICIES = {
    "team.yaml": budget_yaml("team", limit="gpu_hours: 80"),
    "research.yaml": budget_yaml("research", namespace="vision-research", limit="gpu_hours: 60", on_exhausted="delay"),
}


def kinds(received: list[dict]) -> Counter:  # type: ignore[type-arg]
    return Counter((e["run"]["runId"], e["eventType"]) for e in received)


def instant(text: str) -> datetime:
    """The facet and the HTTP answer name the same instants (each in its own RFC 3339 spelling)."""
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


async def test_each_decision_and_reconciliation_is_one_valid_event(settings, pg_dsn, admission_factory, marquez) -> None:  # type: ignore[no-untyped-def]
    require_spec()
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    await apply_policies(pg_dsn, POLICIES, sha="c" * 40)
    admission = await admission_factory()
    await admission.wait_ready()
    emitter = await EmitterServer(emitter_settings(settings), http_client(marquez.url)).start()
    try:
        answers = {}
        for name, overrides in {
            "allow": {"run_id": "prod/allow"},
            "deny": {"run_id": "prod/deny"},
            "labels": {"run_id": "prod/labels", "labels": {"environment": "prod"}},
            "research": {"run_id": "research/allow", "namespace": "vision-research", "job": {"namespace": "vision-research", "name": "sweep"}},
            "delay": {"run_id": "research/delay", "namespace": "vision-research", "job": {"namespace": "vision-research", "name": "sweep"}},
        }.items():
            response = await admission.submit(**overrides)
            assert response.status_code == 200, response.text
            answers[name] = response.json()
        assert [answers[n]["decision"] for n in answers] == ["ALLOW", "DENY", "DENY", "ALLOW", "DELAY"]
        assert (await admission.submit(run_id="prod/allow")).json()["replayed"] is True  # a retry: no new decision

        received = await marquez.wait_for(5)
        expected = {
            ("prod/allow", "START"), ("prod/deny", "ABORT"), ("prod/labels", "ABORT"), ("research/allow", "START"), ("research/delay", "OTHER"),
        }  # fmt: skip
        assert kinds(received) == Counter({(str(events.run_uuid(r)), k): 1 for r, k in expected})
        by_run = {e["run"]["facets"]["budget"]["run_id"]: e for e in received}
        allow = by_run["prod/allow"]["run"]["facets"]["budget"]
        assert allow["decision_id"] == answers["allow"]["decision_id"] and allow["policy_id"] == "team"
        assert allow["policy_git_sha"] == "c" * 40 and allow["projected_gpu_hours"] == 48.0 == allow["admitted_gpu_hours"]
        assert instant(allow["window_start"]) == instant(answers["allow"]["evaluations"][0]["window_start"])
        assert by_run["prod/allow"]["job"] == {"namespace": "vision-prod", "name": "train-resnet", "facets": {}}
        deny = by_run["prod/deny"]["run"]["facets"]["budget"]
        assert deny["deficit_gpu_hours"] == 16.0 and instant(deny["next_eligible_time"]) == instant(answers["deny"]["evaluations"][0]["next_eligible_time"])
        assert by_run["prod/labels"]["run"]["facets"]["budget"]["evaluations"][0]["missing_labels"] == ["team"]
        # Each ledger key's reading as the decision read it reaches Marquez: prod/allow's hold of 48.
        reading = deny["evaluations"][0]["reading"]
        assert (reading["reserved"], reading["consumed"], reading["remaining"]) == (48.0, 0.0, answers["deny"]["evaluations"][0]["remaining"])
        assert reading["limit"] - reading["reserved"] - reading["consumed"] == reading["remaining"]
        assert deny["submission"]["namespace"] == "vision-prod" and deny["submission"]["resources"]["gpus"] == 8
        assert "reading" not in by_run["prod/labels"]["run"]["facets"]["budget"]["evaluations"][0]
        delay = by_run["research/delay"]["run"]["facets"]["budget"]
        assert delay["decision"] == "DELAY" and delay["deficit_gpu_hours"] == 36.0 and "next_eligible_time" in delay

        # Reconciliations, as the reconciler publishes them: a running snapshot, the completion, a
        # later correction, a failure; plus one message delivered twice.
        topics = Topics(settings.topic_prefix)
        allowed = admission_decision(answers["allow"], "prod/allow")
        research = admission_decision(answers["research"], "research/allow", job=("vision-research", "sweep"))
        running = reconciliation(allowed, "RUNNING", actual_hours=10, provisional=True)
        completed = reconciliation(allowed, "COMPLETED", actual_hours=40, provisional=True)
        corrected = reconciliation(allowed, "COMPLETED", actual_hours=42)
        failed = reconciliation(research, "FAILED", actual_hours=50)
        async with Publisher(settings.kafka_bootstrap) as publisher:
            for message in (running, completed, corrected, failed, failed):
                await publisher.send(topics.reconciliations, message, key=message.run_id)
        await marquez.wait_for(9)
        await wait_evidence_settled(settings)  # after this, nothing more can arrive
        received = marquez.received()
        expected |= {("prod/allow", "RUNNING"), ("prod/allow", "COMPLETE"), ("prod/allow", "OTHER"), ("research/allow", "FAIL")}
        assert kinds(received) == Counter({(str(events.run_uuid(r)), k): 1 for r, k in expected})
        assert marquez.invalid == []

        runs = marquez.runs()
        done = runs[str(events.run_uuid("prod/allow"))]
        assert done["state"] == "COMPLETED"
        budget = done["facets"]["budget"]
        assert budget["stage"] == "reconciliation" and budget["actual_gpu_hours"] == 42.0
        assert budget["reservation_error_gpu_hours"] == -6.0 and budget["decision"] == "ALLOW" and budget["provisional"] is False
        assert runs[str(events.run_uuid("research/allow"))]["state"] == "FAILED"
        assert runs[str(events.run_uuid("research/delay"))]["state"] == "NEW"  # OTHER changes no state
        # The group's only member reads every partition of both topics (what a failure elsewhere
        # reports through EmitterServer.assigned).
        read = {name for partitions in emitter.assigned() for name in partitions}
        assert {f"{topic}[{n}]" for topic in (topics.decisions, topics.reconciliations) for n in range(settings.topic_partitions)} <= read
    finally:
        await emitter.stop()


async def test_a_restart_resends_nothing_and_a_refusal_is_dead_lettered(settings, pg_dsn, marquez) -> None:  # type: ignore[no-untyped-def]
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    refused_run = str(events.run_uuid("runs/refused"))
    marquez.refuse = lambda event: event["run"]["runId"] == refused_run
    first = [decision(f"runs/{i}") for i in range(3)] + [decision("runs/refused", "DENY")]
    await publish(settings, *first)
    emitter = await EmitterServer(emitter_settings(settings), http_client(marquez.url)).start()
    try:
        await marquez.wait_for(3)
        await wait_for(lambda: emitter.rt.sender.stats.dead_lettered == 1, what="the refused event to be dead-lettered")
    finally:
        await emitter.stop()
    assert len(marquez.refused) == 1, "a refused event is not retried"
    conn = await asyncpg.connect(pg_dsn)
    try:
        dead = await conn.fetch("SELECT d.status_code, d.body, e.run_id, e.state FROM evidence_dead_letters d JOIN evidence_events e USING (seq)")
        states = Counter(r["state"] for r in await conn.fetch("SELECT state FROM evidence_events"))
    finally:
        await conn.close()
    assert [(r["status_code"], r["run_id"], r["state"]) for r in dead] == [(422, "runs/refused", "dead")]
    assert "refuses this event" in dead[0]["body"]
    assert states == Counter({"delivered": 3, "dead": 1})

    # A new process on the same database and consumer group: only the new decision goes out.
    await publish(settings, decision("runs/after-restart"))
    again = await EmitterServer(emitter_settings(settings), http_client(marquez.url)).start()
    try:
        await marquez.wait_for(4)
        await wait_evidence_settled(settings)
    finally:
        await again.stop()
    assert sorted(e["run"]["facets"]["budget"]["run_id"] for e in marquez.received()) == ["runs/0", "runs/1", "runs/2", "runs/after-restart"]
    assert len(marquez.refused) == 1


async def test_an_event_the_receiver_keeps_failing_on_is_set_aside_and_resent_on_demand(settings, pg_dsn, marquez) -> None:  # type: ignore[no-untyped-def]
    # Marquez answering 500 to one event, for ever, while it takes every other: the event was
    # retried every minute for ever, and its run's later events (a run's go in order) never left.
    from click.testing import CliRunner

    from budgetgate.cli.main import cli

    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    poison_run = str(events.run_uuid("runs/poison"))
    marquez.fail_event = lambda event: 500 if event["run"]["runId"] == poison_run and event["eventType"] == "START" else None
    poisoned = decision("runs/poison")
    await publish(settings, poisoned, *[decision(f"runs/{i}") for i in range(3)])
    env = {"BUDGETGATE_POSTGRES_DSN": settings.postgres_dsn, "BUDGETGATE_HOME": "/nonexistent"}

    async def budgetgate(*args: str):  # type: ignore[no-untyped-def]
        return await asyncio.to_thread(CliRunner().invoke, cli, list(args), env=env)

    emitter = await EmitterServer(emitter_settings(settings, evidence_server_error_limit=3), http_client(marquez.url)).start()
    try:
        await marquez.wait_for(3)
        # The other runs keep the receiver busy: each of the poison's tries after the first finds
        # events delivered since its previous one, until it is set aside.
        for i in range(3, 30):
            if emitter.rt.sender.stats.dead_lettered:
                break
            await publish(settings, decision(f"runs/{i}"))
            await asyncio.sleep(0.3)  # the scenario's pace: a trickle of other runs' decisions between the poison's tries
        await wait_for(lambda: emitter.rt.sender.stats.dead_lettered == 1, what="the failing event to be dead-lettered")
        # Tried once, then at least once per strike (a try with nothing delivered since the last is none).
        assert len(marquez.failed) >= 4 and all(e["run"]["runId"] == poison_run for e in marquez.failed)
        # The run's next event is no longer held back behind it.
        await publish(settings, reconciliation(poisoned, "COMPLETED", actual_hours=1.0))
        await wait_for(lambda: any(e["run"]["runId"] == poison_run for e in marquez.received()), what="the poison run's later event")

        listed = await budgetgate("evidence", "dead", "--json")
        assert listed.exit_code == 0, listed.output
        [dead] = [json.loads(line) for line in listed.stdout.splitlines()]
        assert (dead["run_id"], dead["event_type"], dead["status_code"]) == ("runs/poison", "START", 500), dead
        assert "3 times while it accepted others" in dead["error"] and "fails on this event" in dead["body"]
        unknown = await budgetgate("evidence", "resend", "--seq", "999999999")
        assert unknown.exit_code == 1 and "not dead-lettered" in unknown.output
        assert (await budgetgate("evidence", "resend")).exit_code == 2  # neither --seq nor --all

        # Fixed (the receiver, or what it choked on): resent, the running emitter delivers it.
        marquez.fail_event = lambda _event: None
        resent = await budgetgate("evidence", "resend", "--seq", str(dead["seq"]))
        assert resent.exit_code == 0 and "1 event(s) back" in resent.stdout, resent.output
        await wait_for(lambda: (poison_run, "START") in kinds(marquez.received()), what="the resent event")
        await wait_evidence_settled(settings)
    finally:
        await emitter.stop()
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM evidence_events WHERE state <> 'delivered'") == 0
        assert await conn.fetchval("SELECT count(*) FROM evidence_dead_letters") == 0
    finally:
        await conn.close()


async def test_a_receiver_failing_on_everything_sets_nothing_aside(settings, marquez) -> None:  # type: ignore[no-untyped-def]
    # 500 to every event is the receiver's own trouble, however long: nothing proves any one
    # event the cause, so nothing is dead-lettered, and all of it arrives once it recovers.
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    await publish(settings, *[decision(f"runs/{i}") for i in range(3)])
    marquez.fail(500)
    emitter = await EmitterServer(emitter_settings(settings, evidence_server_error_limit=1), http_client(marquez.url)).start()
    try:
        await wait_for(lambda: emitter.rt.sender.stats.failures >= 8, what="several failed tries")
        assert emitter.rt.sender.stats.dead_lettered == 0
        marquez.recover()
        await marquez.wait_for(3)
        await wait_evidence_settled(settings)
    finally:
        await emitter.stop()
    assert emitter.rt.sender.stats.dead_lettered == 0


async def test_without_configuration_the_file_transport_is_used(settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    for name in ("OPENLINEAGE_URL", "OPENLINEAGE_CONFIG", "OPENLINEAGE__TRANSPORT__TYPE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    await publish(settings, decision("file/1"), decision("file/2", "DELAY"))
    path = tmp_path / "evidence" / "openlineage.jsonl"
    emitter = await EmitterServer(emitter_settings(settings, evidence_file=str(path)), None).start()
    try:
        await wait_for(lambda: path.exists() and len(path.read_text().splitlines()) == 2, what="two events in the file")
        assert emitter.rt.client.transport.kind == "file"
    finally:
        await emitter.stop()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted((e["run"]["facets"]["budget"]["run_id"], e["eventType"]) for e in lines) == [("file/1", "START"), ("file/2", "OTHER")]


async def test_the_kafka_transport_delivers_to_a_topic(settings) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("confluent_kafka", reason="the Kafka transport needs confluent-kafka")
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    lineage_topic = f"{settings.topic_prefix}openlineage.events"
    client = transport.build_client(
        "unused", config={"transport": {"type": "kafka", "topic": lineage_topic, "config": {"bootstrap.servers": settings.kafka_bootstrap}}}
    )
    await publish(settings, decision("kafka/1"), decision("kafka/2", "DENY"))
    emitter = await EmitterServer(emitter_settings(settings), client).start()
    try:
        await wait_for(lambda: emitter.rt.sender.stats.delivered == 2, timeout=60, what="two events delivered to Kafka")
    finally:
        await emitter.stop()
    found = [json.loads(r.value) for r in await drain(settings.kafka_bootstrap, lineage_topic, 2, timeout=30)]
    assert sorted((e["run"]["facets"]["budget"]["run_id"], e["eventType"]) for e in found) == [("kafka/1", "START"), ("kafka/2", "ABORT")]


async def test_a_reconciliation_before_its_decision_waits_for_it(settings, marquez) -> None:  # type: ignore[no-untyped-def]
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    early = decision("order/early")
    early.evaluations.append(decision("x", scope="ns=vision-prod").evaluations[0])  # a second budget, on the namespace
    orphan = decision("order/orphan")  # its decision never comes
    await publish(settings, reconciliation(early, "COMPLETED", actual_hours=40), reconciliation(orphan, "COMPLETED", actual_hours=10))
    emitter = await EmitterServer(emitter_settings(settings, evidence_decision_wait_seconds=3.0), http_client(marquez.url)).start()
    try:
        await wait_for(lambda: emitter.rt.sender.stats.backlog.pending == 2, what="both reconciliations to be stored")
        # The sender reads the backlog at the start of each pass: a new reading means it has been
        # through a delivery pass with both reconciliations stored.
        seen = emitter.rt.sender.stats.backlog
        await wait_for(lambda: emitter.rt.sender.stats.backlog is not seen, what="a delivery pass")
        assert marquez.received() == [], "a reconciliation waits for its decision"
        await publish(settings, early)
        received = await marquez.wait_for(3, timeout=60)
    finally:
        await emitter.stop()
    by_run = [(e["run"]["facets"]["budget"]["run_id"], e["eventType"]) for e in received]
    assert by_run.index(("order/early", "START")) < by_run.index(("order/early", "COMPLETE")), by_run
    complete = next(e for e in received if e["eventType"] == "COMPLETE" and e["run"]["facets"]["budget"]["run_id"] == "order/early")
    budget = complete["run"]["facets"]["budget"]
    assert [e["scope_id"] for e in budget["evaluations"]] == ["ns=vision-prod;team=vision", "ns=vision-prod"]
    assert budget["actual_gpu_hours"] == 40.0 and budget["decision_id"] == early.decision_id and budget["reason"] == early.reason
    # The orphan went out after the wait, with the decision inferred from its charges.
    inferred = next(e for e in received if e["run"]["facets"]["budget"]["run_id"] == "order/orphan")["run"]["facets"]["budget"]
    assert inferred["decision"] == "ALLOW" and [e["scope_id"] for e in inferred["evaluations"]] == ["ns=vision-prod;team=vision"]
    assert marquez.invalid == []


async def test_a_message_the_emitter_cannot_read_is_dead_lettered_and_the_rest_go_on(settings, marquez) -> None:  # type: ignore[no-untyped-def]
    # An outcome this build does not know (a newer admission during a rolling upgrade) or a time
    # out of range raised a plain ValueError, which the inbox took for an outage: the batch was
    # retried for ever, and no decision or reconciliation after it was consumed.
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    unknown = decision("runs/unknown-outcome")
    unknown.outcome = 9
    far = decision("runs/far-future")
    far.event_time.seconds = 10**12
    await publish(settings, unknown, far, decision("runs/after"))
    emitter = await EmitterServer(emitter_settings(settings), http_client(marquez.url)).start()
    try:
        await marquez.wait_for(1)
        await wait_evidence_settled(settings)
    finally:
        await emitter.stop()
    assert [e["run"]["facets"]["budget"]["run_id"] for e in marquez.received()] == ["runs/after"]
    parked = await drain(settings.kafka_bootstrap, dlq(Topics(settings.topic_prefix).decisions), 2)
    reasons = sorted(wire.header(r.headers, wire.DLQ_REASON).decode() for r in parked)
    assert len(reasons) == 2 and all(r.startswith("unusable message: ValueError") for r in reasons), reasons


@pytest.mark.parametrize("decision_first", [True, False])
async def test_a_run_admitted_after_a_refused_attempt_gets_its_own_end(settings, marquez, decision_first: bool) -> None:  # type: ignore[no-untyped-def]
    # Attempt 1 refused (ABORT), attempt 2 admitted (START): the run lives again in Marquez. Its
    # COMPLETE was sent as OTHER because the refusal's ABORT counted as the run's one terminal
    # event, and Marquez kept the run RUNNING for ever. Also when the reconciliation comes before
    # its decision (it waits for it, typed when it came).
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    t0 = datetime.now(UTC) - timedelta(hours=3)
    refused = decision("again/run", "DENY", attempt=1, at=t0)
    admitted = decision("again/run", "ALLOW", attempt=2, at=t0 + timedelta(minutes=10))
    running = reconciliation(admitted, "RUNNING", actual_hours=5, at=t0 + timedelta(hours=1))
    completed = reconciliation(admitted, "COMPLETED", actual_hours=10, at=t0 + timedelta(hours=2))
    corrected = reconciliation(admitted, "COMPLETED", actual_hours=11, at=t0 + timedelta(hours=2, minutes=10))  # late samples
    await publish(settings, refused)
    if decision_first:
        await publish(settings, admitted, running, completed, corrected)
    else:
        await publish(settings, running, completed, corrected)
    emitter = await EmitterServer(emitter_settings(settings), http_client(marquez.url)).start()
    try:
        if not decision_first:
            await wait_for(lambda: emitter.rt.sender.stats.backlog.pending >= 3, what="the reconciliations stored, waiting")
            await publish(settings, admitted)
        received = await marquez.wait_for(5, timeout=60)
        await wait_evidence_settled(settings)
    finally:
        await emitter.stop()
    # One terminal event for the admitted life: the correction after it is OTHER.
    assert [e["eventType"] for e in received] == ["ABORT", "START", "RUNNING", "COMPLETE", "OTHER"], [e["eventType"] for e in received]
    assert marquez.runs()[str(events.run_uuid("again/run"))]["state"] == "COMPLETED"


async def test_a_decision_and_its_reconciliation_consumed_at_once_find_each_other(pg_dsn) -> None:
    # Two consumers (two instances) store a decision and its reconciliation at the same time:
    # each transaction misses the other's row, so the reconciliation waited out the decision wait
    # and went out with an inferred decision (no reason, limit 0). The sender now releases a
    # waiting reconciliation as soon as its decision is stored.
    from budgetgate.services.evidence_emitter import handlers as evidence_handlers
    from budgetgate.services.evidence_emitter.sender import Sender

    handlers = evidence_handlers.EvidenceHandlers(producer=events.producer_uri())
    admitted = decision("race/run")
    done = reconciliation(admitted, "COMPLETED", actual_hours=3)
    first, second = await asyncpg.connect(pg_dsn), await asyncpg.connect(pg_dsn)
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    try:
        async with first.transaction():
            await handlers.reconciliation(first, done, None)  # stored waiting: no decision yet
            async with second.transaction():
                await handlers.decision(second, admitted, None)  # finds nothing waiting: not committed
        state = await first.fetchval("SELECT state FROM evidence_events WHERE stage = 'reconciliation'")
        assert state == "waiting"
        sender = Sender(pool=pool, send=lambda _event: None)
        assert await sender.release_decided() == 1
        row = await first.fetchrow("SELECT state, event_type, payload FROM evidence_events WHERE stage = 'reconciliation'")
        budget = json.loads(row["payload"])["run"]["facets"]["budget"]
        assert (row["state"], row["event_type"]) == ("pending", "COMPLETE")
        assert budget["decision_id"] == admitted.decision_id and budget["reason"] == admitted.reason
        assert await sender.release_decided() == 0
    finally:
        await pool.close()
        await first.close()
        await second.close()
