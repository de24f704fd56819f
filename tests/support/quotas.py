"""Quota and cluster documents and a physics-tenant submission, shared by the quota and quote tests."""

from __future__ import annotations

from tests.support.admission import submission

QUOTA = """apiVersion: budgetgate/v1
kind: Quota
metadata: {{id: tenant-physics}}
spec: {{tenant: physics, {limits}}}
"""
CLUSTER = """apiVersion: budgetgate/v1
kind: Cluster
metadata: {id: cluster}
spec: {gpus: 100, nodes: 50}
"""


def physics(run_id: str, *, gpus: int = 1, nodes: int = 1, **extra: object) -> dict[str, object]:
    return submission(
        run_id=run_id,
        namespace="physics",
        labels={"team": "physics", **extra.pop("labels", {})},
        resources={"gpus": gpus, "nodes": nodes},
        projected_runtime_hours=1.0,
        **extra,
    )
