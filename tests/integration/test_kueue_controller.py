"""The Kueue AdmissionCheck controller against a stand-in Kubernetes API server (no API server can
run here) and a real admission service: Workloads shaped as Kueue v1beta1 are watched, decided,
and their check states written back with merge patches guarded by resourceVersion."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient as KubeClient
from lightkube import KubeConfig

from budgetgate.client import AsyncClient
from budgetgate.kueue import AdmissionCheckController
from budgetgate.platforms import kueue
from tests.support.kube_api import KubeApi
from tests.support.metering import wait_for
from tests.support.servers import InProcessServer, free_port

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kueue"
from tests.support.principals import token_in_env  # noqa: F401 - a fixture, used by name

pytestmark = pytest.mark.usefixtures("token_in_env")


def kubeconfig(url: str) -> KubeConfig:
    """A kubeconfig for the stand-in, with a bearer token as a service account would have."""
    return KubeConfig.from_dict({
        "apiVersion": "v1", "kind": "Config", "current-context": "stand-in",
        "clusters": [{"name": "stand-in", "cluster": {"server": url}}],
        "users": [{"name": "budgetgate", "user": {"token": "stand-in-token"}}],
        "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "budgetgate"}}],
    })  # fmt: skip


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def workload(name: str, *, job_uid: str, gpus_per_pod: int = 4, count: int = 2) -> dict[str, Any]:
    found = fixture("workload-job.json")
    found["metadata"]["name"] = name
    found["metadata"]["ownerReferences"][0]["uid"] = job_uid
    found["spec"]["podSets"][0]["count"] = count
    found["status"]["admission"]["podSetAssignments"][0]["count"] = count
    for where in ("requests", "limits"):
        found["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"][where]["nvidia.com/gpu"] = str(gpus_per_pod)
    return found


@pytest.fixture
async def kube() -> AsyncIterator[tuple[KubeApi, str]]:
    api = KubeApi()
    server = InProcessServer(api.app, port=free_port())
    await server.start()
    yield api, server.url
    await server.stop()


def check_state(api: KubeApi, name: str) -> dict[str, Any]:
    return next(c for c in api.get("workloads", name, "vision-prod")["status"]["admissionChecks"] if c["name"] == "budget")


async def test_workloads_waiting_on_the_check_are_decided(kube, admission) -> None:
    api, url = kube
    api.put("admissionchecks", fixture("admissioncheck.json"))
    api.put(
        "admissionchecks",
        {**fixture("admissioncheck.json"), "metadata": {"name": "someone-else", "generation": 1}, "spec": {"controllerName": "example.com/other"}},
    )
    api.put("workloads", workload("job-fits", job_uid="11111111-1111-4111-8111-111111111111"))  # 8 H100 × 6 h
    kube_client = KubeClient(kubeconfig(url), field_manager="budgetgate")
    async with AsyncClient(admission.url) as budgetgate:
        controller = AdmissionCheckController(kube=kube_client, budgetgate=budgetgate)
        running = asyncio.create_task(controller.run())
        try:
            await wait_for(lambda: _decided(api, "job-fits"), what="the first Workload decided")
            api.put("workloads", workload("job-too-big", job_uid="22222222-2222-4222-8222-222222222222", gpus_per_pod=8, count=16))  # 128 × 6 h
            await wait_for(lambda: _decided(api, "job-too-big"), what="the second Workload decided")
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await kube_client.close()
    fits, too_big = check_state(api, "job-fits"), check_state(api, "job-too-big")
    assert fits["state"] == "Ready" and fits["message"].startswith("budgetgate: admitted")
    assert too_big["state"] == "Rejected" and "budgetgate: " in too_big["message"]
    decision = (await admission.client.get("/v1/admissions/11111111-1111-4111-8111-111111111111")).json()
    assert (decision["decision"], decision["projected_gpu_hours"]) == ("ALLOW", 48.0)
    # The other check of the Workload is left as Kueue set it.
    others = [c for c in api.get("workloads", "job-fits", "vision-prod")["status"]["admissionChecks"] if c["name"] != "budget"]
    assert others == [{"name": "provisioning", "state": "Ready", "lastTransitionTime": "2026-07-14T09:30:05Z", "message": "Provisioned"}]
    ours = api.get("admissionchecks", "budget")["status"]["conditions"]
    assert [(c["type"], c["status"]) for c in ours] == [("Active", "True")]
    assert "status" not in api.get("admissionchecks", "someone-else")
    assert {content_type for _, content_type, _ in api.patches} == {"application/merge-patch+json"}
    status_patches = [body for path, _, body in api.patches if path.endswith("/workloads/job-fits/status")]
    assert status_patches and all(body["metadata"]["resourceVersion"] for body in status_patches)


async def _decided(api: KubeApi, name: str) -> bool:
    try:
        return check_state(api, name)["state"] != "Pending"
    except KeyError:
        return False


async def test_a_workload_changed_meanwhile_is_not_overwritten(kube, admission) -> None:
    api, url = kube
    api.put("admissionchecks", fixture("admissioncheck.json"))
    stale = api.put("workloads", workload("job-raced", job_uid="33333333-3333-4333-8333-333333333333"))
    stale = copy.deepcopy(stale)
    changed = copy.deepcopy(stale)
    changed["status"]["admissionChecks"][1]["message"] = "re-provisioned"
    api.put("workloads", changed)  # Kueue wrote in between
    kube_client = KubeClient(kubeconfig(url), field_manager="budgetgate")
    async with AsyncClient(admission.url) as budgetgate:
        controller = AdmissionCheckController(kube=kube_client, budgetgate=budgetgate)
        await controller.refresh_checks()
        await controller.reconcile(stale)
        await kube_client.close()
    assert check_state(api, "job-raced")["state"] == "Pending"  # 409: left for the watch's newer version
    assert api.get("workloads", "job-raced", "vision-prod")["status"]["admissionChecks"][1]["message"] == "re-provisioned"
    assert kueue.pending_checks(api.get("workloads", "job-raced", "vision-prod"), {"budget"}) == ["budget"]
