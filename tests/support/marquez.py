"""A Marquez stand-in: a small HTTP server following tests/reference/marquez/openapi.yml for
`POST /api/v1/lineage` (answers 201, stores without deduplicating, as Marquez does) and the read
endpoints the audit uses (namespaces, jobs, runs with merged facets, one run, run facets, events).

It can be told to fail (5xx), refuse chosen events (4xx with a body), stall (hold requests
unanswered and unrecorded), be slow, or go away (its port refuses connections) and come back on
the same port. Every event it receives is validated against the OpenLineage spec 2-0-2 and the
budget facet's schema; `invalid` lists what failed.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from tests.support.kafka import wait_consumed
from tests.support.servers import InProcessServer, free_port
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
FACET_SCHEMAS = ROOT / "schemas"
OPENLINEAGE_ID = "https://openlineage.io/spec/2-0-2/OpenLineage.json"
_STATES = {"START": "RUNNING", "RUNNING": "RUNNING", "COMPLETE": "COMPLETED", "FAIL": "FAILED", "ABORT": "ABORTED"}


class MissingSpec(RuntimeError):
    """The OpenLineage spec to validate events against is not where it should be."""


# The reference files the tests validate against, in the repository (tests/reference/README.md).
REFERENCE = ROOT / "tests" / "reference"


def spec_folder() -> Path:
    """Where the OpenLineage spec 2-0-2 is: `openlineage-spec/spec` under BUDGETGATE_REFERENCE_DIR
    (another copy, e.g. a newer spec to try), else the repository's own under tests/reference."""
    reference = os.environ.get("BUDGETGATE_REFERENCE_DIR") or str(REFERENCE)
    return Path(reference) / "openlineage-spec" / "spec"


def require_spec() -> Path:
    """The OpenLineage spec folder. Missing, it fails loudly: a test that cannot validate events
    must not pass as if they were valid."""
    spec = spec_folder()
    if not (spec / "OpenLineage.json").is_file():
        raise MissingSpec(f"OpenLineage spec not found at {spec} (the repository keeps it in tests/reference); events cannot be validated without it")
    return spec


class OpenLineageValidator:
    """Validates RunEvents against spec 2-0-2 and custom facets against the project's schemas."""

    def __init__(self, spec: Path) -> None:
        from jsonschema import Draft202012Validator, FormatChecker
        from referencing import Registry, Resource

        resources = []
        for path in [spec / "OpenLineage.json", *sorted((spec / "facets").glob("*.json")), *sorted(FACET_SCHEMAS.rglob("*.json"))]:
            contents = json.loads(path.read_text())
            resources.append((contents["$id"], Resource.from_contents(contents)))
        self.registry = Registry().with_resources(resources)
        self._validator = Draft202012Validator
        self._checker = FormatChecker()

    def errors(self, event: dict[str, Any]) -> list[str]:
        """Every way `event` departs from the spec and from its facets' schemas."""
        found = [f"event: {e.message} at {list(e.absolute_path)}" for e in self._errors({"$ref": f"{OPENLINEAGE_ID}#/$defs/RunEvent"}, event)]
        try:
            uuid.UUID(event["run"]["runId"])
        except (KeyError, TypeError, ValueError):
            found.append("run.runId is not a UUID")
        try:
            datetime.fromisoformat(event["eventTime"])
        except (KeyError, TypeError, ValueError):
            found.append("eventTime is not an ISO 8601 date-time")
        for key, facet in ((event.get("run") or {}).get("facets") or {}).items():
            url = facet.get("_schemaURL", "") if isinstance(facet, dict) else ""
            if not url.startswith("https://budgetgate.dev/"):
                continue
            found += [f"facet {key}: {e.message} at {list(e.absolute_path)}" for e in self._errors({"$ref": url}, facet)]
        return found

    def _errors(self, schema: dict[str, Any], instance: Any) -> list[Any]:
        validator = self._validator(schema, registry=self.registry, format_checker=self._checker)
        return list(validator.iter_errors(instance))


