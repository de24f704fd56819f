"""The Kubernetes MutatingAdmissionWebhook: `POST /v1/kubernetes/mutate`.

The API server calls it on the CREATE of a Pod, Job, JobSet, RayJob or RayCluster, before the
validating webhook (routes/kubernetes.py), and before it stores the object: the object has no
UID yet (the API server assigns it on storing, after every mutating webhook; the validating
webhooks see it). So the run cannot be named by its UID here, and this webhook names it:
- the run id is the object's annotation `budgetgate.io/run-id`, set to a fresh UUID when the
  object has none; the validating webhook decides under it;
- the label `budgetgate.io/run-id` (run_labels: the run id, or its hash with the whole id in the
  annotation) goes on the object and on its children's templates (a Job's pod template, a
  JobSet's Job and pod templates, a RayJob's or RayCluster's head and worker templates), so the
  pods carry it, where the meter and the lifecycle controller read it;
- with BUDGETGATE_KUBERNETES_PRIORITY_CLASSES set, the pod templates' priorityClassName is the
  class of what a quote of the same submission says now (its soft-budget penalty, and whether
  it would run above its tenant's fair-share target). Nothing is decided yet: the quote holds
  and records nothing. A priorityClassName the object sets is kept unless
  BUDGETGATE_KUBERNETES_OVERRIDE_PRIORITY_CLASS is true. A bare Pod's is left alone: the API
  server's Priority admission resolved the pod's priority from it before any webhook ran.

A FlyteWorkflow (flyte.lyft.com) is named as its Flyte execution's run,
`flyte/<project>/<domain>/<execution>` from FlyteAdmin's labels (platforms/flyte_workflows.py),
the run the preflight submits and the validating webhook decides: the annotation and the label
go on the object, and flytepropeller copies both onto the pods it creates for it.

Left unchanged: objects of other kinds and operations, objects asking for no GPU, objects
labelled for a Kueue queue (Kueue names and admits them), and the children a trusted controller
creates for an admitted owner (a Job's pods, a JobSet's Jobs: they carry their owner's names).
A child a trusted controller creates for an owner never admitted (nor remembered) is a run of its
own, and is named afresh: a run id annotation it has came from its owner's template.

This webhook never denies: what cannot be named (a malformed object) is let through unchanged,
and the validating webhook refuses it naming the field. A dry run (kubectl --dry-run=server) is
answered the same way, with the patch, and nothing happens anywhere: the quote records nothing.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import uuid
from dataclasses import replace
from typing import Any

import asyncpg
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from budgetgate.core.principals import Forbidden
from budgetgate.decisions.deciding import InvalidSubmission
from budgetgate.edge.auth import Action, Principal, allow
from budgetgate.platforms.kubernetes import (
    ADMITTED_KINDS,
    QUEUE_LABEL,
    SCALABLE_KINDS,
    Mapping,
    Owned,
    Submit,
    Unmappable,
    naming,
    priority_class_for,
    short,
    submission,
)
from budgetgate.platforms.flyte_workflows import flyte_run, is_flyte_workflow
from budgetgate.platforms.reviews import Asked, At, ask
from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.services.admission.access import require_submission
from budgetgate.services.admission.admitter import Unavailable
from budgetgate.services.admission.quoting import Quoter
from budgetgate.services.admission.routes.kubernetes import _EXAMPLE as REVIEW_EXAMPLE
from budgetgate.services.admission.routes.kubernetes import _REVIEW as REVIEW_SCHEMA
from budgetgate.services.admission.routes.kubernetes import KubernetesWebhookSettings, _admitted_owner, read_review

log = logging.getLogger(__name__)

_ANSWER_EXAMPLE = {
    "apiVersion": "admission.k8s.io/v1",
    "kind": "AdmissionReview",
    "response": {
        "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
        "allowed": True,
        "patchType": "JSONPatch",
        "patch": base64.b64encode(
            json.dumps([{"op": "add", "path": "/metadata/annotations", "value": {"budgetgate.io/run-id": "0b6f1c1e-8a53-4a43-9d0e-3f7c2b1a9e55"}}]).encode()
        ).decode(),
    },
}
# What a mutating webhook is sent: the object before it is stored, without a UID.
_EXAMPLE = copy.deepcopy(REVIEW_EXAMPLE)
del _EXAMPLE["request"]["object"]["metadata"]["uid"]
_OPENAPI = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": REVIEW_SCHEMA, "example": _EXAMPLE}}},
    "responses": {
        "200": {
            "description": "the AdmissionReview answered: always allowed, with the JSON patch (base64) that names the run",
            "content": {"application/json": {"schema": REVIEW_SCHEMA, "example": _ANSWER_EXAMPLE}},
        }
    },
}


def router(settings: KubernetesWebhookSettings) -> APIRouter:
    """The mutating webhook's route; quotes with `app.state.rt.admitter`."""
    api = APIRouter()
    mapping = settings.mapping()

    @api.post(
        "/v1/kubernetes/mutate",
        operation_id="mutateKubernetesObject",
        openapi_extra=_OPENAPI,
        responses={400: {"description": "not an admission.k8s.io/v1 AdmissionReview with a request uid: no AdmissionReview can answer it"}},
    )
    async def mutate(request: Request, principal: Principal = Depends(allow(Action.SUBMIT))) -> JSONResponse:
        read = await read_review(request)
        if isinstance(read, JSONResponse):
            return read
        body, uid = read
        return JSONResponse(await _answer(request, principal, body, uid, settings, mapping))

    return api


