"""The Flyte preflight against a real admission service: a real workflow is submitted before it
is launched; DENY and DELAY raise and launch nothing; a launch that fails after the ALLOW ends
the run (its reservation released through metering-ingest and the reconciler) or, when its end
cannot be published, names the execution a retry reuses. (No Flyte cluster runs here: the remote
is a recorder of what FlyteRemote.execute would have been asked.)"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import asyncpg
import httpx

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
from tests.support.kubernetes import flyte_review, flyte_workflow
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


class Waiting(Remote):
    """The recorder, with FlyteRemote.wait: the execution as it ended."""

    def __init__(self) -> None:
        super().__init__()
        self.waited: list[str] = []

    def wait(self, execution: str) -> str:
        self.waited.append(execution)
        return f"{execution}: SUCCEEDED"


def _admin():
    from tests.support.flyte_admin import FlyteAdminStandIn

    admin = FlyteAdminStandIn()
    admin.register(flows.fan_out_plan, flows.example().training)
    return admin


async def test_a_fetched_launch_plan_is_admitted_and_launched(admission) -> None:
    # The common production path through a real FlyteRemote (its FlyteAdmin a stand-in): fetch a
    # launch plan, execute it. It was refused (Unprojectable) before anything was submitted.
    admin = _admin()

    def launch() -> Any:
        remote = admin.remote()
        plan = remote.fetch_launch_plan(name="budgetgate_fan_out_of_six", version="v1")
        with Client(admission.url) as bg:
            return execute(remote, plan, client=bg, namespace="vision-prod", labels=VISION)

    execution = await asyncio.to_thread(launch)
    (created,) = admin.created
    assert created["name"] == execution.id.name and created["entity"].name == "budgetgate_fan_out_of_six"
    decision = (await admission.client.get(f"/v1/admissions/flyte/vision/production/{execution.id.name}")).json()
    assert (decision["decision"], decision["projected_gpu_hours"]) == ("ALLOW", 12.0)


async def test_an_execution_name_prefix_names_the_run_and_launches(admission) -> None:
    # flytekit refuses execution_name_prefix beside the execution_name execute passes: it raised
    # after the ALLOW, leaving a decision (and, without an exporter token, a reservation) behind.
    admin = _admin()

    def launch() -> Any:
        remote = admin.remote()
        plan = remote.fetch_launch_plan(name="budgetgate_fan_out_of_six", version="v1")
        with Client(admission.url) as bg:
            return execute(remote, plan, client=bg, namespace="vision-prod", labels=VISION, execution_name_prefix="nightly")

    execution = await asyncio.to_thread(launch)
    name = execution.id.name
    assert name.startswith("nightly-") and len(name) == len("nightly-") + 19 and [c["name"] for c in admin.created] == [name]
    decision = (await admission.client.get(f"/v1/admissions/flyte/vision/production/{name}")).json()
    assert decision["decision"] == "ALLOW"


async def test_a_call_flytekit_would_refuse_submits_nothing(admission) -> None:
    admin = _admin()

    def attempts() -> list[BaseException]:
        remote = admin.remote()
        plan = remote.fetch_launch_plan(name="budgetgate_fan_out_of_six", version="v1")
        refused = []
        with Client(admission.url) as bg:
            for kwargs, error in [
                ({"execution_name": "refused1", "execution_name_prefix": "nightly"}, ValueError),
                ({"execution_name": "refused2", "priority": "high"}, TypeError),  # not an argument of FlyteRemote.execute
                ({"execution_name": "Refused_3"}, ValueError),  # FlyteAdmin's names: lowercase, digits, '-'
                ({"execution_name_prefix": "x" * 44}, ValueError),  # with its suffix, over 63 characters
            ]:
                with pytest.raises(error) as caught:
                    execute(remote, plan, client=bg, namespace="vision-prod", labels=VISION, **kwargs)
                refused.append(caught.value)
            with pytest.raises(ValueError, match=r"has no input epochs.*nothing was submitted"):  # its only input is fixed: none to give
                execute(remote, flows.fan_out_of_a_literal, {"epochs": 3}, client=bg, namespace="vision-prod", labels=VISION, execution_name="refused5")
        return refused

    refused = await asyncio.to_thread(attempts)
    assert "not both" in str(refused[0]) and "would refuse these arguments" in str(refused[1]) and "at most 63" in str(refused[3])
    assert admin.created == []
    for name in ("refused1", "refused2", "refused5"):
        assert (await admission.client.get(f"/v1/admissions/flyte/vision/production/{name}")).status_code == 404
    budgets = (await admission.client.get("/v1/budgets")).json()["budgets"]
    assert all(b["reserved"] == 0 for b in budgets)


async def test_an_error_while_waiting_is_raised_and_the_launched_run_keeps_its_reservation(admission) -> None:
    # FlyteRemote.execute(wait=True) raised while waiting (FlyteAdmin unavailable for a poll);
    # the execution was found launched and returned as if waiting had ended.
    from flytekit.exceptions.system import FlyteSystemUnavailableException

    admin = _admin()
    admin.failing_reads = {2}  # the read after the launch answers; the first poll of the wait does not

    def launch() -> BaseException:
        remote = admin.remote()
        plan = remote.fetch_launch_plan(name="budgetgate_fan_out_of_six", version="v1")
        with Client(admission.url) as bg:
            with pytest.raises(FlyteSystemUnavailableException) as failed:
                execute(remote, plan, client=bg, namespace="vision-prod", labels=VISION, execution_name="waited", wait=True)
            return failed.value

    failed = await asyncio.to_thread(launch)
    assert any("run flyte/vision/production/waited was launched" in note for note in failed.__notes__)
    assert [c["name"] for c in admin.created] == ["waited"]
    vision = next(b for b in (await admission.client.get("/v1/budgets")).json()["budgets"] if b["policy_id"] == "gpu-budget/team-vision-prod")
    assert vision["reserved"] == 12.0  # the execution runs: its reservation stands


async def test_wait_returns_the_execution_as_it_ended(admission) -> None:
    remote = Waiting()

    def launch() -> str:
        with Client(admission.url) as bg:
            return execute(remote, flows.example().training, client=bg, namespace="vision-prod", labels=VISION, wait=True)

    ended = await asyncio.to_thread(launch)
    (launched,) = remote.launched
    assert "wait" not in launched and remote.waited == [launched["execution_name"]] and ended == f"{launched['execution_name']}: SUCCEEDED"

    def without_wait() -> None:
        with Client(admission.url) as bg, pytest.raises(TypeError, match="has no wait"):
            execute(Remote(), flows.example().training, client=bg, namespace="vision-prod", labels=VISION, execution_name="unwaited", wait=True)

    await asyncio.to_thread(without_wait)
    assert (await admission.client.get("/v1/admissions/flyte/vision/production/unwaited")).status_code == 404


class AdminCreatingWorkflows(Remote):
    """A FlyteRemote whose FlyteAdmin creates the execution's FlyteWorkflow, as it does in a
    cluster: the API server sends it to budgetgate's admission webhook, whose answer decides
    whether it is created (FlyteAdmin's launch fails with its message when denied)."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.reviews: list[dict[str, Any]] = []

    def execute(self, entity: Any, inputs: dict[str, Any], **kwargs: Any) -> str:
        review = flyte_review(flyte_workflow(kwargs["execution_name"]))
        headers = {"Authorization": f"Bearer {os.environ['BUDGETGATE_TOKEN']}"}
        answer = httpx.post(f"{self.url}/v1/kubernetes/admission-review", json=review, headers=headers, timeout=30).json()["response"]
        self.reviews.append(answer)
        if not answer["allowed"]:
            raise FlyteSystemUnavailableException(f"failed to create workflow in propeller: {answer['status']['message']}")
        return super().execute(entity, inputs, **kwargs)


async def test_the_webhook_lets_the_preflights_execution_through_on_its_decision(admission, pg_dsn) -> None:
    # The preflight projected the workflow from flytekit's templates; the FlyteWorkflow FlyteAdmin
    # then creates is projected otherwise (its own templates): submitted again it would be a 409.
    # The webhook lets it through on the preflight's decision: one decision, one reservation.
    remote = AdminCreatingWorkflows(admission.url)

    def launch() -> str:
        with Client(admission.url) as bg:
            return execute(remote, flows.example().training, {"epochs": 3}, client=bg, namespace="vision-prod", labels=VISION)

    name = await asyncio.to_thread(launch)
    (answer,) = remote.reviews
    assert answer["allowed"] is True and "not decided again" in answer["status"]["message"], answer
    decision = (await admission.client.get(f"/v1/admissions/flyte/vision/production/{name}")).json()
    assert (decision["decision"], decision["projected_gpu_hours"], decision["attempt"]) == ("ALLOW", 48.5, 1)  # the preflight's
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM decisions WHERE run_id = $1", f"flyte/vision/production/{name}") == 1
    finally:
        await conn.close()
