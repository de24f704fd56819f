"""The Kubernetes ValidatingAdmissionWebhook: `POST /v1/kubernetes/admission-review`.

The API server sends an admission.k8s.io/v1 AdmissionReview for each Pod, Job, JobSet, RayJob
or RayCluster created, and each Job, JobSet, RayJob or RayCluster updated, in the namespaces the
ValidatingWebhookConfiguration selects (deploy/kubernetes/webhook/). A created object is mapped
to a submission (budgetgate/platforms/kubernetes.py), decided by this instance's admitter
exactly as `POST /v1/admissions` would decide it, and answered with `allowed` and the decision's
reason. A `dryRun` request (kubectl --dry-run=server) is quoted as `POST /v1/quotes` would: the
same answer, nothing reserved or recorded, and said so ("would reserve"). An update is
answered without a decision: denied (403) when it raises the object's GPUs, or when it is one
only a controller may make (resuming what Kueue queued, changing a run id label) and someone
else makes it; allowed otherwise. A Job (JobSet, RayJob, RayCluster) labelled for a Kueue queue
and created suspended is left to Kueue's AdmissionCheck: let through undecided and remembered,
so that its children pass on it as on an admitted owner.

The mutating webhook (kubernetes_mutation.py) runs before this one and names the run: the
object reaches here with its `budgetgate.io/run-id` annotation, the run id decided under.

A FlyteWorkflow (flytepropeller's CRD, which FlyteAdmin creates for every execution) is the run
`flyte/<project>/<domain>/<execution>` of its labels, the Flyte preflight's: when FlyteAdmin (a
trusted creator) creates one whose run already has a decision (the preflight's, or a parent
execution's for a child carrying its labels), it is answered from that decision with no new
submission (nothing reserved twice, no 409 for a projection that differs); otherwise it is mapped
(budgetgate/platforms/flyte_workflows.py) and decided like any object, an offloaded closure
refused (422) naming the field and FlyteAdmin's setting. The pods flytepropeller creates for it
pass on it as on an admitted owner.

Only admission.k8s.io/v1 is answered: a body that is not an admission.k8s.io/v1 AdmissionReview
with a request uid is a 400 problem naming the field (no AdmissionReview the API server would
read can answer it). Within one, a malformed request or object (a CREATE or UPDATE without its
object, a field of another type than the API's) is denied (422) naming the field, as is an object
that cannot be a submission; a run resent with another request is denied (409) saying what
changed (budgetgate/platforms/reviews.py, resubmission.py).

When budgetgate cannot decide (its ledger unavailable, no policy bundle yet), the answer is a
denial (`BUDGETGATE_KUBERNETES_FAIL_OPEN=false`, the default) or an admission with a warning
(`true`).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import re
import time
from typing import Any

import asyncpg
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from budgetgate.edge.auth import Action, Principal, allow
from budgetgate.core.principals import Forbidden
from budgetgate.services.admission.quoting import Quoter
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.ledger.queries import owned_by
from budgetgate.platforms.kubernetes import (
    ADMITTED_OWNERS,
    Controlled,
    Mapping,
    Owned,
    Queued,
    Refuse,
    Skip,
    Submit,
    Unmappable,
    decided,
    review,
    short,
    submission,
)
from budgetgate.platforms.flyte_workflows import flyte_run, flyte_submission, is_flyte_workflow, offloaded_message
from budgetgate.platforms.reviews import Asked, NotAReview, ask, review_uid
from budgetgate.services.admission.access import require_submission
from budgetgate.services.admission.admitter import Unavailable
from budgetgate.decisions.deciding import InvalidSubmission
from budgetgate.services.admission.resubmission import Conflict

sql = owned_by("budgetgate.services.admission")

KUEUE_CONTROLLERS = ("system:serviceaccount:kueue-system:kueue-controller-manager",)

log = logging.getLogger(__name__)

_EXAMPLE = {
    "apiVersion": "admission.k8s.io/v1",
    "kind": "AdmissionReview",
    "request": {
        "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
        "kind": {"group": "batch", "version": "v1", "kind": "Job"},
        "resource": {"group": "batch", "version": "v1", "resource": "jobs"},
        "namespace": "vision-prod",
        "operation": "CREATE",
        "dryRun": False,
        "object": {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "train-resnet", "namespace": "vision-prod", "uid": "3c9a6f0e-2b7d-4c1e-9a8b-5d6e7f8a9b0c",
                         "labels": {"team": "vision", "cost-center": "1042", "environment": "prod"}},
            "spec": {"parallelism": 1, "activeDeadlineSeconds": 21600, "template": {"spec": {"restartPolicy": "Never", "containers": [
                {"name": "trainer", "image": "trainer:1", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}}},
        },
    },
}  # fmt: skip


_REVIEW = {"type": "object", "description": "an admission.k8s.io/v1 AdmissionReview (see the Kubernetes API reference)", "required": ["apiVersion", "kind"],
           "properties": {"apiVersion": {"type": "string", "description": "admission.k8s.io/v1"}, "kind": {"type": "string", "description": "AdmissionReview"},
                          "request": {"type": "object", "description": "what the API server asks: uid, kind, namespace, operation, dryRun, object, oldObject"},
                          "response": {"type": "object", "description": "the answer: uid, allowed, status (code, reason, message), warnings"}}}  # fmt: skip
_ANSWER_EXAMPLE = {
    "apiVersion": "admission.k8s.io/v1",
    "kind": "AdmissionReview",
    "response": {
        "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
        "allowed": False,
        "status": {
            "code": 403,
            "reason": "Forbidden",
            "message": "budgetgate: denied: 'gpu-budget/team-vision-prod' has 12 GPU-hours of 500 GPU-hours left; the run needs 48",
        },
    },
}
_OPENAPI = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": _REVIEW, "example": _EXAMPLE}}},
    "responses": {
        "200": {
            "description": "the AdmissionReview answered (allowed, or denied with the reason)",
            "content": {"application/json": {"schema": _REVIEW, "example": _ANSWER_EXAMPLE}},
        }
    },
}


_CLASS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
TRUSTED_CREATORS = (
    "system:kube-controller-manager",
    "system:serviceaccount:kube-system:*",
    "system:serviceaccount:jobset-system:jobset-controller-manager",
    # Flyte (the flyte-core chart's accounts): FlyteAdmin creates FlyteWorkflows, flytepropeller
    # their pods and plugin objects.
    "system:serviceaccount:flyte:flyteadmin",
    "system:serviceaccount:flyte:flytepropeller",
)


class KubernetesWebhookSettings(BaseSettings):
    """The webhook's mapping and failure policy (BUDGETGATE_KUBERNETES_* variables)."""

    model_config = SettingsConfigDict(env_prefix="BUDGETGATE_KUBERNETES_", extra="ignore")

    fail_open: bool = Field(default=False, description="admit (with a warning) when budgetgate cannot decide, instead of denying")
    gpu_resource: str = Mapping.gpu_resource
    run_id_annotation: str = Mapping.run_id_annotation
    attempt_annotation: str = Mapping.attempt_annotation
    runtime_annotation: str = Mapping.runtime_annotation
    flavor_annotation: str = Mapping.flavor_annotation
    region_annotation: str = Mapping.region_annotation
    # JSON, e.g. {"vision-research": 12}: hours assumed for objects without a deadline or annotation.
    namespace_runtime_hours: dict[str, float] = Field(default_factory=dict)
    default_runtime_hours: float | None = None
    default_flavor: str | None = None
    submit_cpu_only: bool = False
    # Who may create an object that passes on its admitted owner (JSON list of user names, shell
    # patterns allowed): an ownerReference is its creator's to write, so a Pod that names an
    # admitted Job but was created by a tenant is decided as a run of its own. The defaults are
    # kube-controller-manager (Job and ReplicaSet pods, under its own or per-controller service
    # accounts), the JobSet controller, and Flyte's FlyteAdmin and flytepropeller (the flyte-core
    # chart's accounts in namespace flyte): a FlyteWorkflow FlyteAdmin creates passes on its run's
    # decision (the preflight's), flytepropeller's pods on their FlyteWorkflow. Add KubeRay's
    # operator where RayJobs run, e.g. "system:serviceaccount:ray-system:kuberay-operator".
    trusted_creators: list[str] = Field(default_factory=lambda: list(TRUSTED_CREATORS))
    # Kueue's controller (JSON list of user names, shell patterns allowed): the one that resumes
    # a Job, JobSet, RayJob or RayCluster queued in Kueue (created suspended with the label
    # kueue.x-k8s.io/queue-name), once Kueue admitted its Workload. Anybody else resuming one is
    # refused: the webhook let it through on Kueue's word, and Kueue's AdmissionCheck decides it.
    kueue_controllers: list[str] = Field(default_factory=lambda: list(KUEUE_CONTROLLERS))
    # The mutating webhook's PriorityClass per quote (JSON): a soft-budget penalty bound ("0" to
    # "1") to the class of runs whose penalty is at least that (the largest bound that fits), and
    # "preemptible" to the class of runs above their tenant's fair-share target, e.g.
    # {"0": "gpu-normal", "0.5": "gpu-low", "preemptible": "gpu-preemptible"}. Set on the pod
    # templates of Jobs, JobSets, RayJobs and RayClusters; empty, no class is set.
    priority_classes: dict[str, str] = Field(default_factory=dict)
    override_priority_class: bool = Field(
        default=False, description="replace a priorityClassName the object sets with the one BUDGETGATE_KUBERNETES_PRIORITY_CLASSES gives"
    )

    @field_validator("priority_classes")
    @classmethod
    def _bands(cls, classes: dict[str, str]) -> dict[str, str]:
        for key, name in classes.items():
            if key != "preemptible":
                try:
                    bound = float(key)
                except ValueError:
                    raise ValueError(f"key {key!r} is neither a penalty bound from 0 to 1 nor 'preemptible'") from None
                if not 0 <= bound <= 1:
                    raise ValueError(f"key {key!r}: a penalty bound is from 0 to 1")
            if not isinstance(name, str) or not _CLASS_NAME.match(name) or len(name) > 253:
                raise ValueError(f"{key!r}: {name!r} is not a PriorityClass name (a DNS subdomain: lowercase letters, digits, '-' and '.')")
        return classes

    def trusts(self, username: str) -> bool:
        return any(fnmatch.fnmatchcase(username, pattern) for pattern in self.trusted_creators)

    def controls(self, username: str) -> bool:
        """Whether `username` is a controller that may make a `Controlled` update: a trusted
        creator, or Kueue's controller."""
        return self.trusts(username) or any(fnmatch.fnmatchcase(username, pattern) for pattern in self.kueue_controllers)

    def mapping(self) -> Mapping:
        return Mapping(
            gpu_resource=self.gpu_resource, run_id_annotation=self.run_id_annotation, attempt_annotation=self.attempt_annotation,
            runtime_annotation=self.runtime_annotation, flavor_annotation=self.flavor_annotation, region_annotation=self.region_annotation,
            namespace_runtime_hours=dict(self.namespace_runtime_hours), default_runtime_hours=self.default_runtime_hours,
            default_flavor=self.default_flavor, submit_cpu_only=self.submit_cpu_only,
        )  # fmt: skip