class MarquezStandIn:
    """The server; use as a context manager or start()/close(). `url` is its base URL."""

    def __init__(self, *, validate: bool = True) -> None:
        self.events: list[dict[str, Any]] = []
        self.invalid: list[tuple[dict[str, Any], list[str]]] = []
        self.refused: list[dict[str, Any]] = []
        self.failed: list[dict[str, Any]] = []
        self.requests = 0
        self.status = 201  # what POST /api/v1/lineage answers; 5xx = failing
        self.refuse: Callable[[dict[str, Any]], bool] = lambda _event: False
        # A status to fail one event with (Marquez answers 500 on an error of its own while
        # storing an event), or None to take it.
        self.fail_event: Callable[[dict[str, Any]], int | None] = lambda _event: None
        self.delay = 0.0  # seconds before answering (the event is recorded first)
        self._stall = threading.Event()
        self._stall.set()  # set = not stalling
        self._lock = threading.Lock()
        self._validator = OpenLineageValidator(require_spec()) if validate else None
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[Any] = set()
        self._away = False
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> MarquezStandIn:
        self._away = False
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), _handler(self))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="marquez-stand-in", daemon=True)
        self._thread.start()
        return self

    def go_away(self) -> None:
        """Stop listening: connections to the port are refused until come_back()."""
        server, self._server = self._server, None
        self._away = True
        self._stall.set()
        if server is not None:
            server.shutdown()
            server.server_close()
        # Kept-alive connections would otherwise go on being served by their handler threads.
        with self._lock:
            connections, self._connections = set(self._connections), set()
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=10)

    def come_back(self) -> None:
        """Listen again on the same port, with everything received so far."""
        self.start()

    def close(self) -> None:
        self.go_away()

    def __enter__(self) -> MarquezStandIn:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- behaviour ------------------------------------------------------------------------------

    def fail(self, status: int = 503) -> None:
        """Answer every POST with `status` and record nothing."""
        self.status = status

    def recover(self) -> None:
        self.status = 201
        self._stall.set()

    def stall(self) -> None:
        """Hold every POST unanswered (and unrecorded) until recover()."""
        self._stall.clear()

    # -- what arrived ---------------------------------------------------------------------------

    def received(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.events)

    async def wait_for(self, count: int, timeout: float = 60) -> list[dict[str, Any]]:
        """Wait until at least `count` events arrived; returns them (fails the test on timeout)."""
        try:
            await wait_for(lambda: len(self.received()) >= count, timeout=timeout, what=f"{count} events at the Marquez stand-in")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: it received {len(self.received())}") from None
        return self.received()

    def runs(self) -> dict[str, dict[str, Any]]:
        """Every run as Marquez serves it (merged facets, state), keyed by run id."""
        with self._lock:
            events = list(self.events)
        runs: dict[str, dict[str, Any]] = {}
        for event in sorted(enumerate(events), key=lambda ie: (_instant(ie[1]["eventTime"]), ie[0])):
            _apply(runs, event[1])
        return runs

    # -- request handling -----------------------------------------------------------------------

    def _post_lineage(self, body: bytes) -> tuple[int, Any]:
        if self._away:
            return 0, None
        with self._lock:
            self.requests += 1
        if not self._stall.is_set():
            # A wedged server: the request is held, then dropped unanswered and unprocessed.
            self._stall.wait(timeout=120)
            return 0, None
        if self.status >= 400:
            return self.status, {"code": self.status, "message": "stand-in told to fail"}
        try:
            event = json.loads(body)
        except ValueError:
            return 400, {"code": 400, "message": "body is not JSON"}
        failing = self.fail_event(event)
        if failing is not None:
            with self._lock:
                self.failed.append(event)
            return failing, {"code": failing, "message": "stand-in fails on this event"}
        if self.refuse(event):
            with self._lock:
                self.refused.append(event)
            return 422, {"code": 422, "message": "stand-in refuses this event", "runId": event.get("run", {}).get("runId")}
        with self._lock:
            self.events.append(event)
            if self._validator is not None:
                errors = self._validator.errors(event)
                if errors:
                    self.invalid.append((event, errors))
        if self.delay:
            time.sleep(self.delay)  # a slow receiver: the stand-in's own request thread, not the test, waits
        return 201, None

    def _get(self, path: str, query: dict[str, list[str]]) -> tuple[int, Any]:
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] != ["api", "v1"]:
            return 404, {"code": 404, "message": f"no route {path}"}
        parts = parts[2:]
        limit = int(query.get("limit", ["100"])[0])
        offset = int(query.get("offset", ["0"])[0])
        runs = self.runs()
        if parts == ["namespaces"]:
            names = sorted({r["_job"][0] for r in runs.values()})
            return 200, {"namespaces": [_namespace(n) for n in names][offset : offset + limit]}
        if len(parts) == 3 and parts[0] == "namespaces" and parts[2] == "jobs":
            jobs = sorted({r["_job"] for r in runs.values() if r["_job"][0] == parts[1]})
            return 200, {"jobs": [_job(j) for j in jobs][offset : offset + limit], "totalCount": len(jobs)}
        if len(parts) == 5 and parts[0] == "namespaces" and parts[2] == "jobs" and parts[4] == "runs":
            mine = [r for r in runs.values() if r["_job"] == (parts[1], parts[3])]
            mine.sort(key=lambda r: r["updatedAt"], reverse=True)
            return 200, {"runs": [_public(r) for r in mine][offset : offset + limit]}
        if len(parts) >= 3 and parts[:2] == ["jobs", "runs"]:
            run = runs.get(parts[2])
            if run is None:
                return 404, {"code": 404, "message": f"run {parts[2]} not found"}
            if len(parts) == 4 and parts[3] == "facets":
                return 200, {"runId": parts[2], "facets": run["facets"]}
            return 200, _public(run)
        if parts == ["events", "lineage"]:
            events = self.received()
            return 200, {"events": events[offset : offset + limit], "totalCount": len(events)}
        return 404, {"code": 404, "message": f"no route {path}"}


