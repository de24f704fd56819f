"""What Kueue does with a Workload's admission check states, on the stand-in API server's stored
Workloads (tests/support/kube_api.py), with a clock the test moves: no Kueue can run here.

Modelled on Kueue's workload controller (kueue.x-k8s.io/v1beta2; pkg/controller/core/
workload_controller.go, pkg/workload/evict/evict.go, the job reconciler's eviction handling), one
reconcile step of a Workload at a time, each a write the watchers see:

- a check `Retry` with `requeueAfterSeconds`: `status.requeueState.requeueAt` is set to its
  lastTransitionTime + requeueAfterSeconds (`NeedsRequeueAtUpdate`; without the field Kueue
  requeues at once);
- then the Workload is evicted (`Evicted` true, reason `AdmissionCheck`), every check not Pending
  reset to `Pending` ("Reset to Pending after eviction. Previously: Retry"), requeueAfterSeconds
  kept, a Retry's `retryCount` raised (any other's dropped), while its quota is still reserved;
- `stop_steps` steps later the job has stopped: the quota is released (`QuotaReserved` false,
  `status.admission` cleared, `Admitted` false) and `Requeued` false with the eviction's reason;
- once the clock reaches requeueAt: `requeueAt` cleared and `Requeued` true (`BackoffFinished`),
  and the scheduler reserves the quota again (the admission it had), `Evicted` false;
- a check `Rejected`: `DeactivationTarget` true (reason `AdmissionCheck`), then `spec.active:
  false`, then evicted with reason `DeactivatedDueToAdmissionCheck` (checks reset to Pending, the
  condition removed), then its quota released as above; it stays inactive (nobody reactivates it);
- every check `Ready` with quota reserved: `Admitted` true.

Checks of other controllers named in `others` (the fixture's `provisioning`) are answered `Ready`
whenever they are Pending on a Workload with quota reserved and not evicted, as their controller
would once it had provisioned: Kueue resets them on every eviction too.

Not modelled: the ClusterQueue's own quota (the scheduler always finds room again), preemption,
PodsReady, and Kueue's own requeue backoff for evictions without requeueAfterSeconds.
"""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime, timedelta
from typing import Any

from tests.support.kube_api import KubeApi


