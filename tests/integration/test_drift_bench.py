"""`budgetgate bench drift` end to end with a small load: both phases are measured, each with its
CPU per submission, and the ledger audit passes. No timing is asserted: the figures belong to the
benchmark (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


async def test_bench_drift_measures_both_phases_with_their_cpu(postgres_admin_dsn: str, redis_server_url: str) -> None:
    # No BUDGETGATE_KAFKA_BOOTSTRAP: the benchmark starts a broker of its own, whose CPU it reads.
    env = {**os.environ, "BUDGETGATE_POSTGRES_DSN": postgres_admin_dsn, "BUDGETGATE_REDIS_URL": redis_server_url}
    env.pop("BUDGETGATE_KAFKA_BOOTSTRAP", None)
    command = [sys.executable, "-m", "budgetgate.cli.main", "bench", "drift", "--held", "60", "--rate", "20", "--duration", "2", "--budgets", "5", "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ledger_ok"] is True
    assert {phase: figures["requests"] for phase, figures in report["admission_latency"].items()} == {"on": 40, "off": 40}
    assert report["drift_checks"] > 0
    for phase in ("on", "off"):
        cpu = report["cpu"][phase]
        # Every part is a process of this machine, so read; this process (the load and, in
        # 'on', the check) is shown apart.
        assert cpu["us_per_unit"]["service"] > 0 and cpu["us_per_unit"]["postgres"] is not None and cpu["us_per_unit"]["broker"] is not None
        assert cpu["not_in_all_parts"] == ["load generator and drift check"]
    # The check's own cost shows in the phase that ran it: this process did more work.
    assert report["cpu"]["on"]["cpu_seconds"]["load generator and drift check"] > report["cpu"]["off"]["cpu_seconds"]["load generator and drift check"]