def _handler(stand_in: MarquezStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_args: object) -> None:  # quiet
            pass

        def setup(self) -> None:
            super().setup()
            with stand_in._lock:
                stand_in._connections.add(self.connection)

        def finish(self) -> None:
            with stand_in._lock:
                stand_in._connections.discard(self.connection)
            try:
                super().finish()
            except OSError:
                pass

        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))
            if urlsplit(self.path).path.rstrip("/") != "/api/v1/lineage":
                self._answer(404, {"code": 404, "message": "no route"})
                return
            status, payload = stand_in._post_lineage(body)
            if status == 0:
                self.close_connection = True
                return
            self._answer(status, payload)

        def do_GET(self) -> None:  # noqa: N802
            parts = urlsplit(self.path)
            status, payload = stand_in._get(parts.path, parse_qs(parts.query))
            self._answer(status, payload)

        def _answer(self, status: int, payload: Any) -> None:
            body = b"" if payload is None else json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except OSError:  # the client went away (killed, or timed out) before the answer
                self.close_connection = True

    return Handler


def _instant(text: str) -> datetime:
    at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def _apply(runs: dict[str, dict[str, Any]], event: dict[str, Any]) -> None:
    run_id = event["run"]["runId"]
    job = (event["job"]["namespace"], event["job"]["name"])
    at = event["eventTime"]
    run = runs.setdefault(
        run_id, {"id": run_id, "createdAt": at, "updatedAt": at, "state": "NEW", "startedAt": None, "endedAt": None, "facets": {}, "_job": job}
    )
    run["updatedAt"] = at
    run["facets"].update((event["run"].get("facets") or {}))
    state = _STATES.get(event.get("eventType", ""))
    if state is not None:
        run["state"] = state
        if state == "RUNNING" and run["startedAt"] is None:
            run["startedAt"] = at
        if state in ("COMPLETED", "FAILED", "ABORTED"):
            run["endedAt"] = at


