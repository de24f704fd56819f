"""The Flyte preflight against a real admission service: a real workflow is submitted before it
is launched; DENY and DELAY raise and launch nothing. (No Flyte cluster runs here: the remote is
a recorder of what FlyteRemote.execute would have been asked.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.support.extras import import_extra

# flytekit is the `flyte` extra, outside `dev`; CI installs it (constraints/dev-flyte.txt).
import_extra("flytekit", extra="flyte")

from budgetgate.client import Client
from budgetgate.flyte import BudgetDelayed, BudgetDenied, execute, preflight
from budgetgate.principals import Role
from tests.support import flyte_workflows as flows
from tests.support.admission import apply_policies, budget_yaml
from tests.support.principals import issue

VISION = {"team": "vision", "cost-center": "1042", "environment": "prod"}


@pytest.fixture(autouse=True)
async def flyte_token(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a Flyte platform holds: a submitter token for its namespaces, as BUDGETGATE_TOKEN."""
    monkeypatch.setenv("BUDGETGATE_TOKEN", await issue(pg_dsn, Role.SUBMITTER, namespaces=["vision-*"]))


class Remote:
    """What budgetgate.flyte uses of FlyteRemote: its defaults and execute()."""

    default_project, default_domain = "vision", "production"

    def __init__(self) -> None:
        self.launched: list[dict[str, Any]] = []

    def execute(self, entity: Any, inputs: dict[str, Any], **kwargs: Any) -> str:
        self.launched.append({"entity": entity, "inputs": inputs, **kwargs})
        return kwargs["execution_name"]


async def test_an_admitted_workflow_is_launched_under_its_run_id(admission) -> None:
    remote = Remote()

    def launch() -> str:
        with Client(admission.url) as bg:
            return execute(remote, flows.example().training, {"epochs": 3}, client=bg, namespace="vision-prod", labels=VISION)

    name = await asyncio.to_thread(launch)
    (launched,) = remote.launched
    assert (launched["execution_name"], launched["project"], launched["domain"], launched["inputs"]) == (name, "vision", "production", {"epochs": 3})
    decision = (await admission.client.get(f"/v1/admissions/flyte/vision/production/{name}")).json()
    assert (decision["decision"], decision["projected_gpu_hours"]) == ("ALLOW", 48.5)


async def test_deny_and_delay_raise_and_launch_nothing(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("vision", labels="{team: vision}", limit="gpu_hours: 50", on_exhausted="delay")}, sha="f" * 40)
    server = await admission_factory()
    await server.wait_ready()
    remote = Remote()

    def attempts() -> tuple[BaseException, BaseException]:
        with Client(server.url) as bg:
            first = preflight(flows.example().training, client=bg, run_id="flyte/vision/production/first", namespace="vision-prod", labels={"team": "vision"})
            assert first.decision == "ALLOW"  # 48.5 of 50 GPU-hours
            with pytest.raises(BudgetDelayed) as delayed:
                execute(remote, flows.nested, client=bg, namespace="vision-prod", labels={"team": "vision"}, execution_name="second")
            with pytest.raises(BudgetDenied) as denied:  # 64 GPU-hours never fit in 50
                execute(remote, flows.without_timeout, client=bg, namespace="vision-prod", labels={"team": "vision"}, default_runtime_hours=64.0)
            return delayed.value, denied.value

    delayed, denied = await asyncio.to_thread(attempts)
    assert remote.launched == []
    assert delayed.next_eligible_time is not None and "resubmit with attempt=2 at or after" in str(delayed)
    assert str(denied).startswith("budgetgate denied run flyte/vision/production/") and denied.answer.decision == "DENY"