def router(settings: KubernetesWebhookSettings) -> APIRouter:
    """The webhook route; decides with `app.state.rt.admitter`."""
    api = APIRouter()
    mapping = settings.mapping()

    @api.post(
        "/v1/kubernetes/admission-review",
        operation_id="reviewKubernetesAdmission",
        openapi_extra=_OPENAPI,
        responses={400: {"description": "not an admission.k8s.io/v1 AdmissionReview with a request uid: no AdmissionReview can answer it"}},
    )
    async def admission_review(request: Request, principal: Principal = Depends(allow(Action.SUBMIT))) -> JSONResponse:
        read = await read_review(request)
        if isinstance(read, JSONResponse):
            return read
        body, uid = read
        return JSONResponse(await _answer(request, principal, body, uid, settings, mapping))

    return api


async def read_review(request: Request) -> tuple[dict[str, Any], str] | JSONResponse:
    """The AdmissionReview a webhook route was sent, and its request uid; or the 400 answering a
    body no AdmissionReview can answer."""
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
        return _not_a_review(NotAReview("body", "is not JSON"))
    try:
        return body, review_uid(body)
    except NotAReview as exc:
        return _not_a_review(exc)


def _not_a_review(exc: NotAReview) -> JSONResponse:
    """400: the API server cannot be answered with an AdmissionReview it would read (another
    version, no uid to answer), so the call fails, and its failurePolicy decides."""
    loc = ["body", *exc.field.split(".")] if exc.field != "body" else ["body"]
    return JSONResponse({"detail": [{"loc": loc, "msg": str(exc), "type": "value_error"}]}, status_code=400)


