"""A small stand-in for the Kubernetes API server, for Kueue's two kinds only, following the API
conventions a controller relies on: list (with the list's resourceVersion), get, watch (a
newline-delimited stream of `{"type", "object"}` events, starting with ADDED for what exists),
and JSON merge patches of an object or its status subresource, where a patch naming another
resourceVersion than the stored one is a 409 Conflict Status. Every write bumps the
resourceVersion and is sent to the watchers."""

from __future__ import annotations

import asyncio
import copy
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

BASE = "/apis/kueue.x-k8s.io/v1beta1"


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


class KubeApi:
    """The stored objects, by (plural, namespace, name), and the app serving them."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.version = 1000
        self.watchers: list[asyncio.Queue[tuple[str, dict[str, Any]]]] = []
        self.patches: list[tuple[str, str, dict[str, Any]]] = []  # (path, content type, body), as received
        self.lists: Counter[str] = Counter()  # collections listed (not watched), by plural: a controller's requeue passes, say
        self.app = self._app()

    def put(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace an object (as Kueue or a user would), announcing it."""
        meta = obj["metadata"]
        key = (plural, meta.get("namespace", ""), meta["name"])
        event = "MODIFIED" if key in self.objects else "ADDED"
        return self._store(key, copy.deepcopy(obj), event)

    def get(self, plural: str, name: str, namespace: str = "") -> dict[str, Any]:
        return copy.deepcopy(self.objects[(plural, namespace, name)])

    def _store(self, key: tuple[str, str, str], obj: dict[str, Any], event: str) -> dict[str, Any]:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.objects[key] = obj
        for queue in self.watchers:
            queue.put_nowait((event, copy.deepcopy(obj)))
        return obj

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get(BASE + "/{plural}")
        async def collection(plural: str, request: Request) -> Any:
            if request.query_params.get("watch") in ("true", "1"):
                return StreamingResponse(self._watch(plural), media_type="application/json")
            self.lists[plural] += 1
            items = [copy.deepcopy(o) for (p, _, _), o in sorted(self.objects.items()) if p == plural]
            return {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "List", "metadata": {"resourceVersion": str(self.version)}, "items": items}

        @app.get(BASE + "/{plural}/{name}")
        async def cluster_object(plural: str, name: str) -> Any:
            found = self.objects.get((plural, "", name))
            return found if found is not None else status(404, "NotFound", f'{plural} "{name}" not found')

        @app.patch(BASE + "/{plural}/{name}/status")
        async def cluster_status(plural: str, name: str, request: Request) -> Any:
            return await self._patch(request, (plural, "", name))

        @app.patch(BASE + "/namespaces/{namespace}/{plural}/{name}")
        async def namespaced(namespace: str, plural: str, name: str, request: Request) -> Any:
            return await self._patch(request, (plural, namespace, name))

        @app.patch(BASE + "/namespaces/{namespace}/{plural}/{name}/status")
        async def namespaced_status(namespace: str, plural: str, name: str, request: Request) -> Any:
            return await self._patch(request, (plural, namespace, name))

        return app

    async def _patch(self, request: Request, key: tuple[str, str, str]) -> Any:
        content_type = request.headers.get("content-type", "")
        body = json.loads(await request.body())
        self.patches.append((request.url.path, content_type, body))
        if content_type != "application/merge-patch+json":
            return status(415, "UnsupportedMediaType", f"this stand-in takes JSON merge patches, not {content_type}")
        stored = self.objects.get(key)
        if stored is None:
            return status(404, "NotFound", f'{key[0]} "{key[2]}" not found')
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != stored["metadata"]["resourceVersion"]:
            return status(
                409,
                "Conflict",
                "the object has been modified; please apply your changes to the latest version (resourceVersion "
                f"{stored['metadata']['resourceVersion']}, not {wanted})",
            )
        # The status subresource changes only status; the object itself everything but status.
        if request.url.path.endswith("/status"):
            patched = {**stored, "status": merge(stored.get("status"), body.get("status"))}
        else:
            patched = merge(stored, {k: v for k, v in body.items() if k != "status"})
        return self._store(key, patched, "MODIFIED")

    async def _watch(self, plural: str) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        for (p, _, _), obj in sorted(self.objects.items()):
            if p == plural:
                queue.put_nowait(("ADDED", copy.deepcopy(obj)))
        self.watchers.append(queue)
        try:
            while True:
                event, obj = await queue.get()
                if obj["kind"].lower() + "s" == plural:
                    yield (json.dumps({"type": event, "object": obj}) + "\n").encode()
        finally:
            self.watchers.remove(queue)