def _public(run: dict[str, Any]) -> dict[str, Any]:
    namespace, name = run["_job"]
    duration = None
    if run["startedAt"] and run["endedAt"]:
        duration = int((_instant(run["endedAt"]) - _instant(run["startedAt"])).total_seconds() * 1000)
    return {
        "id": run["id"],
        "createdAt": run["createdAt"],
        "updatedAt": run["updatedAt"],
        "nominalStartTime": None,
        "nominalEndTime": None,
        "state": run["state"],
        "startedAt": run["startedAt"],
        "endedAt": run["endedAt"],
        "durationMs": duration,
        "args": {},
        "jobVersion": {"namespace": namespace, "name": name, "version": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{namespace}/{name}"))},
        "inputDatasetVersions": [],
        "outputDatasetVersions": [],
        "context": {},
        "facets": run["facets"],
    }


def _namespace(name: str) -> dict[str, Any]:
    now = datetime.now(UTC).isoformat()
    return {"name": name, "createdAt": now, "updatedAt": now, "ownerName": "anonymous", "description": None}


def _job(job: tuple[str, str]) -> dict[str, Any]:
    now = datetime.now(UTC).isoformat()
    return {"id": {"namespace": job[0], "name": job[1]}, "type": "BATCH", "name": job[1], "simpleName": job[1],
            "namespace": job[0], "createdAt": now, "updatedAt": now, "inputs": [], "outputs": [], "facets": {},
            "latestRun": None, "latestRuns": []}  # fmt: skip


@pytest.fixture
def marquez() -> Iterator[MarquezStandIn]:
    """A running Marquez stand-in, closed after the test."""
    with MarquezStandIn() as server:
        yield server


# -- the evidence-emitter, run in-process or as a process to kill -------------------------------


class EmitterServer(InProcessServer):
    """The evidence-emitter in this process (uvicorn on a free port), sending to `client`."""

    name = "evidence-emitter"

    def __init__(self, settings: Any, client: Any | None) -> None:
        from budgetgate.services.evidence_emitter.app import create_app

        self.settings = settings
        super().__init__(create_app(settings, client=client), port=settings.port)

    async def start(self) -> EmitterServer:
        await super().start()
        return self

    async def wait_consuming(self, timeout: float = 30) -> None:
        await self.wait_ready(timeout)

    def assigned(self) -> list[list[str]]:
        """The partitions each of its Kafka subscribers reads now, as `topic[n]` (for a failure
        to say which partitions nobody in its group reads)."""
        return [sorted(f"{tp.topic}[{tp.partition}]" for tp in (sub.consumer.assignment() if sub.consumer else ())) for sub in self.rt.broker.subscribers]


def emitter_settings(settings: Any, **overrides: Any) -> Any:
    """EvidenceSettings on the test's backends, retrying fast."""
    from budgetgate.services.evidence_emitter.settings import EvidenceSettings

    values = {
        **settings.model_dump(),
        "port": free_port(),
        "evidence_initial_backoff_seconds": 0.1,
        "evidence_max_backoff_seconds": 1.0,
        "evidence_idle_seconds": 0.1,
        **overrides,
    }
    return EvidenceSettings(**values)


def http_client(url: str, *, timeout: float = 5.0) -> Any:
    """An OpenLineage client posting to `url` (the stand-in), as the emitter would build it."""
    from budgetgate.services.evidence_emitter import transport

    return transport.build_client("unused.jsonl", config={"transport": {"type": "http", "url": url, "timeout": timeout}})


def decision(
    run_id: str,
    outcome: str = "ALLOW",
    *,
    scope: str = "ns=vision-prod;team=vision",
    policy: str = "team",
    sha: str = "b" * 40,
    gpus: int = 8,
    hours: float = 6.0,
    at: datetime | None = None,
    attempt: int = 1,
    job: tuple[str, str] = ("vision-prod", "train-resnet"),
    remaining_hours: float = 100.0,
) -> Any:
    """A Decision message as admission publishes it, with one GPU-hour budget evaluated (and
    named as the deciding one, as admission names the only charged budget)."""
    from google.protobuf.timestamp_pb2 import Timestamp

    from budgetgate.core.units import MILLI_PER_HOUR
    from budgetgate.v1 import common_pb2, decisions_pb2

    def ts(value: datetime) -> Timestamp:
        stamp = Timestamp()
        stamp.FromDatetime(value)
        return stamp

    at = at or datetime.now(UTC)
    start = at.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    window_key = f"{start.strftime('%Y-%m-%dT%H:%M:%SZ')}/{end.strftime('%Y-%m-%dT%H:%M:%SZ')}"
    projected = int(gpus * hours * MILLI_PER_HOUR)
    remaining = int(remaining_hours * MILLI_PER_HOUR)
    decision_id = str(uuid.uuid4())
    evaluation = decisions_pb2.Decision.Evaluation(
        policy_id=policy, policy_git_sha=sha, scope_id=scope, ledger_key=f"{scope}|{window_key}|gpu_hours",
        window_start=ts(start), window_end=ts(end), unit="gpu_hours", enforcement="hard",
        on_exhausted="delay" if outcome == "DELAY" else "deny", limit_amount=int(1000 * MILLI_PER_HOUR),
        projected_amount=projected, remaining_amount=remaining, admitted_amount=projected if outcome == "ALLOW" else 0,
        deficit_amount=max(projected - remaining, 0) if outcome != "ALLOW" else 0, outcome=common_pb2.Outcome.Value(outcome))  # fmt: skip
    if outcome != "ALLOW":
        evaluation.next_eligible_time.CopyFrom(ts(end))
    return decisions_pb2.Decision(
        event_id=decision_id, event_time=ts(at), decision_id=decision_id, run_id=run_id, attempt=attempt,
        outcome=common_pb2.Outcome.Value(outcome), reason=f"{outcome.lower()} in a test", policy_bundle_sha=sha,
        namespace=job[0], labels={"team": "vision"}, job=common_pb2.Job(namespace=job[0], name=job[1]),
        resources=common_pb2.Resources(gpus=gpus, nodes=1), projected_runtime_hours=hours,
        projected_gpu_milli_hours=projected, evaluations=[evaluation], deciding_evaluation=0)  # fmt: skip


def reconciliation(source: Any, final_state: str, *, actual_hours: float, provisional: bool = False, at: datetime | None = None) -> Any:
    """The Reconciliation the reconciler would publish for the Decision `source`."""
    from google.protobuf.timestamp_pb2 import Timestamp

    from budgetgate.core.units import MILLI_PER_HOUR
    from budgetgate.v1 import reconciliations_pb2

    stamp = Timestamp()
    stamp.FromDatetime(at or datetime.now(UTC))
    actual = int(actual_hours * MILLI_PER_HOUR)
    message = reconciliations_pb2.Reconciliation(
        event_id=str(uuid.uuid4()), event_time=stamp, run_id=source.run_id, decision_id=source.decision_id,
        final_state=final_state, provisional=provisional, projected_gpu_milli_hours=source.projected_gpu_milli_hours,
        actual_gpu_milli_hours=actual, error_gpu_milli_hours=actual - source.projected_gpu_milli_hours,
        job=source.job, policy_bundle_sha=source.policy_bundle_sha)  # fmt: skip
    for e in source.evaluations:
        if e.ledger_key:
            message.charges.append(reconciliations_pb2.Reconciliation.WindowCharge(
                ledger_key=e.ledger_key, scope_id=e.scope_id, policy_id=e.policy_id, window_start=e.window_start,
                window_end=e.window_end, amount=actual if e.unit == "gpu_hours" else e.projected_amount, unit=e.unit))  # fmt: skip
    return message


def admission_decision(answer: dict, run_id: str, *, job: tuple[str, str] = ("vision-prod", "train-resnet")):  # type: ignore[no-untyped-def,type-arg]
    """The Decision message behind an admission answer, enough for a Reconciliation of it."""
    message = decision(
        run_id, "ALLOW", scope=answer["evaluations"][0]["scope_id"], policy=answer["evaluations"][0]["policy_id"], sha=answer["policy_bundle_sha"], job=job
    )
    message.decision_id = answer["decision_id"]
    message.projected_gpu_milli_hours = round(answer["projected_gpu_hours"] * 3_600_000)
    return message


async def publish(settings, *messages) -> None:  # type: ignore[no-untyped-def]
    """Send Decision and Reconciliation messages to the test's topics."""
    from budgetgate.messaging.publisher import Publisher
    from budgetgate.contracts.topics import Topics

    topics = Topics(settings.topic_prefix)
    async with Publisher(settings.kafka_bootstrap) as publisher:
        for message in messages:
            topic = topics.decisions if message.DESCRIPTOR.name == "Decision" else topics.reconciliations
            await publisher.send(topic, message, key=message.run_id)


async def wait_evidence_settled(settings: Any, *, timeout: float = 60) -> None:
    """Wait until the evidence-emitter has consumed (committed) every message on its topics and
    every stored event is delivered or dead: from then on nothing more can reach Marquez, so a
    test may count what arrived without sleeping "long enough" first."""
    import asyncpg

    from budgetgate.contracts.topics import Topics

    topics = Topics(settings.topic_prefix)
    await wait_consumed(settings.kafka_bootstrap, emitter_settings(settings).consumer_group, [topics.decisions, topics.reconciliations], timeout=timeout)
    conn = await asyncpg.connect(settings.postgres_dsn)
    try:
        await wait_for(lambda: _no_pending(conn), timeout=timeout, what="every stored evidence event to be delivered or dead")
    finally:
        await conn.close()


async def _no_pending(conn: Any) -> bool:
    return await conn.fetchval("SELECT count(*) FROM evidence_events WHERE state IN ('pending', 'waiting')") == 0