async def _answer(
    request: Request, principal: Principal, body: dict[str, Any], uid: str, settings: KubernetesWebhookSettings, mapping: Mapping
) -> dict[str, Any]:
    rt = request.app.state.rt
    fail_open = settings.fail_open
    warnings: list[str] = []
    try:
        asked = ask(body)
        if is_flyte_workflow(asked.group, asked.kind):
            flyte = await _flyte_workflow(rt, asked, uid, settings, mapping)
            if isinstance(flyte, dict):  # answered: on its run's decision, or undecided
                return flyte
            mapped = flyte
        else:
            mapped = submission(asked, mapping)
        if isinstance(mapped, Owned):
            try:
                owner_run = await _admitted_owner(rt.pool, mapped, namespace=asked.namespace)
            except (*BACKEND_ERRORS, asyncpg.PostgresError) as exc:  # down, or not migrated yet: undecided
                return _undecided(uid, exc, fail_open=fail_open)
            if owner_run is not None and settings.trusts(asked.username):
                if mapped.owns and not asked.dry_run:
                    await _record_admitted(rt.pool, asked, owner_run)
                return review(uid, allowed=True, message=f"budgetgate: not a submission ({mapped.reason})")
            if owner_run is not None:
                # An admitted owner named by an object its controller did not create: the Pod a
                # tenant wrote with an admitted Job's ownerReference would run beside the Job's own.
                log.info("%s %r names admitted %s %r but was created by %r, not a trusted controller: decided as a run of its own",
                         asked.kind, asked.name, mapped.owner_kind, mapped.owner_name, asked.username)  # fmt: skip
                warnings.append(short(f"budgetgate: created by {asked.username!r}, not a TRUSTED_CREATORS controller: decided as its own run"))
            # An owner never admitted (a CPU-only Job, or an ownerReference written to get past
            # the check), or one named by someone else than its controller: a run of its own.
            mapped = submission(asked, mapping, own_run=True)
    except Unmappable as exc:  # a malformed request or object, or one that cannot be a submission
        return review(uid, allowed=False, code=422, message=f"budgetgate: {exc}")
    if isinstance(mapped, Skip):
        return review(uid, allowed=True, message=f"budgetgate: not a submission ({mapped.reason})")
    if isinstance(mapped, Refuse):
        return review(uid, allowed=False, code=403, message=f"budgetgate: {mapped.reason}")
    if isinstance(mapped, Controlled):
        if settings.controls(asked.username):
            return review(uid, allowed=True, message=f"budgetgate: not a submission (a controller's update: {mapped.what})")
        return review(uid, allowed=False, code=403, message=f"budgetgate: {mapped.reason}")
    if isinstance(mapped, Queued):
        if not asked.dry_run:
            # Its children (a JobSet's Jobs, a Job's pods) pass on it once Kueue resumes it, which
            # Kueue does only after admitting its Workload (and only Kueue may: Controlled).
            notes = asked.object.obj("metadata").strings("annotations") if asked.object is not None else {}
            await _record_admitted(rt.pool, asked, notes.get(mapping.run_id_annotation) or asked.uid or "")
        return review(uid, allowed=True, message=f"budgetgate: not decided here ({mapped.reason})")
    assert isinstance(mapped, Submit)
    warnings += mapped.warnings
    try:
        # The same limits as POST /v1/admissions: a submitter limited to some namespaces or
        # tenants submits within them, whichever way its submission comes.
        require_submission(principal, namespace=mapped.request.namespace, labels=mapped.request.labels, tenant_label=rt.settings.tenant_label)
    except Forbidden as exc:
        return review(uid, allowed=False, code=403, message=f"budgetgate: {exc}")
    started = time.perf_counter()
    try:
        # A dry run (kubectl --dry-run=server) is quoted: the same decision, nothing reserved or recorded.
        # Provisional: the API server may still refuse the object after this answer (another
        # webhook, a ResourceQuota, its name taken), so the hold lapses unless it is confirmed stored.
        answer = await (Quoter(rt.admitter).quote(mapped.request) if asked.dry_run else rt.admitter.admit(mapped.request, provisional=True))
    except Conflict as exc:
        return review(uid, allowed=False, code=409, message=f"budgetgate: {exc} {_resubmitting(exc, mapping)}")
    except InvalidSubmission as exc:
        return review(uid, allowed=False, code=422, message=f"budgetgate: {exc.field}: {exc}")
    except (Unavailable, *BACKEND_ERRORS) as exc:
        return _undecided(uid, exc, fail_open=fail_open)
    if asked.dry_run:
        request.app.state.metrics.observe_quote(answer, time.perf_counter() - started)
    else:
        request.app.state.metrics.observe(answer, time.perf_counter() - started)
        if answer["decision"] == "ALLOW" and (asked.group, asked.kind) in ADMITTED_OWNERS:
            await _record_admitted(rt.pool, asked, mapped.request.run_id)
    reviewed = decided(uid, answer, attempt_annotation=mapping.attempt_annotation, dry_run=asked.dry_run)
    if warnings:
        reviewed["response"]["warnings"] = [short(w) for w in [*warnings, *reviewed["response"].get("warnings", [])]]
    return reviewed


