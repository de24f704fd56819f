"""A run's whole lifecycle on the local stack, from the command line: dev up, policy apply,
admission over HTTP, `budgetgate publish lifecycle` and `publish metering`, then
`budgetgate usage` shows the reservation replaced by the metered actual."""

from __future__ import annotations

import asyncio
import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

from tests.support.cli import budgetgate
from tests.support.admission import EXAMPLES, submission

SCOPE = "ns=vision-prod;cost-center=1042;team=vision"


async def test_started_metered_completed_run_becomes_actuals(tmp_path: Path) -> None:
    workdir = tmp_path / "checkout"
    shutil.copytree(EXAMPLES, workdir / "policies")
    up = budgetgate("dev", "up", "--detach", cwd=workdir)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        applied = budgetgate("policy", "apply", "policies", "--allow-dirty", cwd=workdir)
        assert applied.returncode == 0, applied.stderr
        state = json.loads(budgetgate("dev", "status", "--json", cwd=workdir).stdout)
        async with httpx.AsyncClient(
            base_url=state["admission_url"], timeout=30, headers={"Authorization": f"Bearer {state['tokens']['submitter']}"}
        ) as client:
            for _ in range(200):
                if (await client.get("/readyz")).status_code == 200:
                    break
                await asyncio.sleep(0.1)
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
        budget = None
        for _ in range(300):
            shown = budgetgate("usage", "--scope", SCOPE, "--json", cwd=workdir)
            assert shown.returncode == 0, shown.stderr
            [budget] = json.loads(shown.stdout)["budgets"]
            if budget["reserved"] == 0:
                break
            await asyncio.sleep(0.2)
        assert budget is not None and (budget["reserved"], budget["consumed"], budget["remaining"]) == (0.0, 16.0, 484.0)
    finally:
        down = budgetgate("dev", "down", cwd=workdir)
    assert down.returncode == 0, down.stderr
