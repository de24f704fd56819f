"""The platform adapters on the local stack (`budgetgate dev up`), found as a user finds it: a
Kubernetes Job admitted by the webhook, its start and end posted over HTTP by the client, its
GPUs metered from a DCGM exporter page by `budgetgate meter dcgm`; the reconciler then replaces
the reservation with what was metered. And a Flyte workflow admitted by the preflight."""

from __future__ import annotations

import asyncio
import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

from budgetgate.client import AsyncClient, Client, lifecycle_event
from tests.support.admission import EXAMPLES
from tests.support.cli import budgetgate
from tests.support.dcgm import Exporters
from tests.support.extras import import_extra
from tests.support.kubernetes import admission_review, job
from tests.support.waiting import wait_for

RUN = "flyte/vision/exec-7f3a/n0"  # the run-id label of the recorded exporter pages
SCOPE = "ns=vision-prod;cost-center=1042;team=vision"


async def test_webhook_lifecycle_over_http_and_dcgm_metering_settle_a_run(tmp_path: Path, monkeypatch) -> None:
    workdir = tmp_path / "checkout"
    shutil.copytree(EXAMPLES, workdir / "policies")
    # The meter below ran for the hour before the run's decision, made now: metering takes usage
    # only as far as the run's GPUs can have used it since its decision, give or take this slack.
    monkeypatch.setenv("BUDGETGATE_METERING_USAGE_SLACK_SECONDS", str(2 * 3600))
    up = budgetgate("dev", "up", "--detach", cwd=workdir)
    assert up.returncode == 0, up.stdout + up.stderr
    exporters = Exporters(train_scrapes=0)
    try:
        assert budgetgate("policy", "apply", "policies", "--allow-dirty", cwd=workdir).returncode == 0
        monkeypatch.setenv("BUDGETGATE_HOME", str(workdir))  # the client finds the stack as the CLI does
        # The platform's glue: one token for submitting (the webhook), lifecycle and reading.
        made = budgetgate("token", "create", "--name", "platform", "--role", "submitter", "--role", "exporter", "--role", "reader", cwd=workdir)
        assert made.returncode == 0, made.stderr
        monkeypatch.setenv("BUDGETGATE_TOKEN", made.stdout.strip())
        async with AsyncClient() as client:
            await client.wait_ready(timeout=30)
            obj = job(gpus=2, deadline=4 * 3600, annotations={"budgetgate.io/run-id": RUN, "budgetgate.io/flavor": "h100"})
            async with httpx.AsyncClient(base_url=client.url, timeout=30, headers={"Authorization": f"Bearer {made.stdout.strip()}"}) as http:
                review = (await http.post("/v1/kubernetes/admission-review", json=admission_review(obj))).json()["response"]
            assert review["allowed"] is True, review
            assert (await client.lookup(RUN)).projected_gpu_hours == 8.0  # type: ignore[union-attr]
            started = datetime.now(UTC) - timedelta(hours=1)
            await client.publish_lifecycle(lifecycle_event(RUN, "started", at=started, gpus=2, nodes=1, flavor="h100"))
            # A meter that ran for the last hour (its state file), scraping once more now.
            state = workdir / "dcgm.json"
            before = datetime.now(UTC) - timedelta(seconds=10)
            state.write_text(
                json.dumps(
                    {
                        "last_at": before.isoformat(),
                        "totals": {RUN: [7200.0, 3600.0]},
                        "last": {
                            RUN: {"gpus": ["GPU-0a9b8c7d-6e5f-4a3b-9c1d-2e3f4a5b6c11", "GPU-5d4c3b2a-1f0e-4d9c-8b7a-6f5e4d3c2b12"], "hosts": ["gpu-node-b"]}
                        },
                    }
                )
            )
            metered = budgetgate("meter", "dcgm", "--url", f"{exporters.url}/b/metrics", "--count", "1", "--state", str(state), cwd=workdir)
            assert metered.returncode == 0, metered.stderr
            gpu_seconds = json.loads(state.read_text())["totals"][RUN][0]
            assert 7200 + 2 * 9 < gpu_seconds < 7200 + 2 * 60
            await client.publish_lifecycle(lifecycle_event(RUN, "completed", at=datetime.now(UTC), gpus=2, nodes=1, flavor="h100"))

            async def settled():  # type: ignore[no-untyped-def]
                budget = next(b for b in (await client.scope_usage(SCOPE)).budgets if b.unit == "gpu_hours")
                return budget if budget.reserved == 0 else None

            budget = await wait_for(settled, timeout=120, interval=0.2, what="the run's metered actual in place of its reservation")
        assert abs(budget.consumed - gpu_seconds / 3600) <= 0.01  # the metered actual, not the 8 GPU-hours projected
    finally:
        exporters.close()
        down = budgetgate("dev", "down", cwd=workdir)
    assert down.returncode == 0, down.stderr


async def test_flyte_preflight_on_the_local_stack(tmp_path: Path, monkeypatch) -> None:
    import_extra("flytekit", extra="flyte")
    from budgetgate.adapters.flyte import preflight
    from tests.support import flyte_workflows as flows

    workdir = tmp_path / "checkout"
    shutil.copytree(EXAMPLES, workdir / "policies")
    assert budgetgate("dev", "up", "--detach", cwd=workdir).returncode == 0
    try:
        assert budgetgate("policy", "apply", "policies", "--allow-dirty", cwd=workdir).returncode == 0
        monkeypatch.setenv("BUDGETGATE_HOME", str(workdir))
        # What the Flyte platform is given: a submitter token for its namespaces.
        made = budgetgate("token", "create", "--name", "flyte", "--role", "submitter", "--namespace", "vision-*", cwd=workdir)
        assert made.returncode == 0, made.stderr
        monkeypatch.setenv("BUDGETGATE_TOKEN", made.stdout.strip())

        def admit() -> tuple[str, float]:
            with Client() as bg:
                bg.wait_ready(timeout=30)
                answer = preflight(flows.example().training, client=bg, run_id="flyte/vision/production/e2e", namespace="vision-prod",
                                   labels={"team": "vision", "cost-center": "1042", "environment": "prod"})  # fmt: skip
                return answer.decision, answer.projected_gpu_hours

        assert await asyncio.to_thread(admit) == ("ALLOW", 48.5)
    finally:
        assert budgetgate("dev", "down", cwd=workdir).returncode == 0
