"""The Flyte preflight against a real admission service: a real workflow is submitted before it
is launched; DENY and DELAY raise and launch nothing; a launch that fails after the ALLOW ends
the run (its reservation released through metering-ingest and the reconciler) or, when its end
cannot be published, names the execution a retry reuses. (No Flyte cluster runs here: the remote
is a recorder of what FlyteRemote.execute would have been asked.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.support.extras import import_extra

# flytekit is the `flyte` extra, outside `dev`; CI installs it (constraints/dev-flyte.txt).
import_extra("flytekit", extra="flyte")

from flytekit.exceptions.system import FlyteSystemUnavailableException
from flytekit.exceptions.user import FlyteEntityNotExistException

from budgetgate.client import Client, Conflict
from budgetgate.adapters.flyte import BudgetDelayed, BudgetDenied, LaunchFailed, execute, preflight
from budgetgate.core.principals import Role
from tests.support import flyte_workflows as flows
from tests.support.admission import apply_policies, budget_yaml
from tests.support.metering import metering, metering_factory  # noqa: F401 - pytest fixtures
from tests.support.principals import issue
from tests.support.reconciler import reconciler_factory  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for

VISION = {"team": "vision", "cost-center": "1042", "environment": "prod"}


@pytest.fixture(autouse=True)
async def flyte_token(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a Flyte platform holds: a submitter token for its namespaces, as BUDGETGATE_TOKEN."""
    monkeypatch.setenv("BUDGETGATE_TOKEN", await issue(pg_dsn, Role.SUBMITTER, namespaces=["vision-*"]))


class Remote:
    """What budgetgate.adapters.flyte uses of FlyteRemote: its defaults and execute()."""

    default_project, default_domain = "vision", "production"

    def __init__(self, *, failures: int = 0, lost_answers: int = 0, admin_down: bool = False) -> None:
        self.launched: list[dict[str, Any]] = []
        self.refused: list[str] = []  # execution names of launches that raised
        self.failures = failures  # launches refused, nothing created
        self.lost_answers = lost_answers  # launches that created the execution and raised all the same (a deadline)
        self.admin_down = admin_down  # fetch_execution cannot answer

    def execute(self, entity: Any, inputs: dict[str, Any], **kwargs: Any) -> str:
        if self.failures:
            self.failures -= 1
            self.refused.append(kwargs["execution_name"])
            raise FlyteSystemUnavailableException("FlyteAdmin is unavailable")
        self.launched.append({"entity": entity, "inputs": inputs, **kwargs})
        if self.lost_answers:
            self.lost_answers -= 1
            raise FlyteSystemUnavailableException("deadline exceeded")
        return kwargs["execution_name"]

    def fetch_execution(self, *, project: str, domain: str, name: str) -> str:
        if self.admin_down:
            raise FlyteSystemUnavailableException("FlyteAdmin is unavailable")
        if any(launched["execution_name"] == name for launched in self.launched):
            return name
        raise FlyteEntityNotExistException(f"execution {project}/{domain}/{name} not found")


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


async def test_an_admitted_run_relaunched_with_another_request_raises_the_conflict_and_launches_nothing(admission) -> None:
    # The same execution name (one run) as attempt 2 with other labels was answered with the
    # run's stored ALLOW, and launched on it.
    remote = Remote()

    def attempts() -> Conflict:
        with Client(admission.url) as bg:
            name = execute(remote, flows.example().training, client=bg, namespace="vision-prod", labels=VISION)
            with pytest.raises(Conflict) as conflict:
                execute(remote, flows.example().training, client=bg, namespace="vision-prod", labels={**VISION, "environment": "dev"},
                        execution_name=name, attempt=2)  # fmt: skip
            return conflict.value

    conflict = await asyncio.to_thread(attempts)
    assert len(remote.launched) == 1 and conflict.status == 409
    assert conflict.fields == ["labels"] and conflict.changes == [{"field": "labels.environment", "was": "prod", "now": "dev"}]
    assert conflict.next_attempt is None and "under a new run id" in conflict.detail


