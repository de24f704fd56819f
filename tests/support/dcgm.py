"""Recorded DCGM exporter pages (tests/fixtures/dcgm) served on loopback, as node exporters."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

from tests.support.servers import PageServer

PAGES = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm"


class Exporters:
    """Two node exporters on loopback serving recorded pages; node A's pod `train-resnet-0`
    ends after `train_scrapes` scrapes, and node A answers an empty page (as an exporter
    restarting may) at its scrapes numbered in `a_empty_at` (from 1)."""

    def __init__(self, *, train_scrapes: int, a_empty_at: Collection[int] = ()) -> None:
        self.scrapes = {"a": 0, "b": 0}
        self._train_scrapes = train_scrapes
        self._a_empty_at = frozenset(a_empty_at)
        self.pages = PageServer(self._page)
        self.url = self.pages.url

    def _page(self, path: str) -> tuple[bytes, str]:
        node = path.strip("/").split("/")[0]
        self.scrapes[node] += 1
        if node == "a" and self.scrapes["a"] in self._a_empty_at:
            return b"", "text/plain; version=0.0.4; charset=utf-8"
        name = {"a": "node-a.prom" if self.scrapes["a"] <= self._train_scrapes else "node-a-train-ended.prom", "b": "node-b.prom"}[node]
        return (PAGES / name).read_bytes(), "text/plain; version=0.0.4; charset=utf-8"

    def close(self) -> None:
        self.pages.close()


class NodeExporter:
    """One node's exporter on loopback serving a recorded page (`page`, a file of
    tests/fixtures/dcgm, which a test may change), counting its scrapes; `port` is where it listens."""

    def __init__(self, page: str) -> None:
        self.page = page
        self.scrapes = 0
        self.pages = PageServer(self._page)
        self.port = int(self.pages.url.rsplit(":", 1)[1])

    def _page(self, path: str) -> tuple[bytes, str]:
        self.scrapes += 1
        return (PAGES / self.page).read_bytes(), "text/plain; version=0.0.4; charset=utf-8"

    def close(self) -> None:
        self.pages.close()


def exporter_pod(node: str, port: int, *, running: bool = True, namespace: str = "gpu-operator") -> dict[str, Any]:
    """A dcgm-exporter DaemonSet pod on `node` as the API server has it (its Helm chart's labels
    and port name), listening on loopback at `port`."""
    status: dict[str, Any] = {"phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1"} if running else {"phase": "Pending"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"dcgm-exporter-{node}",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "dcgm-exporter", "app.kubernetes.io/instance": "dcgm-exporter"},
            "creationTimestamp": "2026-07-14T08:00:00Z",
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "exporter", "image": "nvcr.io/nvidia/k8s/dcgm-exporter", "ports": [{"name": "metrics", "containerPort": port}]}],
        },
        "status": status,
    }


def gpu_pod(namespace: str, name: str, *, labels: dict[str, str], annotations: dict[str, str] | None = None, node: str) -> dict[str, Any]:
    """A running pod holding GPUs on `node`."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations or {}},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "trainer", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
        "status": {"phase": "Running", "containerStatuses": [container_status({"running": {"startedAt": "2026-07-14T08:30:00Z"}})]},
    }


def container_status(state: dict[str, Any], *, ready: bool = True) -> dict[str, Any]:
    """A pod's `main` container status as the kubelet reports it."""
    return {
        "name": "main", "image": "trainer:1", "imageID": "docker.io/library/trainer@sha256:" + "0" * 64,
        "ready": ready, "restartCount": 0, "started": ready, "state": state,
    }  # fmt: skip


def kubeconfig_file(path: Path, url: str) -> Path:
    """A kubeconfig for the stand-in API server at `url`, with a bearer token as a service account has."""
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "stand-in",
                "clusters": [{"name": "stand-in", "cluster": {"server": url}}],
                "users": [{"name": "budgetgate-meter", "user": {"token": "stand-in-token"}}],
                "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "budgetgate-meter"}}],
            }
        )  # fmt: skip
    )
    return path