async def _flyte_workflow(rt: Any, asked: Asked, uid: str, settings: KubernetesWebhookSettings, mapping: Mapping) -> dict[str, Any] | Submit | Skip:
    """A FlyteWorkflow: its CREATE answered on its run's decision when the run has one and
    FlyteAdmin (a trusted creator) created it, else mapped to a submission (flyte_workflows)."""
    if asked.operation != "CREATE":
        if asked.operation == "UPDATE" and asked.object is None:
            raise Unmappable("request.object is missing: an UPDATE carries the object it updates")
        return Skip(f"{asked.operation} of a FlyteWorkflow is not a submission; only CREATE is (flytepropeller writes its status into it)")
    if asked.object is None:
        raise Unmappable("request.object is missing: a CREATE carries the object it creates")
    run = flyte_run(asked.object)
    if settings.trusts(asked.username):
        try:
            prior = await rt.pool.fetchrow(sql("latest_decision"), run.run_id)
        except (*BACKEND_ERRORS, asyncpg.PostgresError) as exc:
            return _undecided(uid, exc, fail_open=settings.fail_open)
        if prior is not None:
            return await _on_decision(rt, asked, uid, run.run_id, prior, mapping)
    # No decision yet (or created by someone else than FlyteAdmin: then decided like any
    # submission, a resend of its run's request answered from it, another request a 409).
    if run.offloaded:
        raise Unmappable(offloaded_message(run))
    return flyte_submission(asked, mapping)


