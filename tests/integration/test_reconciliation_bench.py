"""`budgetgate bench reconciliation --replicas 2` end to end with tiny numbers, in both of its
modes (the steady one with a token pool): two reconcilers share the consumer group, the ledger
audit passes, and the report names both, with the CPU of each beside their sum. No timing is
asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.support.bench import assert_nothing_left


def _bench(postgres_admin_dsn: str, redis_server_url: str, kafka_server_bootstrap: str, *arguments: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "BUDGETGATE_POSTGRES_DSN": postgres_admin_dsn,
        "BUDGETGATE_REDIS_URL": redis_server_url,
        "BUDGETGATE_KAFKA_BOOTSTRAP": kafka_server_bootstrap,
    }
    command = [sys.executable, "-m", "budgetgate.cli.main", "bench", "reconciliation", *arguments, "--replicas", "2", "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    assert "waiting for the 2 reconcilers to join their consumer group" in done.stderr
    return json.loads(done.stdout)


def _both_named(report: dict[str, Any], unit: str, units: int) -> None:
    assert report["ledger_ok"] is True and report["replicas"] == 2, report["ledger"]
    taken = report["messages_by_replica"]
    assert list(taken) == ["reconciler 1", "reconciler 2"] and all(count > 0 for count in taken.values())
    cpu = report["cpu"]
    assert cpu["unit"] == unit and cpu["units"] == units
    assert list(cpu["us_per_unit"]) == ["reconciler 1", "reconciler 2", "postgres", "redis", "broker", "load generator"]
    assert cpu["groups"] == {"reconciler": ["reconciler 1", "reconciler 2"]}
    spent = cpu["us_per_unit"]
    assert spent["reconciler 1"] is not None and spent["reconciler 2"] is not None
    assert cpu["group_us_per_unit"]["reconciler"] == pytest.approx(spent["reconciler 1"] + spent["reconciler 2"], abs=0.2)
    assert spent["broker"] is None and cpu["all_parts_us_per_unit"] is None  # the broker was given, not started here: unknown
    assert cpu["not_in_all_parts"] == ["load generator"]


async def test_two_reconcilers_settle_every_run_and_are_named(postgres_admin_dsn: str, redis_server_url: str, kafka_server_bootstrap: str) -> None:
    report = _bench(postgres_admin_dsn, redis_server_url, kafka_server_bootstrap, "--runs", "30", "--rate", "30", "--samples", "2")
    assert report["runs_settled"] == 30 and report["messages"] == 30 * 4
    _both_named(report, "message", 30 * 4)
    await assert_nothing_left(postgres_admin_dsn, report["run_tag"], redis_url=redis_server_url)


async def test_two_reconcilers_under_a_steady_load(postgres_admin_dsn: str, redis_server_url: str, kafka_server_bootstrap: str) -> None:
    """With --token-pool: every run (2 long, 12 short, the warm-up) took a token with its
    admission, and every one was given back when its run ended."""
    arguments = ("--records-per-s", "100", "--run-lengths", "10,50", "--long-runs", "2", "--duration", "2", "--token-pool")
    report = _bench(postgres_admin_dsn, redis_server_url, kafka_server_bootstrap, *arguments)
    assert report["records"] == 200 and report["unseen"] == 0
    _both_named(report, "usage record", 200)
    assert report["options"]["token_pool"] is True
    assert report["tokens"]["granted"] == 15 and report["tokens"]["held"] == 0, report["tokens"]
    await assert_nothing_left(postgres_admin_dsn, report["run_tag"], redis_url=redis_server_url)
