"""The Kueue AdmissionCheck controller (`controllerName: budgetgate.io/budget`): watches Workloads
through the Kubernetes API (lightkube), asks budgetgate about each one waiting on our check
(through budgetgate.client), and writes the check's state back. The rules are pure, in
budgetgate/platforms/kueue.py; this module only reads, decides through the client, and patches.

Writes are JSON merge patches: the Workload's annotations first (when they change), then its
status with the admissionChecks list, guarded by the resourceVersion it was computed from (a
Workload Kueue changed meanwhile answers 409, and the watch brings the new version to decide on).
A submission is idempotent per run id and attempt, so deciding a Workload twice reserves once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
from lightkube import AsyncClient as KubeClient
from lightkube import ApiError
from lightkube.generic_resource import create_global_resource, create_namespaced_resource
from lightkube.types import PatchType

from budgetgate.client import AsyncClient, BudgetgateError
from budgetgate.client.retries import RETRYABLE
from budgetgate.platforms import kueue
from budgetgate.platforms.kubernetes import Mapping, Unmappable

log = logging.getLogger(__name__)

Workload = create_namespaced_resource(kueue.GROUP, kueue.VERSION, "Workload", "workloads")
AdmissionCheck = create_global_resource(kueue.GROUP, kueue.VERSION, "AdmissionCheck", "admissionchecks")


class AdmissionCheckController:
    """Decides the Workloads waiting on budgetgate's AdmissionChecks."""

    def __init__(
        self,
        *,
        kube: KubeClient,
        budgetgate: AsyncClient,
        mapping: Mapping = Mapping(),
        controller_name: str = kueue.CONTROLLER_NAME,
        checks_refresh_seconds: float = 30.0,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.kube = kube
        self.budgetgate = budgetgate
        self.mapping = mapping
        self.controller_name = controller_name
        self.checks_refresh_seconds = checks_refresh_seconds
        self.clock = clock
        self.checks: set[str] = set()
        self._checks_read = 0.0

    async def refresh_checks(self) -> set[str]:
        """Our AdmissionChecks (by controllerName), each marked Active."""
        found = set()
        async for check in self.kube.list(AdmissionCheck):
            body = check.to_dict()
            if (body.get("spec") or {}).get("controllerName") != self.controller_name:
                continue
            found.add(body["metadata"]["name"])
            patch = kueue.active(body, now=self.clock())
            if patch is not None:
                await self.kube.patch(AdmissionCheck.Status, body["metadata"]["name"], patch, patch_type=PatchType.MERGE)
        self.checks, self._checks_read = found, time.monotonic()
        return found

    async def reconcile(self, workload: dict[str, Any]) -> None:
        """Decide every check of ours this Workload waits on, and write the states back."""
        if time.monotonic() - self._checks_read > self.checks_refresh_seconds:
            await self.refresh_checks()
        for check in kueue.pending_checks(workload, self.checks):
            now = self.clock()
            try:
                request = kueue.submission(workload, self.mapping)
            except Unmappable as exc:
                patch = kueue.unmappable(workload, check, str(exc), now=now)
            else:
                try:
                    answer = await self.budgetgate.submit(request)
                except (*RETRYABLE, httpx.TransportError, BudgetgateError) as exc:
                    patch = kueue.undecided(workload, check, f"cannot decide now ({type(exc).__name__}: {exc}); will try again", now=now)
                else:
                    patch = kueue.decided(workload, check, answer.model_dump(mode="json"), now=now, attempt_annotation=self.mapping.attempt_annotation)
            workload = await self._write(workload, patch)

    async def _write(self, workload: dict[str, Any], patch: kueue.Patch) -> dict[str, Any]:
        meta = workload["metadata"]
        status = patch.status
        try:
            if patch.annotations:
                updated = await self.kube.patch(
                    Workload, meta["name"], {"metadata": {"annotations": patch.annotations}}, namespace=meta["namespace"], patch_type=PatchType.MERGE
                )
                # Only our annotation changed since the status was computed: carry its version.
                status = {**status, "metadata": {"resourceVersion": updated.to_dict()["metadata"].get("resourceVersion")}}
            written = await self.kube.patch(Workload.Status, meta["name"], status, namespace=meta["namespace"], patch_type=PatchType.MERGE)
            return written.to_dict()
        except ApiError as exc:
            if exc.status.code == 409:
                log.info("workload %s/%s changed while it was decided; deciding its new version", meta["namespace"], meta["name"])
                return workload
            raise

    async def run(self) -> None:
        """Watch Workloads in every namespace and reconcile each change, until cancelled."""
        await self.refresh_checks()
        while True:
            try:
                async for event, obj in self.kube.watch(Workload, namespace="*"):
                    if event in ("ADDED", "MODIFIED"):
                        await self.reconcile(obj.to_dict())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the API server or a patch failed: watch again
                log.warning("Workload watch ended (%s: %s); watching again in 2s", type(exc).__name__, exc)
                await asyncio.sleep(2)