async def _on_decision(rt: Any, asked: Asked, uid: str, run_id: str, prior: Any, mapping: Mapping) -> dict[str, Any]:
    """A FlyteWorkflow whose run was decided before it was created: by the preflight
    (budgetgate.adapters.flyte, from flytekit's projection, which may differ from this object's),
    or, for a child execution carrying its parent's labels, its parent's. Answered from that
    decision, without a new one: nothing is reserved twice."""
    said = f"run {run_id} already has a decision (attempt {prior['attempt']}, decision {prior['decision_id']})"
    if prior["namespace"] != asked.namespace:
        return review(uid, allowed=False, code=409, message=(
            f"budgetgate: {said} in another namespace than {asked.namespace!r}: a run keeps its namespace; launch it again under a new "
            f"execution name, with the preflight's namespace= set to {asked.namespace!r} (the namespace Flyte runs the project and domain in)"
        ))  # fmt: skip
    answer = prior["response"]
    answer = json.loads(answer) if isinstance(answer, str) else dict(answer)
    if prior["outcome"] == "ALLOW":
        if not asked.dry_run:
            await _record_admitted(rt.pool, asked, run_id)  # its pods pass on it
        return review(uid, allowed=True, message=f"budgetgate: not decided again ({said}: admitted, it runs on that decision)")
    return decided(uid, answer, attempt_annotation=mapping.attempt_annotation, dry_run=asked.dry_run)


def _resubmitting(conflict: Conflict, mapping: Mapping) -> str:
    """How a Kubernetes object is resubmitted as the 409 says: a higher attempt, or a new run id."""
    if conflict.next_attempt is not None:
        return f"(on Kubernetes: set the annotation {mapping.attempt_annotation}={conflict.next_attempt})"
    return (
        f"(on Kubernetes: a new object without the annotation {mapping.run_id_annotation}, which the mutating webhook names afresh "
        "(else its UID), or with another value of it)"
    )


def _undecided(uid: str, exc: BaseException, *, fail_open: bool) -> dict[str, Any]:
    if fail_open:
        return review(uid, allowed=True, warnings=[f"budgetgate: admitted unchecked (fail open): could not decide: {exc}"])
    return review(uid, allowed=False, code=503, message=f"budgetgate cannot decide now ({exc}); nothing was reserved, retry shortly")


async def _admitted_owner(pool: asyncpg.Pool, owned: Owned, *, namespace: str) -> str | None:
    """The run the owner of `owned` was let through for, or None if it never was: an owner of
    that UID, kind and namespace (owners live in their children's namespace)."""
    if not owned.owner_uid:
        return None
    return await pool.fetchval(sql("admitted_owner"), owned.owner_uid, namespace, owned.owner_kind, owned.owner_name)


async def _record_admitted(pool: asyncpg.Pool, asked: Asked, run_id: str) -> None:
    """Remember an object let through on a decision, so its children are let through on it.

    Best effort: the decision stands whatever happens here. Unrecorded, its children are decided
    as runs of their own: reserved twice, never unbudgeted."""
    if not asked.uid or not run_id:
        return
    try:
        await pool.execute(sql("record_admitted_object"), asked.uid, asked.namespace, asked.kind, asked.name, run_id)
    except (*BACKEND_ERRORS, asyncpg.PostgresError) as exc:  # down, or not migrated yet
        log.warning("admitted object %s (run %r) not recorded (%s): its children may be decided on their own", asked.uid, run_id, exc)
