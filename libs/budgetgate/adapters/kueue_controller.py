"""The Kueue AdmissionCheck controller (`controllerName: budgetgate.io/budget`): watches Workloads
through the Kubernetes API (lightkube), asks budgetgate about each one waiting on our check
(through budgetgate.client), and writes the check's state back. The rules are pure, in
budgetgate/adapters/kueue_workloads.py; this module only reads, decides through the client, and patches.

Writes are JSON merge patches: the Workload's annotations first (when they change), then its
status with the admissionChecks list, guarded by the resourceVersion it was computed from (a
Workload Kueue changed meanwhile answers 409, and the watch brings the new version to decide on).
When the attempt annotation went through and Kueue wrote before the status did, the decision is
carried over to Kueue's version (re-read, our check's state put on it) while it still stands for
it: deciding that version again would decide the next attempt with no state ever written for
this one. A write that would change nothing is not made. A submission is idempotent per run id and
attempt, so deciding a Workload twice reserves once.

Besides the watch, every `requeue_seconds` the controller lists the Workloads still waiting on
a check of ours and decides them again: a Workload left Pending because budgetgate could not
decide (the controller's token refused) gets no new event by itself, since a status write that
changes nothing is none, and a watch does not list again. What time fixes (a DELAY, a full quota,
budgetgate unable to decide) is a `Retry` with `requeueAfterSeconds`: Kueue evicts the Workload
and queues it again after that long, and the controller decides it when quota is reserved anew.

A DENY that no hard budget explains was refused by a concurrency limit: the controller reads the
run's status (GET /v1/admissions/{run_id}, which the submitter role may) to tell a limit that is
full now (`Retry`) from one the run can never fit (`Rejected`).

Run one replica (the Deployment's `Recreate` strategy): two controllers deciding one Workload
would each submit, and the second would find its guarded write a conflict.
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

from budgetgate.client import AsyncClient, BudgetgateError, Unauthorized
from budgetgate.client.retries import RETRYABLE
from budgetgate.adapters import kueue_workloads as kueue
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
        requeue_seconds: float = 30.0,
        retries: kueue.Retries = kueue.Retries(),
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.kube = kube
        self.budgetgate = budgetgate
        self.mapping = mapping
        self.controller_name = controller_name
        self.checks_refresh_seconds = checks_refresh_seconds
        self.requeue_seconds = requeue_seconds
        self.retries = retries
        self.clock = clock
        self.checks: set[str] = set()
        self._checks_read = 0.0
        # The watch and the periodic requeue decide one Workload at a time, never both at once.
        self._deciding = asyncio.Lock()
        # Versions of Workloads not to decide (see _superseded), oldest first, a bounded number.
        self._passed: dict[tuple[str | None, str | None, str], None] = {}

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
        async with self._deciding:
            if time.monotonic() - self._checks_read > self.checks_refresh_seconds:
                await self.refresh_checks()
            if self._superseded(workload):
                return
            for check in kueue.pending_checks(workload, self.checks):
                workload = await self._write(workload, check, await self._decide(workload, check))

    def _superseded(self, workload: dict[str, Any]) -> bool:
        """Whether this version of the Workload is one the controller has moved on from: it wrote
        a state computed from it (a watch event or a listing delivered late brings it again), or
        it is the version its own annotation write made, whose status write follows (deciding it
        would submit the raised attempt while its Retry is being written)."""
        meta = workload.get("metadata") or {}
        return (meta.get("namespace"), meta.get("name"), meta.get("resourceVersion")) in self._passed

    def _pass(self, meta: dict[str, Any], version: str | None) -> None:
        if version is None:
            return
        self._passed[(meta.get("namespace"), meta.get("name"), version)] = None
        while len(self._passed) > 10_000:
            self._passed.pop(next(iter(self._passed)))

    async def _decide(self, workload: dict[str, Any], check: str) -> kueue.Patch:
        now = self.clock()
        try:
            if not self.mapping.submit_cpu_only and kueue.asks_no_gpu(workload, self.mapping):
                why = f"the Workload asks for no {self.mapping.gpu_resource}: let through without a decision (CPU-only work is not submitted)"
                return kueue.let_through(workload, check, why, now=now)
            request = kueue.submission(workload, self.mapping)
        except Unmappable as exc:
            return kueue.unmappable(workload, check, str(exc), now=now)
        if (conflict := kueue.run_label_conflict(workload, request.run_id)) is not None:
            return kueue.unmappable(workload, check, conflict, now=now)
        try:
            answer = await self.budgetgate.submit(request)
        except BudgetgateError as exc:
            if isinstance(exc, Unauthorized):
                log.error("budgetgate refused the controller's token (%s): %s", exc.status, exc.detail)
            return kueue.error_answer(workload, check, exc, now=now, retries=self.retries, attempt_annotation=self.mapping.attempt_annotation)
        except (*RETRYABLE, httpx.TransportError) as exc:
            why = f"cannot decide now ({type(exc).__name__}: {exc})"
            return kueue.unavailable(workload, check, why, now=now, retries=self.retries)
        body = answer.model_dump(mode="json")
        kind = kueue.refusal(body)
        if kind is kueue.Refusal.CONCURRENCY:
            kind = await self._concurrency(request.run_id, body)
        return kueue.decided(workload, check, body, now=now, kind=kind, retries=self.retries, attempt_annotation=self.mapping.attempt_annotation)

    async def _concurrency(self, run_id: str, answer: dict[str, Any]) -> kueue.Refusal:
        """Which concurrency limit refused the run, from its status (kueue.Refusal.CONCURRENCY when
        the status cannot be read, or is of another decision than `answer`)."""
        try:
            status = await self.budgetgate.lookup(run_id)
        except (BudgetgateError, *RETRYABLE, httpx.TransportError) as exc:
            log.warning("could not read the status of run %r to tell which limit refused it (%s: %s)", run_id, type(exc).__name__, exc)
            return kueue.Refusal.CONCURRENCY
        if status is None or status.decision_id != answer["decision_id"]:
            return kueue.Refusal.CONCURRENCY
        return kueue.concurrency(status.model_dump(mode="json"))

    async def requeue(self) -> int:
        """Decide again every Workload waiting on a check of ours (listed afresh); how many."""
        waiting = 0
        async for found in self.kube.list(Workload, namespace="*"):
            body = found.to_dict()
            if kueue.pending_checks(body, self.checks):
                waiting += 1
                await self.reconcile(body)
        return waiting

    async def _write(self, workload: dict[str, Any], check: str, patch: kueue.Patch) -> dict[str, Any]:
        if kueue.unchanged(workload, patch):
            return workload
        meta = workload["metadata"]
        status = patch.status
        between: str | None = None
        try:
            if patch.annotations:
                # Guarded by the version decided on, as the status is: a Workload listed minutes
                # ago by the requeue (or changed since the event) is not moved to another attempt.
                version = {"resourceVersion": meta["resourceVersion"]} if meta.get("resourceVersion") else {}
                guarded = {"metadata": {"annotations": patch.annotations, **version}}
                updated = await self.kube.patch(Workload, meta["name"], guarded, namespace=meta["namespace"], patch_type=PatchType.MERGE)
                # The version decided on is no longer the Workload's, whatever the status write meets.
                self._pass(meta, meta.get("resourceVersion"))
                # Only our annotation changed since the status was computed: carry its version.
                between = updated.to_dict()["metadata"].get("resourceVersion")
                status = {**status, "metadata": {"resourceVersion": between}}
            try:
                written = await self.kube.patch(Workload.Status, meta["name"], status, namespace=meta["namespace"], patch_type=PatchType.MERGE)
            except ApiError as exc:
                if exc.status.code != 409 or between is None:
                    raise
                # The attempt is raised but Kueue wrote before the state was: carry the decision
                # over to Kueue's version, or it would be decided again as the next attempt
                # with no state ever written for this one.
                written = await self._carry_over(workload, check, patch)
                if written is None:
                    raise
        except ApiError as exc:
            if exc.status.code == 409:
                # Changed meanwhile: the versions written from are stale, the watch brings the new one.
                self._pass(meta, meta.get("resourceVersion"))
                self._pass(meta, between)
                log.info("workload %s/%s changed while it was decided; deciding its new version", meta["namespace"], meta["name"])
                return workload
            # Another failure: a version still current (the annotation's, if that write went
            # through) is left to be decided again.
            raise
        # Written: the version decided on, and the one the annotation write made (its watch event
        # is handled after this reconcile), are both passed.
        self._pass(meta, meta.get("resourceVersion"))
        self._pass(meta, between)
        return written.to_dict()

    async def _carry_over(self, workload: dict[str, Any], check: str, patch: kueue.Patch, *, tries: int = 3) -> Any | None:
        """Write `patch`'s state of `check` onto the Workload's current version, re-read after
        each 409, while the decision still stands for it (`kueue.carried_over`); None when it
        does not, or after `tries` conflicts."""
        meta = workload["metadata"]
        for _ in range(tries):
            fresh = (await self.kube.get(Workload, meta["name"], namespace=meta["namespace"])).to_dict()
            status = kueue.carried_over(workload, fresh, check, patch)
            if status is None:
                return None
            try:
                written = await self.kube.patch(Workload.Status, meta["name"], status, namespace=meta["namespace"], patch_type=PatchType.MERGE)
            except ApiError as exc:
                if exc.status.code != 409:
                    raise
                continue
            self._pass(meta, (fresh.get("metadata") or {}).get("resourceVersion"))
            log.info("workload %s/%s changed between the two writes; decision carried over to the new version", meta["namespace"], meta["name"])
            return written
        return None

    async def run(self) -> None:
        """Watch Workloads in every namespace and reconcile each change, and requeue those still
        waiting every `requeue_seconds`, until cancelled."""
        await self.refresh_checks()
        requeuing = asyncio.create_task(self._requeue_forever())
        try:
            await self._watch_forever()
        finally:
            requeuing.cancel()
            await asyncio.gather(requeuing, return_exceptions=True)

    async def _requeue_forever(self) -> None:
        while True:
            await asyncio.sleep(self.requeue_seconds)
            try:
                waiting = await self.requeue()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the API server or a patch failed: the next pass tries again
                log.warning("requeue of waiting Workloads failed (%s: %s); trying again in %ss", type(exc).__name__, exc, self.requeue_seconds)
            else:
                if waiting:
                    log.info("requeued %d Workload(s) still waiting on budgetgate", waiting)

    async def _watch_forever(self) -> None:
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
