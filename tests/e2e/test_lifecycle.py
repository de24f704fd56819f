"""A run's whole lifecycle on the local stack, from the command line: dev up, policy apply,
admission over HTTP, `budgetgate publish lifecycle` and `publish metering`, then
`budgetgate usage` shows the reservation replaced by the metered actual."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

from tests.support.cli import budgetgate
from tests.support.admission import EXAMPLES, submission
from tests.support.waiting import wait_for

SCOPE = "ns=vision-prod;cost-center=1042;team=vision"


async def test_started_metered_completed_run_becomes_actuals(tmp_path: Path, monkeypatch) -> None:
    workdir = tmp_path / "checkout"
    shutil.copytree(EXAMPLES, workdir / "policies")
    # The run's history below is two hours old, its decision made now: metering takes usage only
    # as far as the run's GPUs can have used it since its decision, give or take this slack.
    monkeypatch.setenv("BUDGETGATE_METERING_USAGE_SLACK_SECONDS", str(3 * 3600))
    up = budgetgate("dev", "up", "--detach", cwd=workdir)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        applied = budgetgate("policy", "apply", "policies", "--allow-dirty", cwd=workdir)
        assert applied.returncode == 0, applied.stderr
        state = json.loads(budgetgate("dev", "status", "--json", cwd=workdir).stdout)
        async with httpx.AsyncClient(
            base_url=state["admission_url"], timeout=30, headers={"Authorization": f"Bearer {state['tokens']['submitter']}"}
        ) as client:

            async def ready() -> bool:
                return (await client.get("/readyz")).status_code == 200

            await wait_for(ready, timeout=30, what="admission ready")
            answer = (await client.post("/v1/admissions", json=submission(run_id="e2e/lifecycle"))).json()
        assert answer["decision"] == "ALLOW" and answer["projected_gpu_hours"] == 48.0
        start = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=2)
        steps = [
            ("lifecycle", "--event", "started", "--at", start.isoformat(), "--gpus", "8"),
            ("metering", "--gpu-seconds", str(8 * 3600), "--at", (start + timedelta(hours=1)).isoformat(), "--sample-id", "m1"),
            ("metering", "--gpu-seconds", str(16 * 3600), "--at", (start + timedelta(hours=2)).isoformat(), "--sample-id", "m2"),
            ("lifecycle", "--event", "completed", "--at", (start + timedelta(hours=2)).isoformat()),
        ]
        for kind, *args in steps:
            sent = budgetgate("publish", kind, "--run-id", "e2e/lifecycle", *args, cwd=workdir)
            assert sent.returncode == 0, sent.stderr

        # Waited for over the API (a CLI run a poll cost a second of CPU each), then shown as a
        # user asks for it, with `budgetgate usage`.
        async with httpx.AsyncClient(base_url=state["admission_url"], timeout=30, headers={"Authorization": f"Bearer {state['tokens']['reader']}"}) as reader:

            async def settled() -> bool:
                listed = (await reader.get("/v1/budgets")).json()["budgets"]
                return bool(listed) and all(budget["reserved"] == 0 for budget in listed)

            await wait_for(settled, timeout=120, interval=0.2, what="the run's actuals in place of its reservation")
        shown = budgetgate("usage", "--scope", SCOPE, "--json", cwd=workdir)
        assert shown.returncode == 0, shown.stderr
        [budget] = json.loads(shown.stdout)["budgets"]
        assert (budget["reserved"], budget["consumed"], budget["remaining"]) == (0.0, 16.0, 484.0)
    finally:
        down = budgetgate("dev", "down", cwd=workdir)
    assert down.returncode == 0, down.stderr
