"""A stand-in for the Kubernetes API server, following the API conventions a controller relies on,
for any kind it is told to serve (core `v1` under `/api/v1`, every group under `/apis/<group>/<version>`):

- list (cluster-wide or in a namespace, with the list's resourceVersion and equality
  `labelSelector`s), get, and watch (a newline-delimited stream of `{"type", "object"}` events,
  starting with ADDED for what exists; DELETED when an object goes);
- create (POST, 409 AlreadyExists for a name in use, `generateName` honoured, a `uid` given),
  replace (PUT) and JSON merge patches of an object or of its status subresource; a write naming
  another resourceVersion than the stored one is a 409 Conflict Status, and every write bumps
  the resourceVersion and goes to the watchers;
- delete (DELETE), which announces DELETED;
- `expire_watches` ends watches with 410 Gone, as an API server does when a watched version is too old.

An object is stored once, under its group, and served in any version of that group the stand-in
serves; a version it does not serve is a 404, as an API server answers for a version a CRD does not
define. Nothing here is a real API server: admission chains, finalizers and garbage collection are
not modelled (docs/adapters.md says what was never run against a real cluster)."""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.support.servers import InProcessServer, free_port

# (group, version) -> the plurals served there, with their kinds.
SERVED: dict[tuple[str, str], dict[str, str]] = {
    ("", "v1"): {"pods": "Pod", "namespaces": "Namespace", "endpoints": "Endpoints", "services": "Service"},
    ("batch", "v1"): {"jobs": "Job"},
    ("coordination.k8s.io", "v1"): {"leases": "Lease"},
    ("kueue.x-k8s.io", "v1beta2"): {"workloads": "Workload", "admissionchecks": "AdmissionCheck", "clusterqueues": "ClusterQueue", "localqueues": "LocalQueue"},
}
CLUSTER_SCOPED = {"namespaces", "admissionchecks", "clusterqueues"}

Key = tuple[str, str, str]  # (plural, namespace, name)


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge(result.get(key), value)
    return result


def status(code: int, reason: str, message: str) -> JSONResponse:
    return JSONResponse(
        {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message, "reason": reason, "code": code}, status_code=code
    )


def _group_of(api_version: str) -> tuple[str, str]:
    group, _, version = api_version.rpartition("/")
    return group, version


def _selected(obj: dict[str, Any], selector: str | None) -> bool:
    """Equality-based label selectors (`a=b,c!=d,e`), as the API server reads them."""
    if not selector:
        return True
    labels = obj["metadata"].get("labels") or {}
    for term in selector.split(","):
        term = term.strip()
        if "!=" in term:
            name, value = term.split("!=", 1)
            if labels.get(name) == value:
                return False
        elif "=" in term:
            name, value = term.replace("==", "=").split("=", 1)
            if labels.get(name) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def kubeconfig(url: str) -> Any:
    """A lightkube KubeConfig for the stand-in at `url`, with a bearer token as a service account would have."""
    from lightkube import KubeConfig

    return KubeConfig.from_dict({
        "apiVersion": "v1", "kind": "Config", "current-context": "stand-in",
        "clusters": [{"name": "stand-in", "cluster": {"server": url}}],
        "users": [{"name": "budgetgate", "user": {"token": "stand-in-token"}}],
        "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "budgetgate"}}],
    })  # fmt: skip