async def test_a_failed_launch_ends_the_run_and_its_reservation_is_released(admission, metering, reconciler_factory, pg_dsn) -> None:
    await reconciler_factory()  # its start deadline (an hour) would free nothing during this test
    exporter = await issue(pg_dsn, Role.EXPORTER)
    remote = Remote(failures=1)

    def launch() -> LaunchFailed:
        with Client(admission.url) as bg, Client(metering_url=metering.url, token=exporter) as feed:
            with pytest.raises(LaunchFailed) as failed:
                execute(remote, flows.example().training, {"epochs": 3}, client=bg, lifecycle=feed, namespace="vision-prod", labels=VISION)
            return failed.value

    failed = await asyncio.to_thread(launch)
    assert failed.released and isinstance(failed.__cause__, FlyteSystemUnavailableException) and remote.refused == [failed.execution_name]
    assert failed.run_id == f"flyte/vision/production/{failed.execution_name}" and "retry as a new run" in str(failed)
    decision = (await admission.client.get(f"/v1/admissions/{failed.run_id}")).json()
    assert (decision["decision"], decision["projected_gpu_hours"]) == ("ALLOW", 48.5)
    scopes = {e["scope_id"] for e in decision["evaluations"]}

    async def reserved() -> list[float]:
        return [b["reserved"] for scope in scopes for b in (await admission.client.get(f"/v1/scopes/{scope}/usage")).json()["budgets"]]

    async def released() -> bool:
        return all(amount == 0 for amount in await reserved())

    await wait_for(released, what="the reservation of the run that never launched released")
    assert remote.launched == []


async def test_when_the_end_cannot_be_published_a_retry_reuses_the_execution_name(admission) -> None:
    remote = Remote(failures=1)

    def attempts() -> tuple[LaunchFailed, str]:
        with Client(admission.url) as bg:  # no metering-ingest URL: the run's end cannot be published
            with pytest.raises(LaunchFailed) as failed:
                execute(remote, flows.example().training, client=bg, namespace="vision-prod", labels=VISION)
            again = execute(remote, flows.example().training, client=bg, namespace="vision-prod", labels=VISION, execution_name=failed.value.execution_name)
            return failed.value, again

    failed, again = await asyncio.to_thread(attempts)
    assert not failed.released and f"execution_name={failed.execution_name!r}" in str(failed)
    assert again == failed.execution_name and [launched["execution_name"] for launched in remote.launched] == [failed.execution_name]
    # One run, one reservation: the retry was answered from the first decision.
    budgets = (await admission.client.get("/v1/budgets")).json()["budgets"]
    vision = next(b for b in budgets if b["policy_id"] == "gpu-budget/team-vision-prod")
    assert vision["reserved"] == 48.5


async def test_a_launch_that_created_the_execution_and_raised_is_not_ended(admission) -> None:
    # A launch whose answer was lost (a deadline after FlyteAdmin created the execution) was
    # taken for a failed one: CANCELLED published, the reservation of a running workload freed.
    remote = Remote(lost_answers=1)

    def launch() -> str:
        with Client(admission.url) as bg:
            return execute(remote, flows.example().training, client=bg, namespace="vision-prod", labels=VISION)

    name = await asyncio.to_thread(launch)
    assert [launched["execution_name"] for launched in remote.launched] == [name]
    vision = next(b for b in (await admission.client.get("/v1/budgets")).json()["budgets"] if b["policy_id"] == "gpu-budget/team-vision-prod")
    assert vision["reserved"] == 48.5  # still held: the run launched


async def test_when_flyteadmin_cannot_say_whether_it_launched_the_reservation_stays(admission) -> None:
    remote = Remote(failures=1, admin_down=True)

    def launch() -> LaunchFailed:
        with Client(admission.url) as bg:
            with pytest.raises(LaunchFailed) as failed:
                execute(remote, flows.example().training, client=bg, namespace="vision-prod", labels=VISION)
            return failed.value

    failed = await asyncio.to_thread(launch)
    assert not failed.released and f"execution_name={failed.execution_name!r}" in str(failed) and "cannot be told" in str(failed)