def patched(uid: str, patch: list[dict[str, Any]], *, message: str | None = None, warnings: list[str] | None = None) -> dict[str, Any]:
    """An admission.k8s.io/v1 AdmissionReview allowing the request `uid` with `patch` (none when empty)."""
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(patch, separators=(",", ":")).encode()).decode()
    if message:
        response["status"] = {"code": 200, "message": message}
    if warnings:
        response["warnings"] = [short(w) for w in warnings]
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


async def _answer(
    request: Request, principal: Principal, body: dict[str, Any], uid: str, settings: KubernetesWebhookSettings, mapping: Mapping
) -> dict[str, Any]:
    rt = request.app.state.rt
    try:
        asked = ask(body)
    except Unmappable as exc:
        return patched(uid, [], message=f"budgetgate: left unchanged ({exc})")
    if is_flyte_workflow(asked.group, asked.kind) and asked.operation == "CREATE" and asked.object is not None:
        return _flyte_named(uid, asked, mapping)
    if asked.operation != "CREATE" or (asked.group, asked.kind) not in ADMITTED_KINDS or asked.object is None:
        return patched(
            uid, [], message=f"budgetgate: left unchanged (only the CREATE of a workload is named; this is {asked.operation} of {asked.kind or 'an object'})"
        )
    try:
        meta = asked.object.obj("metadata")
        labels, annotations = meta.strings("labels"), meta.strings("annotations")
        if labels.get(QUEUE_LABEL) and (asked.group, asked.kind) in SCALABLE_KINDS:
            return patched(uid, [], message=f"budgetgate: left unchanged (queued in Kueue's {labels[QUEUE_LABEL]!r}: Kueue admits it, under its Workload)")
        run_id = annotations.get(mapping.run_id_annotation) or str(uuid.uuid4())
        named = _with_run_id(asked, run_id, mapping)
        owned = submission(named, mapping)
        if isinstance(owned, Owned) and settings.trusts(asked.username):
            try:
                owner_run = await _admitted_owner(rt.pool, owned, namespace=asked.namespace)
            except (*BACKEND_ERRORS, asyncpg.PostgresError) as exc:
                log.warning("owner of %s %r not looked up (%s): left unchanged", asked.kind, asked.name, exc)
                return patched(uid, [], message=f"budgetgate: left unchanged (its owner could not be looked up: {exc})")
            if owner_run is not None:
                return patched(uid, [], message=f"budgetgate: left unchanged (created by {owned.owner_kind} {owned.owner_name}: it carries its owner's run id)")
            # Its owner was never admitted (or not remembered): it is a run of its own, and a run id
            # it has from its owner's template is its owner's, so it is named afresh.
            run_id = str(uuid.uuid4())
            named = _with_run_id(asked, run_id, mapping)
        mapped = owned if not isinstance(owned, Owned) else submission(named, mapping, own_run=True)
    except Unmappable as exc:
        # The validating webhook refuses it, naming the same field; nothing to name here.
        return patched(uid, [], message=f"budgetgate: left unchanged ({exc})")
    if not isinstance(mapped, Submit):  # asks for no GPU: not a run
        return patched(uid, [], message=f"budgetgate: left unchanged (not a submission: {getattr(mapped, 'reason', type(mapped).__name__)})")
    warnings = list(mapped.warnings)
    priority_class = None
    if settings.priority_classes:
        priority_class, said = await _priority_class(rt, principal, mapped, settings)
        warnings += said
    try:
        patch = naming(asked, run_id, mapping, priority_class=priority_class, override_priority=settings.override_priority_class)
    except Unmappable as exc:
        return patched(uid, [], message=f"budgetgate: left unchanged ({exc})")
    said = f"budgetgate: run {run_id}" + (f", priority class {priority_class}" if priority_class else "")
    return patched(uid, patch, message=said + (" (dry run: nothing recorded)" if asked.dry_run else ""), warnings=warnings)


