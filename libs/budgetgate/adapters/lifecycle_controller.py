"""The Kubernetes lifecycle controller: watches (lightkube, every namespace) the objects of the runs
budgetgate admitted and publishes what happens to them — STORED, STARTED, EVICTED, READMITTED,
COMPLETED, FAILED, CANCELLED — through metering-ingest's lifecycle feed (`POST /v1/lifecycle/events`,
`AsyncClient.publish_lifecycle`), from which the reconciler settles the runs. The rules are pure, in
budgetgate/adapters/workload_phases.py; this module only reads and publishes.

What it watches:
- pods carrying the run label (`budgetgate.io/run-id`; the mutating webhook and Kueue's
  `podSetUpdates` put it there), the run id from the label (and the annotation for a hashed one);
- batch/v1 Jobs carrying the run label or the run-id annotation, and the Jobs that own a watched
  pod or Workload (read when first named, then followed through the Job watch);
- Kueue Workloads (kueue.x-k8s.io/v1beta2) that carry one of budgetgate's AdmissionChecks, the run
  id as the Kueue controller submitted it (`kueue_workloads.submission`: the annotation, else the
  owner Job's UID, else its own).

Each collection is listed, then watched from the list's resourceVersion; a watch that ends, fails
or is answered 410 Gone is listed again (objects gone meanwhile count as deleted), after a backoff
that doubles to `backoff_max_seconds` on repeated failures. Every change marks its run; the
publisher derives the run's facts anew from what it holds and publishes those it has not
published yet. Event ids are stable (workload_phases.Fact.event_id), so a restart, a re-list or a
second replica publishing the same fact is deduplicated downstream; still, only the replica
holding the Lease publishes (leases.py), the others keep their view current to take over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
from lightkube import ApiError, operators
from lightkube import AsyncClient as KubeClient
from lightkube.generic_resource import create_namespaced_resource

from budgetgate.adapters import kueue_workloads as kueue
from budgetgate.adapters import workload_phases as rules
from budgetgate.adapters.leases import LeaderElection
from budgetgate.client import BudgetgateError, InvalidRequest, lifecycle_event
from budgetgate.platforms.kubernetes import Mapping, Unmappable
from budgetgate.platforms.run_labels import RUN_LABEL, pod_run_id, run_id_of
from budgetgate.v1.lifecycle_pb2 import LifecycleEvent

log = logging.getLogger(__name__)

# Generic (dict) resources: an object is read as the API server wrote it, never refused by a model's
# validation (one unreadable pod would otherwise stop the whole watch).
Pod = create_namespaced_resource("", "v1", "Pod", "pods")
Job = create_namespaced_resource("batch", "v1", "Job", "jobs")
Workload = create_namespaced_resource(kueue.GROUP, kueue.VERSION, "Workload", "workloads")
Key = tuple[str, str, str]  # (kind, namespace, name)
Publish = Callable[[Sequence[LifecycleEvent]], Awaitable[Any]]


@dataclass
class _Run:
    keys: set[Key] = field(default_factory=set)
    published: set[str] = field(default_factory=set)  # event ids published (or found published)
    evicted_at: datetime | None = None
    finished: bool = False


class LifecycleController:
    """Publishes the lifecycle of the Kubernetes runs budgetgate admitted."""

    def __init__(
        self,
        *,
        kube: KubeClient,
        publish: Publish,
        election: LeaderElection | None = None,
        mapping: Mapping = Mapping(),
        admission_checks: frozenset[str] = frozenset({"budget"}),
        backoff_seconds: float = 1.0,
        backoff_max_seconds: float = 30.0,
        remember_runs: int = 100_000,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.kube = kube
        self.publish = publish
        self.election = election
        self.mapping = mapping
        self.admission_checks = admission_checks
        self.backoff_seconds = backoff_seconds
        self.backoff_max_seconds = backoff_max_seconds
        self.remember_runs = remember_runs
        self.clock = clock
        self.objects: dict[Key, dict[str, Any]] = {}
        self.run_of: dict[Key, str] = {}
        self.runs: OrderedDict[str, _Run] = OrderedDict()
        self.owner_runs: dict[str, str] = {}  # Job UID → the run a watched pod or Workload of it belongs to
        self.dirty: set[str] = set()
        self.pending: dict[str, list[rules.Fact]] = {}  # derived on a deletion, to publish
        self._fetching: set[tuple[str, str, str]] = set()  # (namespace, name, uid) of owner Jobs to read
        self.wakeup = asyncio.Event()
        self.synced: set[str] = set()  # kinds listed at least once
        self.published_events = 0
        self.watch_restarts = 0

    # -- what belongs to which run ----------------------------------------------------------------

    def _pod_run(self, pod: dict[str, Any]) -> str | None:
        return pod_run_id(pod)

    def _job_run(self, job: dict[str, Any]) -> str | None:
        meta = job.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        return run_id_of(meta.get("labels"), annotations) or annotations.get(self.mapping.run_id_annotation) or self.owner_runs.get(meta.get("uid") or "")

    def _workload_run(self, workload: dict[str, Any]) -> str | None:
        checks = {c.get("name") for c in (workload.get("status") or {}).get("admissionChecks") or []}
        if not checks & self.admission_checks:
            return None
        try:
            # The run id the Kueue controller submitted; CPU-only and runtime-less Workloads are
            # mapped too (their run id is all that is needed here).
            return kueue.submission(workload, Mapping(run_id_annotation=self.mapping.run_id_annotation, submit_cpu_only=True, default_runtime_hours=1.0)).run_id
        except Unmappable as exc:
            meta = workload.get("metadata") or {}
            log.info("workload %s/%s has no run id budgetgate could have admitted (%s): not followed", meta.get("namespace"), meta.get("name"), exc)
            return None

    def _run_id(self, kind: str, obj: dict[str, Any]) -> str | None:
        if kind == "Pod":
            return self._pod_run(obj)
        if kind == "Job":
            return self._job_run(obj)
        return self._workload_run(obj)

    # -- the view ---------------------------------------------------------------------------------

    def observe(self, kind: str, obj: dict[str, Any]) -> str | None:
        """An object as listed or announced (added or changed); the run it belongs to, if any."""
        meta = obj.get("metadata") or {}
        key = (kind, meta.get("namespace") or "", meta.get("name") or "")
        run_id = self._run_id(kind, obj)
        before = self.run_of.get(key)
        if before is not None and before != run_id:
            self._drop(key)
        if run_id is None:
            return None
        self.objects[key] = obj
        self.run_of[key] = run_id
        run = self._run(run_id)
        run.keys.add(key)
        if kind in ("Pod", "Workload"):
            owner = rules.controller_owner(obj)
            if owner is not None and owner.get("kind") == "Job" and owner.get("uid"):
                self._want_job(owner, meta.get("namespace") or "", run_id)
        self._mark(run_id)
        return run_id

    def forget(self, kind: str, obj: dict[str, Any]) -> None:
        """An object deleted (its last state as announced): gone from the view, and its run told."""
        meta = obj.get("metadata") or {}
        key = (kind, meta.get("namespace") or "", meta.get("name") or "")
        run_id = self.run_of.get(key) or self._run_id(kind, obj)
        self._drop(key)
        if run_id is None:
            return
        run = self._run(run_id)
        if not run.finished:
            try:
                fact = rules.deleted(self._snapshot(run_id), obj, kind=kind, now=self.clock())
            except rules.BadObject as exc:
                log.warning("run %r: %s", run_id, exc)
                fact = None
            if fact is not None:
                self.pending.setdefault(run_id, []).append(fact)
        self._mark(run_id)

    def _drop(self, key: Key) -> None:
        run_id = self.run_of.pop(key, None)
        self.objects.pop(key, None)
        if run_id is not None and run_id in self.runs:
            self.runs[run_id].keys.discard(key)

    def _run(self, run_id: str) -> _Run:
        run = self.runs.get(run_id)
        if run is None:
            run = self.runs[run_id] = _Run()
            while len(self.runs) > self.remember_runs:  # forget the oldest runs nothing is left of
                oldest, state = next(iter(self.runs.items()))
                if state.keys or oldest in self.dirty:
                    self.runs.move_to_end(oldest)
                    break
                del self.runs[oldest]
        else:
            self.runs.move_to_end(run_id)
        return run

    def _mark(self, run_id: str) -> None:
        self.dirty.add(run_id)
        self.wakeup.set()

    def _want_job(self, owner: dict[str, Any], namespace: str, run_id: str) -> None:
        uid = str(owner["uid"])
        if self.owner_runs.get(uid) == run_id:
            return
        self.owner_runs[uid] = run_id
        key = ("Job", namespace, str(owner.get("name") or ""))
        if key in self.objects:
            self.observe("Job", self.objects[key])
        else:
            self._fetching.add((namespace, str(owner.get("name") or ""), uid))
            self.wakeup.set()

    async def _fetch_owners(self) -> None:
        """Read the Jobs that own watched pods or Workloads but carry no run label themselves."""
        wanted, self._fetching = self._fetching, set()
        for namespace, name, uid in wanted:
            try:
                job = (await self.kube.get(Job, name, namespace=namespace)).to_dict()
            except ApiError as exc:
                if exc.status.code != 404:
                    self._fetching.add((namespace, name, uid))
                    raise
                continue
            if (job.get("metadata") or {}).get("uid") == uid:
                self.observe("Job", job)

    def _snapshot(self, run_id: str) -> rules.RunObjects:
        run = self.runs[run_id]
        by_kind: dict[str, list[dict[str, Any]]] = {"Pod": [], "Job": [], "Workload": []}
        for key in sorted(run.keys):
            by_kind[key[0]].append(self.objects[key])
        return rules.RunObjects(
            run_id,
            pods=tuple(by_kind["Pod"]),
            jobs=tuple(by_kind["Job"]),
            workloads=tuple(by_kind["Workload"]),
            evicted_at=run.evicted_at,
            gpu_resource=self.mapping.gpu_resource,
            flavor_annotation=self.mapping.flavor_annotation,
        )

    def facts(self, run_id: str) -> list[rules.Fact]:
        """The run's facts not published yet (its memory of evictions brought up to date)."""
        run = self.runs[run_id]
        derived: list[rules.Fact] = list(self.pending.get(run_id, []))
        if run.keys:
            phased = rules.phases(self._snapshot(run_id))
            run.evicted_at = phased.evicted_at
            derived += phased.facts
        return rules.new_facts({f.event_id: f for f in derived}.values(), run.published)

    # -- publishing -------------------------------------------------------------------------------

    @property
    def leading(self) -> bool:
        return self.election is None or self.election.leading

    async def publish_dirty(self) -> int:
        """Publish the new facts of every marked run (the leader only); how many were published.
        A run whose publication fails stays marked; the failure is raised after the others."""
        if not self.leading:
            return 0
        failure: BaseException | None = None
        published = 0
        for run_id in sorted(self.dirty):
            self.dirty.discard(run_id)
            try:
                facts = self.facts(run_id)
            except rules.BadObject as exc:
                log.warning("run %r: %s; its objects are read again at their next change", run_id, exc)
                continue
            if not facts:
                continue
            if not self.leading:
                self.dirty.add(run_id)
                return published
            try:
                await self.publish([self._event(f) for f in facts])
            except InvalidRequest as exc:  # a fact metering-ingest refuses: a bug here, never resent
                log.error("run %r: metering-ingest refused its lifecycle events (%s); dropped: %s", run_id, exc, [(f.kind, f.at) for f in facts])
            except (BudgetgateError, httpx.HTTPError, OSError) as exc:
                self.dirty.add(run_id)
                failure = failure or exc
                continue
            run = self.runs[run_id]
            run.published.update(f.event_id for f in facts)
            run.finished = run.finished or any(f.kind in ("COMPLETED", "FAILED", "CANCELLED") for f in facts)
            self.pending.pop(run_id, None)
            published += len(facts)
            self.published_events += len(facts)
            for fact in facts:
                log.info("run %r: %s at %s (%s)", run_id, fact.kind, fact.at.isoformat(), fact.reason or fact.identity)
        if failure is not None:
            raise failure
        return published

    def _event(self, fact: rules.Fact) -> LifecycleEvent:
        return lifecycle_event(
            fact.run_id, fact.kind, at=fact.at, gpus=fact.gpus, nodes=fact.nodes, flavor=fact.flavor, reason=fact.reason, event_id=fact.event_id
        )

    # -- the loops --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Watch pods, Jobs and Workloads, and publish while leading, until cancelled."""
        tasks = [
            asyncio.create_task(self._watch_forever("Pod", Pod, {RUN_LABEL: operators.exists()}), name="lifecycle-watch-pods"),
            asyncio.create_task(self._watch_forever("Job", Job, None), name="lifecycle-watch-jobs"),
            asyncio.create_task(self._watch_forever("Workload", Workload, None), name="lifecycle-watch-workloads"),
            asyncio.create_task(self._publish_forever(), name="lifecycle-publish"),
        ]
        if self.election is not None:
            tasks.append(asyncio.create_task(self.election.run(), name="lifecycle-lease"))
            tasks.append(asyncio.create_task(self._follow_leadership(), name="lifecycle-leadership"))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow_leadership(self) -> None:
        """On becoming leader, every run is derived again: what the last leader published is
        deduplicated by event id, what it had not published yet goes out now."""
        assert self.election is not None
        while True:
            await self.election.changed.wait()
            self.election.changed.clear()
            if self.election.leading:
                self.dirty |= set(self.runs)
                self.wakeup.set()

    async def _publish_forever(self) -> None:
        delay = self.backoff_seconds
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wakeup.wait(), timeout=5.0)
            self.wakeup.clear()
            try:
                if self._fetching:
                    await self._fetch_owners()
                await self.publish_dirty()
                delay = self.backoff_seconds
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - metering-ingest or the API server away: tried again
                log.warning("publishing lifecycle events failed (%s: %s); trying again in %.1fs", type(exc).__name__, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff_max_seconds)
                self.wakeup.set()

    async def sync(self, kind: str, resource: Any, labels: dict[str, Any] | None) -> str | None:
        """List `kind` afresh: the view takes the list, objects gone from it count as deleted;
        returns the list's resourceVersion to watch from."""
        listing = self.kube.list(resource, namespace="*", labels=labels)
        seen: set[Key] = set()
        async for found in listing:
            obj = found.to_dict()
            meta = obj.get("metadata") or {}
            seen.add((kind, meta.get("namespace") or "", meta.get("name") or ""))
            self.observe(kind, obj)
        for key in [k for k in self.objects if k[0] == kind and k not in seen]:
            self.forget(kind, self.objects[key])
        self.synced.add(kind)
        try:
            return listing.resourceVersion  # type: ignore[attr-defined, no-any-return]
        except Exception:  # noqa: BLE001 - an empty list read nothing: watch from now
            return None

    async def _watch_forever(self, kind: str, resource: Any, labels: dict[str, Any] | None) -> None:
        delay = self.backoff_seconds
        while True:
            try:
                version = await self.sync(kind, resource, labels)
                delay = self.backoff_seconds
                async for event, found in self.kube.watch(resource, namespace="*", labels=labels, resource_version=version):
                    obj = found.to_dict()
                    if event == "DELETED":
                        self.forget(kind, obj)
                    else:
                        self.observe(kind, obj)
                self.watch_restarts += 1  # the server ended the watch: list again
            except asyncio.CancelledError:
                raise
            except ApiError as exc:
                self.watch_restarts += 1
                if exc.status.code == 410:  # the version is too old: list again at once
                    log.info("%s watch: 410 Gone, listing again", kind)
                    continue
                log.warning("%s watch failed (%s %s); listing again in %.1fs", kind, exc.status.code, exc.status.message, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff_max_seconds)
            except Exception as exc:  # noqa: BLE001 - the API server away or the connection cut: list again
                self.watch_restarts += 1
                log.warning("%s watch ended (%s: %s); listing again in %.1fs", kind, type(exc).__name__, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff_max_seconds)