class KubeApi:
    """The stored objects, by (plural, namespace, name), and the app serving them."""

    def __init__(self, served: dict[tuple[str, str], dict[str, str]] | None = None) -> None:
        self.served = served if served is not None else SERVED
        self.groups = {plural: group for (group, _), plurals in self.served.items() for plural in plurals}
        self.objects: dict[Key, dict[str, Any]] = {}
        self.version = 1000
        self.watchers: list[tuple[str, asyncio.Queue[tuple[str, dict[str, Any]]]]] = []
        self.patches: list[tuple[str, str, dict[str, Any]]] = []  # (path, content type, body), as received
        self.writes: list[tuple[str, str]] = []  # (method, path) of every write request, answered or refused
        self.serving: InProcessServer | None = None  # set by the `kube` fixture
        self.lists: Counter[str] = Counter()  # collections listed (not watched), by plural: a controller's requeue passes, say
        self.app = self._app()

    # -- as the cluster (Kueue, the kubelet, a user) would -------------------------------------

    def put(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace an object, announcing it."""
        meta = obj["metadata"]
        key = (plural, meta.get("namespace", ""), meta["name"])
        event = "MODIFIED" if key in self.objects else "ADDED"
        stored = copy.deepcopy(obj)
        stored["metadata"].setdefault("uid", str(uuid.uuid4()))
        return self._store(key, stored, event)

    def get(self, plural: str, name: str, namespace: str = "") -> dict[str, Any]:
        return copy.deepcopy(self.objects[(plural, namespace, name)])

    def find(self, plural: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        found = self.objects.get((plural, namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def delete(self, plural: str, name: str, namespace: str = "") -> dict[str, Any]:
        obj = self.objects.pop((plural, namespace, name))
        self.version += 1
        self._announce(plural, "DELETED", obj)
        return obj

    def expire_watches(self, plural: str) -> int:
        """End every watch of `plural` with the ERROR event an API server sends when the watched
        resourceVersion is too old (410 Gone: the client must list again); how many were ended."""
        gone = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Expired", "code": 410,
                "message": "too old resource version"}  # fmt: skip
        ended = 0
        for watched, queue in self.watchers:
            if watched == plural:
                queue.put_nowait(("ERROR", gone))
                ended += 1
        return ended

    def items(self, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for (p, ns, _), o in sorted(self.objects.items()) if p == plural and namespace in (None, ns)]

    def _store(self, key: Key, obj: dict[str, Any], event: str) -> dict[str, Any]:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.objects[key] = obj
        self._announce(key[0], event, obj)
        return copy.deepcopy(obj)

    def _announce(self, plural: str, event: str, obj: dict[str, Any]) -> None:
        for watched, queue in self.watchers:
            if watched == plural:
                queue.put_nowait((event, copy.deepcopy(obj)))

    # -- as the API server answers ------------------------------------------------------------

    def _served(self, group: str, version: str, plural: str) -> JSONResponse | None:
        if plural not in self.served.get((group, version), {}):
            where = f"{group}/{version}" if group else version
            return status(404, "NotFound", f"the server could not find the requested resource ({plural}.{where})")
        return None

    def _as_version(self, obj: dict[str, Any], group: str, version: str) -> dict[str, Any]:
        out = copy.deepcopy(obj)
        out["apiVersion"] = f"{group}/{version}" if group else version
        return out

    def _app(self) -> FastAPI:
        app = FastAPI()
        for prefix in ("/api/{version}", "/apis/{group}/{version}"):
            self._routes(app, prefix)
        return app

    def _routes(self, app: FastAPI, prefix: str) -> None:
        async def collection(request: Request, version: str, plural: str, group: str = "", namespace: str | None = None) -> Any:
            if (refused := self._served(group, version, plural)) is not None:
                return refused
            selector = request.query_params.get("labelSelector")
            if request.query_params.get("watch") in ("true", "1"):
                return StreamingResponse(self._watch(plural, namespace, selector, group, version), media_type="application/json")
            self.lists[plural] += 1
            kind = self.served[(group, version)][plural]
            items = [self._as_version(o, group, version) for o in self.items(plural, namespace) if _selected(o, selector)]
            api_version = f"{group}/{version}" if group else version
            return {"apiVersion": api_version, "kind": f"{kind}List", "metadata": {"resourceVersion": str(self.version)}, "items": items}

        async def create(request: Request, version: str, plural: str, group: str = "", namespace: str = "") -> Any:
            self.writes.append(("POST", request.url.path))
            if (refused := self._served(group, version, plural)) is not None:
                return refused
            body = json.loads(await request.body())
            meta = body.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            if not meta.get("name"):
                return status(422, "Invalid", f"{plural}: metadata.name: Required value")
            if namespace:
                meta["namespace"] = namespace
            key = (plural, namespace, meta["name"])
            if key in self.objects:
                return status(409, "AlreadyExists", f'{plural} "{meta["name"]}" already exists')
            if request.query_params.get("dryRun") == "All":
                return JSONResponse(self._as_version(body, group, version), status_code=201)
            meta["uid"] = str(uuid.uuid4())
            meta.pop("resourceVersion", None)
            return JSONResponse(self._as_version(self._store(key, body, "ADDED"), group, version), status_code=201)

        async def read(version: str, plural: str, name: str, group: str = "", namespace: str = "") -> Any:
            if (refused := self._served(group, version, plural)) is not None:
                return refused
            found = self.objects.get((plural, namespace, name))
            return self._as_version(found, group, version) if found is not None else status(404, "NotFound", f'{plural} "{name}" not found')

        async def replace(request: Request, version: str, plural: str, name: str, group: str = "", namespace: str = "") -> Any:
            self.writes.append(("PUT", request.url.path))
            if (refused := self._served(group, version, plural)) is not None:
                return refused
            body = json.loads(await request.body())
            key = (plural, namespace, name)
            stored = self.objects.get(key)
            if stored is None:
                return status(404, "NotFound", f'{plural} "{name}" not found')
            if (conflict := self._conflict(stored, body)) is not None:
                return conflict
            body["metadata"]["uid"] = stored["metadata"].get("uid")
            if request.url.path.endswith("/status"):
                body = {**stored, "status": body.get("status")}
            else:
                body["status"] = stored.get("status") if "status" in stored else body.get("status")
            return self._as_version(self._store(key, body, "MODIFIED"), group, version)

        async def patch(request: Request, version: str, plural: str, name: str, group: str = "", namespace: str = "") -> Any:
            self.writes.append(("PATCH", request.url.path))
            if (refused := self._served(group, version, plural)) is not None:
                return refused
            return await self._patch(request, (plural, namespace, name), group, version)

        async def remove(request: Request, version: str, plural: str, name: str, group: str = "", namespace: str = "") -> Any:
            self.writes.append(("DELETE", request.url.path))
            if (refused := self._served(group, version, plural)) is not None:
                return refused
            if (plural, namespace, name) not in self.objects:
                return status(404, "NotFound", f'{plural} "{name}" not found')
            return self._as_version(self.delete(plural, name, namespace), group, version)

        for scope in ("", "/namespaces/{namespace}"):
            base = prefix + scope + "/{plural}"
            app.add_api_route(base, collection, methods=["GET"])
            app.add_api_route(base, create, methods=["POST"])
            app.add_api_route(base + "/{name}", read, methods=["GET"])
            app.add_api_route(base + "/{name}", replace, methods=["PUT"])
            app.add_api_route(base + "/{name}/status", replace, methods=["PUT"])
            app.add_api_route(base + "/{name}", patch, methods=["PATCH"])
            app.add_api_route(base + "/{name}/status", patch, methods=["PATCH"])
            app.add_api_route(base + "/{name}", remove, methods=["DELETE"])

    @staticmethod
    def _conflict(stored: dict[str, Any], body: dict[str, Any]) -> JSONResponse | None:
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != stored["metadata"]["resourceVersion"]:
            return status(
                409,
                "Conflict",
                "the object has been modified; please apply your changes to the latest version (resourceVersion "
                f"{stored['metadata']['resourceVersion']}, not {wanted})",
            )
        return None

    async def _patch(self, request: Request, key: Key, group: str, version: str) -> Any:
        content_type = request.headers.get("content-type", "")
        body = json.loads(await request.body())
        self.patches.append((request.url.path, content_type, body))
        if content_type != "application/merge-patch+json":
            return status(415, "UnsupportedMediaType", f"this stand-in takes JSON merge patches, not {content_type}")
        stored = self.objects.get(key)
        if stored is None:
            return status(404, "NotFound", f'{key[0]} "{key[2]}" not found')
        if (conflict := self._conflict(stored, body)) is not None:
            return conflict
        # The status subresource changes only status; the object itself everything but status.
        if request.url.path.endswith("/status"):
            patched = {**stored, "status": merge(stored.get("status"), body.get("status"))}
        else:
            patched = merge(stored, {k: v for k, v in body.items() if k != "status"})
        return self._as_version(self._store(key, patched, "MODIFIED"), group, version)

    async def _watch(self, plural: str, namespace: str | None, selector: str | None, group: str, version: str) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        for obj in self.items(plural, namespace):
            queue.put_nowait(("ADDED", obj))
        self.watchers.append((plural, queue))
        try:
            while True:
                event, obj = await queue.get()
                if event == "ERROR":  # the watch ends with it, as the API server's does
                    yield (json.dumps({"type": event, "object": obj}) + "\n").encode()
                    return
                if namespace not in (None, obj["metadata"].get("namespace", "")) or not _selected(obj, selector):
                    continue
                yield (json.dumps({"type": event, "object": self._as_version(obj, group, version)}) + "\n").encode()
        finally:
            self.watchers.remove((plural, queue))


@pytest.fixture
async def kube() -> AsyncIterator[tuple[KubeApi, str]]:
    """The stand-in served on loopback for a test: (the API, its URL). `api.serving` is the server,
    which a test may stop and start again on the same port (an API server outage)."""
    api = KubeApi()
    api.serving = InProcessServer(api.app, port=free_port())
    await api.serving.start()
    url = api.serving.url
    yield api, url
    await api.serving.stop()