def _stamp(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def condition(workload: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (workload.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)


def is_true(workload: dict[str, Any], kind: str) -> bool:
    found = condition(workload, kind)
    return found is not None and found.get("status") == "True"


class KueueSim:
    """Kueue's reactions to check states on `api`'s Workloads; `history` lists them in order as
    (namespace/name, what happened)."""

    def __init__(self, api: KubeApi, *, now: datetime | None = None, stop_steps: int = 3, others: frozenset[str] = frozenset({"provisioning"})) -> None:
        self.api = api
        self.others = others
        self.now = (now or datetime.now(UTC)).replace(microsecond=0)
        self.stop_steps = stop_steps
        self.history: list[tuple[str, str]] = []
        self._admissions: dict[str, dict[str, Any]] = {}  # the admission a Workload is given again
        self._stopping: dict[str, int] = {}  # evicted Workloads whose job is still stopping: steps left

    # -- the clock ------------------------------------------------------------------------------

    def clock(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def happened(self, name: str, what: str) -> int:
        return sum(1 for who, done in self.history if who.endswith("/" + name) and done == what)

    # -- reconciling ----------------------------------------------------------------------------

    def step(self) -> bool:
        """One reconcile of every Workload (at most one write each); whether any was written."""
        wrote = False
        for found in self.api.items("workloads"):
            updated = self._reconcile(copy.deepcopy(found))
            if updated is not None:
                key = f"{found['metadata']['namespace']}/{found['metadata']['name']}"
                updated, what = updated
                self.history.append((key, what))
                self.api.put("workloads", updated)  # no await between reading and writing: nothing else wrote meanwhile
                wrote = True
        return wrote

    async def run(self, interval: float = 0.02) -> None:
        """Reconcile every `interval` seconds until cancelled."""
        while True:
            self.step()
            await asyncio.sleep(interval)

    def _set(self, wl: dict[str, Any], kind: str, status: str, reason: str, message: str) -> None:
        conditions = wl.setdefault("status", {}).setdefault("conditions", [])
        found = condition(wl, kind)
        fresh = {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": _stamp(self.now),
            "observedGeneration": wl["metadata"].get("generation", 1),
        }
        if found is None:
            conditions.append(fresh)
        else:
            if found.get("status") == status:
                fresh["lastTransitionTime"] = found.get("lastTransitionTime", fresh["lastTransitionTime"])
            found.clear()
            found.update(fresh)

    def _reconcile(self, wl: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
        key = f"{wl['metadata']['namespace']}/{wl['metadata']['name']}"
        status = wl.setdefault("status", {})
        checks = status.get("admissionChecks") or []
        if is_true(wl, "Finished"):
            return None
        # A Retry's requeueAfterSeconds sets the requeue time first (NeedsRequeueAtUpdate).
        retry_at = max(
            (
                _parse(c["lastTransitionTime"]) + timedelta(seconds=c["requeueAfterSeconds"])
                for c in checks
                if c.get("state") == "Retry" and c.get("requeueAfterSeconds") is not None and c.get("lastTransitionTime")
            ),
            default=None,
        )
        requeue = (status.get("requeueState") or {}).get("requeueAt")
        if retry_at is not None and retry_at > self.now and (requeue is None or _parse(requeue) < retry_at):
            status.setdefault("requeueState", {})["requeueAt"] = _stamp(retry_at)
            return wl, "requeueAt set"
        reserved = is_true(wl, "QuotaReserved")
        if wl["spec"].get("active") is not False:
            if is_true(wl, "DeactivationTarget"):
                wl["spec"]["active"] = False
                return wl, "deactivated"
        elif reserved and not is_true(wl, "Evicted"):
            target = condition(wl, "DeactivationTarget")
            cause = target["reason"] if target else ""
            status["conditions"] = [c for c in status.get("conditions", []) if c.get("type") != "DeactivationTarget"]
            status.pop("requeueState", None)
            self._evict(wl, f"DeactivatedDueTo{cause}" if cause else "Deactivated", "The workload is deactivated")
            return wl, "evicted"
        if reserved and is_true(wl, "Evicted"):
            # The job is stopping; once it has, the quota is released.
            left = self._stopping.get(key, self.stop_steps)
            if left > 0:
                self._stopping[key] = left - 1
                return None
            self._stopping.pop(key, None)
            evicted = condition(wl, "Evicted") or {}
            self._admissions[key] = status.pop("admission", None) or self._admissions.get(key, {})
            self._set(wl, "QuotaReserved", "False", "Pending", evicted.get("message", ""))
            self._set(wl, "Requeued", "False", evicted.get("reason", ""), evicted.get("message", ""))
            if condition(wl, "Admitted") is not None:
                self._set(wl, "Admitted", "False", "NoReservation", "The workload has no reservation")
            return wl, "quota released"
        if not reserved:
            if wl["spec"].get("active") is False:
                return None
            requeued = condition(wl, "Requeued")
            if requeued is not None and requeued.get("status") == "False":
                if requeue is not None and _parse(requeue) > self.now:
                    return None  # backing off
                status.get("requeueState", {}).pop("requeueAt", None)
                self._set(wl, "Requeued", "True", "BackoffFinished", "The workload backoff was finished")
                return wl, "requeued"
            if key in self._admissions:
                # The scheduler reserves quota again (SetQuotaReservation).
                status["admission"] = self._admissions.pop(key)
                self._set(wl, "QuotaReserved", "True", "QuotaReserved", f"Quota reserved in ClusterQueue {status['admission'].get('clusterQueue')}")
                if is_true(wl, "Evicted"):
                    self._set(wl, "Evicted", "False", "QuotaReserved", "Previously: " + (condition(wl, "Evicted") or {}).get("message", ""))
                return wl, "quota reserved"
            return None
        # Quota reserved, not evicted: the check-based eviction, or admission.
        if any(c.get("state") == "Rejected" for c in checks):
            rejected = "; ".join(f'"{c["name"]}" ({c.get("message", "")})' for c in checks if c.get("state") == "Rejected")
            self._set(wl, "DeactivationTarget", "True", "AdmissionCheck", f"AdmissionCheck in Rejected state: {rejected}")
            return wl, "deactivation target"
        if any(c.get("state") == "Retry" for c in checks):
            retried = "; ".join(f'"{c["name"]}" ({c.get("message", "")})' for c in checks if c.get("state") == "Retry")
            self._evict(wl, "AdmissionCheck", f"Evicted due to AdmissionCheck in Retry state: {retried}")
            return wl, "evicted"
        theirs = [c for c in checks if c.get("name") in self.others and c.get("state") == "Pending"]
        if theirs:
            for check in theirs:
                check.update(state="Ready", message="Provisioned", lastTransitionTime=_stamp(self.now))
            return wl, "other checks ready"
        if checks and all(c.get("state") == "Ready" for c in checks) and not is_true(wl, "Admitted"):
            self._set(wl, "Admitted", "True", "Admitted", "The workload is admitted")
            return wl, "admitted"
        return None

    def _evict(self, wl: dict[str, Any], reason: str, message: str) -> None:
        self._set(wl, "Evicted", "True", reason, message)
        for check in wl["status"].get("admissionChecks") or []:
            if check.get("state") == "Pending":
                continue
            reset = {
                "name": check["name"],
                "state": "Pending",
                "message": "Reset to Pending after eviction. Previously: " + check["state"],
                "lastTransitionTime": _stamp(self.now),
            }
            if check.get("requeueAfterSeconds") is not None:
                reset["requeueAfterSeconds"] = check["requeueAfterSeconds"]
            if check["state"] == "Retry":  # Kueue counts the retries; any other state's count is dropped
                reset["retryCount"] = (check.get("retryCount") or 0) + 1
            check.clear()
            check.update(reset)
