"""Replicas of a benchmarked service driven as one (`--replicas N`): the load generator spreads
its clients (closed loop) or its submissions (open loop) over them and records which one
answered; each replica's CPU is shown with their sum and counted once; their stage histograms
and garbage collection figures are added up."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from budgetgate.benchmark import breakdown, load, report, workload
from budgetgate.benchmark.admission_runner import Options, RunResult
from budgetgate.benchmark.correctness import Audit
from budgetgate.benchmark.cpu import CpuUse, Part, parts_text
from budgetgate.benchmark.pauses import Collections

ANSWER = json.dumps({"decision": "ALLOW"}).encode()


class _Server:
    """A real HTTP/1.1 keep-alive server on a free port that answers every POST with ALLOW and
    counts the requests and connections it was sent."""

    def __init__(self) -> None:
        self.requests = 0
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                length = next(int(line.split(":", 1)[1]) for line in head.split("\r\n") if line.lower().startswith("content-length"))
                await reader.readexactly(length)
                self.requests += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def servers() -> AsyncIterator[list[tuple[_Server, int]]]:
    started = [_Server() for _ in range(3)]
    ports = [await server.start() for server in started]
    yield list(zip(started, ports, strict=True))
    for server in started:
        assert server.server is not None
        server.server.close()


async def test_the_closed_loop_pins_client_k_to_replica_k_mod_n(servers: list[tuple[_Server, int]]) -> None:
    ports = [port for _, port in servers]
    bodies = [b"{}"] * 300

    outcome = await load.drive(host="127.0.0.1", ports=ports, bodies=bodies, concurrency=7)

    assert outcome.answered == 300 and outcome.count("ALLOW") == 300
    # Clients 0, 3, 6 on the first replica, 1 and 4 on the second, 2 and 5 on the third: one keep-alive connection each.
    assert [server.connections for server, _ in servers] == [3, 2, 2]
    assert outcome.answered_by(3) == [server.requests for server, _ in servers]
    assert sum(outcome.answered_by(3)) == 300 and None not in outcome.served_by


async def test_the_open_loop_sends_submission_i_to_replica_i_mod_n(servers: list[tuple[_Server, int]]) -> None:
    ports = [port for _, port in servers[:2]]

    outcome = await load.offer(host="127.0.0.1", ports=ports, bodies=[b"{}"] * 41, rate=2000.0)

    assert outcome.served_by == [i % 2 for i in range(41)]
    assert outcome.answered_by(2) == [21, 20] == [server.requests for server, _ in servers[:2]]


async def test_one_port_is_one_replica(servers: list[tuple[_Server, int]]) -> None:
    outcome = await load.drive(host="127.0.0.1", ports=[servers[0][1]], bodies=[b"{}"] * 10, concurrency=4)
    assert outcome.served_by == [0] * 10 and outcome.answered_by(1) == [10]


def test_replicas_are_parts_of_their_own_added_up_as_their_service_and_counted_once() -> None:
    parts = Part.replicas("service", [101, 102])
    assert [(p.name, p.pids, p.group) for p in parts] == [("service 1", (101,), "service"), ("service 2", (102,), "service")]
    assert [(p.name, p.group) for p in Part.replicas("service", [101])] == [("service", None)]

    used = CpuUse(
        seconds=1.0,
        parts={"service 1": 0.10, "service 2": 0.20, "postgres": 0.15, "load generator": 0.05},
        machine_busy=0.95,
        cpus=2,
        apart=frozenset({"load generator"}),
        groups={"service": ("service 1", "service 2")},
    )
    assert used.all_parts == pytest.approx(0.45)  # each replica once; the load generator apart
    assert used.group_us(1000) == {"service": pytest.approx(300.0)}
    assert used.line(1000, "decision") == (
        "CPU µs per decision: all parts 450 (service 300 = service 1 100 + service 2 200, postgres 150); load generator 50; machine 95% busy (2 CPUs)"
    )
    document = used.as_json(1000)
    assert document["groups"] == {"service": ["service 1", "service 2"]} and document["group_us_per_unit"] == {"service": pytest.approx(300.0)}
    assert document["us_per_unit"] == {"service 1": 100.0, "service 2": 200.0, "postgres": 150.0, "load generator": 50.0}

    unknown = CpuUse(1.0, {"service 1": 0.1, "service 2": None}, 0.5, 2, groups={"service": ("service 1", "service 2")})
    assert unknown.group_us(10) == {"service": None} and unknown.all_parts is None
    assert parts_text({"a 1": 1.0, "b": 2.0, "a 2": 3.0}, {"a": ("a 1", "a 2")}, {"a": 4.0}) == "a 4 = a 1 1 + a 2 3, b 2"


def test_the_stage_histograms_of_the_replicas_add_up() -> None:
    one = ({"plan": [(0.001, 3.0), (float("inf"), 4.0)]}, {"plan": 0.004})
    two = ({"plan": [(0.001, 1.0), (float("inf"), 6.0)], "commit": [(0.001, 2.0), (float("inf"), 2.0)]}, {"plan": 0.02, "commit": 0.001})

    combined = breakdown.combine([one, two])

    assert combined == ({"plan": [(0.001, 4.0), (float("inf"), 10.0)], "commit": [(0.001, 2.0), (float("inf"), 2.0)]}, {"plan": 0.024, "commit": 0.001})
    found = {stage.name: stage for stage in breakdown.between(({}, {}), combined)}
    assert found["plan"].count == 10 and found["plan"].mean_ms == pytest.approx(2.4)
    assert breakdown.combine([one, None]) is None  # a replica unread: its submissions would be missing


def test_the_garbage_collection_of_the_replicas_adds_up() -> None:
    total = Collections.total([Collections((1, 2, 0), (0.01, 0.02, 0.0), 2.0), Collections((3, 0, 1), (0.03, 0.0, 0.04), 3.0)])
    assert total == Collections((4, 2, 1), (0.04, 0.02, 0.04), 5.0, replicas=2)
    assert total.share == pytest.approx(0.02)
    assert "in the service's 2 replicas, added up," in total.line() and "of their 5.00 s CPU" in total.line()
    assert Collections.total([total, None]) is None


def test_fewer_clients_than_replicas_is_refused() -> None:
    with pytest.raises(ValueError, match=r"concurrency \(2\) must be at least replicas \(3\)"):
        Options(concurrency=2, replicas=3)


def test_the_report_names_every_replica_and_gives_the_medians_of_each_part() -> None:
    work = workload.build("hot", requests=4, warmup=0, budgets=1, allow_fraction=1.0, tag="t")
    results = []
    for number, (first, second) in enumerate([(0.001, 0.002), (0.003, 0.002), (0.002, 0.002)], 1):
        outcome = load.Outcome(elapsed=1.0, latencies=[0.01] * 4, decisions=["ALLOW"] * 4, served_by=[0, 1, 0, 1])
        cpu = CpuUse(1.0, {"service 1": first, "service 2": second, "postgres": 0.001}, 0.5, 2, groups={"service": ("service 1", "service 2")})
        results.append(RunResult("budgetgate", "hot", work, outcome, Audit(1, 32.0, 32.0, 4), {}, cpu, number, replicas=2))

    [row] = [report.row(results[0])]
    assert row["answered_by_replica"] == {"service 1": 2, "service 2": 2} and row["replicas"] == 2
    [summary] = report.run_medians(results)
    assert summary["parts_us"]["service 1"] == {"median": 500.0, "low": 250.0, "high": 750.0, "rounds": 3}
    assert summary["group_us"]["service"]["median"] == 1000.0 and summary["all_parts_us"]["median"] == 1250.0
    assert summary["decisions_per_second"]["median"] == 4.0

    options = Options(requests=4, concurrency=4, scenarios=("hot",), systems=("budgetgate",), rounds=3, replicas=2, ceiling=False)
    text = report.as_text(options, report.Measurements("t", results))
    assert "budgetgate/hot #1: answered by service 1 2, service 2 2" in text
    assert "CPU µs per decision: all parts 1000 (service 750 = service 1 250 + service 2 500, postgres 250)" in text
    assert "median of 3 rounds, budgetgate/hot: 4 (4-4) decisions/s" in text
    assert "all parts 1250 (1000-1500) (service 1000 = service 1 500 + service 2 500, postgres 250)" in text
    document = report.as_json(options, report.Measurements("t", results))
    assert document["options"]["replicas"] == 2 and document["results"][0]["cpu"]["groups"] == {"service": ["service 1", "service 2"]}


def test_the_commands_refuse_replicas_that_would_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """More admission replicas than clients, or more reconcilers than the topics have partitions:
    a usage error before anything is started."""
    from click.testing import CliRunner

    from budgetgate.cli.bench import bench

    admission = CliRunner().invoke(bench, ["admission", "--concurrency", "2", "--replicas", "3"])
    assert admission.exit_code == 2 and "concurrency (2) must be at least replicas (3)" in admission.output
    monkeypatch.setenv("BUDGETGATE_TOPIC_PARTITIONS", "3")
    for steady in ([], ["--records-per-s", "100"]):
        reconciliation = CliRunner().invoke(bench, ["reconciliation", "--replicas", "4", *steady])
        assert reconciliation.exit_code == 2
        assert "replicas (4) must be between 1 and the topics' partitions (3, BUDGETGATE_TOPIC_PARTITIONS)" in reconciliation.output


def test_a_token_pool_needs_the_steady_load() -> None:
    """`--token-pool` changes only the steady load's admissions: without `--records-per-s` it is a
    usage error before anything is started, not an option silently ignored."""
    from click.testing import CliRunner

    from budgetgate.cli.bench import bench

    refused = CliRunner().invoke(bench, ["reconciliation", "--token-pool"])
    assert refused.exit_code == 2 and "--token-pool goes with --records-per-s" in refused.output


def test_the_steady_bench_declares_a_pool_only_when_asked() -> None:
    """The bundle of `bench reconciliation` gets the token pool (its quota: a token for every run)
    only with a quota; the team budgets are the same either way."""
    from budgetgate.benchmark.reconciliation_runner import POOL, _policies
    from budgetgate.core.loader import build_bundle, parse_text

    def bundle(**kwargs: int) -> object:
        documents = [doc for name, text in _policies(3, **kwargs).items() for doc in parse_text(text, name)]
        return build_bundle(documents, git_sha="0" * 40)

    plain, pooled = bundle(), bundle(pool_quota=15)
    assert plain.pools == () and [p.namespace for p in pooled.pools] == [POOL]  # type: ignore[attr-defined]
    assert pooled.pools[0].quota == 15  # type: ignore[attr-defined]
    assert [p.id for p in plain.policies] == [p.id for p in pooled.policies]  # type: ignore[attr-defined]