def _flyte_named(uid: str, asked: Asked, mapping: Mapping) -> dict[str, Any]:
    """A FlyteWorkflow named as its execution's run (flyte/<project>/<domain>/<execution>, from
    FlyteAdmin's labels; a child execution carries its parent's): the run id annotation and label
    on the object, which flytepropeller copies onto every pod it creates for it."""
    try:
        run = flyte_run(asked.object) if asked.object is not None else None
        patch = naming(asked, run.run_id, mapping) if run is not None else []
    except Unmappable as exc:  # the validating webhook refuses it, naming the same field
        return patched(uid, [], message=f"budgetgate: left unchanged ({exc})")
    said = f"budgetgate: run {run.run_id}" if run is not None else "budgetgate: left unchanged"
    return patched(uid, patch, message=said + (" (dry run: nothing recorded)" if asked.dry_run else ""))


def _with_run_id(asked: Asked, run_id: str, mapping: Mapping) -> Asked:
    """The request as the validating webhook will see it: its object annotated with `run_id`."""
    assert asked.object is not None
    obj = dict(asked.object.value)
    meta = dict(obj.get("metadata") or {})
    meta["annotations"] = {**(meta.get("annotations") or {}), mapping.run_id_annotation: run_id}
    obj["metadata"] = meta
    return replace(asked, object=At(obj, ""))


async def _priority_class(rt: Any, principal: Principal, mapped: Submit, settings: KubernetesWebhookSettings) -> tuple[str | None, list[str]]:
    """The class a quote of the submission maps to, and warnings saying why none was set."""
    try:
        require_submission(principal, namespace=mapped.request.namespace, labels=mapped.request.labels, tenant_label=rt.settings.tenant_label)
    except Forbidden:
        return None, []  # the validating webhook refuses it, saying why
    try:
        quote = await Quoter(rt.admitter).quote(mapped.request)
    except InvalidSubmission:
        return None, []  # refused by the validating webhook, naming the field
    except (Unavailable, *BACKEND_ERRORS) as exc:
        return None, [f"budgetgate: no priority class set: could not quote the run ({exc})"]
    if quote["decision"] != "ALLOW":
        return None, []  # the validating webhook denies or delays it
    return priority_class_for(settings.priority_classes, penalty=float(quote.get("priority_penalty") or 0.0), preemptible=bool(quote.get("preemptible"))), []
