"""What the DCGM meter asks the Kubernetes API (lightkube): where the exporters are, and the pods
holding GPUs (their run label's annotation, labels the exporter did not write, whether they ended).

Exporters are the running pods a label selector picks in one namespace (dcgm-exporter's
DaemonSet: `app.kubernetes.io/name=dcgm-exporter` from its Helm chart, `app=nvidia-dcgm-exporter`
from the GPU Operator), scraped at their pod IP on the container port named `metrics` (else the
given port). Each is named after its node (`node/<nodeName>`), so a restarted exporter pod, with
a new IP, goes on from its node's last page rather than starting afresh.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from lightkube import ApiError
from lightkube import AsyncClient as KubeClient
from lightkube.resources.core_v1 import Pod

METRICS_PORT_NAME = "metrics"


def exporter_url(pod: dict[str, Any], *, port: int, path: str = "/metrics") -> str | None:
    """The metrics URL of a running exporter pod, None for one that cannot be scraped (not
    running, no IP yet, being deleted)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if status.get("phase") != "Running" or not status.get("podIP") or meta.get("deletionTimestamp"):
        return None
    named = [p["containerPort"] for c in (pod.get("spec") or {}).get("containers") or [] for p in c.get("ports") or [] if p.get("name") == METRICS_PORT_NAME]
    host = status["podIP"]
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{named[0] if named else port}{path}"


async def discover_exporters(kube: KubeClient, *, namespace: str, selector: str, port: int, path: str = "/metrics") -> dict[str, str]:
    """Exporter name (`node/<nodeName>`) → metrics URL of each running exporter pod; on a node
    with two (a rollout), the newer."""
    found: dict[str, tuple[str, str]] = {}
    async for pod in kube.list(Pod, namespace=namespace, labels=label_selector(selector)):
        obj = pod.to_dict()
        url = exporter_url(obj, port=port, path=path)
        key = f"node/{(obj.get('spec') or {}).get('nodeName') or obj['metadata']['name']}"
        created = str(obj["metadata"].get("creationTimestamp") or "")
        if url is not None and (key not in found or created > found[key][0]):
            found[key] = (created, url)
    return {name: url for name, (_, url) in sorted(found.items())}


def label_selector(selector: str) -> dict[str, Any]:
    """A label selector of equality terms (`a=b,c=d`) as lightkube takes it."""
    terms: dict[str, Any] = {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        name, sep, value = term.partition("=")
        if not sep or not name.strip() or "!" in name:
            raise ValueError(f"the exporter selector {selector!r} is not of the form name=value[,name=value]")
        terms[name.strip()] = value.lstrip("=").strip()
    return terms


async def look_up_pods(kube: KubeClient, names: Iterable[tuple[str, str]], *, concurrency: int = 16) -> dict[tuple[str, str], dict[str, Any] | None]:
    """Each pod (namespace, name) as the API has it, None when it is not found (deleted).
    Any other API error is raised: without the pods, which of them ended is not known."""
    gate = asyncio.Semaphore(concurrency)

    async def one(namespace: str, name: str) -> dict[str, Any] | None:
        async with gate:
            try:
                return (await kube.get(Pod, name=name, namespace=namespace)).to_dict()
            except ApiError as exc:
                if exc.status.code == 404:
                    return None
                raise

    wanted = sorted(set(names))
    found = await asyncio.gather(*(one(namespace, name) for namespace, name in wanted))
    return dict(zip(wanted, found, strict=True))
