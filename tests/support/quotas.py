"""Quota, resource pool, cluster and budget documents, a physics-tenant submission, and an admission
service started on them: shared by the quota, quote, lease, headroom and ledger tests."""

from __future__ import annotations

from tests.support.admission import apply_policies, budget_yaml, submission

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
POOLS = """apiVersion: budgetgate/v1
kind: ResourcePool
metadata: {{id: warehouse}}
spec: {{namespace: "snowflake:wh-1", quota: {child}, project_cap: {cap}}}
---
apiVersion: budgetgate/v1
kind: ResourcePool
metadata: {{id: snowflake}}
spec: {{namespace: snowflake, quota: {parent}}}
"""
BIG_BUDGET = budget_yaml("physics-gpus", namespace="physics", labels="{team: physics}", limit="gpu_hours: 100000")


async def started(admission_factory, pg_dsn, files: dict[str, str], sha: str = "9" * 40, *, ledger_shards: int = 1):  # type: ignore[no-untyped-def]
    """An admission service, ready, on the policy `files` applied under `sha`, its Redis ledger
    in `ledger_shards` shards."""
    await apply_policies(pg_dsn, files, sha=sha)
    server = await admission_factory(pg_pool_max=30, ledger_shards=ledger_shards)
    await server.wait_ready()
    return server


def physics(run_id: str, *, gpus: int = 1, nodes: int = 1, **extra: object) -> dict[str, object]:
    return submission(
        run_id=run_id,
        namespace="physics",
        labels={"team": "physics", **extra.pop("labels", {})},
        resources={"gpus": gpus, "nodes": nodes},
        projected_runtime_hours=1.0,
        **extra,
    )
